"""The server's memory under repeated overload, inside a real memory limit.

A CPU server runs in a memory cgroup (cgroup v2 where its memory controller is there to
use, else the v1 memory hierarchy) capped, once warm, at the bound it logs: the formula of
docs/service.md (speakerd/serving/server/memory_bound.py) for its flags and the 80 calls this test keeps
open at once, with no recording in progress. Then 10 floods of 16 connections x 5
concurrent maximum-size messages (more bytes than its decode budget), and 16 concurrent
maximum-size messages. Each is answered INVALID_ARGUMENT (13 chunks, more than the 8-chunk
queue: refused only after the whole message is parsed and checked) or RESOURCE_EXHAUSTED,
so no engine work makes the test slow. The server must not be OOM-killed; no flood's peak
may pass the bound; after each flood, once the server has been idle for a moment, its
memory must be back near its warm size, so that nothing accumulates from one flood to the
next (before, each refused message stayed until a full garbage collection and freed memory
was not returned: peaks grew flood after flood and stayed); and it must still answer a
call with the embeddings it gave before.

Skips (saying why) where no memory cgroup can be made: that needs root and a writable
cgroup file system.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections import Counter
from pathlib import Path

import grpc
import numpy as np
import pytest

from speakerd.client.client import build_request
from speakerd.model.architecture import FRAMES, MEL_BINS
from speakerd.serving.api.service import SERVICE_NAME
from speakerd.v1 import speakerd_pb2 as pb
from speakerd.v1.tensors import from_tensor
from tests.serving import ServerProcess, start_server
from tests.test_bad_inputs import _good

pytestmark = pytest.mark.slow

MIB = 1 << 20
#: The flood's cost is its bytes (gRPC's copies on both sides, 6.4 GB at 8 MiB): at 4 MiB the
#: messages, the decode budget and the per-call term of the bound all halve, and a message
#: is still far more than the queue holds.
MAX_MESSAGE_MB = 4
FLAGS = ("--plans", "1,8", "--max-message-mb", str(MAX_MESSAGE_MB), "--queue-chunks", "8")
#: 13 float32 chunks: 4.17 MB, the most that fits a 4 MiB message.
MESSAGE_CHUNKS = 13
FLOODS = 10
CONNECTIONS = 16
CALLS_PER_CONNECTION = 5
#: Once idle, what the server may keep beyond its warm size: allocator pages still in use,
#: gRPC's buffers (seen: 7-47 MiB).
KEPT_BYTES = 128 * MIB
#: The server gives memory back after 1 s without calls (service.IDLE_TRIM_S): each wait for
#: that ends as soon as it has, or after this long (slack for a loaded 2-core machine).
IDLE_LIMIT_S = 15.0
#: Reading /proc is cheap: a fine poll ends each of the 11 waits nearer the moment it may.
IDLE_POLL_S = 0.05
CALL_TIMEOUT_S = 120.0
BOUND = re.compile(r"memory bound (\d+) bytes \+ (\d+) bytes per call open at once")


class MemoryCgroup:
    """A memory cgroup of its own: v2 (memory.max) or v1 (memory.limit_in_bytes)."""

    def __init__(self, path: Path, version: int) -> None:
        self.path, self.version = path, version

    @classmethod
    def create(cls, name: str) -> MemoryCgroup:
        root = Path("/sys/fs/cgroup")
        v2_roots = [root, root / "unified"]
        for base in v2_roots:
            controllers = base / "cgroup.controllers"
            if controllers.exists() and "memory" in controllers.read_text().split():
                try:
                    path = base / name
                    path.mkdir(exist_ok=True)
                    if (path / "memory.max").exists():
                        return cls(path, 2)
                    path.rmdir()
                except OSError:
                    pass
        v1 = root / "memory"
        if (v1 / "memory.limit_in_bytes").exists():
            try:
                path = v1 / name
                path.mkdir(exist_ok=True)
                return cls(path, 1)
            except OSError as error:
                pytest.skip(f"no memory cgroup can be made here ({error}); run as root")
        pytest.skip("no cgroup memory controller here (neither v2 nor v1)")

    def enter(self) -> None:
        """In the child before exec: join the cgroup."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def limit(self, size: int) -> None:
        name = "memory.max" if self.version == 2 else "memory.limit_in_bytes"
        (self.path / name).write_text(str(size))

    def oom_kills(self) -> int:
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        for line in (self.path / name).read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def remove(self) -> None:
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def _status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak) of a process, in bytes."""
    values = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            values[key] = int(value.split()[0]) * 1024
    return values


def _idle_rss(pid: int, enough: int) -> tuple[int, float]:
    """(RSS, seconds waited) once the idle server's RSS is at most `enough`, or after
    IDLE_LIMIT_S: a fixed wait would either be long or fail on a busy machine."""
    started = time.monotonic()
    while True:
        rss = _status(pid)["VmRSS"]
        waited = time.monotonic() - started
        if rss <= enough or waited > IDLE_LIMIT_S:
            return rss, waited
        time.sleep(IDLE_POLL_S)


def _reset_peak(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # resets VmHWM to the current RSS


def _flood(server: ServerProcess, raw: bytes, connections: int, calls: int) -> Counter[str]:
    """`connections` connections each with `calls` concurrent calls of `raw`; their codes."""
    codes: Counter[str] = Counter()
    lock = threading.Lock()

    def connection() -> None:
        options = [("grpc.use_local_subchannel_pool", 1), ("grpc.max_send_message_length", 64 * MIB)]
        with grpc.insecure_channel(server.target, options=options) as channel:
            call = channel.unary_unary(f"/{SERVICE_NAME}/EmbedChunks")
            futures = [call.future(raw, timeout=CALL_TIMEOUT_S) for _ in range(calls)]
            for future in futures:
                error = future.exception()
                with lock:
                    codes["OK" if error is None else error.code().name] += 1

    threads = [threading.Thread(target=connection) for _ in range(connections)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return codes


def _embed(server: ServerProcess, raw: bytes) -> np.ndarray:
    with grpc.insecure_channel(server.target) as channel:
        call = channel.unary_unary(
            f"/{SERVICE_NAME}/EmbedChunks", response_deserializer=pb.EmbedResponse.FromString
        )
        return from_tensor(call(raw, timeout=CALL_TIMEOUT_S).embeddings, "embeddings")


def test_memory_plateaus_and_is_given_back_within_the_bound(weights_path) -> None:
    cgroup = MemoryCgroup.create(f"speakerd-test-{os.getpid()}")
    server = start_server(weights_path, *FLAGS, preexec_fn=cgroup.enter)
    pid = server.process.pid
    try:
        found = BOUND.search(server.log())
        rest = _status(pid)["VmRSS"]
        if found:
            cap = int(found[1]) + CONNECTIONS * CALLS_PER_CONNECTION * int(found[2])
            cgroup.limit(cap)
            line = server.log()[found.start() :].splitlines()[0]
            print(f"\ncgroup v{cgroup.version} memory limit {cap / 1e6:.0f} MB; the server's {line}")
        good = _good().SerializeToString()
        reference = _embed(server, good)
        fbank = np.zeros((MESSAGE_CHUNKS, FRAMES, MEL_BINS), np.float32)
        large = build_request(np.ones((MESSAGE_CHUNKS, 3, 589), np.uint8), fbank=fbank).SerializeToString()
        assert len(large) <= MAX_MESSAGE_MB * MIB
        refused = {"INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"}
        peaks, kept = [], []
        for flood in range(FLOODS):
            _reset_peak(pid)
            codes = _flood(server, large, CONNECTIONS, CALLS_PER_CONNECTION)
            peaks.append(_status(pid)["VmHWM"])
            rss, waited = _idle_rss(pid, rest + KEPT_BYTES)
            kept.append(rss)
            print(f"flood {flood}: {dict(codes)} peak {peaks[-1] / 1e6:.0f} MB, "
                  f"idle {kept[-1] / 1e6:.0f} MB after {waited:.1f} s")  # fmt: skip
            assert set(codes) <= refused and sum(codes.values()) == CONNECTIONS * CALLS_PER_CONNECTION, codes
        _reset_peak(pid)
        codes = _flood(server, large, CONNECTIONS, 1)
        burst = _status(pid)["VmHWM"]
        assert set(codes) <= refused, codes
        idle, waited = _idle_rss(pid, rest + KEPT_BYTES)
        print(f"16 concurrent maximum-size messages: {dict(codes)} peak {burst / 1e6:.0f} MB; "
              f"{waited:.1f} s later {idle / 1e6:.0f} MB (warm {rest / 1e6:.0f} MB)")  # fmt: skip
        assert server.process.poll() is None and cgroup.oom_kills() == 0, server.log()[-3000:]
        assert np.array_equal(_embed(server, good), reference), "a call after the floods answered differently"
        assert found, "the server logged no memory bound"
        megabytes = [size // 10**6 for size in peaks]
        assert max(*peaks, burst) <= cap, f"peaks {megabytes} MB, bound {cap // 10**6} MB"
        megabytes = [size // 10**6 for size in [*kept, idle]]
        assert max(*kept, idle) <= rest + KEPT_BYTES, (
            f"idle after each flood {megabytes} MB, warm {rest // 10**6}"
        )
    finally:
        code = server.terminate()
        cgroup.remove()
    assert code == 0, server.log()[-3000:]

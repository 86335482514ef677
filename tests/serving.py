"""A real `python -m speakerd serve` subprocess on loopback, for the service tests.

Each test server is a separate process (the way it runs in production), on free ports it
picks itself (`--port 0`); the harness reads the ports from the start-up log line, and
keeps every log line so tests can check the order of events (self-check before SERVING).
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from speakerd.client.client import SpeakerClient
from speakerd.serving.api.service import SERVICE_NAME

LISTENING = re.compile(r"listening on (?P<host>[\w.:]+):(?P<port>\d+) \(metrics on :(?P<metrics>\d+)[,)]")
#: The test servers' CPU engine threads. Under `make test` two workers share the cores, each
#: with its servers: one ONNX Runtime thread a server took 0.53-0.59 CPU-s a chunk on 2 cores,
#: two threads 0.76-0.92 (the second thread buys 1.4x the speed for 1.45x the CPU), so one
#: thread each leaves more of the cores to the other worker's tests.
CPU_THREADS = 1
#: What the server logs once health says SERVING (serve.py), the last line of its start-up.
SERVING_LINE = f"SERVING {SERVICE_NAME} after"
#: Start-up on 2 cores: ORT session build, plan timing and the self-check take ~10-20 s.
START_TIMEOUT_S = 180.0


@dataclass
class ServerProcess:
    process: subprocess.Popen[str]
    port: int = 0
    metrics_port: int = 0
    lines: list[str] = field(default_factory=list)
    health_seen: list[str] = field(default_factory=list)
    #: SpeakerClient keyword arguments that reach this server (TLS files, token)
    client_options: dict[str, object] = field(default_factory=dict)
    #: the thread copying stderr into `lines`; it may lag behind the process's exit
    pump: threading.Thread | None = None

    def client(self, **overrides: object) -> SpeakerClient:
        """A client of this server with its TLS and token options (overridable)."""
        return SpeakerClient(self.target, **{**self.client_options, **overrides})  # type: ignore[arg-type]

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def log(self) -> str:
        return "".join(self.lines)

    def index_of(self, text: str) -> int:
        """Position of the first log line containing `text` (-1 when absent)."""
        return next((i for i, line in enumerate(self.lines) if text in line), -1)

    def wait(self, timeout_s: float) -> int:
        """The exit code, once every line the server wrote is in `lines`."""
        code = self.process.wait(timeout_s)
        if self.pump is not None:
            self.pump.join(timeout_s)  # the pipe's last lines arrive after the exit
        return code

    def terminate(self, timeout_s: float = 60.0) -> int:
        """SIGTERM (the server drains), then wait for its exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise


def start_server(
    weights: Path,
    *flags: str,
    wait_serving: bool = True,
    client_options: dict[str, object] | None = None,
    preexec_fn: Callable[[], None] | None = None,
) -> ServerProcess:
    """Start a CPU server with `flags`; return once it is SERVING (or, if not, listening).
    `client_options`: what a SpeakerClient needs to reach it (TLS files, token);
    `preexec_fn`: run in the child before it starts the server (e.g. join a cgroup)."""
    if "--data-dir" not in flags:  # each server its own voiceprint store, never the user's
        flags = (*flags, "--data-dir", tempfile.mkdtemp(prefix="speakerd-data-"))
    if "--cpu-threads" not in flags:
        flags = (*flags, "--cpu-threads", str(CPU_THREADS))
    command = [sys.executable, "-m", "speakerd", "serve", "--engine", "cpu", "--port", "0",
               "--metrics-port", "0", "--weights", str(weights), *flags]  # fmt: skip
    process = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, preexec_fn=preexec_fn
    )
    server = ServerProcess(process, client_options=dict(client_options or {}))
    listening = threading.Event()

    def pump() -> None:
        assert process.stderr is not None
        for line in process.stderr:
            server.lines.append(line)
            match = LISTENING.search(line)
            if match:
                server.port, server.metrics_port = int(match["port"]), int(match["metrics"])
                listening.set()

    server.pump = threading.Thread(target=pump, daemon=True)
    server.pump.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not listening.wait(0.1):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"server did not start (exit {process.poll()}):\n{server.log()}")
    if wait_serving:
        with server.client() as client:
            while True:
                try:
                    status = client.health(timeout_s=2.0)
                except Exception as error:  # the port is open but the call failed: record it
                    status = f"error: {error}"
                if not server.health_seen or server.health_seen[-1] != status:
                    server.health_seen.append(status)
                if status == "SERVING":
                    break
                if process.poll() is not None or time.monotonic() > deadline:
                    process.kill()
                    raise RuntimeError(f"server never SERVING (seen {server.health_seen}):\n{server.log()}")
                time.sleep(0.05)
        # The server sets health SERVING, then logs it; the pump thread copies stderr a line
        # at a time after that. Tests read start-up lines (the memory bound, each device's
        # self-check) from `lines`, so "started" means the SERVING line is there too.
        wait_until(lambda: server.index_of(SERVING_LINE) >= 0, f"the log line {SERVING_LINE!r}", server,
                   timeout_s=max(deadline - time.monotonic(), 10.0))  # fmt: skip
    return server


def serve_module(weights: Path, *flags: str) -> Iterator[ServerProcess]:
    """A module fixture's body: a started server, then a check that it drained and exited 0."""
    running = start_server(weights, *flags)
    yield running
    assert running.terminate() == 0, running.log()


#: How often `wait_until` asks again: a metric or a log line, cheap to read 20 times a second.
POLL_S = 0.05


def wait_until(
    condition: Callable[[], bool], what: str, server: ServerProcess | None = None, *, timeout_s: float
) -> None:
    """Poll `condition` until it holds; fail naming `what` (and the end of `server`'s log)
    after `timeout_s`: a test waits for what it needs instead of sleeping a fixed time."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        log = f":\n{server.log()[-4000:]}" if server is not None else ""
        assert time.monotonic() < deadline, f"{what} not seen within {timeout_s} s{log}"
        time.sleep(POLL_S)


def scrape(server: ServerProcess) -> dict[str, float]:
    """Every sample of the server's /metrics as {name{labels}: value}."""
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}"] = sample.value
    return samples

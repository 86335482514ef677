"""One device's worker process for `serve --devices`: its own engine, fed through shared memory.

Why a process per device, not a thread: the server's Python front end (parsing, batching,
copying rows) is already the limit at one H200 (docs/performance.md: the FP16 server
reached 76% of the engine under load), so a second engine driven from the same
interpreter would share that one GIL. A worker holds its engine, plans, CUDA graphs and
streams alone; the server hands it batches by slot number (shared_slots.py) and it answers
with the run's counters, the embeddings lying in the slot.

Device selection: the worker sets CUDA_VISIBLE_DEVICES to its one GPU before anything
imports CuPy, so its engine sees that GPU as device 0 and nothing of it touches another.
A CPU engine's worker (the stand-in for a GPU in tests and on machines without one) gets a
share of the cores instead.

The pipe protocol, small pickled tuples only:
- worker -> server, once: ("ready", WorkerInfo) after the engine was built, warmed and
  passed its parity self-check, or ("failed", error type, message) and exit;
- server -> worker: ("run", slot, chunks, named) with the batch's rows in the slot, except
  the rows `named` as (row, recording, first window, end window): a recording's windows this
  worker holds (remote_recording.py); ("stop",);
- worker -> server: ("done", slot, BatchRun without embeddings) once `out` holds them,
  ("error", slot, message) when the engine raised, or ("gone", slot, message) when a named
  recording is not open any more (its call ended; the device is fine);
- server -> worker: ("rec", seq, op, recording, args, audio slot or None, bytes) for a
  recording's audio (worker_recordings.py), answered ("rec", seq, ("ok", answer)),
  ("rec", seq, ("input", field, message)) for bad audio, or ("rec", seq, ("error", message));
  seq None: no answer wanted (closing a recording).
Batches run on PIPELINE_DEPTH threads, as in one process: one computes while the next are
staged. Recording ops run in order on a thread of their own, so a recording's decoding
never holds up the batches. The worker exits when the server says stop, when the pipe
closes, or when its parent process is gone (even in the middle of building its engine).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from speakerd.engine.base import BatchRun, Engine
from speakerd.model.inputs import InputError
from speakerd.serving.devices.shared_slots import AudioSlot, SharedSlot, SlotLayout
from speakerd.serving.devices.worker_recordings import RecordingGone, WorkerRecordings
from speakerd.serving.memory import heap

log = logging.getLogger(__name__)

#: How often a worker checks that its server is still there: a server killed with SIGKILL
#: cannot stop its workers, and a worker building an engine reads no pipe for half a minute.
PARENT_CHECK_S = 1.0
_NO_ROWS = np.empty((0,), dtype=np.float32)


class InjectedFault(RuntimeError):
    """The engine error a test asks a worker for (WorkerSpec.fail_batches)."""


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker process needs to build its engine and attach its slots (picklable)."""

    device: int
    kind: str  # "cpu" or "gpu", resolved
    weights: str  # safetensors path, resolved by the server
    math: str
    plan_sizes: tuple[int, ...]
    conv_kernels: str
    slot_names: tuple[str, ...]
    max_batch: int
    log_level: str
    #: CUDA_VISIBLE_DEVICES for this worker (its one GPU); None for a CPU worker
    cuda_visible: str | None = None
    #: CPU engine threads (the cores shared among the CPU workers); None: every core
    cpu_threads: int | None = None
    #: Tests only: raise InjectedFault instead of running these batches (1-based counts of
    #: the batches this worker was sent); empty: never.
    fail_batches: tuple[int, ...] = ()
    #: the audio slots recordings whose home is this device send their bytes through
    audio_slot_names: tuple[str, ...] = ()


@dataclass(frozen=True)
class WorkerInfo:
    """What a ready worker reports about its engine."""

    name: str
    model_id: str
    math: str
    plan_sizes: tuple[int, ...]
    plan_times_ms: dict[int, float]
    memory: dict[str, int]
    pid: int


def visible_gpu(device: int, inherited: str | None) -> str:
    """The CUDA_VISIBLE_DEVICES value that shows a worker only GPU `device`: the device-th
    entry of the server's own CUDA_VISIBLE_DEVICES when it has one (so `--devices 0` under
    CUDA_VISIBLE_DEVICES=2,3 is physical GPU 2), else the index itself."""
    entries = [entry.strip() for entry in (inherited or "").split(",") if entry.strip()]
    if not entries:
        return str(device)
    if device >= len(entries):
        raise ValueError(f"devices: device {device} is not among CUDA_VISIBLE_DEVICES={inherited}")
    return entries[device]


def worker_main(spec: WorkerSpec, conn: Connection) -> None:
    """The worker process's entry point (multiprocessing, spawn start method)."""
    if spec.cuda_visible is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = spec.cuda_visible  # before anything imports CuPy
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group: the server drains, then stops us
    logging.basicConfig(
        level=spec.log_level,
        format=f"%(asctime)s %(levelname)s device {spec.device} %(name)s: %(message)s",
        force=True,  # a parent main module re-imported by spawn may have configured it
    )
    _exit_with_parent(os.getppid())
    try:
        engine = _build(spec)
    except BaseException as error:  # reported to the server, which names the device
        log.exception("device %d: start-up failed", spec.device)
        conn.send(("failed", type(error).__name__, str(error)))
        return
    layout = SlotLayout(spec.max_batch)
    slots = [SharedSlot(layout, name) for name in spec.slot_names]
    audio = [AudioSlot(name=name) for name in spec.audio_slot_names]
    times = engine.plan_times_ms()
    report = getattr(engine, "memory_report", None)
    memory = {str(kind): int(size) for kind, size in dict(report() if callable(report) else {}).items()}
    info = WorkerInfo(
        engine.name, engine.model_id, str(engine.math), engine.plan_sizes, times, memory, os.getpid()
    )
    heap.freeze_long_lived()  # a full collection would stop this engine's threads too (heap.py)
    conn.send(("ready", info))
    _serve(spec, engine, slots, WorkerRecordings(engine, audio), conn)
    os._exit(0)  # batches still running are native code: do not join their threads


def _exit_with_parent(parent: int) -> None:
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_CHECK_S)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _build(spec: WorkerSpec) -> Engine:
    """Load the weights, build and warm the engine, and pass the parity self-check."""
    from speakerd.engine.factory import create_engine
    from speakerd.model.weights import load_model
    from speakerd.reference.self_check import check_engine

    started = time.perf_counter()
    model = load_model(spec.weights)
    engine = create_engine(
        spec.kind, model, spec.math, spec.plan_sizes, spec.conv_kernels, cpu_threads=spec.cpu_threads
    )
    try:
        check_engine(engine, model)
    except BaseException:
        engine.close()
        raise
    log.info("engine %s %s built and self-checked in %.1f s", engine.name, engine.math,
             time.perf_counter() - started)  # fmt: skip
    return engine


def batch_pieces(
    fbank: np.ndarray, chunks: int, named: tuple[tuple[int, int, int, int], ...], recordings: WorkerRecordings
) -> list[Any]:
    """A batch's fbank as pieces in row order: the slot's rows, and for each named range
    (row, recording, first, end) that recording's windows as its source holds them."""
    pieces: list[Any] = []
    row = 0
    for at, recording, first, end in named:
        if at > row:
            pieces.append(fbank[row:at])
        pieces.append(recordings.windows(recording, first, end))
        row = at + end - first
    if row < chunks:
        pieces.append(fbank[row:chunks])
    return pieces


def _serve(
    spec: WorkerSpec, engine: Engine, slots: list[SharedSlot], recordings: WorkerRecordings, conn: Connection
) -> None:
    """Run batches and recording ops until told to stop or the pipe closes."""
    send_lock = threading.Lock()
    received = 0

    def reply(message: tuple[Any, ...]) -> None:
        with send_lock:
            conn.send(message)

    def run(slot_index: int, chunks: int, named: tuple[tuple[int, int, int, int], ...], fail: bool) -> None:
        slot = slots[slot_index]
        try:
            if fail:
                raise InjectedFault(f"injected engine fault on device {spec.device}")
            fbank = batch_pieces(slot.fbank, chunks, named, recordings) if named else slot.fbank[:chunks]
            result = engine.run_batch(fbank, slot.masks[:chunks])
            slot.out[:chunks] = result.embeddings
            counters: BatchRun = dataclasses.replace(result, embeddings=_NO_ROWS)
            reply(("done", slot_index, counters))
        except RecordingGone as error:
            reply(("gone", slot_index, str(error)))
        except Exception as error:  # the server decides what an engine error means
            log.exception("device %d: engine error on a batch of %d chunks", spec.device, chunks)
            reply(("error", slot_index, f"{type(error).__name__}: {error}"))

    def recording_op(seq: int | None, op: str, recording: int, args: tuple[Any, ...], slot: int | None,
                     nbytes: int) -> None:  # fmt: skip
        if op == "close":
            recordings.close(recording)
            return
        try:
            answer: tuple[Any, ...] = ("ok", recordings.apply(op, recording, args, slot, nbytes))
        except InputError as error:
            answer = ("input", error.field, error.message)
        except Exception as error:  # reported to the call, which answers it; the device serves on
            log.exception("device %d: recording %d: %s failed", spec.device, recording, op)
            answer = ("error", f"{type(error).__name__}: {error}")
        reply(("rec", seq, answer))

    # not a `with`: leaving it would join a batch still inside the engine (the caller exits
    # the process without waiting instead)
    pool = ThreadPoolExecutor(len(slots), thread_name_prefix=f"device-{spec.device}")
    audio = ThreadPoolExecutor(1, thread_name_prefix=f"device-{spec.device}-audio")  # ops in order
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the server is gone
            break
        if message[0] == "stop":
            break
        if message[0] == "rec":
            audio.submit(recording_op, *message[1:])
            continue
        _, slot_index, chunks, named = message
        received += 1
        pool.submit(run, slot_index, chunks, named, received in spec.fail_batches)
    pool.shutdown(wait=False, cancel_futures=True)
    audio.shutdown(wait=False, cancel_futures=True)

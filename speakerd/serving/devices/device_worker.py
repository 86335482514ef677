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
  A named range whose recording is STAGED (0) is the fbank of waveforms a "waveform" op
  (args: slot, row, count; the waveforms in an audio slot) staged for that batch, computed
  by this engine (waveforms.py);
- worker -> server: ("done", slot, BatchRun without embeddings) once `out` holds them,
  ("error", slot, message) when the engine raised, or ("gone", slot, message) when a named
  recording is not open any more (its call ended; the device is fine);
- server -> worker: ("op", seq, op, recording, args, audio slot or None, bytes): a
  recording's audio (worker_recordings.py: open, pcm, samples, finish, rows, close;
  segment_kept, a segmenting recording's next windows), or "segment" (args: samples,
  starts) and "link" (args: points) for remote_compute.py;
  answered ("op", seq, ("ok", answer)), ("op", seq, ("input", field, message)) for bad
  audio, ("op", seq, ("memory", message)) for a linkage the device has not the memory for,
  ("op", seq, ("value", message)) for SciPy's ValueError (non-finite distances), or
  ("op", seq, ("error", message)); seq None: no answer wanted (closing a recording).
Batches run on PIPELINE_DEPTH threads, as in one process: one computes while the next are
staged. Recording ops run in order on a thread of their own, so a recording's decoding
never holds up the batches; segmentation and linkage on COMPUTE_THREADS more. The worker
exits when the server says stop, when the pipe closes, or when its parent process is gone
(even in the middle of building its engine).
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
from pathlib import Path
from typing import Any

import numpy as np

from speakerd.engine.base import BatchRun, Engine
from speakerd.engine.segmenter import Segmenter
from speakerd.model.architecture import CHUNK_SAMPLES
from speakerd.model.inputs import InputError
from speakerd.serving.devices.shared_slots import AudioSlot, SharedSlot, SlotLayout
from speakerd.serving.devices.waveforms import CHUNK_BYTES
from speakerd.serving.devices.worker_recordings import RecordingGone, WorkerRecordings
from speakerd.serving.memory import heap

log = logging.getLogger(__name__)

#: How often a worker checks that its server is still there: a server killed with SIGKILL
#: cannot stop its workers, and a worker building an engine reads no pipe for half a minute.
PARENT_CHECK_S = 1.0
#: Threads for segmentation and linkage calls: two calls at once keep the device busy
#: through each other's host steps, as the server's own segmentation threads do.
COMPUTE_THREADS = 2
#: The ops run on those threads: a segmenting recording's group of kept windows, a group of
#: samples sent, a linkage.
COMPUTE_OPS = ("segment_kept", "segment", "link")
#: The "recording" of a named range that is a batch's staged waveform rows ("waveform" ops):
#: the server numbers recordings from 1.
STAGED = 0
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
    #: the segmentation model's safetensors (--segmentation-model, resolved), built beside
    #: the engine on the same kind of device; None: this worker segments nothing
    segmentation: str | None = None
    #: the segmenter's maths (--segmentation-math)
    segmentation_math: str = "fp32"


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
    #: the segmentation engine built: (name, model id, most windows a call); None: none
    segmenter: tuple[str, str, int] | None = None
    #: the most rows its engine's centroid linkage takes (0: the engine has none)
    linkage_rows: int = 0


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
        segmenter = _build_segmenter(spec)
    except BaseException as error:  # reported to the server, which names the device
        log.exception("device %d: start-up failed", spec.device)
        conn.send(("failed", type(error).__name__, str(error)))
        return
    linkage = engine.centroid_linkage()
    layout = SlotLayout(spec.max_batch)
    slots = [SharedSlot(layout, name) for name in spec.slot_names]
    audio = [AudioSlot(name=name) for name in spec.audio_slot_names]
    times = engine.plan_times_ms()
    report = getattr(engine, "memory_report", None)
    memory = {str(kind): int(size) for kind, size in dict(report() if callable(report) else {}).items()}
    info = WorkerInfo(
        engine.name,
        engine.model_id,
        str(engine.math),
        engine.plan_sizes,
        times,
        memory,
        os.getpid(),
        None if segmenter is None else (segmenter.name, segmenter.model_id, segmenter.max_windows),
        0 if linkage is None else int(linkage.max_rows),
    )
    heap.freeze_long_lived()  # a full collection would stop this engine's threads too (heap.py)
    conn.send(("ready", info))
    recordings = WorkerRecordings(engine, audio)
    _serve(spec, engine, slots, recordings, _Compute(segmenter, linkage, recordings), conn)
    os._exit(0)  # batches still running are native code: do not join their threads


def _exit_with_parent(parent: int) -> None:
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_CHECK_S)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _build(spec: WorkerSpec) -> Engine:
    """Load the weights, build and warm the engine, and pass the parity self-check. A GPU
    engine starts as serve's does: its first start times cuDNN's plans in processes of its
    own from the start (engine/gpu/tuning_pool.py), and its choices are kept in the build
    cache for the next start, which builds only those (reference/self_check.checked_engine
    drops cached choices that fail the check)."""
    from speakerd.engine.factory import create_engine, start_tuning
    from speakerd.model.weights import load_model
    from speakerd.reference.self_check import checked_engine

    started = time.perf_counter()
    tuning = start_tuning(spec.kind, spec.math, spec.plan_sizes, spec.conv_kernels)
    try:
        model = load_model(spec.weights)

        def build(begun: Any = None) -> Engine:
            return create_engine(spec.kind, model, spec.math, spec.plan_sizes, spec.conv_kernels,
                                 cpu_threads=spec.cpu_threads, build_cache=True, tuning=begun)  # fmt: skip

        engine = checked_engine(build(tuning), model, rebuild=build)
    finally:
        if tuning is not None:  # handed to the engine (which closed it), or not: closed
            tuning.close()
    cached = ", cached start-up choices" if engine.built_from_cache else ""
    log.info("engine %s %s built and self-checked in %.1f s%s", engine.name, engine.math,
             time.perf_counter() - started, cached)  # fmt: skip
    return engine


def batch_pieces(
    fbank: np.ndarray,
    chunks: int,
    named: tuple[tuple[int, int, int, int], ...],
    recordings: WorkerRecordings,
    staged: dict[int, Any],
) -> list[Any]:
    """A batch's fbank as pieces in row order: the slot's rows, and for each named range
    (row, recording, first, end) that recording's windows as its source holds them, or
    (row, STAGED, 0, count) the fbank rows of waveforms staged for this batch at `row`."""
    pieces: list[Any] = []
    row = 0
    for at, recording, first, end in named:
        if at > row:
            pieces.append(fbank[row:at])
        pieces.append(staged.pop(at) if recording == STAGED else recordings.windows(recording, first, end))
        row = at + end - first
    if row < chunks:
        pieces.append(fbank[row:chunks])
    return pieces


def _build_segmenter(spec: WorkerSpec) -> Segmenter | None:
    """The segmentation engine beside the embedding engine (its kind), when asked for."""
    if spec.segmentation is None:
        return None
    from speakerd.engine.factory import create_segmenter
    from speakerd.model.segmentation.weights import load_model

    segmenter = create_segmenter(
        load_model(spec.segmentation), Path(spec.segmentation), spec.kind, spec.segmentation_math
    )
    log.info("segmentation model %s on %s, %d windows a run", segmenter.model_id[:16], segmenter.name,
             segmenter.max_windows)  # fmt: skip
    return segmenter


@dataclass
class _Compute:
    """The worker's segmentation and linkage calls (remote_compute.py), and the groups of
    windows of its segmenting recordings (remote_recording.KeptWindows)."""

    segmenter: Segmenter | None
    linkage: Any  # the engine's DeviceLinkage, or None
    recordings: WorkerRecordings

    def apply(self, op: str, recording: int, args: tuple[Any, ...]) -> tuple[Any, ...]:
        if op in ("segment", "segment_kept") and self.segmenter is None:
            return ("error", "this device was started without a segmentation model")
        if op == "segment_kept":
            return ("ok", self.recordings.segment(recording, *args, self.segmenter))
        if op == "segment":
            done = self.segmenter.segment(*args)
            return ("ok", (done.multilabel, done.compute_s))
        if op == "link":
            (points,) = args
            if self.linkage is None or not self.linkage.can_implement(int(points.shape[0])):
                return ("memory", f"this device's linkage does not take {points.shape[0]} rows")
            try:
                return ("ok", self.linkage(points))
            except MemoryError as error:
                return ("memory", str(error))
            except ValueError as error:  # SciPy's own message, which the caller re-raises
                return ("value", str(error))
        return ("error", f"op {op!r}: expected one of {COMPUTE_OPS}")


def _serve(
    spec: WorkerSpec,
    engine: Engine,
    slots: list[SharedSlot],
    recordings: WorkerRecordings,
    compute: _Compute,
    conn: Connection,
) -> None:
    """Run batches and recording ops until told to stop or the pipe closes."""
    send_lock = threading.Lock()
    received = 0

    def reply(message: tuple[Any, ...]) -> None:
        with send_lock:
            conn.send(message)

    # slot -> row -> fbank rows of waveforms staged for the slot's next batch ("waveform")
    staged: dict[int, dict[int, Any]] = {index: {} for index in range(len(slots))}

    def run(slot_index: int, chunks: int, named: tuple[tuple[int, int, int, int], ...], fail: bool) -> None:
        slot = slots[slot_index]
        try:
            if fail:
                raise InjectedFault(f"injected engine fault on device {spec.device}")
            rows = staged[slot_index]
            fbank = (
                batch_pieces(slot.fbank, chunks, named, recordings, rows) if named else slot.fbank[:chunks]
            )
            result = engine.run_batch(fbank, slot.masks[:chunks])
            slot.out[:chunks] = result.embeddings
            counters: BatchRun = dataclasses.replace(result, embeddings=_NO_ROWS)
            reply(("done", slot_index, counters))
        except RecordingGone as error:
            reply(("gone", slot_index, str(error)))
        except Exception as error:  # the server decides what an engine error means
            log.exception("device %d: engine error on a batch of %d chunks", spec.device, chunks)
            reply(("error", slot_index, f"{type(error).__name__}: {error}"))
        finally:
            staged[slot_index].clear()

    def stage(args: tuple[Any, ...], audio_slot: int | None, nbytes: int) -> None:
        """A "waveform" op: waveforms [count, 160000] in an audio slot become fbank rows
        (this engine's Engine.waveform_fbank: on the GPU for a GPU engine), kept for the
        batch slot's next run at `row`."""
        slot_index, row, count = args
        assert audio_slot is not None and nbytes == count * CHUNK_BYTES, (nbytes, count)
        waveform = np.frombuffer(
            recordings.audio[audio_slot].buf, dtype=np.float32, count=count * CHUNK_SAMPLES
        )
        staged[slot_index][row] = engine.waveform_fbank(waveform.reshape(count, CHUNK_SAMPLES).copy())

    def operation(seq: int | None, op: str, recording: int, args: tuple[Any, ...], slot: int | None,
                  nbytes: int) -> None:  # fmt: skip
        if op == "close":
            recordings.close(recording)
            return
        try:
            if op in COMPUTE_OPS:
                answer = compute.apply(op, recording, args)
            elif op == "waveform":
                stage(args, slot, nbytes)
                answer = ("ok", None)
            else:
                answer = ("ok", recordings.apply(op, recording, args, slot, nbytes))
        except InputError as error:
            answer = ("input", error.field, error.message)
        except Exception as error:  # reported to the call, which answers it; the device serves on
            log.exception("device %d: %s (recording %d) failed", spec.device, op, recording)
            answer = ("error", f"{type(error).__name__}: {error}")
        reply(("op", seq, answer))

    # not a `with`: leaving it would join a batch still inside the engine (the caller exits
    # the process without waiting instead)
    pool = ThreadPoolExecutor(len(slots), thread_name_prefix=f"device-{spec.device}")
    audio = ThreadPoolExecutor(1, thread_name_prefix=f"device-{spec.device}-audio")  # ops in order
    computing = ThreadPoolExecutor(COMPUTE_THREADS, thread_name_prefix=f"device-{spec.device}-compute")
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the server is gone
            break
        if message[0] == "stop":
            break
        if message[0] == "op":
            executor = computing if message[2] in COMPUTE_OPS else audio
            executor.submit(operation, *message[1:])
            continue
        _, slot_index, chunks, named = message
        received += 1
        pool.submit(run, slot_index, chunks, named, received in spec.fail_batches)
    for executor in (pool, audio, computing):
        executor.shutdown(wait=False, cancel_futures=True)

"""`serve --devices`: several devices behind the one batcher, as one Engine.

The batcher forms batches as before and hands each plan run to `run_batch` (a full batch
is one plan run; a partial one the cost model splits into smaller plans may spread over
devices). The pool sends it to the device with the fewest batches in flight, ties to the
lowest index (device_table.py), through that device's worker process (device_worker.py):
the rows are written into one of the worker's shared-memory slots (shared_slots.py), the
worker runs them on its engine and leaves the embeddings in the slot. `run_batch` returns
them as any engine does, so a request's rows land in its own order whichever devices ran
them: the batcher writes each run's rows by position, as with one engine.

A device that fails at run time is taken out for good (until the server restarts): its
worker process died (seen by the pipe closing, busy or idle), or its engine raised on a
batch. Its batches in flight re-run on the devices left; an ERROR log line names the
device and why, and speakerd_device_failures_total{device} counts it. A batch that raised
on one device and raises again on another is the batch's fault, not the second device's:
it fails (INTERNAL) and that device stays. With no device left every batch fails with
NoDevice (UNAVAILABLE) and `on_lost` tells the server, which reports NOT_SERVING.

A recording (EmbedRecording, and the recordings Diarize embeds) has a home device, the one
with the fewest recordings open: `fbank_source` gives the call a RemoteFrames
(remote_recording.py) that sends its audio to that device's worker through the device's
audio slots, where it is decoded and turned into fbank as the engine in process would
(on the GPU for a GPU engine). Its windows stay there: the batcher binds their requests to
the home device, and `run_batch` sends such a batch to that device with the windows named,
not copied. When the home device is taken out, its recordings fail with RecordingFailed
(UNAVAILABLE: their audio was there); other calls serve on.

A recording the server segments (a call with `segment`, Diarize) is decoded in its home
worker too, which keeps its samples and segments each group of its windows there
(`segmenting_source`, remote_recording.py); Diarize's centroid linkage runs on the workers
as well (remote_compute.py: `segmenter`, `centroid_linkage`), each call on the device with
the fewest waiting, again elsewhere if that one is lost.

EmbedChunks' waveform chunks go to the device that runs their batch too: `waveform_fbank`
keeps them as waveforms, and the worker makes their fbank (waveforms.py).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from speakerd.engine.base import BatchInputs, BatchRun, Engine, Pieces, batch_inputs, device_of
from speakerd.engine.segmenter import Segmenter
from speakerd.model.architecture import FRAMES, MEL_BINS, TRUNK_FRAMES
from speakerd.model.inputs import InputError
from speakerd.model.numerics import Math, resize_masks
from speakerd.reference.self_check import SelfCheckFailed
from speakerd.serving.batching.batcher import PIPELINE_DEPTH
from speakerd.serving.batching.queue import NoDevice
from speakerd.serving.devices.device_table import DeviceTable, Lease
from speakerd.serving.devices.device_worker import STAGED, WorkerInfo, WorkerSpec, visible_gpu, worker_main
from speakerd.serving.devices.remote_compute import RemoteLinkage, RemoteSegmenter
from speakerd.serving.devices.remote_recording import ROW_BYTES, RecordingFailed, RemoteFrames, RemoteWindows
from speakerd.serving.devices.shared_slots import AUDIO_SLOT_BYTES, AudioSlot, SharedSlot, SlotLayout
from speakerd.serving.devices.waveforms import CHUNK_BYTES, HostWaveforms, waveforms_per_slot
from speakerd.serving.observability.metrics import Metrics

log = logging.getLogger(__name__)

#: Batches in flight per device, each in its own slot: the batcher's PIPELINE_DEPTH (one
#: computing while two are staged) for every device.
SLOTS_PER_DEVICE = PIPELINE_DEPTH
#: Audio slots per device: one recording's piece is copied in while the worker decodes another's.
AUDIO_SLOTS_PER_DEVICE = 2
#: After "stop", how long a worker gets to exit before it is terminated: it only has to
#: leave its loop (a batch inside the engine is not waited for).
STOP_WAIT_S = 5.0
#: How long a worker that was taken out gets to exit on SIGTERM before SIGKILL.
TERMINATE_WAIT_S = 2.0

#: Called with (device taken out, devices left), from a pool thread.
OnLost = Callable[[int, int], None]


def shared_bytes_per_device(max_batch: int) -> int:
    """Shared memory one device's worker is given: its batch slots and its audio slots."""
    return SLOTS_PER_DEVICE * SlotLayout(max_batch).nbytes + AUDIO_SLOTS_PER_DEVICE * AUDIO_SLOT_BYTES


class DeviceStartFailed(RuntimeError):
    """A device's worker could not build its engine; the server does not start."""


class _DeviceLost(Exception):
    """The device of a batch in flight was taken out: run the batch elsewhere."""


@dataclass(frozen=True)
class PoolConfig:
    """What every worker builds: the server's settings, resolved."""

    kind: str  # "cpu" or "gpu"
    weights: str
    math: Math
    plan_sizes: tuple[int, ...]
    devices: tuple[int, ...]
    conv_kernels: str = "auto"
    log_level: str = "INFO"
    #: --cpu-threads: each CPU worker's threads; 0 splits the cores between the workers
    cpu_threads: int = 0
    #: the segmentation model's safetensors: every worker builds it beside its engine and
    #: the server's segmenter is theirs (remote_compute.py); None: no worker segments
    segmentation: str | None = None
    #: --segmentation-math: the maths of the workers' segmenters
    segmentation_math: str = "fp32"
    #: Tests only: device -> the batches (1-based, as its worker counts them) on which its
    #: engine raises (WorkerSpec.fail_batches).
    fail_batches: dict[int, tuple[int, ...]] = field(default_factory=dict)


@dataclass(eq=False)
class _Worker:
    device: int
    process: Any  # multiprocessing's SpawnProcess
    conn: Connection
    slots: list[SharedSlot]
    audio: list[AudioSlot] = field(default_factory=list)
    info: WorkerInfo | None = None
    send_lock: threading.Lock = field(default_factory=threading.Lock)
    pending: dict[int, Future[tuple[str, Any]]] = field(default_factory=dict)
    #: audio slot numbers free; ops waiting for their answer, by sequence number
    audio_free: list[int] = field(default_factory=list)
    answers: dict[int, Future[tuple[Any, ...]]] = field(default_factory=dict)


def worker_specs(
    config: PoolConfig, slot_names: dict[int, list[str]], audio_names: dict[int, list[str]] | None = None
) -> list[WorkerSpec]:
    """One spec per device: a GPU worker sees only its GPU; CPU workers share the cores."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    inherited = os.environ.get("CUDA_VISIBLE_DEVICES")
    specs = []
    for device in config.devices:
        gpu = config.kind == "gpu"
        specs.append(
            WorkerSpec(
                device=device,
                kind=config.kind,
                weights=config.weights,
                math=str(config.math),
                plan_sizes=config.plan_sizes,
                conv_kernels=config.conv_kernels,
                slot_names=tuple(slot_names[device]),
                max_batch=config.plan_sizes[-1],
                log_level=config.log_level,
                cuda_visible=visible_gpu(device, inherited) if gpu else None,
                cpu_threads=None if gpu else config.cpu_threads or max(1, cores // len(config.devices)),
                fail_batches=config.fail_batches.get(device, ()),
                audio_slot_names=tuple((audio_names or {}).get(device, ())),
                segmentation=config.segmentation,
                segmentation_math=config.segmentation_math,
            )
        )
    return specs


class DevicePool(Engine):
    """An Engine over one worker process per device (module docstring). `start` builds every
    device's engine (blocking, seconds to a minute); then `run_batch` is thread-safe."""

    def __init__(
        self,
        config: PoolConfig,
        metrics: Metrics,
        on_lost: OnLost | None = None,
        audio_bytes: int = AUDIO_SLOT_BYTES,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.on_lost = on_lost
        self.math = config.math
        self.plan_sizes = config.plan_sizes
        self.name = ""
        self.model_id = ""
        self._table = DeviceTable(config.devices, SLOTS_PER_DEVICE)
        self._changed = threading.Condition()
        self._workers: dict[int, _Worker] = {}
        self._slots: dict[int, list[SharedSlot]] = {}
        self._audio: dict[int, list[AudioSlot]] = {}
        self._closing = False
        self._sequence = 0  # numbers the ops sent to workers, for their answers
        #: bytes of each audio slot, what one recording or waveform op carries
        #: (remote_recording.py's RecordingLink, waveforms.py; smaller in tests, to split
        #: every op): at least one waveform chunk, the unit waveforms are sent in, and so
        #: one window's fbank row, the unit a host copy of windows comes back in
        self.audio_bytes = audio_bytes
        if audio_bytes < max(CHUNK_BYTES, ROW_BYTES):
            raise ValueError(
                f"audio_bytes: {audio_bytes}, expected at least one waveform chunk ({CHUNK_BYTES})"
            )

    # --- start --------------------------------------------------------------------------

    @property
    def device_count(self) -> int:
        return len(self.config.devices)

    @property
    def devices(self) -> tuple[int, ...]:
        return self._table.devices

    @property
    def live_devices(self) -> tuple[int, ...]:
        with self._changed:
            return self._table.live

    def in_flight(self, device: int) -> int:
        with self._changed:
            return self._table.in_flight(device)

    def recordings(self, device: int) -> int:
        """Recordings open with `device` as their home."""
        with self._changed:
            return self._table.recordings(device)

    def pid(self, device: int) -> int:
        """The worker process of `device` (for operators' logs and the tests)."""
        return int(self._workers[device].process.pid)

    def start(self) -> None:
        """Start every worker and wait until each is ready; DeviceStartFailed (or
        SelfCheckFailed) naming the first device that is not, after stopping them all."""
        layout = SlotLayout(self.config.plan_sizes[-1])
        context = multiprocessing.get_context("spawn")  # fork would copy the server's gRPC and CUDA state
        slots: dict[int, list[SharedSlot]] = {device: [] for device in self.config.devices}
        audio: dict[int, list[AudioSlot]] = {device: [] for device in self.config.devices}
        self._slots, self._audio = slots, audio  # closed by close(), whatever start() got to
        try:
            for device_slots in slots.values():
                device_slots.extend(SharedSlot(layout) for _ in range(SLOTS_PER_DEVICE))
            for device_audio in audio.values():
                device_audio.extend(AudioSlot(self.audio_bytes) for _ in range(AUDIO_SLOTS_PER_DEVICE))
            names = {device: [slot.name for slot in device_slots] for device, device_slots in slots.items()}
            audio_names = {
                device: [slot.name for slot in device_audio] for device, device_audio in audio.items()
            }
            for spec in worker_specs(self.config, names, audio_names):
                ours, theirs = context.Pipe(duplex=True)
                name = f"speakerd-device-{spec.device}"
                # not a daemon: a GPU engine's first start times cuDNN plans in processes of
                # its own (engine/gpu/tuning_pool.py), which a daemonic process may not start;
                # a worker still ends with the server (close(), or its parent watch)
                process = context.Process(target=worker_main, args=(spec, theirs), name=name, daemon=False)
                process.start()
                theirs.close()  # ours alone now: its recv sees EOF when the worker dies
                self._workers[spec.device] = _Worker(
                    spec.device, process, ours, slots[spec.device], audio[spec.device],
                    audio_free=list(range(AUDIO_SLOTS_PER_DEVICE)),
                )  # fmt: skip
            for worker in self._workers.values():
                worker.info = self._wait_ready(worker)
        except BaseException:
            self.close()
            raise
        self._adopt({device: worker.info for device, worker in self._workers.items() if worker.info})
        for worker in self._workers.values():
            self.metrics.device_up.labels(device=str(worker.device)).set(1)
            self.metrics.device_inflight.labels(device=str(worker.device)).set(0)
            self.metrics.device_recordings.labels(device=str(worker.device)).set(0)
            self.metrics.device_failures.labels(device=str(worker.device))  # a zero series from the start
            threading.Thread(target=self._read, args=(worker,), name=f"device-{worker.device}-replies",
                             daemon=True).start()  # fmt: skip
        log.info("devices %s ready: one %s engine each, every one passed its self-check (worker pids %s)",
                 list(self.devices), self.name, [self.pid(d) for d in self.devices])  # fmt: skip

    def _wait_ready(self, worker: _Worker) -> WorkerInfo:
        try:
            message = worker.conn.recv()
        except (EOFError, OSError):
            worker.process.join(TERMINATE_WAIT_S)
            raise DeviceStartFailed(
                f"device {worker.device}: its worker process exited during start-up "
                f"(exit code {worker.process.exitcode}); see its log lines above"
            ) from None
        if message[0] == "ready":
            return message[1]
        _, kind, text = message
        error = SelfCheckFailed if kind == "SelfCheckFailed" else DeviceStartFailed
        raise error(f"device {worker.device}: {kind}: {text}")

    def _adopt(self, infos: dict[int, WorkerInfo]) -> None:
        """Take the engines' identity from the workers; they must all serve the same model."""
        first_device, first = next(iter(infos.items()))
        for device, info in infos.items():
            if (info.model_id, info.name, info.plan_sizes) != (first.model_id, first.name, first.plan_sizes):
                self.close()
                raise DeviceStartFailed(
                    f"device {device}: serves {info.name} {info.plan_sizes} model {info.model_id[:12]}, "
                    f"device {first_device} {first.name} {first.plan_sizes} model {first.model_id[:12]}"
                )
        self.name, self.model_id = first.name, first.model_id

    # --- Engine -------------------------------------------------------------------------

    def plan_times_ms(self) -> dict[int, float]:
        """The slowest device's time of each plan (devices of one host are alike; the
        slowest keeps the batcher's cost model honest for every one)."""
        infos = [worker.info for worker in self._workers.values() if worker.info is not None]
        if not infos:
            return {}
        return {size: max(info.plan_times_ms.get(size, 0.0) for info in infos) for size in self.plan_sizes}

    def memory_report(self) -> dict[str, int]:
        """GPU memory of every device's engine, summed by kind."""
        total: dict[str, int] = {}
        for worker in self._workers.values():
            for kind, size in (worker.info.memory if worker.info else {}).items():
                total[kind] = total.get(kind, 0) + size
        return total

    def run_batch(self, fbank: Pieces, masks: Pieces) -> BatchRun:
        """See Engine.run_batch: on the least-loaded device, re-run elsewhere when it fails;
        a batch of a recording's windows on the recording's home device alone."""
        inputs = batch_inputs(fbank, masks)
        if not 1 <= inputs.chunks <= self.max_batch:
            raise ValueError(f"fbank: {inputs.chunks} chunks, expected 1..{self.max_batch} per batch")
        homes = {device for piece in inputs.fbank if (device := device_of(piece)) is not None}
        if homes:
            return self._run_at_home(inputs, homes)
        failed_on: int | None = None  # the device whose engine raised on this batch
        while True:
            lease = self._acquire()
            try:
                kind, payload = self._run_on(lease, inputs)
            except _DeviceLost:
                continue  # taken out while this batch was on it: the next device runs it
            if kind == "done":
                return payload
            if failed_on is not None:
                raise RuntimeError(
                    f"engine error on device {failed_on} and again on device {lease.device}: {payload}"
                )
            failed_on = lease.device
            self._take_out(lease.device, f"its engine raised {payload}")

    def _run_at_home(self, inputs: BatchInputs, homes: set[int]) -> BatchRun:
        """A batch holding a recording's windows, on their home device (the batcher never
        mixes two devices' windows in a batch: serving/batching/queue.py). Nowhere else can
        run it: a device lost meanwhile fails it with RecordingFailed, and an engine error
        fails it alone (the device stays: one batch cannot tell whose fault it was)."""
        if len(homes) > 1:
            raise RuntimeError(
                f"a batch holds windows of recordings on devices {sorted(homes)}; expected one"
            )
        (device,) = homes
        try:
            lease = self._acquire(device)
            kind, payload = self._run_on(lease, inputs)
        except _DeviceLost:
            raise RecordingFailed(self._lost_message(device)) from None
        if kind == "done":
            return payload
        raise RuntimeError(f"device {device}: {payload}")

    @staticmethod
    def _lost_message(device: int) -> str:
        return f"device {device}, which held this recording's audio, failed; retry the call"

    def _acquire(self, device: int | None = None) -> Lease:
        """A slot on the least-loaded device (or on `device` alone), waiting while every one
        is full; _DeviceLost when `device` is out."""
        with self._changed:
            while True:
                if self._closing:
                    raise NoDevice("the server is stopping")
                if not self._table.live:
                    failed = list(self.devices)
                    raise NoDevice(
                        f"every device of --devices failed ({failed}); this replica is NOT_SERVING"
                    )
                if device is not None and not self._table.is_up(device):
                    raise _DeviceLost
                lease = self._table.choose(device)
                if lease is not None:
                    self.metrics.device_inflight.labels(device=str(lease.device)).inc()
                    return lease
                self._changed.wait()

    def _release(self, lease: Lease) -> None:
        with self._changed:
            if self._table.is_up(lease.device):
                self.metrics.device_inflight.labels(device=str(lease.device)).dec()
            self._table.release(lease)
            self._changed.notify_all()

    def _run_on(self, lease: Lease, inputs: BatchInputs) -> tuple[str, Any]:
        """Write the batch into the lease's slot, have the worker run it, and read the
        embeddings back: ("done", BatchRun) or ("error", message); _DeviceLost when the
        device went away meanwhile."""
        worker = self._workers[lease.device]
        slot = worker.slots[lease.slot]
        started = time.perf_counter()
        try:
            named, waveforms = write_batch(slot, inputs, waveforms_per_slot(self.audio_bytes))
            self._stage_waveforms(worker, lease.slot, waveforms)
            future: Future[tuple[str, Any]] = Future()
            with self._changed:
                if not self._table.is_up(lease.device):
                    raise _DeviceLost
                worker.pending[lease.slot] = future
            try:
                with worker.send_lock:
                    worker.conn.send(("run", lease.slot, inputs.chunks, named))
            except OSError as error:  # the worker is gone; its reader takes the device out
                raise _DeviceLost from error
            kind, payload = future.result()  # _DeviceLost when the reader saw the worker die
            if kind != "done":
                return kind, payload
            embeddings = slot.out[: inputs.chunks].copy()  # the slot is reused once released
        finally:
            self._release(lease)
        device = str(lease.device)
        self.metrics.device_batches.labels(device=device).inc()
        self.metrics.device_batch.labels(device=device).observe(time.perf_counter() - started)
        return kind, replace(payload, embeddings=embeddings)

    def _stage_waveforms(self, worker: _Worker, slot: int, waveforms: list[tuple[int, np.ndarray]]) -> None:
        """Each part of the batch's waveform chunks (row, waveforms: write_batch's) sent to
        the worker through an audio slot and turned into fbank rows there for batch slot
        `slot` (waveforms.py). _DeviceLost when the device goes meanwhile (the batch then
        runs elsewhere)."""
        for row, part in waveforms:
            data = memoryview(part).cast("B")
            answer = self._slot_exchange(worker, "waveform", STAGED, (slot, row, len(part)), data)
            _answered(worker.device, "waveform", answer)

    def _read(self, worker: _Worker) -> None:
        """A worker's replies, to the batch or op waiting for each; on EOF the worker is gone."""
        while True:
            try:
                kind, key, payload = worker.conn.recv()
            except (EOFError, OSError):
                break
            with self._changed:
                waiting = worker.pending if kind != "op" else worker.answers
                future = waiting.pop(key, None)
            if future is not None:
                future.set_result((kind, payload) if kind != "op" else payload)
        if not self._closing:
            worker.process.join(TERMINATE_WAIT_S)
            self._take_out(worker.device, f"its worker process exited (exit code {worker.process.exitcode})")
        with self._changed:
            lost = [*worker.pending.values(), *worker.answers.values()]
            worker.pending, worker.answers = {}, {}
        for future in lost:
            future.set_exception(_DeviceLost())

    # --- recordings (remote_recording.RecordingLink) ------------------------------------

    def waveform_fbank(self, waveform: np.ndarray) -> HostWaveforms:
        """EmbedChunks' checked waveforms, whose fbank the device running their batch makes
        (waveforms.py), not this host."""
        return HostWaveforms(waveform)

    def fbank_source(self, step: int) -> RemoteFrames:
        """A recording's FbankSource on its home device (module docstring); NoDevice when
        none is up."""
        return self._home_source(step, segmenting=False)

    def segmenting_source(self, step: int) -> RemoteFrames:
        """The same for a recording the server segments: decoded and kept in the worker,
        segmented there (remote_recording.py)."""
        return self._home_source(step, segmenting=True)

    def _home_source(self, step: int, segmenting: bool) -> RemoteFrames:
        with self._changed:
            home = None if self._closing else self._table.home()
            if home is not None:
                self.metrics.device_recordings.labels(device=str(home)).set(self._table.recordings(home))
        if home is None:
            raise NoDevice("no device of --devices is serving; this replica is NOT_SERVING")
        return RemoteFrames(self, home, step, segmenting)

    def call(
        self, device: int, op: str, recording: int, args: tuple[Any, ...], data: memoryview | None
    ) -> Any:
        """One recording op on `device`'s worker, `data` (or the rows it answers) through one
        of its audio slots; the answer (RemoteFrames says what each op answers).
        RecordingFailed when the device is or goes out; InputError when the worker found the
        audio bad."""
        try:
            answer = self._slot_exchange(self._workers[device], op, recording, args, data)
        except _DeviceLost:
            raise RecordingFailed(self._lost_message(device)) from None
        return _answered(device, op, answer)

    def _slot_exchange(
        self, worker: _Worker, op: str, recording: int, args: tuple[Any, ...], data: memoryview | None
    ) -> tuple[Any, ...]:
        """`_exchange` with `data` written into a free audio slot of the worker's device
        first (the `rows` op: the bytes the worker wrote there come back as the answer's
        value); _DeviceLost when the device is or goes out."""
        slot = self._audio_slot(worker) if data is not None or op == "rows" else None
        try:
            size = 0 if data is None else len(data)
            if data is not None and slot is not None:
                worker.audio[slot].buf[:size] = data
            answer = self._exchange(worker, op, recording, args, slot, size)
            if answer[0] == "ok" and op == "rows" and slot is not None:
                return ("ok", bytes(worker.audio[slot].buf[: answer[1]]))
            return answer
        finally:
            if slot is not None:
                with self._changed:
                    worker.audio_free.append(slot)
                    self._changed.notify_all()

    def _audio_slot(self, worker: _Worker) -> int:
        """A free audio slot of `worker`'s device, waiting while both are in use;
        _DeviceLost when the device is or goes out."""
        with self._changed:
            while True:
                if self._closing or not self._table.is_up(worker.device):
                    raise _DeviceLost
                if worker.audio_free:
                    return worker.audio_free.pop()
                self._changed.wait()

    def _exchange(
        self, worker: _Worker, op: str, recording: int, args: tuple[Any, ...], slot: int | None, size: int
    ) -> tuple[Any, ...]:
        """Send one op to `worker` and wait for its answer; _DeviceLost when it is gone."""
        future: Future[tuple[Any, ...]] = Future()
        with self._changed:
            if self._closing or not self._table.is_up(worker.device):
                raise _DeviceLost
            self._sequence += 1
            sequence = self._sequence
            worker.answers[sequence] = future
        try:
            try:
                with worker.send_lock:
                    worker.conn.send(("op", sequence, op, recording, args, slot, size))
            except OSError:  # the worker is gone; its reader takes the device out
                raise _DeviceLost from None
            return future.result()
        finally:
            with self._changed:
                worker.answers.pop(sequence, None)

    # --- segmentation and linkage (remote_compute.ComputeLink) --------------------------

    def ask(self, op: str, args: tuple[Any, ...]) -> Any:
        """`op` on the live device with the fewest ops waiting (ties: the lowest index),
        again on another when that one is lost; NoDevice when none is left."""
        while True:
            with self._changed:
                live = [self._workers[device] for device in self._table.live]
                if self._closing or not live:
                    raise NoDevice("every device of --devices failed; this replica is NOT_SERVING")
                worker = min(live, key=lambda w: (len(w.answers), w.device))
            try:
                answer = self._exchange(worker, op, 0, args, None, 0)
            except _DeviceLost:
                continue
            return _answered(worker.device, op, answer)

    def segmenter(self) -> Segmenter | None:
        """The workers' segmentation engine (remote_compute.py), when they built one."""
        infos = [worker.info for worker in self._workers.values() if worker.info is not None]
        if not infos or any(info.segmenter is None for info in infos):
            return None
        built = [info.segmenter for info in infos if info.segmenter is not None]
        name, model_id, _ = built[0]
        return RemoteSegmenter(self, name, model_id, min(windows for _, _, windows in built))

    def centroid_linkage(self) -> RemoteLinkage | None:
        """The clustering's linkage on the workers' GPUs, when every one has it (the CPU
        engine's workers have none: the server merges on its host)."""
        rows = [worker.info.linkage_rows for worker in self._workers.values() if worker.info is not None]
        if not rows or min(rows) < 2:
            return None
        return RemoteLinkage(self, min(rows))

    def forget(self, device: int, recording: int) -> None:
        """The recording ended: its home counts one fewer, its worker drops it."""
        with self._changed:
            self._table.leave(device)
            self.metrics.device_recordings.labels(device=str(device)).set(self._table.recordings(device))
            self._changed.notify_all()
        worker = self._workers.get(device)
        if worker is None:
            return
        try:
            with worker.send_lock:
                worker.conn.send(("op", None, "close", recording, (), None, 0))
        except (OSError, ValueError):  # gone, or the pool closed: nothing left to drop
            pass

    def _take_out(self, device: int, why: str) -> None:
        """Never use `device` again (once: later calls do nothing); its batches in flight
        re-run elsewhere, and its worker is stopped."""
        with self._changed:
            if not self._table.take_out(device):
                return
            left = self._table.live
            self._changed.notify_all()
        label = str(device)
        self.metrics.device_failures.labels(device=label).inc()
        self.metrics.device_up.labels(device=label).set(0)
        self.metrics.device_inflight.labels(device=label).set(0)
        self.metrics.device_recordings.labels(device=label).set(0)
        log.error("device %d taken out: %s; its batches in flight re-run on the others; serving on %s",
                  device, why, f"devices {list(left)}" if left else "none: NOT_SERVING")  # fmt: skip
        process = self._workers[device].process
        if process.is_alive():  # an engine that raised: its device's state is unknown
            process.terminate()
        if self.on_lost is not None:
            self.on_lost(device, len(left))

    # --- stop ---------------------------------------------------------------------------

    def close(self) -> None:
        """Stop every worker (not waiting for batches inside an engine) and remove the
        shared memory. Batches waiting for a device get NoDevice."""
        with self._changed:
            self._closing = True
            self._changed.notify_all()
        for worker in self._workers.values():
            try:
                with worker.send_lock:
                    worker.conn.send(("stop",))
            except OSError:
                pass  # gone already
        deadline = time.monotonic() + STOP_WAIT_S
        for worker in self._workers.values():
            worker.process.join(max(0.0, deadline - time.monotonic()))
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join(TERMINATE_WAIT_S)
            worker.conn.close()
        for device_slots in self._slots.values():
            for slot in device_slots:
                slot.close()
        for device_audio in self._audio.values():
            for audio in device_audio:
                audio.close()


def _answered(device: int, op: str, answer: tuple[Any, ...]) -> Any:
    """A worker's answer to an op: its value, or the error it stands for (device_worker.py
    lists them: bad audio, a linkage without the memory or with non-finite rows)."""
    kind = answer[0]
    if kind == "ok":
        return answer[1]
    if kind == "input":
        raise InputError(answer[1], answer[2])
    if kind == "memory":
        raise MemoryError(f"device {device}: {answer[1]}")
    if kind == "value":
        raise ValueError(answer[1])
    raise RuntimeError(f"device {device}: {op}: {answer[1]}")


def write_batch(
    slot: SharedSlot, inputs: BatchInputs, waveforms_per_part: int
) -> tuple[tuple[tuple[int, int, int, int], ...], list[tuple[int, np.ndarray]]]:
    """Copy a batch's pieces into a slot's fbank and masks rows (masks resized onto the
    trunk's 125 frames: shared_slots.py says why that changes no embedding), except the rows
    the worker has or makes, which are named instead, in row order, as (row, recording,
    first window, end window): a recording's windows, which lie in the worker already, and
    waveform chunks, whose fbank the worker makes (as (row, STAGED, 0, count), the chunks in
    parts of at most `waveforms_per_part`, also returned as (row, waveforms) to send first:
    DevicePool._stage_waveforms). The named ranges are what the "run" message carries."""
    row = 0
    named: list[tuple[int, int, int, int]] = []
    waveforms: list[tuple[int, np.ndarray]] = []
    for piece in inputs.fbank:
        if isinstance(piece, RemoteWindows):
            named.append((row, piece.recording, piece.start, piece.stop))
            row += len(piece)
            continue
        if isinstance(piece, HostWaveforms):
            for first in range(0, len(piece), waveforms_per_part):
                part = piece.waveform[first : first + waveforms_per_part]
                named.append((row + first, STAGED, 0, len(part)))
                waveforms.append((row + first, part))
            row += len(piece)
            continue
        rows = np.asarray(piece)
        count = rows.size // (FRAMES * MEL_BINS)
        slot.fbank[row : row + count] = rows.reshape(count, FRAMES, MEL_BINS)
        row += count
    row = 0
    for piece in inputs.masks:
        count = piece.shape[0]
        slot.masks[row : row + count] = piece if piece.shape[2] == TRUNK_FRAMES else resize_masks(piece)
        row += count
    return tuple(named), waveforms

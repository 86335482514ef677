"""`python -m speakerd serve`: the gRPC server's life cycle, once its flags were read
(command.py).

Before listening, what can be checked at once is (`preflight`): the flags' combination, the
engine kind (an explicit `--engine gpu` needs a usable GPU), the CPU engine's FP32-only
math, an explicit `--model` (a Hugging Face repo id downloaded and converted now, or a local
file; model/source.py), `--segmentation-model` and `--plda` (server/plda.py) the same way,
the TLS files and the token file, and that the address can be bound. A failure there is a
usage error: one log line naming the flag and what to do, exit code 2, and nothing about
draining (the server never served).

Start: listen at once with health NOT_SERVING (so probes get an answer during warm-up),
then in a warm-up thread load the weights, build and warm the engine's plans and run the
parity self-check; only when it passes attach the batcher and say SERVING. A failed
self-check stops the server with exit code 1 instead of serving wrong embeddings.

With --devices (device_pool.py) the warm-up starts one worker process per device instead,
each building and checking its own engine; SERVING once all have. A device lost later is
taken out by the pool; with none left health turns NOT_SERVING (the process stays up to
answer probes and drain, and the orchestrator restarts it). Preflight checks that the
devices exist and that their batch slots fit in /dev/shm.

SIGTERM / SIGINT: health NOT_SERVING, new calls UNAVAILABLE, calls in progress and queued
chunks get up to --drain-seconds; what is left then is failed with UNAVAILABLE and the
server stops. During warm-up the server stops at once without waiting for it. A batch
already inside the engine cannot be interrupted (native code), so when one is still
running once the drain is over, the process exits without joining its thread: the drain
time bounds the exit, not the work in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from speakerd.engine.base import Engine
from speakerd.engine.segmenter import Segmenter
from speakerd.model.diarization import linkage
from speakerd.model.diarization.pipeline import compile_loops
from speakerd.model.diarization.plda import Plda
from speakerd.model.segmentation.weights import SegmentationModel
from speakerd.model.source import ModelSource, ResolvedModel, ResolvedPlda
from speakerd.model.weights import FoldedModel
from speakerd.reference.self_check import SelfCheckFailed, checked_engine
from speakerd.serving.access.auth import TokenAuthInterceptor, TokenFile
from speakerd.serving.access.security import TlsFileError, TlsFiles, add_port, server_credentials
from speakerd.serving.api.http2 import stream_options
from speakerd.serving.api.service import (
    MAX_CONCURRENT_STREAMS,
    SERVICE_NAME,
    SpeakerEmbeddingService,
    package_version,
    register,
)
from speakerd.serving.batching.batcher import Batcher, DrainReport
from speakerd.serving.devices.device_pool import DevicePool, OnLost, PoolConfig, shared_bytes_per_device
from speakerd.serving.devices.shared_slots import SHM_DIR, shared_memory_free
from speakerd.serving.diarization.service import SERVICE_NAME as DIARIZATION_SERVICE
from speakerd.serving.diarization.service import DiarizationService
from speakerd.serving.diarization.service import register as register_diarization
from speakerd.serving.memory import heap
from speakerd.serving.memory.recording_budget import RecordingBudget
from speakerd.serving.observability.logs import LOG_FORMAT
from speakerd.serving.observability.metrics import Metrics
from speakerd.serving.receivers.receiver_link import SLOT_BYTES, SLOTS_PER_RECEIVER, ReceiverSpec
from speakerd.serving.receivers.receivers import ReceiverFailed, ReceiverGroup
from speakerd.serving.server import config, plda, segmentation
from speakerd.serving.server import data_dir as data_dir_lock
from speakerd.serving.server.memory_bound import memory_bound, resident_bytes
from speakerd.serving.server.phases import Phases
from speakerd.serving.server.precompile import ClusteringCompile
from speakerd.serving.voiceprints.records import StoreUnavailable
from speakerd.serving.voiceprints.service import SERVICE_NAME as VOICEPRINTS_SERVICE
from speakerd.serving.voiceprints.service import VoiceprintService
from speakerd.serving.voiceprints.service import register as register_voiceprints
from speakerd.serving.voiceprints.store import SQLITE

log = logging.getLogger(__name__)

#: Seconds grpc.aio gets to close connections once every call has finished or timed out.
STOP_GRACE_S = 1.0
#: After the drain time, how long calls failed with UNAVAILABLE get to send that answer
#: before the server cancels whatever is left (a few event-loop turns are enough).
FAIL_LEFTOVERS_S = 0.5
#: A failed self-check's exit code; a configuration the server cannot start with exits
#: config.USAGE_EXIT, as its flags do.
START_FAILED_EXIT = 1

T = TypeVar("T")


@dataclass
class Prepared:
    """What preflight resolved, handed to the server so nothing is loaded twice."""

    engine_kind: str  # "cpu" or "gpu"
    model: FoldedModel | None  # an explicit --model, resolved and loaded; None: the default model
    credentials: grpc.ServerCredentials | None
    tokens: TokenFile | None
    #: `--devices`, resolved to indices that exist here; None: one engine in this process
    devices: tuple[int, ...] | None = None
    #: where an explicit --model's safetensors came from; None: the default model
    resolved: ResolvedModel | None = None
    #: an explicit --segmentation-model, resolved and loaded; None: the default one
    segmentation: tuple[ResolvedModel, SegmentationModel] | None = None
    #: --plda, resolved and loaded; None: no PLDA (Diarize's VBx unavailable)
    plda: tuple[ResolvedPlda, Plda] | None = None
    #: --data-dir's lock file, held open while this process keeps its SQLite voiceprints
    #: there (data_dir.py)
    data_dir: IO[str] | None = None


@dataclass
class Outcome:
    exit_code: int
    #: engine work still running in a thread that the process will not wait for
    abandoned_work: bool = False


def run(settings: config.ServeConfig) -> int:
    """Preflight, then serve until stopped; the process's exit code."""
    logging.basicConfig(level=settings.log_level, format=LOG_FORMAT)
    heap.keep_freed_memory()  # before any thread: requests' buffers reused, arenas capped (heap.py)
    try:
        prepared = preflight(settings)
    except config.UsageError as error:
        log.error("%s", error)
        return config.USAGE_EXIT
    outcome = asyncio.run(serve(settings, prepared))
    if outcome.abandoned_work:
        # a batch or the warm-up is still running in native code; joining it (what the
        # interpreter does for pool threads at exit) would stretch the exit by that work
        log.info("exiting without waiting for engine work still running")
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(outcome.exit_code)
    return outcome.exit_code


def preflight(settings: config.ServeConfig) -> Prepared:
    """Check what can be checked before listening; UsageError naming the flag otherwise."""
    from speakerd.engine.factory import EngineUnavailable, resolve_kind

    try:
        kind = resolve_kind(settings.engine)
    except EngineUnavailable as error:
        reason = str(error).removeprefix("engine: gpu requested but ")
        raise config.UsageError(
            f"--engine gpu: {reason}; install the gpu extra on a machine with an NVIDIA GPU, "
            "or use --engine cpu (or auto, which takes the CPU when no GPU is usable)"
        ) from error
    if kind == "cpu":
        why = "--engine cpu" if settings.engine == "cpu" else "no GPU is usable here"
        for flag, asked, what in (
            ("--math", settings.math, "engine"),
            ("--segmentation-math", settings.segmentation_math, "segmenter"),
        ):
            if asked != "fp32":
                raise config.UsageError(
                    f"{flag} {asked}: the CPU {what} ({why}) computes fp32 only; "
                    f"use {flag} fp32, or {flag} {asked} with --engine gpu on a GPU"
                )
    resolved = _resolve_model(settings.model) if settings.model else None
    model = _load_model(resolved, settings.model) if resolved is not None else None
    segmentation_model = None
    if settings.segmentation_model:
        found = segmentation.resolve(settings.segmentation_model)
        segmentation_model = (found, segmentation.load(found, settings.segmentation_model))
    vbx_plda = plda.prepare(settings.plda) if settings.plda else None
    credentials = None
    if settings.tls_cert is not None and settings.tls_key is not None:
        files = TlsFiles(settings.tls_cert, settings.tls_key, settings.tls_client_ca)
        try:
            credentials = server_credentials(files)
        except TlsFileError as error:
            raise config.UsageError(f"{error}") from error
    tokens = None
    if settings.auth_tokens is not None:
        try:
            tokens = TokenFile(settings.auth_tokens)
        except (OSError, UnicodeDecodeError) as error:
            message = f"--auth-tokens {settings.auth_tokens}: cannot read it ({error})"
            raise config.UsageError(message) from error
    devices = None
    if settings.devices is not None:
        from speakerd.engine.factory import device_count

        devices = settings.devices.resolve(*device_count(kind))
    _check_shared_memory(len(devices or ()), settings.plans[-1], settings.receivers)
    _check_bindable(settings.host, settings.port, "--port")
    _check_bindable(settings.host, settings.metrics_port, "--metrics-port")
    # last: nothing after it fails, so a refused start never held the directory
    held = data_dir_lock.hold(settings.data_dir) if settings.voiceprints == SQLITE else None
    return Prepared(kind, model, credentials, tokens, devices, resolved, segmentation_model, vbx_plda, held)


def _check_shared_memory(devices: int, max_batch: int, receivers: int) -> None:
    """The batch and audio slots of `devices` workers and the request slots of `receivers` must fit in
    /dev/shm: past its end a write is a SIGBUS that kills the writer mid-batch, so a small
    one is a usage error now."""
    needs = {
        "--devices": devices * shared_bytes_per_device(max_batch),
        "--receivers": receivers * SLOTS_PER_RECEIVER * SLOT_BYTES,
    }
    needed = sum(needs.values())
    free = shared_memory_free()
    if needed and free is not None and free < needed:
        flags = " and ".join(f"{flag} ({size / 1e6:.0f} MB)" for flag, size in needs.items() if size)
        raise config.UsageError(
            f"{flags}: need {needed / 1e6:.0f} MB of shared memory in {SHM_DIR}, {free / 1e6:.0f} MB are "
            f"free; give the container more (docker run --shm-size 1g, or a memory-backed emptyDir at "
            f"{SHM_DIR} as deploy/k8s-multi-gpu does), or ask for fewer"
        )


def _free_port(host: str) -> int:
    """A port free on `host` now (for --port 0 with --receivers, which must share one)."""
    family = socket.getaddrinfo(host or None, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def _resolve_model(model: str) -> ResolvedModel:
    """--model's safetensors (downloaded, converted and cached as needed); UsageError otherwise."""
    from speakerd.model.source import ModelError, resolve_model

    try:
        return resolve_model(model)
    except ModelError as error:
        raise config.UsageError(str(error)) from error


def _load_model(resolved: ResolvedModel, model: str) -> FoldedModel:
    from speakerd.model.weights import load_model

    try:
        return load_model(resolved.path)
    except (ValueError, KeyError, OSError) as error:
        raise config.UsageError(
            f"--model {model}: {resolved.path} is not usable ({error}); give pyannote's WeSpeaker ResNet34 "
            "(a repo id like pyannote/wespeaker-voxceleb-resnet34-LM, its pytorch_model.bin, or safetensors)"
        ) from error


def _check_bindable(host: str, port: int, flag: str) -> None:
    """Bind `host:port` once and let go, so that an address taken or not on this machine is
    one line naming the flags instead of the gRPC core's error and a traceback."""
    if port == 0 and host in ("", "0.0.0.0", "::"):
        return
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as error:
        message = f"--host {host}: not an address of this machine ({error.strerror})"
        raise config.UsageError(message) from error
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds
        try:
            probe.bind(address)
        except OSError as error:
            raise config.UsageError(
                f"--host {host} {flag} {port}: cannot listen there ({error.strerror}); "
                f"pick a free {flag} (0 picks one) or an address of this machine"
            ) from error


async def serve(settings: config.ServeConfig, prepared: Prepared) -> Outcome:
    """Run until SIGTERM/SIGINT (exit 0 after draining) or a failed start (exit 1 or 2)."""
    server = SpeakerServer(settings, prepared)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):  # before listening: no window without them
        loop.add_signal_handler(sig, server.request_stop)
    try:
        await server.start()
    except config.UsageError as error:
        log.error("%s", error)
        await server.close_unstarted()
        return Outcome(config.USAGE_EXIT)
    code = await server.wait()
    return Outcome(code, server.abandoned_work)


def _build_engine(
    settings: config.ServeConfig,
    prepared: Prepared,
    resolved: ResolvedModel,
    phases: Phases,
    tuning: object | None = None,
) -> Engine:
    """Load the weights, build and warm the engine, check it against the reference (blocking).
    A GPU engine built from cached start-up choices (engine/build_cache.py) that fails the
    self-check is built afresh once, its cached choices removed; one that passes keeps its
    choices for the next start."""
    from speakerd.model.weights import load_model

    model = prepared.model if prepared.model is not None else load_model(resolved.path)
    engine = _engine(settings, prepared, model, resolved.path, phases, tuning)
    engine = checked_engine(
        engine,
        model,
        rebuild=lambda: _engine(settings, prepared, model, resolved.path, phases),
        timed=lambda: phases.timed("self-check"),
    )
    try:
        log.info("self-check passed for every plan; timing plans for the batcher's cost model")
        # measured here, off the event loop (the batcher reads them when it is made): on a
        # CPU engine this runs every plan once, seconds in which health must still answer;
        # so are the rows the batcher answers silent windows with (Engine.empty_rows)
        with phases.timed("plan timing"):
            times = engine.plan_times_ms()
            engine.empty_rows()
    except BaseException:
        engine.close()
        raise
    log.info("plan times %s", plan_times_text(times, prepared.engine_kind))
    return engine


def _engine(
    settings: config.ServeConfig,
    prepared: Prepared,
    model: FoldedModel,
    source: Path,
    phases: Phases,
    tuning: object | None = None,
) -> Engine:
    """The engine `settings` ask for, built and warmed (the "engine" phase); `tuning`: its
    plan timing begun earlier (factory.start_tuning)."""
    from speakerd.engine.factory import create_engine

    started = time.perf_counter()
    with phases.timed("engine"):
        engine = create_engine(prepared.engine_kind, model, settings.math, settings.plans,
                               settings.conv_kernels, cpu_threads=settings.cpu_threads or None,
                               build_cache=True, tuning=tuning)  # fmt: skip
    threads = f", {engine.threads} thread{'s' * (engine.threads != 1)}" if engine.threads else ""
    log.info("engine %s %s plans %s%s built in %.1f s from %s (model %s%s)", engine.name, engine.math,
             engine.plan_sizes, threads, time.perf_counter() - started, source, model.model_id[:12],
             ", cached start-up choices" if engine.built_from_cache else "")  # fmt: skip
    return engine


@dataclass
class Built:
    """What a start-up builds before serving (build_all)."""

    engine: Engine
    segmenter: Segmenter
    model_source: ModelSource
    segmentation_source: ModelSource
    linker: linkage.Linker


def build_all(
    settings: config.ServeConfig,
    prepared: Prepared,
    phases: Phases,
    metrics: Metrics,
    on_lost: Callable[[int, int], None],
) -> Built:
    """The models (the default ones made here on first use), the segmenter, the engine (or
    the device pool) with its self-check, and Diarize's linkage: what `serve` waits for
    before SERVING and `speakerd warm` builds to fill the caches (blocking)."""
    from speakerd.engine.factory import start_tuning
    from speakerd.model.source import SEGMENTATION, resolve_model

    clustering = ClusteringCompile()  # numba's compile in a child process, beside all of this
    segmenter: Segmenter | None = None
    # a GPU engine's first start times cuDNN's plans in worker processes from now on, while
    # the models are made or loaded (engine/gpu/tuning_pool.py)
    tuning = None
    if prepared.devices is None:
        tuning = start_tuning(prepared.engine_kind, settings.math, settings.plans, settings.conv_kernels)
    try:
        with phases.timed("models"):
            resolved = prepared.resolved or resolve_model(None)
            if prepared.segmentation is not None:
                found, weights = prepared.segmentation
            else:
                found = resolve_model(None, kind=SEGMENTATION)
                weights = segmentation.load(found, None)
        if prepared.devices is None:
            # the segmenter's GPU work is never beside a plan being timed
            beside = tuning.gpu_lock if tuning is not None else contextlib.nullcontext()
            with phases.timed("segmentation"), beside:
                segmenter = segmentation.build(
                    weights, found.path, prepared.engine_kind, settings.segmentation_math
                )
            engine = _build_engine(settings, prepared, resolved, phases, tuning)
        else:
            # the GPUs belong to the worker processes: each builds the segmenter beside its
            # engine, and this process's segmenter and linkage are theirs (remote_compute.py)
            with phases.timed("devices"):
                pool = _start_pool(settings, prepared, resolved, found.path, metrics, on_lost)
            engine, segmenter = pool, pool.segmenter()
            assert segmenter is not None, "every worker was given the segmentation model"
        with phases.timed("clustering check"):
            clustering.wait()  # then the linkage and the frame loops load what the child compiled
            linker = diarization_linker(settings.linkage, engine)
            compile_loops()
    except BaseException:
        clustering.close()
        if tuning is not None:  # not yet handed to the engine, or closed by it already
            tuning.close()
        if segmenter is not None:
            segmenter.close()
        raise
    return Built(engine, segmenter, resolved.source, found.source, linker)


def _start_pool(
    settings: config.ServeConfig,
    prepared: Prepared,
    resolved: ResolvedModel,
    segmentation_path: Path,
    metrics: Metrics,
    on_lost: OnLost,
) -> DevicePool:
    """`--devices`: one worker process per device, each building its engine and passing the
    self-check; blocking until all have (DeviceStartFailed or SelfCheckFailed otherwise)."""
    assert prepared.devices is not None
    started = time.perf_counter()
    pool_config = PoolConfig(
        kind=prepared.engine_kind,
        weights=str(resolved.path),  # the default model made here, once
        math=settings.math,
        plan_sizes=settings.plans,
        devices=prepared.devices,
        conv_kernels=settings.conv_kernels,
        log_level=settings.log_level,
        cpu_threads=settings.cpu_threads,
        segmentation=str(segmentation_path),
        segmentation_math=settings.segmentation_math,
    )
    pool = DevicePool(pool_config, metrics, on_lost)
    pool.start()
    times = pool.plan_times_ms()
    pool.empty_rows()  # one b1 run on a device, as _build_engine measures it
    log.info("%d devices %s up in %.1f s; plan times (slowest device) %s", len(prepared.devices),
             list(prepared.devices), time.perf_counter() - started,
             plan_times_text(times, prepared.engine_kind))  # fmt: skip
    return pool


def plan_times_text(times: dict[int, float], engine_kind: str) -> str:
    """The start-up log's plan times, saying which are estimates: the CPU engine runs one
    chunk per ONNX Runtime call, so it times one chunk and gives plan b as b times that
    (CpuEngine.plan_times_ms); the GPU engine times every plan."""
    text = ", ".join(f"b{size} {ms:.2f} ms" for size, ms in sorted(times.items()))
    if engine_kind == "cpu" and len(times) > 1:
        text += f" (b1 measured; b{max(times)} and the other plans are b x b1, estimated)"
    return text


def diarization_linker(implementation: str, engine: Engine) -> linkage.Linker:
    """Diarize's centroid linkage (--linkage): compiled, on the engine's device when it has
    one (Engine.centroid_linkage, up to the rows it takes; beyond them the host merges, its
    distances from Engine.pair_distances) or on the CPU engine's threads; or SciPy's. Waits
    for the checks against SciPy and says in one line what it will use."""
    if implementation == linkage.SCIPY:
        log.info("clustering: centroid linkage by SciPy (--linkage scipy)")
        return linkage.Linker(linkage.SCIPY)
    device = engine.centroid_linkage()
    if device is not None and linkage.device_proven(device):
        log.info("clustering: centroid linkage on %s up to %d rows, checked equal to SciPy's",
                 engine.name, device.max_rows)  # fmt: skip
    else:
        device = None
    chosen = linkage.Linker(implementation, engine.pair_distances(), engine.threads, device)
    if chosen.compiled:
        where = f"distances on {engine.name}" if chosen.distances is not None else "distances on the host"
        log.info("clustering: centroid linkage compiled, checked equal to SciPy's (%s)", where)
    else:
        log.info("clustering: centroid linkage by SciPy (the compiled port is %s)",
                 "not installed" if not linkage.available() else "not equal to this SciPy")  # fmt: skip
    return chosen


def in_daemon_thread(work: Callable[[], T], orphan: Callable[[T], None]) -> asyncio.Future[T]:
    """Run `work` in a daemon thread; its result or exception arrives in the future returned.

    Not asyncio.to_thread: the loop's default executor is joined when asyncio.run ends, so a
    SIGTERM during a 30 s warm-up would wait for it. If the future was cancelled (nobody
    waits any more) when `work` returns, `orphan` gets the result (to release it).
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if future.cancelled():
            if error is None:
                orphan(result)  # type: ignore[arg-type]
        elif error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)  # type: ignore[arg-type]

    def target() -> None:
        result, error = None, None
        try:
            result = work()
        except BaseException as caught:
            error = caught
        with contextlib.suppress(RuntimeError):  # a closed loop: the process is on its way out
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=target, name="warm-up", daemon=True).start()
    return future


class SpeakerServer:
    """The gRPC server, its health and metrics, and the engine behind them."""

    def __init__(self, settings: config.ServeConfig, prepared: Prepared) -> None:
        self.settings = settings
        self.prepared = prepared
        self.metrics = Metrics()
        self.health = health.aio.HealthServicer()
        budget = RecordingBudget(settings.recording_memory_mb << 20, settings.recording_queue)
        self.service = SpeakerEmbeddingService(
            self.metrics, settings.max_message_bytes, budget, prepared.plda
        )
        self.voiceprints: VoiceprintService | None = None
        if settings.voiceprints != "off":
            self.voiceprints = VoiceprintService(self.service, self.service.recordings, settings.voiceprints,
                                                 settings.data_dir, prepared.tokens is not None)  # fmt: skip
        clustering = RecordingBudget(settings.clustering_memory_mb << 20, settings.recording_queue)
        self.metrics.clustering_bytes_limit.set(clustering.limit_bytes)
        self.diarization = DiarizationService(
            self.service, self.service.recordings, self.voiceprints, prepared.tokens is not None,
            clustering, prepared.plda,
        )  # fmt: skip
        self.engine: Engine | None = None
        self.batcher: Batcher | None = None
        self.port = 0
        self.metrics_port = 0
        self.abandoned_work = False
        #: where the served weights came from (GetModelInfo.source), known once warm-up resolved them
        self.model_source = ModelSource()
        self.segmenter: Segmenter | None = None
        self.segmentation_source = ModelSource()
        self._server: grpc.aio.Server | None = None
        #: --receivers: the processes taking calls on the port, and the private directory
        #: of this server's own socket, where they forward what they do not hand over
        self.receivers: ReceiverGroup | None = None
        self._internal_dir: str | None = None
        self._started = time.monotonic()
        #: where the start-up's seconds went, said on the SERVING line
        self.phases = Phases()
        self._stop = asyncio.Event()
        self._exit_code = 0
        self._warm_up: asyncio.Task[None] | None = None
        self._building: asyncio.Future[Engine] | None = None
        self._stopping: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Listen (NOT_SERVING) and begin the warm-up; UsageError when the port cannot be had."""
        s = self.settings
        options = [
            ("grpc.max_receive_message_length", s.max_message_bytes),
            ("grpc.max_send_message_length", s.max_message_bytes),
            # advertised in HTTP/2 SETTINGS: a client opens at most this many calls at once per
            # connection, so one connection cannot queue unbounded work (service.py says why 32
            # and why streams are counted as the client counts them)
            *stream_options(MAX_CONCURRENT_STREAMS),
        ]
        interceptors = [] if self.prepared.tokens is None else [TokenAuthInterceptor(self.prepared.tokens)]
        self._server = grpc.aio.server(options=options, interceptors=interceptors)
        register(self.service, self._server)
        register_diarization(self.diarization, self._server)
        if self.voiceprints is not None:
            register_voiceprints(self.voiceprints, self._server)
            await self._open_voiceprints(self.voiceprints)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        served = (SERVICE_NAME, DIARIZATION_SERVICE)
        if self.voiceprints is not None:
            served += (VOICEPRINTS_SERVICE,)
        reflection.enable_server_reflection(
            (*served, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self._server,
        )
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        internal = None
        if s.receivers:  # they listen on the port; this server only on its private socket
            self._internal_dir = tempfile.mkdtemp(prefix="speakerd-")  # mode 0700: this user only
            internal = f"unix:{self._internal_dir}/server.sock"
            if self._server.add_insecure_port(internal) == 0:
                raise config.UsageError(f"--receivers: cannot listen on {internal} (is /tmp writable?)")
        else:
            self.port = self._bind_port()
        try:
            self.metrics_port = self.metrics.serve_http(s.metrics_port, s.host)
        except OSError as error:
            raise config.UsageError(
                f"--host {s.host} --metrics-port {s.metrics_port}: cannot listen there ({error.strerror}); "
                "pick a free --metrics-port (0 picks one)"
            ) from error
        await self._server.start()
        if internal is not None:
            self.port = await self._start_receivers(internal)
        self.metrics.build_info.labels(version=package_version()).set(1)
        log.info("listening on %s:%d (metrics on :%d, plain HTTP), gRPC %s%s; NOT_SERVING until the "
                 "warm-up (model, engine build, parity self-check) passes", s.host, self.port,
                 self.metrics_port, self._transport(), "" if self.prepared.tokens is None else
                 ", bearer tokens required (health open)")  # fmt: skip
        self._warm_up = asyncio.ensure_future(self._warm())

    async def _open_voiceprints(self, voiceprints: VoiceprintService) -> None:
        """Open the voiceprint store. One that cannot be opened now (a database that is
        down, a read-only --data-dir) does not stop the embedding service: each voiceprint
        call tries again, UNAVAILABLE with the reason until it opens."""
        try:
            await asyncio.to_thread(voiceprints.open)
        except StoreUnavailable as error:
            log.warning("voiceprints: %s; their calls get UNAVAILABLE until it opens", error)

    def _bind_port(self) -> int:
        """Listen on --host:--port in this process; the port bound."""
        s = self.settings
        address = f"{s.host}:{s.port}"
        assert self._server is not None
        try:
            return add_port(self._server, address, self.prepared.credentials)
        except RuntimeError as error:
            message = f"--host {s.host} --port {s.port}: cannot listen there ({error})"
            raise config.UsageError(message) from error

    async def _start_receivers(self, internal: str) -> int:
        """Start --receivers processes on --host:--port (a free port first when it is 0:
        they must all bind the same one); the port."""
        s = self.settings
        port = s.port or _free_port(s.host)
        template = ReceiverSpec(
            index=0, host=s.host, port=port, max_message_bytes=s.max_message_bytes,
            max_concurrent_streams=MAX_CONCURRENT_STREAMS, internal_target=internal, slot_names=(),
            slot_bytes=SLOT_BYTES, tls_cert=s.tls_cert, tls_key=s.tls_key, tls_client_ca=s.tls_client_ca,
            auth_tokens=s.auth_tokens, log_level=s.log_level, drain_seconds=s.drain_seconds,
        )  # fmt: skip
        # each receiver's counter looked up once (on its first call), not on every call
        calls = functools.cache(lambda index: self.metrics.receiver_calls.labels(receiver=str(index)))
        self.receivers = ReceiverGroup(
            s.receivers,
            template,
            self.service.EmbedChunks,
            self.metrics.receiver_restarts.inc,
            lambda index: calls(index).inc(),
        )
        try:
            await self.receivers.start()
        except ReceiverFailed as error:
            flags = f"--host {s.host} --port {port} --receivers {s.receivers}"
            raise config.UsageError(f"{flags}: {error}") from error
        log.info("%d receiver processes take calls on port %d (pids %s); EmbedChunks requests of up to "
                 "%d MiB reach this process through shared memory", s.receivers, port,
                 self.receivers.pids, SLOT_BYTES >> 20)  # fmt: skip
        return port

    async def _stop_receivers(self, grace_s: float) -> None:
        """Stop the receivers (each finishes its calls within `grace_s`) and remove the socket."""
        if self.receivers is not None:
            await self.receivers.stop(grace_s)
        if self._internal_dir is not None:
            shutil.rmtree(self._internal_dir, ignore_errors=True)

    def _transport(self) -> str:
        if self.prepared.credentials is None:
            return "plaintext"
        return "mutual TLS" if self.settings.tls_client_ca is not None else "TLS"

    async def close_unstarted(self) -> None:
        """Release what start() got before it failed; nothing was served, nothing drains."""
        await self._stop_receivers(0.0)
        if self._server is not None:
            await self._server.stop(None)
        self.service.close()
        self.diarization.close()
        if self.voiceprints is not None:
            self.voiceprints.close()
        self.metrics.close()

    async def _warm(self) -> None:
        s = self.settings
        loop = asyncio.get_running_loop()

        def on_lost(device: int, left: int) -> None:  # a pool thread
            with contextlib.suppress(RuntimeError):  # a closed loop: the process is on its way out
                loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._device_lost(device, left)))

        def build() -> Engine:
            # the default models are made here, on first use, while health answers NOT_SERVING
            built = build_all(s, self.prepared, self.phases, self.metrics, on_lost)
            self.model_source, self.segmentation_source = built.model_source, built.segmentation_source
            self.segmenter = built.segmenter
            self.diarization.linker = built.linker
            return built.engine

        self._building = in_daemon_thread(build, lambda e: e.close())
        try:
            engine = await self._building
        except SelfCheckFailed as error:
            log.error("self-check failed, not serving wrong embeddings: %s", error)
            self._fail_start()
            return
        except Exception:
            log.exception("start-up failed; not serving")
            self._fail_start()
            return
        self.engine = engine
        self.batcher = Batcher(engine, self.metrics, s.max_delay_ms / 1e3, s.queue_chunks)
        self.batcher.start()
        self.service.attach(engine, self.batcher, self.model_source, self.segmenter, self.segmentation_source)
        self.metrics.model_info.labels(
            model_id=engine.model_id, engine=engine.name, math=str(engine.math)
        ).set(1)
        self._report_memory(engine)
        frozen = heap.freeze_long_lived()  # full collections walk requests' objects only (heap.py)
        log.debug("%d start-up objects frozen out of the garbage collector's passes", frozen)
        heap.give_back()  # the start-up's freed memory: the baseline is what serving keeps
        bound = memory_bound(
            resident_bytes(), s.max_message_bytes, s.queue_chunks, engine.max_batch,
            len(self.prepared.devices or ()) or 1, s.receivers, s.recording_memory_mb << 20,
            s.clustering_memory_mb << 20,
        )  # fmt: skip
        log.info("memory bound %d bytes + %d bytes per call open at once (at most %d a connection): %s; "
                 "docs/service.md has the formula", bound.fixed, bound.per_call, MAX_CONCURRENT_STREAMS,
                 bound.describe())  # fmt: skip
        if self._stopping is None:
            for name in ("", SERVICE_NAME):
                await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
            took = time.monotonic() - self._started
            log.info("SERVING %s after %.1f s of start-up (%s)", SERVICE_NAME, took, self.phases.text())

    async def _device_lost(self, device: int, left: int) -> None:
        """A device of --devices was taken out (the pool logged why); with none left the
        server cannot embed anything: NOT_SERVING, so probes and balancers route elsewhere."""
        if left == 0 and self._stopping is None:
            for name in ("", SERVICE_NAME):
                await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
            log.error("no device left after device %d failed: NOT_SERVING (restart the server)", device)

    def _fail_start(self) -> None:
        self._exit_code = START_FAILED_EXIT
        self.request_stop()

    def _report_memory(self, engine: Engine) -> None:
        """GPU engines report their memory as {kind: bytes}; CPU engines have none."""
        report = getattr(engine, "memory_report", None)
        if callable(report):
            for kind, size in dict(report()).items():
                self.metrics.gpu_memory.labels(kind=str(kind)).set(float(size))

    def request_stop(self) -> None:
        """Begin draining (idempotent); safe to call from a signal handler on the loop."""
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._drain_and_stop())

    async def _drain_and_stop(self) -> None:
        started = time.monotonic()
        await self.health.enter_graceful_shutdown()
        self.service.begin_drain()
        if self._warm_up is not None and not self._warm_up.done():
            log.info("stopping during warm-up: not waiting for it (it ends with the process)")
            # cancelling the task cancels the future it awaits, not the thread behind it: the
            # thread runs on in native code (ONNX Runtime, CUDA), which the interpreter's exit
            # must not wait for, nor tear down under it
            self._warm_up.cancel()
            self.abandoned_work = True
        served = self.engine is not None
        if served:
            await self._drain(started)
        elif self._server is not None:  # never served: no calls to drain
            await self._stop_receivers(0.0)
            await self._server.stop(None)
        self.service.close()
        self.diarization.close()
        if self.voiceprints is not None:
            self.voiceprints.close()
        self.metrics.close()
        log.info("stopped after %.2f s %s", time.monotonic() - started,
                 "of draining" if served else "(it never served: nothing to drain)")  # fmt: skip
        self._stop.set()

    async def _drain(self, started: float) -> None:
        """Up to --drain-seconds for calls in progress, then UNAVAILABLE for what is left."""
        s = self.settings
        assert self._server is not None and self.batcher is not None and self.engine is not None
        log.info("draining: NOT_SERVING, new calls UNAVAILABLE, up to %.1f s for calls in progress",
                 s.drain_seconds)  # fmt: skip
        idle = await self.service.wait_idle(s.drain_seconds)
        calls_left = self.service.inflight
        remaining = max(0.0, s.drain_seconds - (time.monotonic() - started))
        # queued chunks are failed with UNAVAILABLE (Draining) once `remaining` is spent; the
        # wait for batches already in the engine is bounded, they are not interruptible
        try:
            await asyncio.wait_for(self.batcher.drain(remaining), remaining + FAIL_LEFTOVERS_S)
            batches_done = True
        except TimeoutError:
            batches_done = False
        report = self.batcher.drain_report or DrainReport(False, 0, 0, 0, remaining)
        if not idle or not report.finished or not batches_done:
            # one line for an operator: what the drain gave up, not a line per piece of it
            log.warning(
                "drain: --drain-seconds %.1f passed; abandoned %d calls in progress (answered UNAVAILABLE "
                "or cancelled), %d queued requests (%d chunks) failed with UNAVAILABLE, %d batches %s",
                s.drain_seconds, calls_left, report.failed_requests, report.failed_chunks,
                report.running_batches, "still running in the engine, not waited for" if not batches_done
                else "that ran to their end",
            )  # fmt: skip
        # calls still waiting on a running batch: the server cancels them (clients: UNAVAILABLE)
        await self._stop_receivers(STOP_GRACE_S if idle else 0)
        await self._server.stop(STOP_GRACE_S if idle else 0)
        if batches_done or isinstance(self.engine, DevicePool):
            # worker processes end whatever they run: nothing in this process is cut short
            self.engine.close()
        if not batches_done:
            self.abandoned_work = True

    async def wait(self) -> int:
        await self._stop.wait()
        return self._exit_code

    async def wait_serving(self, timeout_s: float) -> None:
        """For embedding the server in tests: wait until SERVING (raise if start-up failed)."""
        assert self._warm_up is not None, "start() first"
        await asyncio.wait_for(asyncio.shield(self._warm_up), timeout_s)
        if self.engine is None:
            raise RuntimeError("start-up failed; see the log")

"""`python -m speakerd serve`: the gRPC server's life cycle.

Start: listen at once with health NOT_SERVING (so probes get an answer during warm-up),
then off the event loop load the weights, build and warm the engine's plans and run the
parity self-check; only when it passes attach the batcher and say SERVING. A failed
self-check stops the server with exit code 1 instead of serving wrong embeddings.

SIGTERM / SIGINT: health NOT_SERVING, new calls UNAVAILABLE, calls in progress and queued
chunks finish (up to --drain-seconds), then the server stops and the engine is released.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from speakerd.engine.base import Engine
from speakerd.reference.self_check import check_engine
from speakerd.serving import config
from speakerd.serving.batcher import Batcher
from speakerd.serving.metrics import Metrics
from speakerd.serving.service import SERVICE_NAME, SpeakerEmbeddingService, package_version, register

log = logging.getLogger(__name__)

#: Seconds grpc.aio gets to close connections once every call has finished or timed out.
STOP_GRACE_S = 1.0
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure(parser: argparse.ArgumentParser) -> None:
    config.configure(parser)


def run(args: argparse.Namespace) -> int:
    settings = config.from_args(args)
    logging.basicConfig(level=settings.log_level, format=LOG_FORMAT)
    return asyncio.run(serve(settings))


async def serve(settings: config.ServeConfig) -> int:
    """Run until SIGTERM/SIGINT (exit 0 after draining) or a failed start (exit 1)."""
    server = SpeakerServer(settings)
    await server.start()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, server.request_stop)
    return await server.wait()


def _build_engine(settings: config.ServeConfig) -> Engine:
    """Load the weights, build and warm the engine, check it against the reference (blocking)."""
    from speakerd.engine.factory import create_engine
    from speakerd.model.store import resolve_weights
    from speakerd.model.weights import load_model

    started = time.perf_counter()
    weights = resolve_weights(settings.weights)
    model = load_model(weights)
    engine = create_engine(settings.engine, model, settings.math, settings.plans, settings.conv_kernels)
    log.info("engine %s %s plans %s built in %.1f s from %s (model %s)", engine.name, engine.math,
             engine.plan_sizes, time.perf_counter() - started, weights, model.model_id[:12])  # fmt: skip
    try:
        check_engine(engine, model)
        log.info("self-check passed for every plan; timing plans for the batcher's cost model")
        # measured here, off the event loop (the batcher reads them when it is made): on a
        # CPU engine this runs every plan once, seconds in which health must still answer
        times = engine.plan_times_ms()
    except BaseException:
        engine.close()
        raise
    log.info("plan times %s", ", ".join(f"b{size} {ms:.2f} ms" for size, ms in sorted(times.items())))
    return engine


class SpeakerServer:
    """The gRPC server, its health and metrics, and the engine behind them."""

    def __init__(self, settings: config.ServeConfig) -> None:
        self.settings = settings
        self.metrics = Metrics()
        self.health = health.aio.HealthServicer()
        self.service = SpeakerEmbeddingService(self.metrics, settings.max_message_bytes)
        self.engine: Engine | None = None
        self.batcher: Batcher | None = None
        self.port = 0
        self.metrics_port = 0
        self._server: grpc.aio.Server | None = None
        self._stop = asyncio.Event()
        self._exit_code = 0
        self._warm_up: asyncio.Task[None] | None = None
        self._stopping: asyncio.Task[None] | None = None

    async def start(self) -> None:
        s = self.settings
        options = [
            ("grpc.max_receive_message_length", s.max_message_bytes),
            ("grpc.max_send_message_length", s.max_message_bytes),
        ]
        self._server = grpc.aio.server(options=options)
        register(self.service, self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        reflection.enable_server_reflection(
            (
                SERVICE_NAME,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            self._server,
        )
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        self.port = self._server.add_insecure_port(f"{s.host}:{s.port}")
        if self.port == 0:
            raise OSError(f"could not listen on {s.host}:{s.port}")
        await self._server.start()
        self.metrics.build_info.labels(version=package_version()).set(1)
        self.metrics_port = self.metrics.serve_http(s.metrics_port, s.host)
        log.info("listening on %s:%d (metrics on :%d), NOT_SERVING until warm", s.host, self.port,
                 self.metrics_port)  # fmt: skip
        self._warm_up = asyncio.ensure_future(self._warm())

    async def _warm(self) -> None:
        s = self.settings
        try:
            engine = await asyncio.to_thread(_build_engine, s)
        except Exception:
            log.exception("start-up failed; not serving")
            self._exit_code = 1
            self.request_stop()
            return
        self.engine = engine
        self.batcher = Batcher(engine, self.metrics, s.max_delay_ms / 1e3, s.queue_chunks)
        self.batcher.start()
        self.service.attach(engine, self.batcher)
        self.metrics.model_info.labels(
            model_id=engine.model_id, engine=engine.name, math=str(engine.math)
        ).set(1)
        self._report_memory(engine)
        if self._stopping is None:
            for name in ("", SERVICE_NAME):
                await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
            log.info("SERVING %s", SERVICE_NAME)

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
        s = self.settings
        started = time.monotonic()
        log.info("draining: NOT_SERVING, new calls UNAVAILABLE, up to %.1f s for calls in progress",
                 s.drain_seconds)  # fmt: skip
        await self.health.enter_graceful_shutdown()
        self.service.begin_drain()
        if self._warm_up is not None and not self._warm_up.done():
            self._warm_up.cancel()
        if not await self.service.wait_idle(s.drain_seconds):
            log.warning("drain: calls still in progress after %.1f s; stopping anyway", s.drain_seconds)
        if self.batcher is not None:
            await self.batcher.close(max(0.0, s.drain_seconds - (time.monotonic() - started)))
        if self._server is not None:
            await self._server.stop(STOP_GRACE_S)
        if self.engine is not None:
            self.engine.close()
        self.service.close()
        self.metrics.close()
        log.info("stopped after %.2f s of draining", time.monotonic() - started)
        self._stop.set()

    async def wait(self) -> int:
        await self._stop.wait()
        return self._exit_code

    async def wait_serving(self, timeout_s: float) -> None:
        """For embedding the server in tests: wait until SERVING (raise if start-up failed)."""
        assert self._warm_up is not None, "start() first"
        await asyncio.wait_for(asyncio.shield(self._warm_up), timeout_s)
        if self.engine is None:
            raise RuntimeError("start-up failed; see the log")

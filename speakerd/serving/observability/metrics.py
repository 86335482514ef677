"""Prometheus metrics of the service, on their own HTTP port.

The names are a contract: the deployment's dashboards and alerts query
them, so they live in one table here and a test checks /metrics against it. Each server
owns its own registry, so several servers in one process (tests) never share counters.
"""

from __future__ import annotations

import threading
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.metrics import MetricWrapperBase

from speakerd.serving.observability.metrics_http import BoundedMetricsServer, serve_metrics

#: Latency buckets from 50 us (a b1 FP16 graph replay is 0.46 ms on an H200) to 10 s (a b32
#: request on the CPU engine), about three per decade so p99 interpolation stays within 2x.
SECONDS_BUCKETS = (
    5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
#: Batch sizes in chunks: powers of two up to the b32 plan, then room for larger plans.
CHUNK_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 128)
#: A Diarize call's clustering: milliseconds for a minute of speech, seconds for an hour
#: (the linkage is quadratic in the clean speaker pairs), minutes for 3 h.
CLUSTERING_BUCKETS = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0, 300.0)
#: Fill = real chunks / plan capacity run; tenths are fine enough to see padding waste.
FILL_BUCKETS = tuple(round(0.1 * step, 1) for step in range(1, 11))

M = TypeVar("M", bound=MetricWrapperBase)

#: Every metric name the service exports (without the _total/_bucket suffixes Prometheus adds).
METRIC_NAMES = (
    "speakerd_request_duration_seconds",
    "speakerd_queue_wait_seconds",
    "speakerd_batch_size_chunks",
    "speakerd_batch_fill_ratio",
    "speakerd_batch_requests",
    "speakerd_batch_compute_seconds",
    "speakerd_host_to_device_seconds",
    "speakerd_device_to_host_seconds",
    "speakerd_device_gap_seconds",
    "speakerd_queue_depth_chunks",
    "speakerd_recordings_waiting",
    "speakerd_recording_bytes_held",
    "speakerd_clusterings_waiting",
    "speakerd_clustering_bytes_held",
    "speakerd_clustering_bytes_limit",
    "speakerd_clustering_seconds",
    "speakerd_inflight_requests",
    "speakerd_chunks_embedded_total",
    "speakerd_windows_skipped_total",
    "speakerd_windows_segmented_total",
    "speakerd_segmentation_compute_seconds",
    "speakerd_requests_rejected_total",
    "speakerd_plan_runs_total",
    "speakerd_fp16_fallbacks_total",
    "speakerd_build_info",
    "speakerd_model_info",
    "speakerd_gpu_memory_bytes",
    "speakerd_device_up",
    "speakerd_device_inflight_batches",
    "speakerd_device_recordings",
    "speakerd_device_batches_total",
    "speakerd_device_batch_seconds",
    "speakerd_device_failures_total",
    "speakerd_receiver_restarts_total",
    "speakerd_receiver_calls_total",
)

#: Values of speakerd_requests_rejected_total{reason}: why a request got no embeddings.
#: decode_budget: too many bytes of other requests were being decoded (RESOURCE_EXHAUSTED).
#: The voiceprint methods' own: not_found (no such voiceprint in the caller's namespace),
#: already_exists (a speaker enrolled again without replace), other_model (a voiceprint made
#: by other weights), store_unavailable (the voiceprint database did not answer).
#: unserved: an option this server was not started to serve (Diarize's names without
#: voiceprints, vbx without a PLDA: FAILED_PRECONDITION).
REJECT_REASONS = (
    "invalid_argument", "queue_full", "decode_budget", "deadline_exceeded", "draining", "not_ready",
    "cancelled", "internal", "no_device", "not_found", "already_exists", "other_model", "store_unavailable",
    "unserved",
)  # fmt: skip


class Metrics:
    """The service's metric objects, registered in a private registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        # process_cpu_seconds_total, process_resident_memory_bytes, ...: the CPU a server uses
        # under load (bench_diarize --concurrent reads it) and its memory beside the bound
        ProcessCollector(registry=r)
        self.request_duration = Histogram(
            "speakerd_request_duration_seconds",
            "Time from receiving a call (or a stream message) to its answer, by method and gRPC code",
            ["method", "code"],
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "speakerd_queue_wait_seconds",
            "Time a request waited in the batch queue before its first chunk entered a batch",
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            "speakerd_batch_size_chunks",
            "Real chunks per formed batch (from one or more requests)",
            buckets=CHUNK_BUCKETS,
            registry=r,
        )
        self.batch_requests = Histogram(
            "speakerd_batch_requests",
            "Requests whose chunks share a formed batch (above 1 = cross-request batching works)",
            buckets=CHUNK_BUCKETS,
            registry=r,
        )
        self.batch_fill = Histogram(
            "speakerd_batch_fill_ratio",
            "Real chunks / capacity of the plans run for a batch (1 = no padding)",
            buckets=FILL_BUCKETS,
            registry=r,
        )
        self.batch_compute = Histogram(
            "speakerd_batch_compute_seconds",
            "Engine compute time of one plan run (CUDA events on GPU, wall time on CPU)",
            ["plan"],
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        self.host_to_device = Histogram(
            "speakerd_host_to_device_seconds",
            "Host-to-device copy time of one plan run",
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        self.device_to_host = Histogram(
            "speakerd_device_to_host_seconds",
            "Device-to-host copy time of one plan run",
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        self.device_gap = Histogram(
            "speakerd_device_gap_seconds",
            "GPU time between a plan run and the one before it: the device waiting for the host, "
            "or idle for want of requests (the first run after an idle spell carries it; under "
            "load read the median: high there, the host path, not the GPU, limits throughput)",
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge("speakerd_queue_depth_chunks", "Chunks waiting for a batch", registry=r)
        self.recordings_waiting = Gauge(
            "speakerd_recordings_waiting",
            "Recording calls waiting for room in the recording memory budget (--recording-memory-mb)",
            registry=r,
        )
        self.recording_bytes_held = Gauge(
            "speakerd_recording_bytes_held",
            "Bytes of the recording memory budget held by the recording calls in progress",
            registry=r,
        )
        self.clusterings_waiting = Gauge(
            "speakerd_clusterings_waiting",
            "Diarize calls waiting for room in the clustering memory budget (--clustering-memory-mb)",
            registry=r,
        )
        self.clustering_bytes_held = Gauge(
            "speakerd_clustering_bytes_held",
            "Bytes of the clustering memory budget held by the Diarize calls clustering",
            registry=r,
        )
        self.clustering_bytes_limit = Gauge(
            "speakerd_clustering_bytes_limit",
            "Bytes the clustering memory budget holds at most (--clustering-memory-mb)",
            registry=r,
        )
        self.clustering_seconds = Histogram(
            "speakerd_clustering_seconds",
            "Seconds a Diarize call's clustering, reconstruction and turns took after its embeddings",
            buckets=CLUSTERING_BUCKETS,
            registry=r,
        )
        self.inflight = Gauge(
            "speakerd_inflight_requests", "Calls being served (stream messages count one each)", registry=r
        )
        self.chunks_embedded = Counter(
            "speakerd_chunks_embedded_total", "Chunks run through the engine", registry=r
        )
        self.windows_skipped = Counter(
            "speakerd_windows_skipped_total",
            "Windows whose every speaker mask was empty (silence, music): answered with the "
            "model's empty-mask rows (seg_1.bias) without engine work",
            registry=r,
        )
        self.windows_segmented = Counter(
            "speakerd_windows_segmented_total",
            "Windows the server segmented itself (EmbedRecording with header.segment)",
            registry=r,
        )
        self.segmentation_compute = Histogram(
            "speakerd_segmentation_compute_seconds",
            "Segmentation engine time of one group of windows (wall time on the CPU)",
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        self.rejected = Counter(
            "speakerd_requests_rejected_total",
            "Requests answered without embeddings, by reason",
            ["reason"],
            registry=r,
        )
        self.plan_runs = Counter(
            "speakerd_plan_runs_total",
            "Plan runs by plan and mode (graph = captured CUDA graph replay, eager = launched op by op)",
            ["plan", "mode"],
            registry=r,
        )
        self.fp16_fallbacks = Counter(
            "speakerd_fp16_fallbacks_total",
            "Batches recomputed without FP16 after an out-of-range value",
            registry=r,
        )
        self.build_info = Gauge("speakerd_build_info", "Always 1; the version", ["version"], registry=r)
        self.model_info = Gauge(
            "speakerd_model_info", "Always 1; the model served", ["model_id", "engine", "math"], registry=r
        )
        self.gpu_memory = Gauge(
            "speakerd_gpu_memory_bytes", "GPU memory held by the engine, by kind", ["kind"], registry=r
        )

        # per device of `serve --devices` (no samples without it: one engine in process)
        def per_device(kind: type[M], name: str, doc: str, **options: Any) -> M:
            return kind(name, f"{doc} (serve --devices)", ["device"], registry=r, **options)

        self.device_up = per_device(
            Gauge, "speakerd_device_up", "1 while the device serves, 0 once it failed and was taken out"
        )
        self.device_inflight = per_device(
            Gauge, "speakerd_device_inflight_batches", "Plan runs handed to the device and not yet answered"
        )
        self.device_recordings = per_device(
            Gauge, "speakerd_device_recordings", "Recordings whose audio and windows the device holds"
        )
        self.device_batches = per_device(
            Counter, "speakerd_device_batches_total", "Plan runs the device answered"
        )
        self.device_batch = per_device(
            Histogram,
            "speakerd_device_batch_seconds",
            "Time of one plan run on a device: copy into shared memory, run, copy back",
            buckets=SECONDS_BUCKETS,
        )
        self.device_failures = per_device(
            Counter,
            "speakerd_device_failures_total",
            "Devices taken out: the worker process died or its engine raised",
        )
        self.receiver_restarts = Counter(
            "speakerd_receiver_restarts_total",
            "Receiver processes (serve --receivers) that exited while serving and were replaced",
            registry=r,
        )
        self.receiver_calls = Counter(
            "speakerd_receiver_calls_total",
            "EmbedChunks calls each receiver (serve --receivers) handed over; the kernel spreads "
            "connections, not calls, so an uneven split means one receiver carries more clients",
            ["receiver"],
            registry=r,
        )
        for reason in REJECT_REASONS:  # export zeros, so a rate() alert has a series from the start
            self.rejected.labels(reason=reason)
        self._http: BoundedMetricsServer | None = None
        self._thread: threading.Thread | None = None

    def serve_http(self, port: int, host: str, **limits: float) -> int:
        """Expose /metrics on host:port (0 = a free port), bounded as metrics_http.py says;
        returns the port bound. `limits`: max_connections, idle_timeout_s (tests)."""
        self._http, self._thread = serve_metrics(self.registry, host, port, **limits)  # type: ignore[arg-type]
        return int(self._http.server_port)

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None

"""GpuSegmenter: PyanNet (pyannote/segmentation-3.0) over a group of windows in one CUDA-graph replay.

Two choices, both with FP32 storage and FP32-accurate arithmetic.

`sinc=`, the first layer (the waveform InstanceNorm, then the 80 sinc filters):
- "window": each window's samples are
  normalised as torch rounds them (mean and variance over the window's 160000 samples in
  double, a last window's zero padding included, then the normalisation in float32 with
  `norm_mode`'s rounding, see NORM_MODES) and each window is convolved on its own. The
  normalised samples are made on the fly inside the sinc kernel, which also takes abs and
  the max-pool, so the 15975 x 80 raw frames of a window never reach memory.
- "shared32" (math="fast"'s default): the InstanceNorm is affine per window (y = a x + c) and
  the convolution linear, so conv(y) = a conv(x) + c sum(w): the convolution runs ONCE over
  the group's raw samples (windows 1 s apart share 90% of their frames: ~10x less work) and
  each window reads its frames with its own (a, c).
- "shared64" (math="fp32"'s default): "shared32" with the products and sums in double, each
  frame rounded once.
Why three: torch convolves float32-ROUNDED normalised samples y (= 0.0099 n + 0.045 with
segmentation-3.0's weights: the offset dominates y, so its rounding noise is large next to
the signal) and the InstanceNorms after the convolution scale that noise up in quiet bands.
Reproducing y bit for bit helps only if the convolution then adds in torch's order too;
on the CPU (torch 2.13, 256 windows of synthetic speech), a NumPy forward from torch's
exact y was 2.8e-4 off torch on well-conditioned windows, one with the convolution exact
in float64 8.4e-5, one with the rounding of y not bit-equal to torch's 2.6e-4.

`math=`, the GEMMs (LSTM input projections, the first head linear):
- "fp32": strict FP32 SGEMM (cuBLAS default math).
- "fast": TF32 tensor cores over split operands ([hi | lo | hi] x [W_hi | W_hi | W_lo],
  weights.py), FP32-accurate (~1e-5 on the log-probabilities, emulated on the CPU) at ~3x
  SGEMM's speed. Plain TF32 anywhere in this network moves log-probabilities by ~5e-3
  (emulated): not used.

The rest is shared: in0 is fused into the first conv's input loads (its statistics come from
per-tile partial sums the sinc kernels write, reduced in a fixed order, so replay is bitwise
eager); the small convs are register-tiled direct kernels with bias + max-pool; LSTM: one
GEMM a layer projects every frame of every window for both directions, then the recurrence
runs as `lstm_cluster` (W_hh held in the registers of a two-SM cluster, h exchanged through
distributed shared memory; `lstm="simple"` is the first version, W_hh streamed from L2).
A plan (all buffers) per window count, its forward captured once into a CUDA graph; replay is
bit-identical to eager (same kernels, same cuBLAS workspaces, no atomics).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Mapping

import numpy as np

from speakerd.engine.gpu import kernels
from speakerd.engine.gpu.segmentation import weights as W
from speakerd.engine.segmenter import Segmentation, Segmenter
from speakerd.model.segmentation.architecture import (
    CLASSES,
    CONV_CHANNELS,
    LEAKY_SLOPE,
    LSTM_GATE_ROWS,
    LSTM_HIDDEN,
    LSTM_LAYERS,
    LSTM_OUTPUT,
    NORM_EPS,
    OUTPUT_FRAMES,
    POOLED_CONV1_FRAMES,
    POOLED_SINC_FRAMES,
    SINC_FILTERS,
    SINC_KERNEL,
    SINC_STRIDE,
    SPEAKERS,
    WINDOW_SAMPLES,
)
from speakerd.model.segmentation.powerset import MAPPING

SOURCE = "segmentation.cu"
#: The maths and first layers (module docstring), and each math's default first layer.
MATHS = ("fp32", "fast")
SINCS = ("window", "shared32", "shared64")
#: fp32 takes "shared64": on an H100 (k=64 windows of synthetic speech, the real weights) it was
#: 1.06e-4 from the float64 forward at worst, "window" 9.8e-4 (and 56 ms an hour slower).
DEFAULT_SINC = {"fp32": "shared64", "fast": "shared32"}
#: Instance-norm rounding modes of kernels/segmentation.cu's norm_apply: 0 is ATen's native
#: CUDA formula ((x - mean) * invstd) * gamma + beta with every op rounded; the others are
#: the roundings torch's cuDNN batch-norm path might use instead (the test's probe compares
#: torch's own normalised samples with each).
NORM_MODES = range(6)
DEFAULT_NORM_MODE = 0
LSTM_KERNELS = ("cluster", "simple")
#: Tiles; each must equal its #define in kernels/segmentation.cu (the test checks them).
SINC_TILE, SINC_HALF, SINC_QUARTER, POOL_TILE, SW_GROUP, CONV_TILE, LSTM_TB = 128, 40, 20, 128, 20, 64, 16
LC_THREADS, LC_CHUNK, LC_UNITS = 256, 16, 64
#: lstm_cluster's kernels by windows a phase: a cluster's tile of windows is a multiple of
#: LC_HALF_CHUNK, and lstm_cluster8 takes the tiles that are not multiples of LC_CHUNK (the
#: server's 256-window groups: 8 windows a cluster keep 128 SMs busy where 16 kept 64)
LC_HALF_CHUNK = LC_CHUNK // 2
LC_KERNELS = {LC_CHUNK: "lstm_cluster", LC_HALF_CHUNK: "lstm_cluster8"}
#: lstm_cluster's dynamic shared memory, floats: h twice (double-buffered) and c per window,
#: plus the partial gate sums of one chunk (16 windows x 4 k-quarters x 64 units x 4 gates).
LC_FLOATS_PER_WINDOW = 2 * LSTM_HIDDEN + LC_UNITS
LC_FIXED_FLOATS = LC_CHUNK * 4 * LC_UNITS * 4
#: two SMs a cluster, one cluster a direction and tile: a wave of clusters holds SMs / 4 tiles
SMS_PER_TILE = 4
#: lstm_cluster's start-up check: a few windows and steps against lstm_layer (the same sums in
#: another order agree to ~1e-6; a broken launch or layout is off by ~1e-1)
CHECK_WINDOWS, CHECK_STEPS, CHECK_TOL = 5, 9, 1e-4
#: windows one call takes by default: ~9 MB of activations a window (fast math), so ~9 GB
DEFAULT_MAX_WINDOWS = 1024
#: pooled frames per window after each stage
P1, P2, P3 = POOLED_SINC_FRAMES, POOLED_CONV1_FRAMES, OUTPUT_FRAMES
#: the in0 partial sums: one per (window, filter, tile of POOL_TILE pooled frames)
P1_TILES = -(-P1 // POOL_TILE)
#: split rows ([hi | lo | hi]) are three times as wide
SPLIT = 3
NULL = np.uint64(0)
KERNEL_NAMES = (
    "window_stats", "sinc_window", "sinc_global", "sinc_shared_pool", "sinc_global64", "sinc_shared_pool64",
    "norm0_stats", "instnorm_leaky",
    "conv5_pool", "lstm_layer", "lstm_cluster", "lstm_cluster8", "bias_leaky", "classify",
)  # fmt: skip


class _Plan:
    """Every buffer one forward over `k` windows and up to `n_max` samples needs, plus its graph."""

    def __init__(self, cp, k: int, n_max: int, fast: bool, sinc: str) -> None:
        self.k, self.n_max = k, n_max
        f = cp.float32
        s = SPLIT if fast else 1
        self.x = cp.zeros((n_max,), f)
        self.starts = cp.zeros((k,), cp.int64)
        self.stats = cp.zeros((k, 4), f)
        self.ac64 = cp.zeros((k, 2), cp.float64)
        if sinc != "window":
            # shared sinc frames: enough for the last window to start at n_max - 10 (zero-padded)
            g = (n_max + WINDOW_SAMPLES - SINC_KERNEL) // SINC_STRIDE + 1
            self.G = -(-g // SINC_TILE) * SINC_TILE
            self.raw = cp.zeros((SINC_FILTERS, self.G), cp.float64 if sinc == "shared64" else f)
        self.a1 = cp.zeros((k, SINC_FILTERS, P1), f)
        self.part = cp.zeros((k, SINC_FILTERS, P1_TILES, 2), cp.float64)
        self.ms0 = cp.zeros((k, SINC_FILTERS, 2), f)
        self.a2 = cp.zeros((k, CONV_CHANNELS, P2), f)
        self.a3 = cp.zeros((k, CONV_CHANNELS, P3), f)
        self.seq = cp.zeros((k, P3, CONV_CHANNELS * s), f)
        self.xp = cp.zeros((k, P3, 2 * LSTM_GATE_ROWS), f)
        # one h buffer: a layer's projection reads all of it before its recurrence rewrites it
        self.h = cp.zeros((k, P3, LSTM_OUTPUT * s), f)
        self.l0 = cp.zeros((k, P3, LSTM_HIDDEN), f)
        self.l1 = cp.zeros((k, P3, LSTM_HIDDEN), f)
        self.logp = cp.zeros((k, P3, CLASSES), f)
        self.ml = cp.zeros((k, P3, SPEAKERS), cp.uint8)
        self.n = 0
        self.graph = None


class GpuSegmenter(Segmenter):
    """pyannote/segmentation-3.0 on one CUDA device (CuPy + NVRTC kernels + cuBLAS)."""

    name = "gpu-cupy"

    def __init__(
        self,
        state: Mapping[str, np.ndarray],
        model_id: str,
        max_windows: int = DEFAULT_MAX_WINDOWS,
        math: str = "fp32",
        sinc: str | None = None,
        use_graph: bool = True,
        norm_mode: int = DEFAULT_NORM_MODE,
        lstm: str = "cluster",
    ) -> None:
        if math not in MATHS:
            raise ValueError(f"math {math!r}: expected one of {MATHS}")
        sinc = DEFAULT_SINC.get(math, "window") if sinc is None else sinc
        if sinc not in SINCS:
            raise ValueError(f"sinc {sinc!r}: expected one of {SINCS}")
        if norm_mode not in NORM_MODES:
            raise ValueError(f"norm_mode {norm_mode}: expected one of {list(NORM_MODES)}")
        if lstm not in LSTM_KERNELS:
            raise ValueError(f"lstm {lstm!r}: expected one of {LSTM_KERNELS}")
        import cupy as cp

        from speakerd.engine.gpu.segmentation.blas import Gemms

        self.cp, self.model_id, self.max_windows, self.math = cp, model_id, int(max_windows), math
        self.fast, self.sinc = math == "fast", sinc
        self.use_graph, self.norm_mode, self.lstm = use_graph, int(norm_mode), lstm
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.gemms = Gemms(self.stream.ptr)
        #: held from a call's upload to its outputs' copy back: the recording threads segment
        #: at once (serving/api/recording.py's SEGMENT_THREADS), and a plan's buffers, its
        #: graph and the stream are shared by every call of its size
        self._lock = threading.RLock()
        device = cp.cuda.Device()
        self.sms = int(device.attributes["MultiProcessorCount"])
        self.smem_optin = int(device.attributes["MaxSharedMemoryPerBlockOptin"])
        self.lc_max_tb = (
            (self.smem_optin // 4 - LC_FIXED_FLOATS) // LC_FLOATS_PER_WINDOW // LC_CHUNK * LC_CHUNK
        )
        assert self.lc_max_tb >= LC_CHUNK, (
            f"{self.smem_optin} B of shared memory a block is too little for lstm_cluster"
        )
        module = kernels.module(SOURCE)
        self.k = {name: module.get_function(name) for name in KERNEL_NAMES if name not in LC_KERNELS.values()}
        for name in LC_KERNELS.values():
            self.k[name] = kernels.entry(SOURCE, name, self._lc_shared(self.lc_max_tb))
        host = W.prepare(state)
        with self.stream:
            self.w = {key: cp.asarray(v) for key, v in host.items()}
            self.mapping = cp.asarray(MAPPING, dtype=cp.uint8)  # the kernel reads bytes; MAPPING is float32
        self.stream.synchronize()
        self.wav_gamma, self.wav_beta = (float(v) for v in host["wav_norm"])
        self._plans: dict[tuple[int, int], _Plan] = {}
        #: why lstm="cluster" fell back to "simple" on this device, if it did
        self.lstm_fallback: str | None = None
        if self.lstm == "cluster":
            self.lstm_fallback = self._check_lstm_cluster()
            if self.lstm_fallback:
                self.lstm = "simple"

    def _check_lstm_cluster(self) -> str | None:
        """None if lstm_cluster runs here and agrees with lstm_layer on random inputs, else why
        not (a device without thread-block clusters, or too little shared memory a block)."""
        cp, i32 = self.cp, np.int32
        rng = np.random.default_rng(0)
        b, t = CHECK_WINDOWS, CHECK_STEPS
        with self.stream:
            xp = cp.asarray(rng.standard_normal((b, t, 2 * LSTM_GATE_ROWS)).astype(np.float32))
            outs = {
                name: cp.zeros((b, t, LSTM_OUTPUT), cp.float32)
                for name in ("lstm_layer", *LC_KERNELS.values())
            }
            w = self.w
            try:
                for chunk, name in LC_KERNELS.items():
                    args = (xp, w["lstm1_whh"], w["lstm1_b"], outs[name], i32(b), i32(t), i32(0), i32(chunk))
                    self.k[name]((2, 2), (LC_THREADS,), args, shared_mem=self._lc_shared(chunk))
                self.k["lstm_layer"](
                    (1, 2),
                    (256,),
                    (xp, w["lstm1_whhT"], w["lstm1_b"], outs["lstm_layer"], i32(b), i32(t), i32(0)),
                )
                self.stream.synchronize()
            except cp.cuda.driver.CUDADriverError as error:
                return f"lstm_cluster failed to launch: {error}"
            diffs = {
                name: float(cp.abs(outs[name] - outs["lstm_layer"]).max()) for name in LC_KERNELS.values()
            }
        for name, diff in diffs.items():
            if not diff <= CHECK_TOL:
                return f"{name} differs from lstm_layer by {diff:.3e} (> {CHECK_TOL:.0e})"
        return None

    @staticmethod
    def _lc_shared(tb: int) -> int:
        return 4 * (LC_FIXED_FLOATS + LC_FLOATS_PER_WINDOW * tb)

    def _lstm_tile(self, k: int) -> int:
        """Windows a cluster takes: as few tiles as fill one wave of clusters (both
        directions), a multiple of LC_HALF_CHUNK (`_lstm_kernel` picks the kernel for it)."""
        per_wave = max(1, self.sms // SMS_PER_TILE)
        windows = -(-k // per_wave)
        return min(-(-windows // LC_HALF_CHUNK) * LC_HALF_CHUNK, self.lc_max_tb)

    @staticmethod
    def _lstm_kernel(tb: int) -> str:
        """lstm_cluster for tiles of whole LC_CHUNKs, else lstm_cluster8."""
        return LC_KERNELS[LC_CHUNK if tb % LC_CHUNK == 0 else LC_HALF_CHUNK]

    # -- forward -------------------------------------------------------------------------
    def _forward(self, p: _Plan, mark: Callable[[str], None] | None = None) -> None:
        mark = mark or (lambda name: None)
        k, K, w, mode = p.k, self.k, self.w, np.int32(self.norm_mode)
        i32, i64, f32 = np.int32, np.int64, np.float32
        eps, slope = f32(NORM_EPS), f32(LEAKY_SLOPE)
        gamma, beta = f32(self.wav_gamma), f32(self.wav_beta)
        K["window_stats"]((k,), (512,), (p.x, i64(p.n), p.starts, gamma, beta, eps, p.stats, p.ac64))
        mark("sinc.stats")
        if self.sinc == "shared64":
            K["sinc_global64"](
                (p.G // SINC_TILE, SINC_FILTERS // SINC_QUARTER),
                (SINC_TILE,),
                (p.x, i64(p.n), w["sinc_wT"], i32(p.G), p.raw),
            )
            mark("sinc.conv")
            K["sinc_shared_pool64"](
                (P1_TILES, SINC_FILTERS, k),
                (POOL_TILE,),
                (p.raw, i32(p.G), p.starts, p.ac64, w["sinc_wsum64"], i32(P1), p.a1, p.part),
            )
        elif self.sinc == "shared32":
            K["sinc_global"](
                (p.G // SINC_TILE, SINC_FILTERS // SINC_HALF),
                (SINC_TILE,),
                (p.x, i64(p.n), w["sinc_wT"], i32(p.G), p.raw),
            )
            mark("sinc.conv")
            K["sinc_shared_pool"](
                (P1_TILES, SINC_FILTERS, k),
                (POOL_TILE,),
                (p.raw, i32(p.G), p.starts, p.stats, w["sinc_wsum"], i32(P1), p.a1, p.part),
            )
        else:
            K["sinc_window"](
                (P1_TILES, SINC_FILTERS // SW_GROUP, k),
                (POOL_TILE,),
                (p.x, i64(p.n), p.starts, p.stats, gamma, beta, mode, w["sinc_wT"], i32(P1), p.a1, p.part),
            )
        mark("sinc.pool")  # sinc="window": the whole per-window convolution
        rows0 = k * SINC_FILTERS
        K["norm0_stats"](
            ((rows0 + 255) // 256,), (256,), (p.part, i32(rows0), i32(P1_TILES), i32(P1), eps, p.ms0)
        )
        mark("in0.stats")
        K["conv5_pool"](
            ((P2 + CONV_TILE - 1) // CONV_TILE, k),
            (CONV_TILE, 3),
            (p.a1, i32(SINC_FILTERS), i32(P1), w["conv1_wT"], w["conv1_b"], i32(P2), p.a2,
             p.ms0, w["in0_g"], w["in0_b"], slope, mode),
        )  # fmt: skip
        mark("conv1")
        K["instnorm_leaky"](
            (k * CONV_CHANNELS,),
            (256,),
            (p.a2, i32(CONV_CHANNELS), i32(P2), w["in1_g"], w["in1_b"], eps, slope, mode, NULL, i32(0)),
        )
        K["conv5_pool"](
            ((P3 + CONV_TILE - 1) // CONV_TILE, k),
            (CONV_TILE, 3),
            (p.a2, i32(CONV_CHANNELS), i32(P2), w["conv2_wT"], w["conv2_b"], i32(P3), p.a3,
             NULL, NULL, NULL, slope, mode),
        )  # fmt: skip
        split = i32(1 if self.fast else 0)
        K["instnorm_leaky"](
            (k * CONV_CHANNELS,),
            (256,),
            (p.a3, i32(CONV_CHANNELS), i32(P3), w["in2_g"], w["in2_b"], eps, slope, mode, p.seq, split),
        )
        mark("in1+conv2+in2")
        rows = k * P3
        x, inner = p.seq, CONV_CHANNELS
        tb = self._lstm_tile(k)
        for layer in range(LSTM_LAYERS):
            if self.fast:
                wih, width = w[f"lstm{layer}_wih3"], SPLIT * inner
            else:
                wih, width = w[f"lstm{layer}_wih"], inner
            self.gemms.linear(
                x.data.ptr, wih.data.ptr, p.xp.data.ptr, rows, width, 2 * LSTM_GATE_ROWS, self.fast
            )
            mark(f"lstm{layer}.proj")
            if self.lstm == "cluster":
                tiles = -(-k // tb)
                K[self._lstm_kernel(tb)](
                    (2 * tiles, 2),
                    (LC_THREADS,),
                    (p.xp, w[f"lstm{layer}_whh"], w[f"lstm{layer}_b"], p.h, i32(k), i32(P3), split, i32(tb)),
                    shared_mem=self._lc_shared(tb),
                )
            else:
                K["lstm_layer"](
                    ((k + LSTM_TB - 1) // LSTM_TB, 2),
                    (256,),
                    (p.xp, w[f"lstm{layer}_whhT"], w[f"lstm{layer}_b"], p.h, i32(k), i32(P3), split),
                )
            mark(f"lstm{layer}.rec")
            x, inner = p.h, LSTM_OUTPUT
        n = rows * LSTM_HIDDEN
        lin0 = w["lin0_w3"] if self.fast else w["lin0_w"]
        self.gemms.linear(
            p.h.data.ptr, lin0.data.ptr, p.l0.data.ptr, rows, lin0.shape[1], LSTM_HIDDEN, self.fast
        )
        K["bias_leaky"](((n + 255) // 256,), (256,), (p.l0, i64(n), i32(LSTM_HIDDEN), w["lin0_b"], slope))
        self.gemms.linear(
            p.l0.data.ptr, w["lin1_w"].data.ptr, p.l1.data.ptr, rows, LSTM_HIDDEN, LSTM_HIDDEN, False
        )
        K["bias_leaky"](((n + 255) // 256,), (256,), (p.l1, i64(n), i32(LSTM_HIDDEN), w["lin1_b"], slope))
        K["classify"](
            ((rows + 127) // 128,),
            (128,),
            (p.l1, i64(rows), w["cls_w"], w["cls_b"], self.mapping, p.logp, p.ml),
        )
        mark("head")

    def _plan(self, k: int, n: int) -> _Plan:
        # plans are keyed by window count and a sample capacity rounded up to whole seconds
        # of windows, so a recording's groups of the same size reuse one graph
        cap = max(k * 16000 + WINDOW_SAMPLES, n)
        key = (k, cap)
        if key not in self._plans:
            with self.stream:
                self._plans[key] = _Plan(self.cp, k, cap, self.fast, self.sinc)
        return self._plans[key]

    def _upload(self, samples: np.ndarray, starts: np.ndarray) -> _Plan:
        samples = np.ascontiguousarray(samples, dtype=np.float32).reshape(-1)
        starts = np.ascontiguousarray(starts, dtype=np.int64).reshape(-1)
        k = len(starts)
        assert 1 <= k <= self.max_windows, f"{k} windows, max_windows is {self.max_windows}"
        assert np.all(starts % SINC_STRIDE == 0), (
            f"starts must be multiples of {SINC_STRIDE}: {starts[starts % SINC_STRIDE != 0][:4]}"
        )
        assert np.all(starts >= 0) and np.all(np.diff(starts) >= 0), "starts must be ascending and >= 0"
        p = self._plan(k, len(samples))
        # samples past n (a last window's zero padding) are never read: every kernel checks n
        p.x[: len(samples)].set(samples, stream=self.stream)
        p.starts.set(starts, stream=self.stream)
        if p.n != len(samples):
            p.n, p.graph = len(samples), None  # n is baked into the graph's arguments
        return p

    def run(self, samples: np.ndarray, starts: np.ndarray, graph: bool | None = None) -> _Plan:
        """Upload, forward (graph replay or eager), and return the plan holding the outputs
        (read them while holding `_lock`, as log_probs and segment do: the next call of the
        same size overwrites them)."""
        use_graph = self.use_graph if graph is None else graph
        with self._lock, self.stream:
            p = self._upload(samples, starts)
            if use_graph:
                if p.graph is None:
                    self.stream.begin_capture()
                    self._forward(p)
                    p.graph = self.stream.end_capture()
                p.graph.launch(self.stream)
            else:
                self._forward(p)
        return p

    def stage_times(self, samples: np.ndarray, starts: np.ndarray) -> dict[str, float]:
        """One eager forward with a CUDA event after each stage: {stage: milliseconds}."""
        cp = self.cp
        events: list[tuple[str, object]] = []

        def mark(name: str) -> None:
            event = cp.cuda.Event()
            event.record(self.stream)
            events.append((name, event))

        with self._lock:
            with self.stream:
                mark("start")
                p = self._upload(samples, starts)
                mark("upload")
                self._forward(p, mark)
            self.stream.synchronize()
        return {name: cp.cuda.get_elapsed_time(a, b) for (_, a), (name, b) in itertools.pairwise(events)}

    def log_probs(self, samples: np.ndarray, starts: np.ndarray, graph: bool | None = None) -> np.ndarray:
        """[k, 589, 7] float32 powerset log-probabilities (the parity surface)."""
        with self._lock:
            p = self.run(samples, starts, graph)
            out = p.logp.get(stream=self.stream)
            self.stream.synchronize()
        return out

    def multilabel_log_probs(self, samples: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`segment`'s multilabel [k, 589, 3] and the log-probabilities [k, 589, 7] it came
        from, of one forward."""
        with self._lock:
            p = self.run(samples, starts)
            ml, logp = p.ml.get(stream=self.stream), p.logp.get(stream=self.stream)
            self.stream.synchronize()
        return ml, logp

    def segment(self, samples: np.ndarray, starts: np.ndarray) -> Segmentation:
        t0 = time.perf_counter()
        with self._lock:
            p = self.run(samples, starts)
            ml = p.ml.get(stream=self.stream)
            self.stream.synchronize()
        return Segmentation(multilabel=ml, compute_s=time.perf_counter() - t0)

    def close(self) -> None:
        with self._lock:
            self._plans.clear()
            self.gemms.close()

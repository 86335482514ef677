"""GPU-event timing: how the engine measures kernels, cuDNN plans and whole forwards.

Everything is timed as it serves. A b1 convolution of ~15 us costs more host time to
launch than GPU time to run, so kernels and cuDNN plans are captured into a CUDA graph and
its replays are timed with CUDA events (GPU work, not launch overhead). Set-up only: the
serving path times a batch with one pair of events (`gpu_ms`).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import TypeVar

#: Replays timed per candidate of our own kernels (after one warm-up), and launches captured
#: per replay, so a b1 conv of ~15 us is timed as GPU work, not launch overhead.
OWN_TIMED_REPLAYS = 5
OWN_LAUNCHES_PER_REPLAY = 5

T = TypeVar("T")


def gpu_ms(stream, work: Callable[[], T]) -> tuple[float, T]:
    """(GPU ms between events recorded on `stream` around `work()`, its result); waits."""
    import cupy

    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record(stream)
    result = work()
    end.record(stream)
    end.synchronize()
    return cupy.cuda.get_elapsed_time(start, end), result


def replay_ms(graph, stream) -> float:
    """GPU ms of one launch of the captured CUDA `graph` on `stream` (waits for it)."""
    return gpu_ms(stream, lambda: graph.launch(stream))[0]


def time_launches(launch: Callable[[object], None], stream) -> float:
    """Median GPU ms of one `launch(stream)`, from replays of a CUDA graph holding
    OWN_LAUNCHES_PER_REPLAY of them (after one eager launch)."""
    launch(stream)
    stream.begin_capture()
    try:
        for _ in range(OWN_LAUNCHES_PER_REPLAY):
            launch(stream)
    finally:
        graph = stream.end_capture()
    graph.launch(stream)
    per_launch = [replay_ms(graph, stream) / OWN_LAUNCHES_PER_REPLAY for _ in range(OWN_TIMED_REPLAYS)]
    return statistics.median(per_launch)


def median_ms(stream, work: Callable[[], object], runs: int) -> float:
    """Median GPU ms of `work()` over `runs` timed runs, after one untimed warm-up run."""
    work()
    return float(statistics.median(gpu_ms(stream, work)[0] for _ in range(runs)))


def fill_random(values, random) -> None:
    """values[...] = standard normal draws of `random` (a cupy RandomState), in values' own
    dtype (halves are drawn in float32 and rounded: CuPy draws no float16). Timing data is
    never zeros: zeros can run faster than real data."""
    import cupy

    values[...] = random.standard_normal(values.shape, dtype=cupy.float32).astype(values.dtype, copy=False)


class OwnKernel:
    """What our convolution kernels (igemm.IgemmConv, stem.StemConv) share: `launch(stream)`
    enqueues the bound kernel, `time(stream)` measures it as it serves and keeps `ms`."""

    ms: float
    tile: int
    #: the autotuner candidate (autotune.py) it belongs to, by that candidate's name:
    #: refusals are per family
    family: str

    @property
    def name(self) -> str:
        raise NotImplementedError

    def launch(self, stream) -> None:
        raise NotImplementedError

    def time(self, stream) -> float:
        """Median GPU ms of one launch (see time_launches)."""
        self.ms = time_launches(self.launch, stream)
        return self.ms

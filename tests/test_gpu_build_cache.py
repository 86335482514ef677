"""A GPU engine built from cached start-up choices is the engine its first build was.

engine/build_cache.py keeps what a start-up's autotuner chose (each cuDNN graph's execution
plan and times, the fused graphs cuDNN could not serve); the next engine under an equal
BuildKey builds those plans alone instead of timing every candidate. What must hold: the
second build uses the cache and builds fewer cuDNN plans in less time, every convolution
runs on what the first build chose, and its embeddings are the first build's to the bit; a
cached plan that does not rebuild is timed afresh; a corrupt cache entry is rebuilt.
Each test prints its table (build, cuDNN graphs, seconds building them).

Needs a GPU (REQUIRE_GPU=1 makes a skip a failure); the cache's own rules are
tests/test_build_cache.py's, on the CPU.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from speakerd.engine.build_cache import BUILDS_DIR, BuildCache
from speakerd.model.numerics import Math
from tests.test_gpu_engine import GPU_DETAIL, GPU_USABLE

pytestmark = pytest.mark.skipif(not GPU_USABLE, reason=f"no usable GPU for the CuPy engine: {GPU_DETAIL}")

#: One plan size and TF32 (no FP16 fallback plans): the fewest graphs that still have fused
#: and bare cuDNN candidates beside ours.
MATH, SIZES = Math.TF32, (1,)


def _engine(model, cache: BuildCache):
    from speakerd.engine.gpu.engine import GpuEngine

    return GpuEngine(model, MATH, SIZES, build_cache=cache)


def _embeddings(engine, case) -> np.ndarray:
    return np.asarray(engine.run_batch(case.fbank, case.masks).embeddings)


def _row(name: str, engine) -> None:
    report, cached = engine.tuner.report(), engine.built_from_cache
    print(f"{name:<34} {report['cudnn_graphs']:>7} {report['cudnn_build_s']:>10.2f} {cached!s:>7}")


def test_a_cached_build_is_the_first_build_faster(folded_model, reference_cases, tmp_path, capsys) -> None:
    cache = BuildCache(tmp_path / BUILDS_DIR)
    case = reference_cases[0]
    with capsys.disabled():
        print(f"\n{'build':<34} {'graphs':>7} {'build s':>10} {'cached':>7}")
        first = _engine(folded_model, cache)
        _row("first (every plan timed)", first)
        expected, runners = _embeddings(first, case), [c.choice.runner for c in first.plans[1].convs]
        first.keep_build()
        first.close()
        second = _engine(folded_model, cache)
        _row("second (cached choices)", second)
    try:
        assert second.built_from_cache, "the second build did not use the cache"
        assert [c.choice.runner for c in second.plans[1].convs] == runners, "another choice ran a conv"
        assert np.array_equal(_embeddings(second, case), expected), "the cached build's embeddings differ"
        assert second.tuner.report()["cudnn_build_s"] < first.tuner.report()["cudnn_build_s"]
    finally:
        second.close()


def test_a_cached_plan_that_does_not_rebuild_is_timed_again(
    folded_model, reference_cases, tmp_path, caplog
) -> None:
    cache = BuildCache(tmp_path / BUILDS_DIR)
    first = _engine(folded_model, cache)
    first.keep_build()
    key, expected = first.build_key, _embeddings(first, reference_cases[0])
    first.close()
    path = cache.path(key)
    document = json.loads(path.read_text())
    # every plan name is wrong now: no cached plan rebuilds, every graph's plans are timed again
    for entry in document["entries"]["graphs"].values():
        if "plan_name" in entry:
            entry["plan_name"] = "not-a-plan"
    cache.store(key, document["entries"])
    second = _engine(folded_model, cache)
    try:
        assert all(
            g.plan_ms and any(ms is not None for ms in g.plan_ms) for g in second.tuner.graphs.values()
        )
        assert np.array_equal(_embeddings(second, reference_cases[0]), expected)
    finally:
        second.close()

"""A GPU engine built from cached start-up choices is the engine its first build was.

engine/build_cache.py keeps what a start-up's autotuner chose (each cuDNN graph's execution
plan and times, the fused graphs cuDNN could not serve); the next engine under an equal
BuildKey builds those plans alone instead of timing every candidate. What must hold: the
second build runs every convolution on the cached choice, times nothing and builds in less
time, and its embeddings are the first build's to the bit; cached choices that no longer
build (a cuDNN plan of another name, a kernel we no longer have) are timed afresh, one log
line each, and the engine still meets the math's bound. Each test prints its table (build,
cuDNN graphs built, convolutions on cached choices, seconds building).

Needs a GPU (REQUIRE_GPU=1 makes a skip a failure); the cache's own rules are
tests/test_build_cache.py's, on the CPU.
"""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from speakerd.engine.build_cache import BUILDS_DIR, BuildCache
from speakerd.model.architecture import EMBEDDING_DIM, MAX_SPEAKERS
from speakerd.model.numerics import BOUNDS, Math, compare
from tests.test_gpu_engine import GPU_DETAIL, GPU_USABLE

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not GPU_USABLE, reason=f"no usable GPU for the CuPy engine: {GPU_DETAIL}"),
]

#: One plan size and TF32 (no FP16 fallback plans): the fewest graphs that still have fused
#: and bare cuDNN candidates beside ours.
MATH, SIZES = Math.TF32, (1,)


def _engine(model, cache: BuildCache, **options):
    from speakerd.engine.gpu.engine import GpuEngine

    return GpuEngine(model, MATH, SIZES, build_cache=cache, **options)


def _embeddings(engine, case) -> np.ndarray:
    return np.asarray(engine.run_batch(case.fbank, case.masks).embeddings)


def _build_s(engine) -> float:
    report = engine.tuner.report()
    return report["cudnn_build_s"] + report["instance_build_s"]


def _row(name: str, engine) -> None:
    timed, cached = engine.tuner.report()["cudnn_graphs"], engine.tuner.from_cache
    print(f"{name:<34} {timed:>7} {cached:>7} {_build_s(engine):>10.2f}")


def _header() -> None:
    print(f"\n{'build':<34} {'graphs':>7} {'cached':>7} {'build s':>10}")


def test_a_cached_build_is_the_first_build_faster(folded_model, reference_cases, tmp_path, capsys) -> None:
    cache = BuildCache(tmp_path / BUILDS_DIR)
    case = reference_cases[0]
    with capsys.disabled():
        _header()
        first = _engine(folded_model, cache)
        _row("first (every candidate timed)", first)
        expected, runners = _embeddings(first, case), [c.choice.runner for c in first.plans[1].convs]
        first.keep_build()
        first_s = _build_s(first)
        first.close()
        second = _engine(folded_model, cache)
        _row("second (cached choices)", second)
    try:
        convolutions = len(second.tuner.choice_entries)
        assert second.built_from_cache, "the second build did not use the cache"
        assert second.tuner.from_cache == convolutions, f"{second.tuner.from_cache} of {convolutions} cached"
        assert second.tuner.report()["cudnn_graphs"] == 0, "the cached build timed cuDNN graphs"
        assert [c.choice.runner for c in second.plans[1].convs] == runners, "another choice ran a conv"
        assert np.array_equal(_embeddings(second, case), expected), "the cached build's embeddings differ"
        assert _build_s(second) < first_s, f"cached build {_build_s(second):.2f} s, first {first_s:.2f} s"
    finally:
        second.close()


def test_cached_choices_that_do_not_build_are_timed_again(
    folded_model, reference_cases, tmp_path, caplog, capsys
) -> None:
    caplog.set_level(logging.INFO, logger="speakerd.engine.gpu.autotune")
    cache = BuildCache(tmp_path / BUILDS_DIR)
    first = _engine(folded_model, cache)
    first.keep_build()
    key = first.build_key
    first.close()
    path = cache.path(key)
    document = json.loads(path.read_text())
    # no cached plan rebuilds under its name and none of our kernels has the cached name
    for entry in document["entries"]["graphs"].values():
        if "plan_name" in entry:
            entry["plan_name"] = "not-a-plan"
    for entry in document["entries"]["choices"].values():
        if entry["runs"] == "ours":
            entry["kernel"] = "not-a-kernel"
    cache.store(key, document["entries"])
    with capsys.disabled():
        _header()
        second = _engine(folded_model, cache)
        _row("second (no cached choice builds)", second)
    try:
        tuner = second.tuner
        assert tuner.from_cache == 0, f"{tuner.from_cache} convolutions on choices that cannot build"
        assert all(g.plan_ms and any(ms is not None for ms in g.plan_ms) for g in tuner.graphs.values())
        said = [r.message for r in caplog.records if "the cached choice does not run it" in r.message]
        unsaid = [label for label in tuner.choice_entries if not any(f"{label} (" in line for line in said)]
        assert not unsaid, f"no line for {unsaid}"
        bound = BOUNDS[MATH]
        for case in (c for c in reference_cases if c.chunks == 1):
            parity = compare(_embeddings(second, case), case.output.reshape(1, MAX_SPEAKERS, EMBEDDING_DIM))
            assert parity.min_cosine >= bound.min_cosine, f"{case.name}: min cosine {parity.min_cosine:.9f}"
    finally:
        second.close()


def test_a_first_build_times_its_graphs_in_worker_processes(
    folded_model, reference_cases, tmp_path, caplog, capsys
) -> None:
    """tuning_pool.py: every graph the plans use timed by the workers, each chosen plan then
    built here from their answer (none rebuilt differently), and the engine meets its bound."""
    caplog.set_level(logging.INFO, logger="speakerd.engine.gpu")
    with capsys.disabled():
        _header()
        engine = _engine(folded_model, BuildCache(tmp_path / BUILDS_DIR), tuning_workers=4)
        _row("first (graphs timed in 4 workers)", engine)
    try:
        tuned = engine.tuned
        assert tuned is not None and tuned.workers == 4, tuned
        print(f"pool: {len(tuned.entries)} graphs in {tuned.seconds:.1f} s, unanswered {tuned.unanswered}")
        assert not tuned.unanswered, f"the workers did not time {tuned.unanswered}"
        assert {key.label() for key in engine.tuner.graphs} <= set(tuned.entries), (
            "a graph outside the pool's"
        )
        rebuilt = [r.message for r in caplog.records if "did not rebuild" in r.message]
        assert not rebuilt, rebuilt
        for case in (c for c in reference_cases if c.chunks == 1):
            parity = compare(_embeddings(engine, case), case.output.reshape(1, MAX_SPEAKERS, EMBEDDING_DIM))
            assert parity.min_cosine >= BOUNDS[MATH].min_cosine, (
                f"{case.name}: min cosine {parity.min_cosine:.9f}"
            )
    finally:
        engine.close()

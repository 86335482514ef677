"""What a first start hands its tuning pool (engine/gpu/tuning_pool.py), on the CPU.

The pool times, before the plans exist, the cuDNN graphs the plans' `choose` calls will ask
for: each convolution's bare graph per plan size and math where cuDNN may run it, and its
fused graph where the math fuses. These tests pin that list to the trunk (plan.trunk_convs,
which Plan._build asserts it binds) and the pool's size to the host. The workers themselves
need a GPU: tests/test_gpu_build_cache.py.
"""

from __future__ import annotations

import pytest

from speakerd.engine.gpu import maths, tuning_pool
from speakerd.engine.gpu.autotune import graph_keys
from speakerd.engine.gpu.plan import CONVOLUTIONS, STEM_EPILOGUE, trunk_convs
from speakerd.model.architecture import STEM
from speakerd.model.numerics import Math

SIZES = (1, 32)


def _maths(math: Math) -> tuple[Math, ...]:
    fallback = maths.of(math).fallback
    return (math,) if fallback is None else (math, fallback)


def test_the_trunk_is_every_convolution_in_order() -> None:
    convs = trunk_convs()
    assert len(convs) == CONVOLUTIONS, (len(convs), CONVOLUTIONS)
    assert convs[0] == (STEM, STEM_EPILOGUE), convs[0]


@pytest.mark.parametrize("math", list(Math))
def test_graph_keys_are_the_bare_and_fused_graphs_of_each_shape(math: Math) -> None:
    keys = graph_keys(trunk_convs(), SIZES, _maths(math))
    assert len(keys) == len(set(keys)), "a graph listed twice"
    shapes = {(s.cin, s.cout, s.kernel, s.stride, s.h_in, s.w_in) for s, _ in trunk_convs()}
    rows = []
    for plan_math in _maths(math):
        table = maths.of(plan_math)
        for batch in SIZES:
            bare = [k for k in keys if k.math == plan_math and k.batch == batch and k.epilogue is None]
            fused = [k for k in keys if k.math == plan_math and k.batch == batch and k.epilogue is not None]
            # cuDNN's half convolution needs a half input: a half math's stem has no cuDNN graph
            expected_bare = len(shapes) - (1 if table.half_io else 0)
            rows.append((plan_math, batch, len(bare), len(fused)))
            assert len(bare) == expected_bare, (plan_math, batch, len(bare), expected_bare)
            assert bool(fused) == table.cudnn_fusion, (plan_math, batch, len(fused))
            assert all(k.bare() in bare for k in fused), "a fused graph without its bare one"
    table_row = ", ".join(f"{m} b{b}: {n} bare, {f} fused" for m, b, n, f in rows)
    print(f"\n{math}: {len(keys)} graphs; {table_row}")


def test_fp16_with_its_fallback_is_the_hundred_graphs_an_h100_start_times() -> None:
    """The FP16 engine's start-up on an H100 logged 100 cuDNN graphs for plans (1, 32)."""
    assert len(graph_keys(trunk_convs(), SIZES, _maths(Math.FP16))) == 100


def test_the_pool_leaves_cores_to_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    cases = ((2, 100, 0), (3, 100, 0), (4, 100, 2), (16, 100, 8), (64, 100, 8), (16, 3, 3))
    for cores, graphs, expected in cases:
        monkeypatch.setattr(tuning_pool.os, "sched_getaffinity", lambda _pid, n=cores: set(range(n)))
        assert tuning_pool.workers_for(graphs) == expected, (cores, graphs, expected)

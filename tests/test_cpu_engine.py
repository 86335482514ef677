"""CpuEngine (ONNX Runtime CPU) behind the engine interface, and the engine factory.

The CPU engine serves the same ONNX graph the references come from, so it must agree
with them at the FP32 bound of SPEC 3 on every case, and a chunk's embedding must be bit
for bit the same alone or among neighbours (the batcher relies on that).
"""

from __future__ import annotations

import numpy as np
import pytest

from speakerd.engine.cpu import CpuEngine
from speakerd.engine.factory import EngineUnavailable, create_engine, resolve_kind
from speakerd.engine.gpu import gpu_available
from speakerd.model.architecture import EMBEDDING_DIM, MAX_SPEAKERS
from speakerd.model.inputs import InputError
from speakerd.model.numerics import BOUNDS, Math, compare

#: Small plans keep CPU tests fast; (1, 4) still exercises splitting and plan choice.
PLANS = (1, 4)


@pytest.fixture(scope="module")
def engine(folded_model) -> CpuEngine:
    return CpuEngine(folded_model, Math.FP32, PLANS)


def test_every_reference_case_within_fp32_bound(engine: CpuEngine, reference_cases) -> None:
    bound = BOUNDS[Math.FP32]
    print(f"\n{'case':<18} {'math':<5} {'rows':>5} {'min cosine':>12} {'max abs':>10}")
    for case in reference_cases:
        result = engine.embed(case.fbank, case.masks)
        parity = compare(result.embeddings.reshape(-1, EMBEDDING_DIM), case.output)
        print(
            f"{case.name:<18} {'fp32':<5} {parity.rows:>5} {parity.min_cosine:>12.9f} {parity.max_abs:>10.3e}"
        )
        assert parity.within(bound), f"{case.name}: {parity} outside {bound}"
        assert (
            result.plans == ["b4/eager"] * (-(-case.chunks // PLANS[-1])) if case.chunks > 1 else ["b1/eager"]
        )


def test_batch_invariance_bit_for_bit(engine: CpuEngine, reference_cases) -> None:
    """Every chunk of mixed_b32 alone equals itself at every position of every batch size."""
    mixed = reference_cases[-1]
    alone = np.concatenate([engine.run_batch(mixed.fbank[i : i + 1], mixed.masks[i : i + 1]).embeddings
                            for i in range(mixed.chunks)])  # fmt: skip
    for size in (2, 3, 4):
        for start in range(0, mixed.chunks - size + 1, size):
            batch = engine.run_batch(mixed.fbank[start : start + size], mixed.masks[start : start + size])
            worst = float(np.abs(batch.embeddings - alone[start : start + size]).max())
            assert np.array_equal(batch.embeddings, alone[start : start + size]), (
                f"chunks {start}..{start + size - 1} in a batch of {size} differ from alone by {worst:.3e}"
            )


def test_fewer_speakers_and_any_frame_count(engine: CpuEngine, reference_cases) -> None:
    """s < 3 speakers come back as s rows; masks at 125 frames equal their 589-frame origin."""
    first = reference_cases[0]
    full = engine.embed(first.fbank, first.masks).embeddings
    two = engine.embed(first.fbank, first.masks[:, :2])
    assert two.embeddings.shape == (1, 2, EMBEDDING_DIM) and two.active_frames.shape == (1, 2)
    np.testing.assert_array_equal(two.embeddings, full[:, :2])
    index = (np.arange(125) * first.masks.shape[-1]) // 125
    resized = engine.embed(first.fbank, np.ascontiguousarray(first.masks[..., index])).embeddings
    assert np.array_equal(resized, full), np.abs(resized - full).max()


def test_plans_times_and_errors(engine: CpuEngine, folded_model) -> None:
    times = engine.plan_times_ms()
    assert set(times) == set(PLANS) and all(t > 0 for t in times.values()), times
    with pytest.raises(ValueError, match="math: tf32 is not supported by cpu-onnxruntime"):
        CpuEngine(folded_model, Math.TF32, PLANS)
    with pytest.raises(ValueError, match=r"expected 1\.\.4 per batch"):
        engine.run_batch(np.zeros((5, 998, 80), np.float32), np.ones((5, MAX_SPEAKERS, 589), np.float32))
    with pytest.raises(InputError, match=r"fbank: .*\[n, 998, 80\]"):
        engine.embed(np.zeros((1, 997, 80), np.float32), np.ones((1, 3, 589), np.float32))


def test_factory_chooses_cpu_without_gpu_and_refuses_gpu(folded_model) -> None:
    usable, why = gpu_available()
    if usable:
        pytest.skip(f"a GPU is usable here ({why}): the no-GPU behaviour cannot be observed")
    assert resolve_kind("auto") == "cpu"
    assert create_engine("auto", folded_model, Math.FP32, PLANS).name == "cpu-onnxruntime"
    with pytest.raises(EngineUnavailable, match="gpu requested but no GPU is usable"):
        create_engine("gpu", folded_model, Math.FP32, PLANS)
    with pytest.raises(ValueError, match="engine: 'tpu'"):
        resolve_kind("tpu")

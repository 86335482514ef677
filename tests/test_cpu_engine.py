"""CpuEngine (ONNX Runtime CPU) behind the engine interface, and the engine factory.

The CPU engine serves the same ONNX graph the references come from, so it must agree
with them at the FP32 bound of docs/parity.md on every case, and a chunk's embedding must be bit
for bit the same alone or among neighbours (the batcher relies on that).
"""

from __future__ import annotations

import numpy as np
import pytest

from speakerd.engine.cpu import CpuEngine
from speakerd.engine.factory import EngineUnavailable, create_engine, resolve_kind
from speakerd.engine.gpu import gpu_available
from speakerd.model.architecture import EMBEDDING_DIM, MAX_SPEAKERS
from speakerd.model.inputs import InputError, InputLengthError
from speakerd.model.numerics import BOUNDS, Math, compare

#: Small plans keep CPU tests fast; (1, 4) still exercises splitting and plan choice.
PLANS = (1, 4)
#: Chunks of the batch-invariance test: batches of 2, 3 and 4 over the first 4 put a chunk at
#: every position of every batch size up to the largest plan (15 runs; 12 chunks, each in a
#: batch of each size, took 48 runs and 29 s of CI, all 32 took 128 runs and 119 s).
INVARIANCE_CHUNKS = 4


@pytest.fixture(scope="module")
def engine(folded_model) -> CpuEngine:
    return CpuEngine(folded_model, Math.FP32, PLANS)


@pytest.mark.slow
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


@pytest.mark.slow
def test_batch_invariance_bit_for_bit(engine: CpuEngine, reference_cases) -> None:
    """Chunks of mixed_b32 alone equal themselves in batches, at every position of every batch
    size (each chunk is one ORT run, so more chunks would repeat the same check)."""
    mixed = reference_cases[-1]
    alone = np.concatenate([engine.run_batch(mixed.fbank[i : i + 1], mixed.masks[i : i + 1]).embeddings
                            for i in range(INVARIANCE_CHUNKS)])  # fmt: skip
    for size in (2, 3, 4):
        for start in range(0, INVARIANCE_CHUNKS - size + 1, size):
            batch = engine.run_batch(mixed.fbank[start : start + size], mixed.masks[start : start + size])
            worst = float(np.abs(batch.embeddings - alone[start : start + size]).max())
            assert np.array_equal(batch.embeddings, alone[start : start + size]), (
                f"chunks {start}..{start + size - 1} in a batch of {size} differ from alone by {worst:.3e}"
            )


@pytest.mark.slow
def test_pieces_give_the_bits_of_the_joined_batch(engine: CpuEngine, reference_cases) -> None:
    """run_batch on lists of pieces (the batcher's requests, fbank and masks split at
    different places) equals run_batch on the joined arrays bit for bit."""
    mixed = reference_cases[-1]
    fbank, masks = mixed.fbank[:4], mixed.masks[:4]
    joined = engine.run_batch(fbank, masks)
    pieces = engine.run_batch([fbank[:1], fbank[1:]], [masks[:3], masks[3:]])
    worst = float(np.abs(pieces.embeddings - joined.embeddings).max())
    assert np.array_equal(pieces.embeddings, joined.embeddings), f"pieces differ from joined by {worst:.3e}"
    assert pieces.plans == joined.plans == ["b4/eager"], (pieces.plans, joined.plans)


def test_pieces_are_checked(engine: CpuEngine, reference_cases) -> None:
    """Pieces of one batch share F; a piece of the wrong shape and a short fbank are named."""
    first = reference_cases[0]
    frames = first.masks.shape[-1]
    assert frames != 125, frames
    short = np.ascontiguousarray(first.masks[..., :125])
    with pytest.raises(InputError, match=rf"masks\[1\]: 125 mask frames where masks\[0\] has {frames}"):
        engine.run_batch([first.fbank, first.fbank], [first.masks, short])
    with pytest.raises(InputLengthError) as wrong:
        engine.run_batch([first.fbank, first.fbank], [first.masks, first.masks[:, :2]])
    assert wrong.value.field == "masks[1]" and wrong.value.given == 2 * frames, wrong.value
    with pytest.raises(InputLengthError) as fbank:
        engine.run_batch([first.fbank], [first.masks, first.masks])
    assert (fbank.value.field, fbank.value.expected, fbank.value.given) == ("fbank", 2 * 998 * 80, 998 * 80)
    # the right number of elements on the wrong axes: the shape is named, not a length
    axes_named = rf"masks: shape \(1, 1, 3, {frames}\): expected \[chunks, 3, F\]"
    with pytest.raises(InputError, match=axes_named) as axes:
        engine.run_batch(first.fbank, first.masks[None])
    assert not isinstance(axes.value, InputLengthError), axes.value


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


class CountingSession:
    """An ORT session that counts its runs (the CPU engine makes one per chunk)."""

    def __init__(self, session) -> None:
        self.session, self.runs = session, 0

    def run(self, *args, **kwargs):
        self.runs += 1
        return self.session.run(*args, **kwargs)


def test_plan_times_come_from_a_warm_chunk_already_run(folded_model) -> None:
    """A server's start-up self-check runs chunks before it asks for plan times: the time of a
    warm one is the measurement, no chunk is run for it; a cold engine warms up then times one."""
    warm = CpuEngine(folded_model, Math.FP32, PLANS)
    warm.session = counting = CountingSession(warm.session)
    warm.run_batch(np.zeros((2, 998, 80), np.float32), np.ones((2, MAX_SPEAKERS, 589), np.float32))
    assert counting.runs == 2, counting.runs
    times = warm.plan_times_ms()
    assert counting.runs == 2 and set(times) == set(PLANS), (counting.runs, times)
    assert times[4] == 4 * times[1] > 0, times
    cold = CpuEngine(folded_model, Math.FP32, PLANS)
    cold.session = counting = CountingSession(cold.session)
    assert cold.plan_times_ms()[1] > 0 and counting.runs == 2, counting.runs  # a warm-up, a timed run


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

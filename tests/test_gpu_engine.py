"""GPU engine (CuPy + cuDNN frontend) against the ONNX Runtime CPU references.

Mirrors the GPU parity suite of speakrs (a Rust system this one is modelled on): the b1 cases
and the b32 case at FP32 (strict), TF32 and FP16 mixed within docs/parity.md's bounds, a per-layer
table against the reference taps (every tap fires once), FP32 strict (it differs from
TF32), two eager passes and a graph replay bit-identical, the FP16 residual stream (every
block passes halves) against FP32 activations, wrong input lengths rejected. FP16's range
fallback and our kernels against float64: tests/test_gpu_fp16.py, test_gpu_igemm.py. Each
test prints its table straight to the terminal (`capsys.disabled`), so a passing run on
the device still shows the numbers.

Without a usable GPU the GPU tests skip with the reason (REQUIRE_GPU=1 makes that a
failure); the layout helpers at the bottom need no GPU and run everywhere.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from speakerd.model.architecture import BLOCKS, CONVS, EMBEDDING_DIM, MAX_SPEAKERS, STEM, TAP_NAMES, tap_shape
from speakerd.model.inputs import InputError, InputLengthError
from speakerd.model.numerics import BOUNDS, Math, active_frames, compare
from speakerd.serving.server.config import env_default


def _gpu() -> tuple[bool, str]:
    from speakerd.engine.gpu import gpu_available

    return gpu_available()


GPU_USABLE, GPU_DETAIL = _gpu()
needs_gpu = pytest.mark.skipif(not GPU_USABLE, reason=f"no usable GPU for the CuPy engine: {GPU_DETAIL}")
MATHS = (Math.FP32, Math.TF32, Math.FP16)
#: A relative jump of one tap's error over the previous tap's by this factor is marked in
#: the per-layer table, as in the seed suite (it points at the layer that went wrong).
JUMP_FACTOR = 10.0
#: Rows of a partial batch on the b32 plan must match the full batch's rows this closely
#: (the same plan and algorithms; rows never mix in the trunk).
PARTIAL_MIN_COSINE = 0.999999


def _by_name(reference_cases) -> dict:
    return {case.name: case for case in reference_cases}


@pytest.fixture(scope="module")
def engines(folded_model):
    """One engine per math with plans b1 and b32, graphs captured (built once: start-up
    times every cuDNN plan)."""
    from speakerd.engine.gpu.engine import GpuEngine

    own = env_default("conv-kernels", "auto") == "auto"  # SPEAKERD_CONV_KERNELS=cudnn: cuDNN only
    built = {math: GpuEngine(folded_model, math, (1, 32), own_kernels=own) for math in MATHS}
    yield built
    for engine in built.values():
        engine.close()


def _row(capsys, text: str) -> None:
    with capsys.disabled():
        print(text, flush=True)


@pytest.mark.parametrize("math", MATHS, ids=str)
@pytest.mark.gpu
@needs_gpu
def test_b1_cases_match_reference(engines, reference_cases, math, capsys) -> None:
    engine, bound = engines[math], BOUNDS[math]
    b1_cases = [case for case in reference_cases if case.chunks == 1]
    assert len(b1_cases) == 6, [case.name for case in reference_cases]
    _row(capsys, f"\n{'case':<18} {'math':<5} {'plan':<9} {'min cosine':>14} {'1 - cos':>9} {'max abs':>10}")
    for case in b1_cases:
        run = engine.run_batch(case.fbank, case.masks)
        parity = compare(run.embeddings, case.output.reshape(1, MAX_SPEAKERS, EMBEDDING_DIM))
        _row(
            capsys,
            f"{case.name:<18} {math!s:<5} {run.plans[0]:<9} {parity.min_cosine:>14.12f} "
            f"{1 - parity.min_cosine:>9.2e} {parity.max_abs:>10.3e}",
        )
        assert run.plans == ["b1/graph"], run.plans
        assert parity.min_cosine >= bound.min_cosine, (
            f"{case.name} {math}: min cosine {parity.min_cosine:.9f} below {bound.min_cosine}"
        )
        counted = engine.active_frames(1)
        expected = active_frames(case.masks)
        assert np.array_equal(counted, expected), (
            f"{case.name}: GPU active frames {counted} vs host {expected}"
        )


@pytest.mark.parametrize("math", MATHS, ids=str)
@pytest.mark.gpu
@needs_gpu
def test_b32_matches_reference_and_is_deterministic(engines, reference_cases, math, capsys) -> None:
    engine, bound = engines[math], BOUNDS[math]
    case = _by_name(reference_cases)["mixed_b32"]
    assert case.chunks == 32
    expected = case.output.reshape(32, MAX_SPEAKERS, EMBEDDING_DIM)
    eager = engine.run_batch(case.fbank, case.masks, use_graph=False)
    assert eager.plans == ["b32/eager"] and eager.eager_runs == 1, eager
    parity = compare(eager.embeddings, expected)
    _row(
        capsys,
        f"\nb32 {case.name} {math}: min cosine {parity.min_cosine:.12f} "
        f"(1 - cos {1 - parity.min_cosine:.2e}), max abs {parity.max_abs:.3e} over {parity.rows} rows",
    )
    assert parity.min_cosine >= bound.min_cosine, f"b32 {math}: min cosine {parity.min_cosine:.9f}"

    again = engine.run_batch(case.fbank, case.masks, use_graph=False)
    differ = int(np.count_nonzero(again.embeddings != eager.embeddings))
    assert differ == 0, f"b32 {math}: a second eager pass differs in {differ} values"

    graphed = engine.run_batch(case.fbank, case.masks)
    assert graphed.plans == ["b32/graph"] and graphed.graph_replays == 1, graphed
    differ = int(np.count_nonzero(graphed.embeddings != eager.embeddings))
    assert differ == 0, f"b32 {math}: graph replay differs from eager in {differ} values"

    engine.capture_graph(32)  # a fresh capture replays the same bits too
    assert engine.has_graph(32)
    recaptured = engine.run_batch(case.fbank, case.masks)
    differ = int(np.count_nonzero(recaptured.embeddings != eager.embeddings))
    assert differ == 0, f"b32 {math}: a re-captured graph differs from eager in {differ} values"

    # a partial batch pads to the b32 plan; its rows are the full batch's rows
    partial = engine.run_batch(case.fbank[:5], case.masks[:5])
    assert partial.plans == ["b32/graph"], partial.plans
    same = compare(partial.embeddings, eager.embeddings[:5])
    _row(capsys, f"b32 {math} 5-chunk partial vs full batch rows: min cosine {same.min_cosine:.12f}")
    assert same.min_cosine >= PARTIAL_MIN_COSINE, f"partial batch rows: min cosine {same.min_cosine:.12f}"


@pytest.mark.parametrize("math", MATHS, ids=str)
@pytest.mark.gpu
@needs_gpu
def test_layers_match_reference(engines, reference_cases, math, capsys) -> None:
    engine, bound = engines[math], BOUNDS[math].max_relative_abs
    case = _by_name(reference_cases)["first_b1"]
    taps = engine.forward_with_taps(case.fbank, case.masks)
    assert list(taps) == list(TAP_NAMES), f"taps fired in order {list(taps)}"
    assert len(taps) == 1 + 2 * 16 + 3 + 2, f"{len(taps)} taps fired"
    _row(capsys, f"\nlayer errors {case.name} {math} (max abs, max |ref|, relative):")
    previous, worst = 0.0, []
    for name in TAP_NAMES:
        actual, reference = taps[name], case.taps[name]
        assert actual.shape == reference.shape == tap_shape(name, 1), (name, actual.shape, reference.shape)
        error = float(np.max(np.abs(actual.astype(np.float64) - reference)))
        scale = float(np.max(np.abs(reference)))
        relative = error / max(scale, np.finfo(np.float64).tiny)
        jump = "  <- jump" if previous > 0 and relative > JUMP_FACTOR * previous else ""
        _row(capsys, f"  {name:>18}  {error:.3e}  {scale:.3e}  {relative:.3e}{jump}")
        previous = relative
        if not relative < bound:
            worst.append(f"{name}: {relative:.3e}")
    assert not worst, f"{math}: taps over the relative bound {bound}: {worst}"


@pytest.mark.gpu
@needs_gpu
def test_fp32_is_strict_and_differs_from_tf32(engines, reference_cases, capsys) -> None:
    case = _by_name(reference_cases)["first_b1"]
    fp32 = engines[Math.FP32].run_batch(case.fbank, case.masks).embeddings
    tf32 = engines[Math.TF32].run_batch(case.fbank, case.masks).embeddings
    expected = case.output.reshape(1, MAX_SPEAKERS, EMBEDDING_DIM)
    fp32_error, tf32_error = compare(fp32, expected).max_abs, compare(tf32, expected).max_abs
    _row(capsys, f"\nfirst_b1 max abs vs reference: fp32 {fp32_error:.3e}, tf32 {tf32_error:.3e}")
    assert not np.array_equal(fp32, tf32), "FP32 and TF32 engines gave identical bits: TF32 is not in use"
    assert fp32_error < tf32_error, f"strict FP32 error {fp32_error:.3e} not below TF32's {tf32_error:.3e}"
    for batch in (1, 32):
        fused = [
            row["conv"] for row in engines[Math.FP32].conv_report(batch) if row["epilogue"] == "cudnn-fused"
        ]
        assert not fused, f"FP32 b{batch} uses cuDNN fused graphs (not strict, and slow): {fused}"


@pytest.mark.gpu
@needs_gpu
def test_fp16_passes_half_activations_and_meets_the_bound_against_fp32_activations(
    engines, reference_cases, capsys
) -> None:
    """The seed's half_hidden_blocks / half_output_blocks checks: FP16 mode passes every
    block's hidden and output activations (the residual stream) as halves, FP32 and TF32
    never; the half stream and the FP32-activation forward (TF32 mode: same weights, float32
    activations between blocks) both meet the bound, and their difference is printed."""
    case = _by_name(reference_cases)["mixed_b32"]
    for math, engine in engines.items():
        for batch, plan in engine.plans.items():
            half = [c.name for c in plan.convs if c.y.dtype.itemsize == 2]
            expected = [c.name for c in plan.convs] if math == Math.FP16 else []
            hidden = sum(c.name.endswith("conv1") for c in plan.convs if c.name in half)
            outputs = sum(c.name.endswith("conv2") for c in plan.convs if c.name in half)
            line = f"b{batch} {math}: {hidden} half hidden blocks, {outputs} half block outputs"
            _row(capsys, f"\n{line} of {len(BLOCKS)}")
            assert half == expected, f"b{batch} {math}: half outputs {half}, expected {expected}"
    reference = case.output.reshape(32, MAX_SPEAKERS, EMBEDDING_DIM)
    half_run = engines[Math.FP16].run_batch(case.fbank, case.masks)
    full_run = engines[Math.TF32].run_batch(case.fbank, case.masks)
    assert half_run.fp16_fallbacks == 0, half_run
    half, full = compare(half_run.embeddings, reference), compare(full_run.embeddings, reference)
    shift = compare(half_run.embeddings, full_run.embeddings)
    _row(
        capsys,
        f"b32 mixed_b32 FP32 activations (tf32): min cosine {full.min_cosine:.12f}; half stream (fp16): "
        f"{half.min_cosine:.12f}; half vs FP32 activations: min cosine {shift.min_cosine:.12f}, "
        f"max abs {shift.max_abs:.3e}",
    )
    bound = BOUNDS[Math.FP16].min_cosine
    assert half.min_cosine >= bound and full.min_cosine >= bound, (half.min_cosine, full.min_cosine)


@pytest.mark.gpu
@needs_gpu
def test_wrong_input_lengths_are_rejected(engines) -> None:
    engine = engines[Math.FP32]
    with pytest.raises(InputLengthError) as short:
        engine.run_batch(np.zeros(10, np.float32), np.zeros((1, MAX_SPEAKERS, 589), np.float32))
    assert (short.value.field, short.value.expected, short.value.given) == ("fbank", 998 * 80, 10), (
        short.value
    )
    assert "expected 79840 elements, given 10" in str(short.value)
    with pytest.raises(InputLengthError) as masks:
        engine.run_batch(np.zeros((1, 998, 80), np.float32), np.zeros((1, 2, 589), np.float32))
    assert masks.value.field == "masks" and masks.value.given == 2 * 589, masks.value
    with pytest.raises(InputLengthError):
        engine.forward_with_taps(
            np.zeros((2, 998, 80), np.float32), np.zeros((1, MAX_SPEAKERS, 589), np.float32)
        )
    with pytest.raises(InputError, match="at most 32"):
        engine.run_batch(np.zeros((33, 998, 80), np.float32), np.zeros((33, MAX_SPEAKERS, 589), np.float32))


@pytest.mark.gpu
@needs_gpu
def test_pieces_are_staged_as_the_joined_batch(engines, reference_cases) -> None:
    """run_batch on lists of pieces (the batcher's requests; fbank and masks split at
    different places) gives the joined batch's bits: each piece is copied straight into
    the pinned staging slot at its offset. Pieces disagreeing on F are refused by name."""
    engine = engines[Math.TF32]
    case = _by_name(reference_cases)["mixed_b32"]
    fbank, masks = case.fbank[:7], case.masks[:7]
    joined = engine.run_batch(fbank, masks)
    pieces = engine.run_batch([fbank[:2], fbank[2:3], fbank[3:]], [masks[:4], masks[4:]])
    assert pieces.plans == joined.plans == ["b32/graph"], (pieces.plans, joined.plans)
    differ = int(np.count_nonzero(pieces.embeddings != joined.embeddings))
    assert differ == 0, f"pieces differ from the joined batch in {differ} values"
    frames = masks.shape[-1]
    assert frames != 125, frames
    with pytest.raises(InputError, match=rf"masks\[1\]: 125 mask frames where masks\[0\] has {frames}"):
        engine.run_batch([fbank[:2]], [masks[:1], np.ascontiguousarray(masks[1:2, :, :125])])


@pytest.mark.gpu
@needs_gpu
def test_two_threads_at_once_get_their_own_rows(engines, reference_cases) -> None:
    engine = engines[Math.TF32]
    cases = _by_name(reference_cases)
    inputs = [
        (cases["first_b1"].fbank, cases["first_b1"].masks),
        (cases["mixed_b32"].fbank[:7], cases["mixed_b32"].masks[:7]),
    ]
    alone = [engine.run_batch(fbank, masks).embeddings for fbank, masks in inputs]
    results: dict[int, list[np.ndarray]] = {0: [], 1: []}
    errors: list[BaseException] = []

    def work(index: int) -> None:
        try:
            for _ in range(5):
                results[index].append(engine.run_batch(*inputs[index]).embeddings)
        except BaseException as error:  # re-raised in the main thread below
            errors.append(error)

    threads = [threading.Thread(target=work, args=(index,)) for index in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    for index in (0, 1):
        assert len(results[index]) == 5
        for result in results[index]:
            assert np.array_equal(result, alone[index]), f"thread {index}: rows differ from a lone run"


@pytest.mark.gpu
@needs_gpu
def test_batches_queued_back_to_back_on_one_plan_keep_their_rows(engines, reference_cases, capsys) -> None:
    """Three threads, three different 32-chunk batches on the same b32 plan, FP16: each
    thread lets the compute lock go once its batch is enqueued, so the next batch's forward
    and download run before this one's rows are read; every run must still give the very
    bits of the batch run alone (the rows come back through the thread's own slot)."""
    engine = engines[Math.FP16]
    mixed = _by_name(reference_cases)["mixed_b32"]
    rolled = [(np.roll(mixed.fbank, k, axis=0), np.roll(mixed.masks, k, axis=0)) for k in (0, 5, 11)]
    alone = [engine.run_batch(fbank, masks).embeddings for fbank, masks in rolled]
    assert not np.array_equal(alone[0], alone[1]), "the three batches must differ to tell them apart"
    runs = 8
    results: dict[int, list[np.ndarray]] = {index: [] for index in range(len(rolled))}
    errors: list[BaseException] = []

    def work(index: int) -> None:
        try:
            for _ in range(runs):
                results[index].append(engine.run_batch(*rolled[index]).embeddings)
        except BaseException as error:  # re-raised in the main thread below
            errors.append(error)

    threads = [threading.Thread(target=work, args=(index,)) for index in results]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    differ = {i: sum(not np.array_equal(r, alone[i]) for r in results[i]) for i in results}
    _row(capsys, f"b32 fp16, 3 threads x {runs} batches on one plan: runs differing from a lone run {differ}")
    assert all(len(results[i]) == runs for i in results), {i: len(r) for i, r in results.items()}
    assert not any(differ.values()), differ


@pytest.mark.gpu
@needs_gpu
def test_gap_is_the_device_time_between_batches(engines, reference_cases, capsys) -> None:
    """BatchRun.gap_s (speakerd_device_gap_seconds) is the GPU time from the end of the batch
    enqueued before to this batch's forward: a host that pauses 50 ms between two batches
    shows as a gap of at least that, and never as compute time."""
    engine = engines[Math.FP16]
    case = _by_name(reference_cases)["mixed_b32"]
    engine.run_batch(case.fbank, case.masks)
    pause_s = 0.05
    time.sleep(pause_s)
    run = engine.run_batch(case.fbank, case.masks)
    _row(capsys, f"b32 fp16 after a {pause_s} s pause: gap {run.gap_s} s, compute {run.compute_s:.5f} s")
    assert run.gap_s is not None and run.gap_s >= 0.9 * pause_s, f"gap {run.gap_s} s after {pause_s} s"
    assert run.compute_s < pause_s, f"compute {run.compute_s} s includes the host's pause"


@pytest.mark.gpu
@needs_gpu
def test_forward_allocates_nothing_and_reports(engines, reference_cases, capsys) -> None:
    import cupy

    case = _by_name(reference_cases)["mixed_b32"]
    pool = cupy.get_default_memory_pool()
    for math, engine in engines.items():
        engine.run_batch(case.fbank, case.masks)  # warm
        before = (pool.used_bytes(), pool.total_bytes())
        for use_graph in (True, False):
            engine.run_batch(case.fbank, case.masks, use_graph=use_graph)
            engine.run_batch(case.fbank[:1], case.masks[:1], use_graph=use_graph)
        after = (pool.used_bytes(), pool.total_bytes())
        assert after == before, f"{math}: device pool (used, total) bytes went {before} -> {after}"
        report = engine.memory_report()
        _row(capsys, f"\n{math} memory MiB: " + ", ".join(f"{k} {v / 2**20:.1f}" for k, v in report.items()))
        assert report["total"] == report["buffers"] + report["weights"] + report["workspace"], report
        assert report["buffers"] > 0 and report["weights"] > 0, report
        times = engine.plan_times_ms()
        _row(capsys, f"{math} plan ms: {times}; build {engine.build_report()}")
        assert sorted(times) == [1, 32] and all(ms > 0 for ms in times.values()), times


# ----- layout helpers: no GPU needed -------------------------------------------------------
def test_nhwc_to_nchw_is_the_inverse_of_the_nhwc_layout() -> None:
    from speakerd.engine.gpu.plan import nhwc_to_nchw

    rng = np.random.default_rng(0)
    nchw = rng.standard_normal((2, 5, 3, 4)).astype(np.float32)
    flat = np.concatenate([nchw.transpose(0, 2, 3, 1).reshape(-1), np.full(7, np.nan, np.float32)])
    assert np.array_equal(nhwc_to_nchw(flat, nchw.shape), nchw)


def test_activation_buffers_hold_every_conv_output() -> None:
    from speakerd.engine.gpu.convs import ConvKey
    from speakerd.engine.gpu.plan import activation_elements

    sizes = activation_elements(3)
    for spec in CONVS:
        key = ConvKey.of(spec, 3, Math.FP32, None)
        assert (key.h_out, key.w_out) == (spec.h_out, spec.w_out), spec
        buffer = "shortcut" if spec.kernel == 1 else "out"
        assert 3 * spec.cout * spec.h_out * spec.w_out <= sizes[buffer], (spec.name, sizes)
    assert sizes["x"] == 3 * STEM.cout * STEM.h_out * STEM.w_out == 3 * BLOCKS[0].conv1.cout * 80 * 998


def test_the_maths_table_has_a_row_per_math() -> None:
    """Every math has one row; its parity bound is the model's, a range-flag math falls back
    to a math without one, strict FP32 alone excludes tensor-core engines."""
    from speakerd.engine.gpu import maths

    assert list(maths.MATHS) == list(Math), list(maths.MATHS)
    for math, row in maths.MATHS.items():
        assert row.math == math and row.parity == BOUNDS[math], row
        assert row.element_bytes == row.io_dtype.itemsize == (2 if row.half_io else 4), row
        assert set(maths.ALWAYS_EXCLUDED) <= set(row.excluded_notes), row.excluded_notes
        assert row.cudnn_fusion == (row.no_fusion_reason == ""), row
        assert 0 < row.agreement < 0.1, row.agreement
        if row.range_flag:
            assert row.fallback is not None and not maths.of(row.fallback).range_flag, row
        else:
            assert row.fallback is None, row
    tensor_core = [math for math, row in maths.MATHS.items() if "TENSOR_CORE" in row.excluded_notes]
    assert tensor_core == [Math.FP32], tensor_core
    with pytest.raises(ValueError, match="math: 'bf16', expected one of fp32, tf32, fp16"):
        maths.of("bf16")


def test_fused_range_check_graphs_time_fewer_plans() -> None:
    """An FP16 fused graph carries its range check (AMAX) and every plan of it is compiled
    at start-up, so fewer are tried; bare graphs and TF32's fused ones keep the full count."""
    from speakerd.engine.gpu.convs import MAX_PLANS, MAX_RANGE_FUSED_PLANS, ConvKey, plan_limit

    def key(math: Math, epilogue: str | None) -> ConvKey:
        return ConvKey(32, 128, 128, 3, 1, 20, 250, math, epilogue)

    assert MAX_RANGE_FUSED_PLANS < MAX_PLANS
    assert plan_limit(key(Math.FP16, "bias_add_relu")) == MAX_RANGE_FUSED_PLANS
    assert plan_limit(key(Math.FP16, None)) == MAX_PLANS
    assert plan_limit(key(Math.TF32, "bias_relu")) == MAX_PLANS


def test_no_math_comparisons_outside_the_maths_table() -> None:
    """The GPU engine reads what a math means from maths.py; no module compares Math values."""
    import re
    from pathlib import Path

    from speakerd.engine import gpu

    comparison = re.compile(r"(==|!=|\bis|\bin)\s*\(?\s*Math\.|Math\.\w+\s*(==|!=)")
    found = [
        f"{path.name}:{number}: {line.strip()}"
        for path in sorted(Path(gpu.__file__).parent.glob("*.py"))
        if path.name != "maths.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if comparison.search(line)
    ]
    assert not found, found


def test_refusals_are_summarized_by_candidate_and_reason() -> None:
    from speakerd.engine.gpu.autotune import Refusal, summarize

    refusals = [
        Refusal("ours:stem", "b1 32->32 + bias_relu", "runs only the stem"),
        Refusal("cudnn-fused", "b1 32->32 + bias_relu", "strict FP32"),
        Refusal("ours:stem", "b1 32->64 + bias_relu", "runs only the stem"),
    ]
    assert summarize(refusals) == {"ours:stem: runs only the stem": 2, "cudnn-fused: strict FP32": 1}
    assert str(refusals[1]) == "cudnn-fused for b1 32->32 + bias_relu: strict FP32"

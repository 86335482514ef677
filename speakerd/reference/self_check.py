"""Start-up parity self-check: the engine just built against the ONNX Runtime reference.

Why at start-up: a GPU engine can build and warm up fine and still compute wrong numbers
(a bad kernel for one plan, a driver's TF32 default, a corrupt weights file folded fine).
The server says SERVING only after every plan has reproduced the FP32 reference within the
docs/parity.md bound of the engine's math, on a built-in case, with the same bits on every run, so
a load balancer never routes to a replica that would return wrong embeddings.

Every plan runs a batch of the built-in chunk, the speaker masks rotated by the chunk's
position, so each row's expected value is one of the reference's 3 rows: that checks every
plan's rows come back in order, at the cost of one reference run.

How many chunks: a GPU plan is a fixed-shape graph, so it is checked on a full batch (every
row position of the plan). The CPU engine runs one chunk per ONNX Runtime call whatever the
plan (speakerd/engine/cpu.py), so a full b32 batch would check the same computation 32 times
at ~0.12 s a chunk on 2 cores (the b32 check alone took 94 s of start-up, with its repeat
runs); there each plan gets the fewest chunks that select it (the previous plan's size + 1),
which still proves the plan dispatch and the row order.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager

import numpy as np

from speakerd.engine.base import Engine
from speakerd.engine.cpu import CpuEngine
from speakerd.model.architecture import EMBEDDING_DIM, MAX_SPEAKERS
from speakerd.model.numerics import BOUNDS, Parity, compare, pad_speakers
from speakerd.model.weights import FoldedModel

log = logging.getLogger(__name__)

#: The built-in case: one full chunk of synthetic speech with 3 overlapping speakers.
SELF_CHECK_CASE = "first_b1"
#: Runs of each plan on the case: every one must give the same bits, and a captured graph
#: eager's bits too. Seen on the H200: a TF32 b1 graph that passed its capture check on
#: random inputs, then gave embeddings that moved between calls while staying inside the
#: TF32 bound (min cosine 0.9994 against the reference's bound of 0.999).
SELF_CHECK_RUNS = 2
#: The CPU engine checks each plan once: it is one ONNX Runtime session in sequential mode,
#: one chunk per call, so a repeat run executes the same kernels in the same order on the
#: same bits (tests/test_cpu_engine.py holds it to that, bit for bit). On 2 cores a repeat
#: run of every plan was 3 of the 10 chunk runs of a CPU server's start-up.
CPU_SELF_CHECK_RUNS = 1


class SelfCheckFailed(RuntimeError):
    """The engine disagrees with the reference beyond its math's bound; never serve it."""


def rotated_batch(fbank: np.ndarray, masks: np.ndarray, chunks: int) -> tuple[np.ndarray, np.ndarray]:
    """`chunks` copies of a 1-chunk case; chunk i has its speaker masks rolled by i."""
    padded = pad_speakers(masks)[0]
    batch_masks = np.stack([np.roll(padded, i, axis=0) for i in range(chunks)])
    return np.repeat(fbank[:1], chunks, axis=0), np.ascontiguousarray(batch_masks)


def rotated_reference(reference: np.ndarray, chunks: int) -> np.ndarray:
    """Expected [chunks, 3, 256] for `rotated_batch` from the 1-chunk reference rows [3, 256]."""
    rows = reference.reshape(MAX_SPEAKERS, EMBEDDING_DIM)
    return np.stack([np.roll(rows, i, axis=0) for i in range(chunks)])


def check_sizes(engine: Engine) -> dict[int, int]:
    """Plan size -> chunks its check runs (module docstring): the full plan on a GPU, the
    fewest chunks that select the plan on the CPU engine."""
    if not isinstance(engine, CpuEngine):
        return {size: size for size in engine.plan_sizes}
    smaller = (0, *engine.plan_sizes[:-1])
    return {size: previous + 1 for size, previous in zip(engine.plan_sizes, smaller, strict=True)}


def check_runs(engine: Engine) -> int:
    """Runs of each plan's check: a GPU plan's repeats catch bits that move between calls
    (SELF_CHECK_RUNS); the CPU engine's cannot move (CPU_SELF_CHECK_RUNS)."""
    return CPU_SELF_CHECK_RUNS if isinstance(engine, CpuEngine) else SELF_CHECK_RUNS


def check_engine(engine: Engine, model: FoldedModel) -> dict[int, Parity]:
    """Run every plan of `engine` on the built-in case against ORT on `model`; raise when off.

    Returns the parity per plan size (logged by the caller and kept for GetModelInfo).
    """
    from speakerd.model.cases import case_inputs
    from speakerd.onnx.runtime import OnnxReference

    fbank, masks = case_inputs(SELF_CHECK_CASE)
    reference = OnnxReference(model, taps=False).run(fbank[:1], pad_speakers(masks[:1]))["output"]
    bound = BOUNDS[engine.math]
    results: dict[int, Parity] = {}
    for size, chunks in check_sizes(engine).items():
        batch_fbank, batch_masks = rotated_batch(fbank, masks, chunks)
        runs = [engine.run_batch(batch_fbank, batch_masks) for _ in range(check_runs(engine))]
        run = runs[0]
        if any(plan.endswith("/graph") for plan in run.plans):
            # a captured graph must give eager's bits on real inputs too, not only on the
            # random ones it was checked with at capture (GPU engines take use_graph)
            runs.append(engine.run_batch(batch_fbank, batch_masks, use_graph=False))  # type: ignore[call-arg]
        for again in runs[1:]:
            differ = int(np.count_nonzero(again.embeddings != run.embeddings))
            if differ:
                raise SelfCheckFailed(
                    f"plan b{size} ({engine.name}, {engine.math}): runs {run.plans} and {again.plans} of "
                    f"case {SELF_CHECK_CASE} differ in {differ} of {run.embeddings.size} values"
                )
        if not any(plan.startswith(f"b{size}/") for plan in run.plans):
            raise SelfCheckFailed(f"plan b{size} ({engine.name}): {chunks} chunks ran plans {run.plans}")
        parity = compare(run.embeddings, rotated_reference(reference, chunks))
        results[size] = parity
        log.info(
            "self-check b%d (%d chunks) %s: min cosine %.7f, max abs %.3g (relative %.3g); bound >= %g, < %g",
            size, chunks, engine.math, parity.min_cosine, parity.max_abs, parity.max_relative_abs,
            bound.min_cosine, bound.max_relative_abs,
        )  # fmt: skip
        if not parity.within(bound):
            raise SelfCheckFailed(
                f"plan b{size} ({engine.name}, {engine.math}): min cosine {parity.min_cosine:.7f} "
                f"(bound >= {bound.min_cosine}), max abs / max |ref| {parity.max_relative_abs:.3g} "
                f"(bound < {bound.max_relative_abs}) on case {SELF_CHECK_CASE}"
            )
    return results


def checked_engine(
    engine: Engine,
    model: FoldedModel,
    rebuild: Callable[[], Engine],
    timed: Callable[[], AbstractContextManager[object]] = contextlib.nullcontext,
) -> Engine:
    """`engine` once it passed `check_engine`, its start-up choices kept for the next start
    (Engine.keep_build). An engine built from cached choices (engine/build_cache.py) that
    fails is built again by `rebuild` (nothing cached), its cached choices removed, and
    that one checked instead: a cached choice is proven on every start, and one that fails
    is dropped and every candidate timed again. Whatever fails is closed before raising.
    `timed`: the context each check runs in (the start-up's "self-check" phase)."""
    try:
        try:
            with timed():
                check_engine(engine, model)
        except SelfCheckFailed as failure:
            if not engine.built_from_cache:
                raise
            log.warning("self-check failed on cached start-up choices (%s); removing them, building afresh",
                        failure)  # fmt: skip
            engine.forget_build()
            engine.close()
            engine = rebuild()
            with timed():
                check_engine(engine, model)
        engine.keep_build()
    except BaseException:
        engine.close()
        raise
    return engine

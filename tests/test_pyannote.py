"""speakerd.pyannote against pyannote.audio itself: a real CPU server, a real pipeline.

The pipeline is pyannote.audio 4.0.7's `SpeakerDiarization` with the segmentation-3.0
checkpoint, pyannote's own `WeSpeakerResNet34` holding the served weights (the synthetic
default model) and AgglomerativeClustering, run on the first SAMPLE_SECONDS of pyannote's
bundled sample.wav (4 windows: silence, both speakers, two overlaps). The same pipeline
with and without `use_server` must give the same embeddings (cosine >= 0.99999 per row, the
same empty rows) and the same diarization (DER 0), with `embedding_exclude_overlap` off and
on. With the server segmenting too (`use_server(segmentation=True)` and `remote_pipeline`, the
server serving the same segmentation-3.0 checkpoint), the segmentations must be pyannote's
exactly and the diarization the same again, from a pipeline that holds no weights. Skips,
saying why, without pyannote.audio or the segmentation checkpoint (.ci/run installs both).
"""

from __future__ import annotations

import copy
import os
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

# pyannote.audio 4 sends usage telemetry to its vendor unless told not to; tests send nothing
os.environ["PYANNOTE_METRICS_ENABLED"] = "false"
pytest.importorskip(
    "pyannote.audio",
    reason="pyannote.audio is not installed (pip install 'speakerd[pyannote]'; .ci/run installs 4.0.7)",
)

import soundfile
import torch
from pyannote.metrics.diarization import DiarizationErrorRate

from speakerd.client import RetryPolicy
from speakerd.model.fbank import chunk_recording
from speakerd.model.numerics import BOUNDS, Math, active_frames, compare
from speakerd.model.weights import load_state_dict
from speakerd.pyannote import (
    ModelMismatchError,
    ServerUnavailableError,
    SpeakerdFallbackWarning,
    models,
    remote_pipeline,
    use_server,
)
from speakerd.pyannote.remote import weightless_segmentation
from tests.pyannote_checkpoints import SEGMENTATION_CHECKPOINT, SEGMENTATION_MISSING
from tests.serving import scrape, serve_module

SEGMENTATION = SEGMENTATION_CHECKPOINT
#: Log-probability margin under which pyannote's two best powerset classes tie to float32
#: rounding: sample.wav's window 1, frame 548 has 9.8e-6, and there pyannote's float32 and
#: float64 forwards pick different classes (docs/segmentation.md).
TIE_MARGIN = 1e-4
#: Nothing listens on port 1 of loopback (a privileged port no test server takes).
UNREACHABLE = "127.0.0.1:1"
#: Two quick attempts: the unreachable tests need the retry path, not its full patience.
QUICK_RETRY = RetryPolicy(attempts=2, initial_backoff_s=0.01, max_backoff_s=0.05)
#: Relative noise on every weight of the "other model": far beyond any parity bound.
PERTURBATION = 0.05
#: Seconds of sample.wav the pipelines compare on: 13 s hold what the whole 30 s do (6.7 s of
#: silence, then both speakers taking turns and two overlaps, 9.92-10.02 s and 10.57-11.03 s
#: by its sample.rttm) in 4 windows, not 21: pyannote's segmentation hears one speaker in
#: window 0 (so rows with empty masks) and both in windows 1 to 3, with 41, 31 and 29
#: overlapped frames (so exclude_overlap changes their rows), window 1 holding TIE_MARGIN's
#: tie. Not 12 s: on 3 windows that one tied frame, outvoted by fewer windows, moves a turn
#: (DER 0.003 between the served segmentation's diarization and pyannote's).
#: pyannote's CPU pipeline runs its ResNet 3 times a window at about 0.7 s each on 2 cores,
#: and its runs here were CI's slowest fixture (181 s at 20 s of audio, 6 windows at 15 s).
SAMPLE_SECONDS = 13
#: Seconds of sample.wav the served-segmentation and file-path tests diarize: 2 windows, the
#: second with both speakers and an overlap.
SHORT_SECONDS = 11
#: Seconds the fallback test embeds with pyannote's own model, twice: one window (3 local
#: ResNet runs each) shows the fallback's rows are pyannote's as well as three would.
FALLBACK_SECONDS = 10
#: pyannote's models run on one torch thread here. With torch's default pool (one thread a
#: core) on CI's 2 cores, which the other pytest worker shares, the pool's threads spin
#: waiting for each other: pyannote's segmentation of 6 windows took 6 to 24 CPU-s on 2
#: threads and 0.4 s on one, its ResNet on 3 chunks 4.3 s and 2.7 s.
TORCH_THREADS = 1

pytestmark = pytest.mark.slow
if not SEGMENTATION.is_file():
    pytest.skip(SEGMENTATION_MISSING, allow_module_level=True)


@dataclass
class Run:
    """One pipeline run: the embeddings its hook saw, its output, its progress calls."""

    embeddings: np.ndarray
    segmentations: np.ndarray  # [windows, frames, speakers] as the pipeline binarized them
    output: Any  # DiarizeOutput
    progress: list[tuple[int, int]]  # (completed, total) of the "embeddings" step


def run_pipeline(pipeline, file: dict[str, Any]) -> Run:
    """Apply `pipeline` with a hook that keeps what pyannote's ArtifactHook would."""
    artifacts: dict[str, Any] = {}
    progress: list[tuple[int, int]] = []

    def hook(
        step: str, artifact: Any, file: Any = None, total: int | None = None, completed: int | None = None
    ):
        if artifact is not None:
            artifacts[step] = artifact
        if step == "embeddings" and completed is not None:
            progress.append((completed, total))

    output = pipeline(dict(file), hook=hook)
    return Run(artifacts["embeddings"], artifacts["segmentation"].data, output, progress)


@pytest.fixture(scope="module", autouse=True)
def torch_threads():
    """TORCH_THREADS for this module's tests and fixtures, the process's own count after."""
    previous = torch.get_num_threads()
    torch.set_num_threads(TORCH_THREADS)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def server(weights_path):
    """Serving the synthetic embedding model and the real segmentation-3.0 checkpoint
    (converted without torch on start-up)."""
    yield from serve_module(weights_path, "--plans", "1,8", "--segmentation-model", str(SEGMENTATION))


@pytest.fixture(scope="module")
def segmentation():
    return models.segmentation_model(SEGMENTATION)


@pytest.fixture(scope="module")
def embedding(weights_path):
    return models.embedding_model(weights_path)


@pytest.fixture(scope="module")
def sample() -> dict[str, Any]:
    samples, rate = soundfile.read(
        str(models.sample_path()), dtype="float32", always_2d=True, frames=SAMPLE_SECONDS * 16_000
    )
    return models.in_memory(samples, rate, "sample")


@pytest.fixture(scope="module")
def runs(server, segmentation, embedding, sample) -> dict[str, tuple[Run, Run, Any]]:
    """case -> (pyannote alone, pyannote + speakerd, the served pipeline's ServerEmbeddings)."""
    out = {}
    for exclude_overlap in (False, True):
        local = models.diarization_pipeline(segmentation, embedding, exclude_overlap)
        served = use_server(
            models.diarization_pipeline(segmentation, embedding, exclude_overlap), server.target
        )
        case = f"exclude_overlap={exclude_overlap}"
        out[case] = (run_pipeline(local, sample), run_pipeline(served, sample), served.get_embeddings)
    return out


@pytest.fixture(scope="module")
def remote_runs(server, sample, runs) -> dict[str, tuple[Run, Run]]:
    """case -> (pyannote alone, a pipeline without weights segmenting and embedding on the server)."""
    out = {}
    for exclude_overlap in (False, True):
        case = f"exclude_overlap={exclude_overlap}"
        remote = remote_pipeline(server.target, exclude_overlap=exclude_overlap)
        out[case] = (runs[case][0], run_pipeline(remote, sample))
    return out


def test_server_segmentation_is_pyannotes(remote_runs, segmentation, sample) -> None:
    """The segmentations pyannote's pipeline gets from the server equal its own, frame by
    frame except where pyannote's two best powerset classes tie to float32 rounding (within
    TIE_MARGIN: there its own float32 and float64 forwards disagree too), and the diarization
    is the same (DER 0), with a pipeline that holds no weights."""
    windows = chunk_recording(sample["waveform"].numpy()[0]).waveforms
    with torch.inference_mode():  # eval: the LSTM's dropout off, as the pipeline's Inference runs it
        scores = segmentation.eval()(torch.from_numpy(windows)[:, None]).numpy()
    top2 = np.sort(scores, axis=-1)[..., -2:]
    tied = (top2[..., 1] - top2[..., 0]) < TIE_MARGIN
    print(f"\n{'case':<24}{'windows':>8}{'frames':>8}{'differ':>8}{'ties':>6}{'min cosine':>14}")
    for case, (local, remote) in remote_runs.items():
        assert remote.segmentations.shape == local.segmentations.shape == (SAMPLE_SECONDS - 9, 589, 3), case
        differ = np.any(remote.segmentations != local.segmentations, axis=-1)
        parity = compare(remote.embeddings.reshape(-1, 256), local.embeddings.reshape(-1, 256))
        print(
            f"{case:<24}{differ.shape[0]:>8}{differ.size:>8}{int(differ.sum()):>8}{int(tied.sum()):>6}"
            f"{parity.min_cosine:>14.9f}"
        )
        assert not np.any(differ & ~tied), (case, np.argwhere(differ & ~tied)[:5])
        assert parity.min_cosine >= BOUNDS[Math.FP32].min_cosine, (case, parity)
        for name in ("speaker_diarization", "exclusive_speaker_diarization"):
            reference, hypothesis = getattr(local.output, name), getattr(remote.output, name)
            assert DiarizationErrorRate()(reference, hypothesis) == 0.0, (case, name)
            assert list(reference.itertracks(yield_label=True)) == list(
                hypothesis.itertracks(yield_label=True)
            )


def test_use_server_segmentation_checks_the_segmentation_model(
    server, segmentation, embedding, sample
) -> None:
    """use_server(segmentation=True) on a pipeline with weights: its segmentation model is
    checked against the server's on a probe (refused when it is another), then each file
    is one call whose embeddings need no second one."""
    other = models.diarization_pipeline(weightless_segmentation(), embedding)
    with pytest.raises(
        ModelMismatchError, match="segmentation differs from the pipeline's segmentation model"
    ):
        use_server(other, server.target, segmentation=True)
    assert "get_segmentations" not in other.__dict__
    pipeline = use_server(
        models.diarization_pipeline(segmentation, embedding), server.target, segmentation=True
    )
    calls = "speakerd_request_duration_seconds_count{code=OK,method=EmbedRecording}"
    before = scrape(server)[calls]
    served = run_pipeline(pipeline, {**sample, "waveform": sample["waveform"][:, : SHORT_SECONDS * 16_000]})
    assert served.segmentations.shape == (SHORT_SECONDS - 9, 589, 3)
    assert scrape(server)[calls] == before + 1  # the segmentation and embeddings of one call
    pipeline.get_embeddings.detach()
    assert "get_segmentations" not in pipeline.__dict__ and "get_embeddings" not in pipeline.__dict__


def test_embeddings_equal_pyannote(runs, weights_path) -> None:
    bias = load_state_dict(weights_path)["resnet.seg_1.bias"]
    print(f"\n{'case':<24}{'rows':>6}{'empty':>7}{'min cosine':>14}{'max abs':>11}")
    for case, (local, served, embeddings) in runs.items():
        assert served.embeddings.shape == local.embeddings.shape == (SAMPLE_SECONDS - 9, 3, 256), case
        assert served.embeddings.dtype == local.embeddings.dtype == np.float32, case
        assert np.array_equal(np.isnan(served.embeddings), np.isnan(local.embeddings)), case
        empty = embeddings.last.empty
        masks = np.nan_to_num(np.transpose(local.segmentations, (0, 2, 1)))
        # a row is empty iff its mask has no weight on the trunk's 125 frames (pyannote's
        # nearest resize), whatever exclude_overlap chose: pyannote then returns seg_1.bias
        assert np.array_equal(empty, active_frames(masks) == 0), case
        assert compare(local.embeddings[empty], np.broadcast_to(bias, (int(empty.sum()), 256))).min_cosine > (
            BOUNDS[Math.FP32].min_cosine
        ), case
        parity = compare(served.embeddings[~empty], local.embeddings[~empty])
        print(
            f"{case:<24}{parity.rows:>6}{int(empty.sum()):>7}{parity.min_cosine:>14.9f}{parity.max_abs:>11.2e}"
        )
        assert parity.min_cosine >= BOUNDS[Math.FP32].min_cosine, (case, parity)


def test_diarization_is_the_same(runs) -> None:
    for case, (local, served, _) in runs.items():
        for name in ("speaker_diarization", "exclusive_speaker_diarization"):
            reference, hypothesis = getattr(local.output, name), getattr(served.output, name)
            assert len(reference) > 0, (case, name)
            assert DiarizationErrorRate()(reference, hypothesis) == 0.0, (case, name)
            assert list(reference.itertracks(yield_label=True)) == list(
                hypothesis.itertracks(yield_label=True)
            ), (case, name)
        assert len(local.output.speaker_diarization.labels()) >= 1, case


def test_hook_progress_like_pyannote(runs) -> None:
    """The "embeddings" step starts at 0 and ends at pyannote's own total, never going back."""
    for case, (local, served, _) in runs.items():
        total = local.progress[0][1]
        assert served.progress[0] == (0, total), case
        assert served.progress[-1] == (total, total), case
        assert [c for c, _ in served.progress] == sorted(c for c, _ in served.progress), case
        assert {t for _, t in served.progress} == {total}, case


def test_other_model_refused(server, segmentation, embedding) -> None:
    """A pipeline whose embedding weights differ from the served ones is refused at start."""
    perturbed = copy.deepcopy(embedding)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in perturbed.parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            parameter.mul_(1 + PERTURBATION * noise)
    pipeline = models.diarization_pipeline(segmentation, perturbed)
    with pytest.raises(ModelMismatchError) as refused:
        use_server(pipeline, server.target)
    message = str(refused.value)
    assert server.target in message and "WeSpeakerResNet34" in message and "probe min cosine" in message
    assert "get_embeddings" not in pipeline.__dict__  # the pipeline keeps its own method


def test_unreachable_target_is_named(segmentation, embedding) -> None:
    pipeline = models.diarization_pipeline(segmentation, embedding)
    with pytest.raises(
        ServerUnavailableError, match=rf"speakerd at {UNREACHABLE}: UNAVAILABLE after 2 attempts"
    ):
        use_server(pipeline, UNREACHABLE, retry=QUICK_RETRY, timeout_s=10.0)


def test_local_fallback_is_explicit(segmentation, embedding, sample) -> None:
    """local_fallback=True: a warning at start and per file, then pyannote's own embeddings."""
    short = {**sample, "waveform": sample["waveform"][:, : FALLBACK_SECONDS * sample["sample_rate"]]}
    pipeline = models.diarization_pipeline(segmentation, embedding, exclude_overlap=True)
    segmentations = pipeline.get_segmentations(short)
    expected = pipeline.get_embeddings(short, segmentations, exclude_overlap=True)
    with pytest.warns(SpeakerdFallbackWarning, match=UNREACHABLE):
        use_server(pipeline, UNREACHABLE, local_fallback=True, retry=QUICK_RETRY, timeout_s=10.0)
    with pytest.warns(SpeakerdFallbackWarning, match="local_fallback=True"):
        fallback = pipeline.get_embeddings(short, segmentations, exclude_overlap=True)
    assert pipeline.get_embeddings.last.fallback
    assert fallback.shape == expected.shape == (FALLBACK_SECONDS - 9, 3, 256)
    assert np.array_equal(fallback, expected)


def test_only_served_models_accepted(server, segmentation, embedding) -> None:
    with pytest.raises(TypeError, match=r"expected pyannote\.audio\.pipelines\.SpeakerDiarization"):
        use_server(object(), server.target)  # type: ignore[arg-type]
    pipeline = models.diarization_pipeline(segmentation, embedding)
    pipeline._embedding.model_ = segmentation
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(
            TypeError, match=r"pipeline._embedding: PyanNet, expected pyannote's WeSpeakerResNet34"
        ):
            use_server(pipeline, server.target)


def test_a_file_path_works_through_use_server(server, segmentation, embedding, tmp_path) -> None:
    """`pipeline("meeting.wav")`, as pyannote documents it: where pyannote cannot decode a
    path itself (torchcodec missing, as in CI), use_server has the pipeline read it with
    soundfile, so it gives what the same audio given in memory gives; detach() restores
    pyannote's own reading. The file: SHORT_SECONDS of sample.wav, its 16-bit samples as
    they are (the pipeline runs three times, on 2 windows where the whole 30 s has 21)."""
    pcm, rate = soundfile.read(str(models.sample_path()), dtype="int16", frames=SHORT_SECONDS * 16_000)
    path = str(tmp_path / "excerpt.wav")
    soundfile.write(path, pcm, rate, subtype="PCM_16")
    samples, _ = soundfile.read(path, dtype="float32", always_2d=True)
    pipeline = use_server(models.diarization_pipeline(segmentation, embedding), server.target)
    served = run_pipeline(pipeline, {"audio": path})
    in_memory = run_pipeline(pipeline, models.in_memory(samples, rate, "excerpt"))
    assert len(served.output.speaker_diarization) > 0
    assert np.array_equal(served.embeddings, in_memory.embeddings)
    for name in ("speaker_diarization", "exclusive_speaker_diarization"):
        assert list(getattr(served.output, name).itertracks(yield_label=True)) == list(
            getattr(in_memory.output, name).itertracks(yield_label=True)
        ), name
    assert pipeline(path).speaker_diarization == served.output.speaker_diarization  # a bare str path too
    pipeline.get_embeddings.detach()
    assert "apply" not in pipeline.__dict__ and "get_embeddings" not in pipeline.__dict__

"""Diarize: a recording in, pyannote's diarization (and names) out, from one call.

A real CPU server serving the synthetic embedding model and the real segmentation-3.0
checkpoint, against pyannote.audio 4.0.7's own SpeakerDiarization pipeline on the same
weights (AgglomerativeClustering with speaker-diarization-3.1's parameters) on pyannote's
sample.wav: the same turns, track for track (DER 0), with the speaker count free or bound
and exclude_overlap on (tests/test_diarization_math.py holds every other bound to pyannote on
the same arrays, without a server); the names of enrolled voiceprints on the speakers whose centroid
matches; every bad option INVALID_ARGUMENT naming its field; VBx on this server, which has no
--plda, FAILED_PRECONDITION (tests/test_diarize_vbx.py serves one); silence no turns. Skips, saying
why, without pyannote.audio or the segmentation checkpoint (.ci/run installs both).
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any

import grpc
import numpy as np
import pytest

os.environ["PYANNOTE_METRICS_ENABLED"] = "false"
pytest.importorskip(
    "pyannote.audio",
    reason="pyannote.audio is not installed (pip install 'speakerd[pyannote]'; .ci/run installs 4.0.7)",
)

import soundfile
from pyannote.metrics.diarization import DiarizationErrorRate

from speakerd.client.cli import main as cli_main
from speakerd.client.diarize import DiarizationClient
from speakerd.client.voiceprints import VoiceprintClient
from speakerd.pyannote import diarize, models
from tests.serving import serve_module
from tests.test_bad_inputs import field_violations
from tests.test_pyannote import SEGMENTATION

pytestmark = pytest.mark.slow
if not SEGMENTATION.is_file():
    pytest.skip(
        f"segmentation-3.0 checkpoint not found at {SEGMENTATION}: run scripts/pyannote_segmentation.sh",
        allow_module_level=True,
    )

TIMEOUT_S = 600.0
#: (case, pyannote's apply keyword arguments, exclude_overlap)
CASES = [
    ("free", {}, False),
    ("num_speakers=2", {"num_speakers": 2}, False),
    ("exclude_overlap", {}, True),
]


@pytest.fixture(scope="module")
def server(weights_path):
    yield from serve_module(weights_path, "--plans", "1,8", "--segmentation-model", str(SEGMENTATION))


@pytest.fixture(scope="module")
def sample() -> dict[str, Any]:
    samples, rate = soundfile.read(str(models.sample_path()), dtype="float32", always_2d=True)
    return models.in_memory(samples, rate, "sample")


@pytest.fixture(scope="module")
def pyannote_outputs(weights_path, sample) -> dict[str, Any]:
    """case -> pyannote alone's DiarizeOutput on sample.wav (the same weights as the server).

    pyannote's embedding step dominates on a CPU (63 ResNet runs a pass), so each
    exclude_overlap setting runs it once; the other cases apply the same pipeline with its
    get_embeddings answering the arrays that run computed (pyannote's own, for the same
    segmentation), which changes nothing else in `apply`."""
    segmentation, embedding = models.segmentation_model(SEGMENTATION), models.embedding_model(weights_path)
    outputs: dict[str, Any] = {}
    computed: dict[bool, Any] = {}
    for case, bounds, exclude_overlap in CASES:
        pipeline = models.diarization_pipeline(segmentation, embedding, exclude_overlap)
        if exclude_overlap in computed:
            pipeline.get_embeddings = lambda *args, _kept=computed[exclude_overlap], **kwargs: _kept
        else:
            own = pipeline.get_embeddings

            def keep(*args, _own=own, _flag=exclude_overlap, **kwargs):
                computed[_flag] = _own(*args, **kwargs)
                return computed[_flag]

            pipeline.get_embeddings = keep
        with warnings.catch_warnings():
            warnings.simplefilter(
                "ignore"
            )  # min_speakers=3 warns that 2 clusters were found, as pyannote does
            outputs[case] = pipeline(dict(sample), **bounds)
    return outputs


def _tracks(annotation) -> list[tuple[float, float, str]]:
    return [
        (round(s.start, 6), round(s.end, 6), label) for s, _, label in annotation.itertracks(yield_label=True)
    ]


def test_turns_equal_pyannotes(server, sample, pyannote_outputs) -> None:
    print(f"\n{'case':<18}{'speakers':>9}{'turns':>7}{'exclusive':>10}{'DER':>6}")
    with DiarizationClient(server.target, timeout_s=TIMEOUT_S) as client:
        for case, bounds, exclude_overlap in CASES:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                served = diarize(
                    server.target, sample, client=client, exclude_overlap=exclude_overlap, **bounds
                )
            local = pyannote_outputs[case]
            der = DiarizationErrorRate()(local.speaker_diarization, served.speaker_diarization)
            print(f"{case:<18}{len(served.speaker_diarization.labels()):>9}{len(served.speaker_diarization):>7}"
                  f"{len(served.exclusive_speaker_diarization):>10}{der:>6.3f}")  # fmt: skip
            assert der == 0.0, case
            assert _tracks(served.speaker_diarization) == _tracks(local.speaker_diarization), case
            assert _tracks(served.exclusive_speaker_diarization) == _tracks(
                local.exclusive_speaker_diarization
            ), case
            np.testing.assert_allclose(
                served.speaker_embeddings, local.speaker_embeddings, rtol=1e-4, atol=1e-4
            )


def test_names_label_the_speakers_their_voiceprints_match(server, sample) -> None:
    samples = sample["waveform"].numpy().T
    with VoiceprintClient(server.target, timeout_s=TIMEOUT_S) as voiceprints:
        voiceprints.enroll("alice", samples, 16_000, segment=True, replace=True)
    with DiarizationClient(server.target, timeout_s=TIMEOUT_S) as client:
        plain = client.diarize(samples, 16_000)
        named = client.diarize(samples, 16_000, names=True, threshold=-1.0)  # every speaker matches someone
        strict = client.diarize(
            samples, 16_000, names=True, threshold=1.0
        )  # no centroid is exactly a voiceprint
    # a speaker made by the frame count alone (more speakers at once than clusters) has no
    # centroid, as in pyannote: nothing to compare, so it keeps its label
    voiced = [bool(np.any(speaker.centroid)) for speaker in plain.speakers]
    assert any(voiced), plain.speakers
    expected = [
        "alice" if has else speaker.label for has, speaker in zip(voiced, plain.speakers, strict=True)
    ]
    assert [s.label for s in named.speakers] == expected, named.speakers
    assert {t.label for t in named.turns} == set(expected) and len(named.turns) == len(plain.turns)
    assert all(
        s.speaker_id == "alice" and s.voiceprint_id
        for s, has in zip(named.speakers, voiced, strict=True)
        if has
    )
    assert [s.label for s in strict.speakers] == [
        s.label for s in plain.speakers
    ]  # names only above threshold
    assert all(
        s.score > 0 and not s.speaker_id for s, has in zip(strict.speakers, voiced, strict=True) if has
    ), strict.speakers
    assert "alice" in named.rttm and "SPEAKER_00" in plain.rttm


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"num_speakers": 3, "max_speakers": 2}, "num_speakers"),
        ({"min_speakers": 4, "max_speakers": 2}, "min_speakers"),
        ({"num_speakers": 5000}, "num_speakers"),
        ({"clustering_threshold": 3.0}, "clustering.threshold"),
        ({"threshold": 1.5, "names": True}, "threshold"),
    ],
)
def test_bad_options_are_invalid_argument_naming_the_field(server, sample, options, field) -> None:
    samples = sample["waveform"].numpy().T[: 12 * 16_000]
    with (
        DiarizationClient(server.target, timeout_s=TIMEOUT_S) as client,
        pytest.raises(grpc.RpcError) as caught,
    ):
        client.diarize(samples, 16_000, **options)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value
    assert [name for name, _ in field_violations(caught.value)] == [field], caught.value.details()


def test_silence_is_no_turns(server) -> None:
    with DiarizationClient(server.target, timeout_s=TIMEOUT_S) as client:
        result = client.diarize(np.zeros(12 * 16_000, np.int16), 16_000)
    assert result.turns == [] and result.speakers == [] and result.rttm == "" and result.windows == 3
    assert result.plda_id == ""  # the agglomerative clustering uses no PLDA


def test_vbx_without_a_plda_is_failed_precondition(server, sample) -> None:
    """This server has no --plda: GetModelInfo says so, and vbx is FAILED_PRECONDITION naming
    clustering.method and the flag (tests/test_diarize_vbx.py serves one)."""
    samples = sample["waveform"].numpy().T[:16_000]
    with DiarizationClient(server.target, timeout_s=TIMEOUT_S) as client:
        assert not client.model_info().HasField("plda")
        with pytest.raises(grpc.RpcError) as caught:
            client.diarize(samples, 16_000, clustering="vbx")
    details = caught.value.details()
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION, caught.value
    assert [name for name, _ in field_violations(caught.value)] == ["clustering.method"], details
    assert details.startswith("clustering.method: ") and "--plda" in details, details


def test_cli_writes_pyannotes_rttm(server, pyannote_outputs, tmp_path, capsys) -> None:
    rttm = tmp_path / "sample.rttm"
    code = cli_main(
        ["diarize", "--target", server.target, "--audio", str(models.sample_path()), "--rttm", str(rttm)]
    )
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    expected = tmp_path / "expected.rttm"
    local = pyannote_outputs["free"].speaker_diarization
    local.uri = "sample"
    with expected.open("w") as handle:
        local.write_rttm(handle)
    assert rttm.read_text() == expected.read_text()
    assert [s["label"] for s in summary["speakers"]] == local.labels() and summary["turns"] == len(local)

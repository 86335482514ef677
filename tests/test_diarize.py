"""Diarize: a recording in, pyannote's diarization (and names) out, from one call.

A real CPU server serving the synthetic embedding model and the real segmentation-3.0
checkpoint, against pyannote.audio 4.0.7's own SpeakerDiarization pipeline
(AgglomerativeClustering with speaker-diarization-3.1's parameters) on the first
SAMPLE_SECONDS of pyannote's sample.wav: the same turns, track for track (DER 0), with the
speaker count free or bound and exclude_overlap on. The pipeline compared is
`remote_pipeline`: pyannote's own clustering, reconstruction and turns on the segmentation
and embeddings of the same server, so the comparison isolates what Diarize adds (the steps
after the embeddings, in NumPy and SciPy), and needs no PyTorch model run here;
tests/test_pyannote.py shows that this pipeline diarizes as pyannote alone on the same weights
does (DER 0), and tests/test_diarization_math.py holds every other bound to pyannote on the
same arrays. Then the names of enrolled voiceprints on the speakers whose centroid matches;
every bad option INVALID_ARGUMENT naming its field; VBx on this server, which has no --plda,
FAILED_PRECONDITION (tests/test_diarize_vbx.py serves one); silence no turns; a clustering larger than
the server's budget refused. Skips, saying why, without pyannote.audio or the segmentation
checkpoint (.ci/run installs both).
"""

from __future__ import annotations

import json
import os
import time
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
from speakerd.client.client import NO_RETRY
from speakerd.client.diarize import DiarizationClient
from speakerd.client.voiceprints import VoiceprintClient
from speakerd.pyannote import diarize, models, remote_pipeline
from speakerd.tools.suite.diarize import server_split
from tests.serving import scrape, serve_module, wait_until
from tests.test_bad_inputs import field_violations
from tests.test_pyannote import SAMPLE_SECONDS, SEGMENTATION

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


#: The clustering budget of the module's server, MiB: the smallest the flag takes, so that 80 s
#: of audio do not fit it (71 windows reserve 1.12 MB) while the sample (4 windows, at most 12
#: clean pairs: 0.11 MB) does.
CLUSTERING_MEMORY_MB = 1
#: Seconds of silence whose clustering reservation exceeds that budget.
OVER_BUDGET_S = 80
#: Seconds of the sample the bench reads, and the seconds it tiles them to: 2 windows (its
#: warm-up calls each kind once on them too), each holding both speakers' first turns (6.7 s
#: to 10 s of the sample, by its sample.rttm).
BENCH_AUDIO_SECONDS, BENCH_SECONDS = 10, 11


@pytest.fixture(scope="module")
def server(weights_path):
    yield from serve_module(
        weights_path, "--plans", "1,8", "--segmentation-model", str(SEGMENTATION),
        "--clustering-memory-mb", str(CLUSTERING_MEMORY_MB),
    )  # fmt: skip


@pytest.fixture(scope="module")
def sample() -> dict[str, Any]:
    samples, rate = soundfile.read(
        str(models.sample_path()), dtype="float32", always_2d=True, frames=SAMPLE_SECONDS * 16_000
    )
    return models.in_memory(samples, rate, "sample")


@pytest.fixture(scope="module")
def pyannote_outputs(server, sample) -> dict[str, Any]:
    """case -> the DiarizeOutput of pyannote's pipeline on the server's segmentation and
    embeddings (module doc), one server call a case."""
    outputs: dict[str, Any] = {}
    for case, bounds, exclude_overlap in CASES:
        pipeline = remote_pipeline(server.target, exclude_overlap=exclude_overlap, timeout_s=TIMEOUT_S)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # pyannote's own warnings (e.g. clusters found vs asked)
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


@pytest.mark.parametrize("seconds", [1.0, 3.0])
def test_a_recording_shorter_than_a_window_gets_pyannotes_turns(server, sample, seconds) -> None:
    """A recording shorter than one 10 s window is one zero-padded window, as in pyannote's
    pipeline; the turns are pyannote's, the last ending where its frames put it (3.102 s for
    3 s of speech: pyannote does not cut turns at the audio's end either)."""
    samples = sample["waveform"].numpy().T
    clip = samples[int(6.7 * 16_000) : int((6.7 + seconds) * 16_000)]  # both speakers' first turns
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = remote_pipeline(server.target, timeout_s=TIMEOUT_S)(models.in_memory(clip, 16_000, "clip"))
    with DiarizationClient(server.target, timeout_s=TIMEOUT_S) as client:
        ours = client.diarize(clip, 16_000)
    expected = [(round(s.start, 3), round(s.end, 3), label)
                for s, _, label in theirs.speaker_diarization.itertracks(yield_label=True)]  # fmt: skip
    assert [(round(t.start_s, 3), round(t.end_s, 3), t.label) for t in ours.turns] == expected
    assert ours.windows == 1 and expected, expected


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
    assert scrape(server)["speakerd_requests_rejected_total{reason=unserved}"] >= 1


def test_a_recording_whose_clustering_exceeds_the_budget_is_invalid_argument(server) -> None:
    """Diarize reserves its clustering's memory (docs/service.md, C); a recording whose
    `header.frames` already make more windows than the server's whole --clustering-memory-mb
    can cluster is refused at the header, naming the field, with the numbers, before any
    window is segmented; the server goes on serving."""
    with DiarizationClient(server.target, timeout_s=TIMEOUT_S) as client:
        with pytest.raises(grpc.RpcError) as caught:
            client.diarize(np.zeros(OVER_BUDGET_S * 16_000, np.int16), 16_000)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value
        details = caught.value.details()
        assert [name for name, _ in field_violations(caught.value)] == ["header.recording.frames"], details
        assert "1280000 frames make 71 windows, whose clustering needs at least 1 MiB" in details, details
        assert "clustering budget (1 MiB, serve --clustering-memory-mb)" in details, details
        assert client.diarize(np.zeros(12 * 16_000, np.int16), 16_000).windows == 3


def _raw_diarize(server, header: Any, parts: list[Any], metadata=()) -> Any:
    """One Diarize call of these messages on a plain stub: what another client may send."""
    from speakerd.v1 import speakerd_pb2 as pb
    from speakerd.v1 import speakerd_pb2_grpc as pb_grpc

    with grpc.insecure_channel(server.target) as channel:
        messages = [pb.DiarizeRequest(header=header), *parts]
        return pb_grpc.DiarizationStub(channel).Diarize(iter(messages), timeout=TIMEOUT_S, metadata=metadata)


def _header(samples: np.ndarray, **recording: Any) -> Any:
    from speakerd.v1 import speakerd_pb2 as pb

    header = pb.DiarizeHeader()
    header.recording.sample_rate = 16_000
    header.recording.channels = 1
    header.recording.encoding = pb.AUDIO_ENCODING_PCM_S16LE
    header.recording.frames = samples.shape[0]
    for name, value in recording.items():
        setattr(header.recording, name, value)
    return header


def test_unusual_inputs_are_refused_naming_the_field_or_answered_right(server, sample) -> None:
    """A uri RTTM cannot carry is INVALID_ARGUMENT naming `uri` (a space, or a tab and a
    newline that would forge turns), at the header; a speaker id with a space is written into
    the RTTM as one field; the recording header's request_id is the call's id; the recording's
    own header errors name `header.recording.*`; a message of another method's part says
    what Diarize takes; and after it all no recording or clustering budget is held."""
    from speakerd.v1 import speakerd_pb2 as pb

    samples = sample["waveform"].numpy().T
    pcm = (samples[:, 0] * 32767).astype(np.int16)
    with DiarizationClient(server.target, timeout_s=TIMEOUT_S) as client:
        for uri in ("team meeting", "a\tb\nSPEAKER forged 1 0 1 <NA> <NA> x <NA> <NA>"):
            with pytest.raises(grpc.RpcError) as caught:
                client.diarize(samples, 16_000, uri=uri)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value
            assert [name for name, _ in field_violations(caught.value)] == ["uri"], caught.value.details()
    with VoiceprintClient(server.target, timeout_s=TIMEOUT_S) as voiceprints:
        voiceprints.enroll("Alice Smith", samples, 16_000, segment=True, replace=True)
    try:
        with DiarizationClient(server.target, timeout_s=TIMEOUT_S) as client:
            named = client.diarize(samples, 16_000, names=True, threshold=-1.0, uri="team_meeting")
        assert "Alice Smith" in {s.label for s in named.speakers}, named.speakers
        assert all(len(line.split()) == 10 for line in named.rttm.splitlines()), named.rttm
        assert " Alice_Smith " in named.rttm and named.rttm.startswith("SPEAKER team_meeting 1 "), named.rttm
    finally:
        with VoiceprintClient(server.target, timeout_s=TIMEOUT_S) as voiceprints:
            for record in voiceprints.list_voiceprints():
                if record.speaker_id == "Alice Smith":
                    voiceprints.delete_voiceprint(record.voiceprint_id)
    audio = pb.DiarizeRequest(audio=pcm[: 12 * 16_000].tobytes())
    answer = _raw_diarize(server, _header(pcm[: 12 * 16_000], request_id="my-request-7"), [audio])
    assert answer.request_id == "my-request-7" and answer.windows == 3, answer.request_id
    answer = _raw_diarize(server, _header(pcm[: 12 * 16_000], request_id="header-id"), [audio],
                          metadata=(("x-request-id", "metadata-id"),))  # fmt: skip
    assert answer.request_id == "metadata-id"  # x-request-id first, as EmbedRecording
    with pytest.raises(grpc.RpcError) as caught:
        _raw_diarize(server, _header(pcm, encoding=pb.AUDIO_ENCODING_UNSPECIFIED), [audio])
    assert [name for name, _ in field_violations(caught.value)] == ["header.recording.encoding"], caught.value
    assert caught.value.details().startswith("header.recording.encoding: "), caught.value.details()
    with pytest.raises(grpc.RpcError) as caught:
        _raw_diarize(server, _header(pcm), [pb.DiarizeRequest()])
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == "part: an empty message (or another method's part); set audio"
    held = scrape(server)
    assert held["speakerd_recording_bytes_held{}"] == 0 and held["speakerd_clustering_bytes_held{}"] == 0, {
        k: v for k, v in held.items() if "bytes_held" in k
    }


def test_a_diarize_cancelled_or_past_its_deadline_is_logged_and_leaves_nothing_pending(
    server, sample
) -> None:
    """A call whose deadline passes, and one whose client goes away mid-work, each end in one
    log line naming the call and its code; no task is left pending, no budget held."""
    from speakerd.client.diarize import diarize_requests
    from speakerd.v1 import speakerd_pb2 as pb
    from speakerd.v1 import speakerd_pb2_grpc as pb_grpc

    samples = sample["waveform"].numpy().T  # a few seconds of work on the CPU engine
    with (
        DiarizationClient(server.target, timeout_s=TIMEOUT_S, retry=NO_RETRY) as client,
        pytest.raises(grpc.RpcError) as caught,
    ):
        client.diarize(samples, 16_000, timeout_s=0.5)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    header = pb.DiarizeHeader()
    with grpc.insecure_channel(server.target) as channel:
        messages = diarize_requests(samples, 16_000, header, 1.0, False)
        call = pb_grpc.DiarizationStub(channel).Diarize.future(
            messages, timeout=TIMEOUT_S, metadata=(("x-request-id", "going-away"),)
        )
        wait_until(lambda: "segmentation" in server.log() and server.log().count("Diarize") >= 1,
                   "the call under way", server, timeout_s=30)  # fmt: skip
        time.sleep(1.0)
        call.cancel()
    wait_until(lambda: "Diarize going-away: CANCELLED after" in server.log(),
               "the cancelled Diarize's log line", server, timeout_s=30)  # fmt: skip
    log = server.log()
    assert any("Diarize " in line and "DEADLINE_EXCEEDED" in line for line in log.splitlines()), log[-2000:]
    assert "Task was destroyed but it is pending" not in log
    wait_until(lambda: scrape(server)["speakerd_recording_bytes_held{}"] == 0, "the recording budget free",
               server, timeout_s=30)  # fmt: skip


def test_cli_writes_pyannotes_rttm(server, sample, pyannote_outputs, tmp_path, capsys) -> None:
    rttm, audio = tmp_path / "sample.rttm", tmp_path / "sample.wav"
    soundfile.write(audio, sample["waveform"].numpy().T, 16_000, subtype="PCM_16")  # sample.wav's own samples
    code = cli_main(
        ["diarize", "--target", server.target, "--audio", str(audio), "--rttm", str(rttm), "--json"]
    )
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    expected = tmp_path / "expected.rttm"
    local = pyannote_outputs["free"].speaker_diarization
    local.uri = "sample"
    with expected.open("w") as handle:
        local.write_rttm(handle)
    assert rttm.read_text() == expected.read_text()
    assert [s["label"] for s in summary["speakers"]] == local.labels() and len(summary["turns"]) == len(local)
    assert [(t["start"], t["end"], t["speaker"]) for t in summary["turns"]] == [
        (round(segment.start, 3), round(segment.end, 3), label)
        for segment, _, label in local.itertracks(True)
    ]


def test_cli_shows_who_spoke_when_and_says_why_when_nobody_did(server, sample, tmp_path, capsys) -> None:
    """By default a table of turns (start, end, speaker), then a summary line; with --names the
    speaker's score beside each turn; for a second of silence one line saying what was found
    and why; on stderr, that the server's embedding model is the synthetic one."""
    audio = tmp_path / "team meeting.wav"  # the uri defaults to its stem, spaces made _
    soundfile.write(audio, sample["waveform"].numpy().T, 16_000, subtype="PCM_16")
    assert cli_main(["diarize", "--target", server.target, "--audio", str(audio), "--no-progress"]) == 0
    shown = capsys.readouterr()
    lines = shown.out.strip().splitlines()
    with DiarizationClient(server.target, timeout_s=TIMEOUT_S) as client:
        result = client.diarize(sample["waveform"].numpy().T, 16_000)
    assert lines[0].split() == ["start", "end", "speaker"], lines[0]
    assert [line.split() for line in lines[1:-1]] == [
        [f"{t.start_s:.3f}", f"{t.end_s:.3f}", t.label] for t in result.turns
    ]
    assert lines[-1].startswith(f"{len(result.speakers)} speakers (SPEAKER_00 "), lines[-1]
    seconds = sample["waveform"].shape[-1] / 16_000
    assert lines[-1].endswith(
        f", {len(result.turns)} turns, {result.windows} windows, {seconds:.1f} s of audio"
    )
    assert "the server's embedding model is synthetic" in shown.err, shown.err
    silence = tmp_path / "silence.wav"
    soundfile.write(silence, np.zeros(16_000, np.int16), 16_000)
    assert cli_main(["diarize", "--target", server.target, "--audio", str(silence)]) == 0
    assert capsys.readouterr().out.strip() == (
        "no speaker found in 1.0 s of audio (1 windows): the segmentation found no speech above its "
        "threshold (the recording is shorter than one 10 s window)"
    )
    samples = sample["waveform"].numpy().T
    with VoiceprintClient(server.target, timeout_s=TIMEOUT_S) as voiceprints:
        voiceprints.enroll("alice", samples, 16_000, segment=True, replace=True)
    argv = ["diarize", "--target", server.target, "--audio", str(audio), "--names", "--threshold", "-1"]
    assert cli_main(argv) == 0
    named = capsys.readouterr().out.strip().splitlines()
    assert named[0].split() == ["start", "end", "speaker", "score"], named[0]
    assert all(len(line.split()) == 4 and -1 <= float(line.split()[3]) <= 1 for line in named[1:-1]), named
    enroll = ["enroll", "--target", server.target, "--speaker-id", "alice", "--audio", str(audio),
              "--segment"]  # fmt: skip
    assert cli_main(enroll) == 1
    err = capsys.readouterr().err.strip()
    assert (
        err.startswith("speakerd-client enroll: speaker_id: already enrolled") and "add --replace" in err
    ), err


def test_progress_reaches_the_client_while_the_server_works(server, sample) -> None:
    seen = []
    with DiarizationClient(server.target, timeout_s=TIMEOUT_S) as client:
        result = client.diarize(sample["waveform"].numpy().T, 16_000, progress=seen.append)
    assert seen, "no progress at all"
    assert seen[-1].stage == "clustering" and seen[-1].windows_done == seen[-1].windows == result.windows, (
        seen
    )
    embedding = [p for p in seen if p.stage == "embedding"]
    assert all(0 < p.windows_done <= p.windows == result.windows for p in embedding), embedding
    assert [p.elapsed_s for p in seen] == sorted(p.elapsed_s for p in seen)
    # its errors are Diarize's: INVALID_ARGUMENT naming the field, after no progress at all
    seen.clear()
    with (
        DiarizationClient(server.target, timeout_s=TIMEOUT_S) as client,
        pytest.raises(grpc.RpcError) as caught,
    ):
        client.diarize(sample["waveform"].numpy().T, 16_000, uri="a b", progress=seen.append)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value
    assert [name for name, _ in field_violations(caught.value)] == ["uri"] and seen == [], caught.value


def test_bench_diarize_times_both_calls_and_the_clustering(server, sample, tmp_path, capsys) -> None:
    """speakerd.tools.bench_diarize (the harness's diarize suite) on a short tiling of the sample:
    one line per call kind and the clustering's steps, the saved arrays its last run's."""
    from speakerd.tools.bench_diarize import main as bench

    audio, saved = tmp_path / "speech.npy", tmp_path / "hour.npz"
    np.save(audio, sample["waveform"].numpy().T[: BENCH_AUDIO_SECONDS * 16_000])
    argv = ["--target", server.target, "--audio", str(audio), "--sample-rate", "16000",
            "--seconds", str(BENCH_SECONDS), "--runs", "1", "--save", str(saved)]  # fmt: skip
    assert bench(argv) == 0
    lines = {row["kind"]: row for row in map(json.loads, capsys.readouterr().out.splitlines())}
    windows = BENCH_SECONDS - 9
    assert lines["segment"]["windows"] == lines["diarize"]["windows"] == windows, lines
    assert lines["diarize"]["speakers"] >= 1 and lines["diarize"]["turns"] >= 1, lines
    steps = lines["clustering"]
    assert steps["windows"] == windows and 0 < steps["clean_pairs"] <= steps["pairs"] == 3 * windows, steps
    # each Diarize ends with the server's line of where its time went; the suite's split of it
    split = server_split(server.log(), windows, "agglomerative", 1)
    assert split is not None, f"no Diarize line of {windows} windows in the server's log"
    assert 0 < split["embeddings"] <= split["total"] and split["clustering"] <= split["total"], split
    assert 0 <= split["linkage"] <= split["clustering"] and 0 <= split["reply"] <= split["total"], split
    assert server_split(server.log(), windows, "agglomerative", 99) is None
    assert steps["speakers"] == lines["diarize"]["speakers"], steps
    with np.load(saved) as arrays:
        assert arrays["segmentation"].shape == (windows, 589, 3) and arrays["embeddings"].shape == (
            windows,
            3,
            256,
        )

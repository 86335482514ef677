"""EmbedRecording with `header.segment`: the server segments the recording and embeds under it.

A real `python -m speakerd serve` on loopback (CPU engine, the synthetic default models).
The contract: the segmentation answered is the served segmentation model's own (the NumPy
forward on the windows pyannote's `Inference` cuts, hard multilabel); the rows are exactly
those EmbedRecording gives when the client sends that segmentation as masks (exclude_overlap
on and off); masks beside `segment` are INVALID_ARGUMENT; GetModelInfo names the model; the
voiceprint methods take the speech the segmentation finds; a call without `segment` runs no
segmentation at all.
"""

from __future__ import annotations

import json

import grpc
import numpy as np
import pytest

from speakerd.client.cli import main as cli_main
from speakerd.client.client import SpeakerClient
from speakerd.client.voiceprints import VoiceprintClient
from speakerd.model.architecture import CHUNK_SAMPLES
from speakerd.model.audio import synthetic_recording
from speakerd.model.fbank import chunk_recording
from speakerd.model.segmentation.architecture import CLASSES, OUTPUT_FRAMES, SPEAKERS
from speakerd.model.segmentation.forward import log_probs
from speakerd.model.segmentation.powerset import to_multilabel
from speakerd.model.segmentation.weights import load_model
from speakerd.model.weights import file_sha256
from speakerd.v1 import speakerd_pb2 as pb
from speakerd.v1 import speakerd_pb2_grpc as pb_grpc
from tests.serving import scrape, serve_module
from tests.test_bad_inputs import field_violations

pytestmark = pytest.mark.slow  # a CPU server segmenting and embedding: seconds of 2 cores a test

#: b2 keeps a CPU batch near 0.5 s, so the 3 windows of `speech` span two batches (2, 1).
PLANS = "1,2"
TIMEOUT_S = 600.0
SEGMENTED = "speakerd_windows_segmented_total{}"
#: Log-probability margin under which two powerset classes tie to float32 rounding: the two
#: forwards (the server's, over a group's samples at once; the reference, window by window)
#: may pick either there, and nowhere else.
TIE_MARGIN = 1e-4


@pytest.fixture(scope="module")
def server(weights_path, segmentation_path):
    yield from serve_module(weights_path, "--plans", PLANS, "--segmentation-model", str(segmentation_path))


@pytest.fixture(scope="module")
def client(server):
    with SpeakerClient(server.target, timeout_s=TIMEOUT_S) as speaker_client:
        yield speaker_client


@pytest.fixture(scope="module")
def speech():
    """11.5 s of 3-speaker speech-like audio: 3 windows, the last one zero-padded."""
    return synthetic_recording(11.5, seed=23)


@pytest.fixture(scope="module")
def segmented(client, speech):
    """exclude_overlap -> the server's segmentation call on `speech`."""
    return {
        flag: client.embed_recording(speech.samples, 16_000, None, exclude_overlap=flag)
        for flag in (False, True)
    }


def test_segmentation_is_the_served_models(segmented, speech, segmentation_path) -> None:
    weights = load_model(segmentation_path)
    chunks = chunk_recording(speech.samples)
    reference = log_probs(weights, chunks.waveforms)
    expected = to_multilabel(reference)
    top2 = np.sort(reference, axis=-1)[..., -2:]
    tied = (top2[..., 1] - top2[..., 0]) < TIE_MARGIN
    for flag, result in segmented.items():
        assert result.segmentation is not None
        assert result.segmentation.shape == (len(chunks), OUTPUT_FRAMES, SPEAKERS), result.segmentation.shape
        assert result.segmentation.dtype == np.uint8
        differ = np.any(result.segmentation != expected, axis=-1)
        print(
            f"\nexclude_overlap={flag}: {int(differ.sum())} of {differ.size} frames differ, "
            f"{int(tied.sum())} tied"
        )
        assert not np.any(differ & ~tied), np.argwhere(differ & ~tied)[:5]
        assert result.segmentation_model_id == weights.model_id
        assert len(np.unique(result.segmentation.reshape(-1, SPEAKERS), axis=0)) > 1, "one class everywhere"


@pytest.mark.parametrize("exclude_overlap", [False, True])
def test_rows_are_those_of_the_segmentation_sent_as_masks(client, speech, segmented, exclude_overlap) -> None:
    served = segmented[exclude_overlap]
    masks = np.ascontiguousarray(np.transpose(served.segmentation, (0, 2, 1)))
    sent = client.embed_recording(speech.samples, 16_000, masks, exclude_overlap=exclude_overlap)
    np.testing.assert_array_equal(served.embeddings, sent.embeddings)
    np.testing.assert_array_equal(served.empty, sent.empty)
    np.testing.assert_array_equal(served.active_frames, sent.active_frames)
    np.testing.assert_array_equal(served.starts, sent.starts)
    assert sent.segmentation is None and sent.segmentation_model_id == ""


def test_masks_beside_segment_are_invalid_argument(server, speech) -> None:
    pcm = np.round(speech.samples * 32767).astype("<i2")
    header = pb.RecordingHeader(
        sample_rate=16_000, channels=1, encoding=pb.AUDIO_ENCODING_PCM_S16LE, segment=True
    )
    windows = len(chunk_recording(speech.samples))
    masks = pb.RecordingMasks(
        windows=windows,
        masks=pb.Tensor(dtype=pb.DTYPE_UINT8, shape=[windows, 3, 589], data=bytes(windows * 3 * 589)),
    )
    messages = [
        pb.EmbedRecordingRequest(header=header),
        pb.EmbedRecordingRequest(audio=pcm.tobytes()),
        pb.EmbedRecordingRequest(masks=masks),
    ]
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.SpeakerEmbeddingStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.EmbedRecording(iter(messages), timeout=TIMEOUT_S))
    error = caught.value
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert "header.segment" in error.details(), error.details()
    assert [field for field, _ in field_violations(error)] == ["masks"], field_violations(error)


def test_model_info_names_the_segmentation_model(client, segmentation_path) -> None:
    info = client.model_info().segmentation
    assert info.model_id == file_sha256(segmentation_path)
    assert (info.engine, info.frames, info.speakers, info.classes) == (
        "cpu-numpy",
        OUTPUT_FRAMES,
        SPEAKERS,
        CLASSES,
    )


def test_a_call_without_segment_segments_nothing(server, client, speech, segmented) -> None:
    """Counted on the first window alone (10 s): the count, not the recording, is the point."""
    first_window = speech.samples[:CHUNK_SAMPLES]
    before = scrape(server)[SEGMENTED]
    masks = np.transpose(segmented[False].segmentation[:1], (0, 2, 1))
    client.embed_recording(first_window, 16_000, masks)
    assert scrape(server)[SEGMENTED] == before
    client.embed_recording(first_window, 16_000, None)
    assert scrape(server)[SEGMENTED] == before + 1


def test_cli_embed_segment_writes_the_segmentation(server, speech, segmented, tmp_path, capsys) -> None:
    import soundfile

    audio, output = tmp_path / "speech.wav", tmp_path / "out.npz"
    soundfile.write(audio, speech.samples, 16_000, subtype="FLOAT")
    assert (
        cli_main(
            ["embed", "--target", server.target, "--audio", str(audio), "--segment", "--output", str(output)]
        )
        == 0
    )
    summary = json.loads(capsys.readouterr().out)
    saved = np.load(output)
    np.testing.assert_array_equal(saved["segmentation"], segmented[False].segmentation)
    np.testing.assert_array_equal(saved["embeddings"], segmented[False].embeddings)
    assert summary["segmentation_model_id"] == segmented[False].segmentation_model_id


def test_voiceprints_take_the_speech_the_server_finds(server, speech) -> None:
    with VoiceprintClient(server.target, timeout_s=TIMEOUT_S) as voiceprints:
        enrolled = voiceprints.enroll("found-speech", speech.samples, 16_000, segment=True)
        assert enrolled.voiceprint.windows >= 1 and enrolled.voiceprint.speech_s > 0, enrolled
        found = voiceprints.identify(samples=speech.samples, sample_rate=16_000, segment=True)
        assert [row.speaker_id for row in found.rows] == ["found-speech"], found
        assert found.rows[0].matches[0].score > 0.999, found
        with pytest.raises(ValueError, match="give no masks or segments"):
            voiceprints.identify(samples=speech.samples, sample_rate=16_000, segments=[(0, 3)], segment=True)


def test_segments_beside_segment_are_invalid_argument(server, speech) -> None:
    pcm = np.round(speech.samples * 32767).astype("<i2")
    recording = pb.RecordingHeader(
        sample_rate=16_000, channels=1, encoding=pb.AUDIO_ENCODING_PCM_S16LE, segment=True
    )
    speech_header = pb.SpeechHeader(recording=recording, segments=[pb.SpeechSegment(start_s=0, end_s=3)])
    messages = [
        pb.IdentifyRequest(header=pb.IdentifyHeader(speech=speech_header)),
        pb.IdentifyRequest(audio=pcm.tobytes()),
    ]
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.VoiceprintsStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            stub.Identify(iter(messages), timeout=TIMEOUT_S)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value
    assert [field for field, _ in field_violations(caught.value)] == ["speech.segments"]

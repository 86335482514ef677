"""EmbedRecording end to end: a real `python -m speakerd serve` on loopback, CPU engine.

The contract: a recording's rows equal EmbedChunks on the windows pyannote's pipeline would
cut from it (resampled, downmixed, exclude_overlap applied), in window order with their
start times; every bad input is INVALID_ARGUMENT naming its field; a client that cancels
mid-recording costs no further engine work. Every test runs twice: against a server that
receives its calls itself, and against one with `--receivers 2` (which forwards these
streams to the server: the same rows, errors and cancellations must come through).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import wave

import grpc
import numpy as np
import pytest

from speakerd.client import load_sizing
from speakerd.client.cli import main as cli_main
from speakerd.client.client import AsyncSpeakerClient, SpeakerClient
from speakerd.client.recording import PIECE_BYTES, collect, recording_requests
from speakerd.model.audio import speaker_masks, synthetic_recording
from speakerd.model.fbank import chunk_recording, fbank
from speakerd.model.numerics import BOUNDS, Math, compare
from speakerd.model.recording import exclude_overlap
from speakerd.model.resample import resample
from speakerd.serving.api.recording import BATCHES_IN_FLIGHT
from speakerd.v1 import speakerd_pb2 as pb
from speakerd.v1 import speakerd_pb2_grpc as pb_grpc
from speakerd.v1.tensors import to_tensor
from tests.serving import scrape, start_server
from tests.test_bad_inputs import field_violations

pytestmark = pytest.mark.slow  # a CPU server doing seconds of engine work per test

#: b2 keeps a CPU batch near 0.5 s, so the 3 windows of `speech` span two batches (2, then the
#: padded last one alone) and a cancelled call has little engine work in flight; the cost of a
#: test is its windows.
PLANS = "1,2"
MAX_BATCH = 2
TIMEOUT_S = 600.0
EMBEDDED = "speakerd_chunks_embedded_total{}"
CANCELLED = "speakerd_requests_rejected_total{reason=cancelled}"
#: A cancelled call's handler ends within milliseconds; a loaded 2-core CI machine gets slack.
CANCEL_SEEN_S = 10.0
#: The receive window of the cancelled call's channel (`grpc.http2.lookahead_bytes`, with
#: BDP probing off so that gRPC does not grow it): under two of its 2.2 KB answers (b2, one
#: speaker), where the default 64 KB, which BDP probing grows, holds 30 and more. So the
#: writer blocks a few batches after the client stops reading, not a minute of engine work
#: later (measured in process: 4 windows sent, then no more).
CANCELLED_CALL_WINDOW_BYTES = 4096
#: Windows the engine computes beyond those the client has read, by which whoever writes the
#: answers (the server, or with `--receivers` the receiver forwarding them) is blocked writing
#: one: an answer in the receive window, the one being written, and a batch more, so that the
#: write has had a batch's time to block.
WRITE_BLOCKED_WINDOWS = 3 * MAX_BATCH
#: How long reaching that may take: 8 windows are 2-4 s on 2 cores; a loaded CI machine gets slack.
WORK_SEEN_S = 120.0
#: Batches of a call that may still run once its answers stop: the one being answered,
#: BATCHES_IN_FLIGHT queued behind it, and one the submitter made and waits to queue.
IN_FLIGHT_AFTER_ANSWERS = BATCHES_IN_FLIGHT + 2
#: The recording the three clients send: 2 windows (their rows in order, the last padded),
#: each sent three times, so a window fewer than `speech` is three chunks less per server.
CLIENTS_S = 10.5
#: Poll /metrics at a pace a monitor might: scraping it 20 times a second on 2 cores starves
#: the server's event loop of the GIL (the cancellation then waited for the scrapes to stop).
SCRAPE_EVERY_S = 0.5


@pytest.fixture(scope="module", params=[0, 2], ids=["in-process", "2-receivers"])
def server(request, weights_path):
    """The server receiving its calls itself, then with two receiver processes forwarding
    the EmbedRecording streams (and their cancellations) to it."""
    receivers = ["--receivers", str(request.param)] if request.param else []
    running = start_server(weights_path, "--plans", PLANS, *receivers)
    yield running
    assert running.terminate() == 0, running.log()


@pytest.fixture(scope="module")
def client(server):
    with SpeakerClient(server.target, timeout_s=TIMEOUT_S) as speaker_client:
        yield speaker_client


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.target) as channel:
        yield pb_grpc.SpeakerEmbeddingStub(channel)


@pytest.fixture(scope="module")
def speech():
    """11.5 s of 3-speaker speech-like audio with overlap in every window: 3 windows (two
    batches), the last one zero-padded; the first speaker is silent in windows 0 and 1 and
    speaks in window 2, so some of its rows are empty and one is not."""
    return synthetic_recording(11.5, seed=53)


@pytest.fixture(scope="module")
def via_embed_chunks() -> dict[str, object]:
    """The EmbedChunks rows of each case, computed by the first server variant that asks and
    reused by the other: the same windows and masks through the same model's EmbedChunks."""
    return {}


def _windows_via_embed_chunks(
    client: SpeakerClient, samples16k: np.ndarray, masks: np.ndarray, cache: dict[str, object], case: str
):
    """What the pipeline computes: per-window fbank (speakerd.model.fbank) over EmbedChunks."""
    if case not in cache:
        chunks = chunk_recording(samples16k)
        cache[case] = client.embed(fbank(chunks.waveforms), masks)
    return cache[case]


def _check_equal(result, expected, windows: int, speakers: int) -> None:
    assert result.embeddings.shape == (windows, speakers, 256), result.embeddings.shape
    parity = compare(result.embeddings, expected.embeddings)
    print(
        f"\nEmbedRecording vs EmbedChunks: min cosine {parity.min_cosine:.7f}, max abs {parity.max_abs:.2e}"
    )
    assert parity.min_cosine >= BOUNDS[Math.FP32].min_cosine, parity
    assert expected.empty.any() and not expected.empty.all(), "the case needs empty rows and others"
    np.testing.assert_array_equal(result.empty, expected.empty)
    np.testing.assert_array_equal(result.active_frames, expected.active_frames)
    np.testing.assert_allclose(result.starts, np.arange(windows, dtype=np.float64))


def test_equals_embed_chunks_at_16k_with_exclude_overlap(
    client: SpeakerClient, speech, via_embed_chunks
) -> None:
    chunks = chunk_recording(speech.samples)
    masks = speaker_masks(speech, chunks.starts)
    result = client.embed_recording(speech.samples, 16_000, masks, exclude_overlap=True)
    expected = _windows_via_embed_chunks(
        client, speech.samples, exclude_overlap(masks), via_embed_chunks, "16k exclude_overlap"
    )
    _check_equal(result, expected, len(chunks), 3)
    assert result.precision == "fp32" and result.model_id == expected.model_id


def test_equals_embed_chunks_for_stereo_s16_at_22k(client: SpeakerClient, speech, via_embed_chunks) -> None:
    """22.05 kHz stereo int16: the server downmixes and resamples; the expected windows are
    cut from the same decode -> downmix -> resample (speakerd.model, tested on its own)."""
    rate = 22_050
    left = resample(speech.samples, 16_000, rate)
    stereo = np.stack([left, 0.5 * left[::-1]], axis=1)
    pcm = np.round(np.clip(stereo, -1, 1) * 32767).astype(np.int16)
    mono16k = resample(
        (pcm.astype(np.float32) / 32768).mean(axis=1, dtype=np.float64).astype(np.float32), rate, 16_000
    )
    chunks = chunk_recording(mono16k)
    masks = speaker_masks(speech, chunks.starts)[:, :2]
    result = client.embed_recording(pcm, rate, masks)
    expected = _windows_via_embed_chunks(client, mono16k, masks, via_embed_chunks, "22k stereo s16")
    _check_equal(result, expected, len(chunks), 2)


def _orders(samples: np.ndarray, masks: np.ndarray) -> dict[str, list[pb.EmbedRecordingRequest]]:
    """One recording's messages in three orders: the client's (masks first), all audio then
    the masks, and 1 s of audio after each window's masks (interleaved, no header.frames)."""
    messages = list(recording_requests(samples, 16_000, masks, piece_bytes=64_000))
    header = [m for m in messages if m.WhichOneof("part") == "header"]
    audio = [m for m in messages if m.WhichOneof("part") == "audio"]
    rows = [m for m in messages if m.WhichOneof("part") == "masks"]
    plain = pb.EmbedRecordingRequest()
    plain.CopyFrom(header[0])
    plain.header.frames = 0
    windows, interleaved = masks.shape[0], [plain]
    pcm = samples.astype("<f4")
    for k in range(windows):
        row = pb.RecordingMasks(windows=windows, masks=to_tensor(masks[k : k + 1]))
        interleaved.append(pb.EmbedRecordingRequest(masks=row))
        interleaved.append(_audio(pcm[k * 16_000 : (k + 1) * 16_000]))
    interleaved.append(_audio(pcm[windows * 16_000 :]))
    return {"masks first": messages, "audio first": header + audio + rows, "interleaved": interleaved}


def test_any_order_of_audio_and_masks_gives_the_same_rows(stub, speech) -> None:
    """Masks before, after or between the audio pieces: the same windows, the same rows."""
    masks = speaker_masks(speech, chunk_recording(speech.samples).starts)
    results = {
        order: collect(stub.EmbedRecording(iter(messages), timeout=TIMEOUT_S))
        for order, messages in _orders(speech.samples, masks).items()
    }
    reference = results.pop("masks first")
    for order, result in results.items():
        parity = compare(result.embeddings, reference.embeddings)
        print(f"\n{order} vs masks first: min cosine {parity.min_cosine:.9f}, max abs {parity.max_abs:.2e}")
        assert parity.min_cosine >= BOUNDS[Math.FP32].min_cosine, (order, parity)
        np.testing.assert_array_equal(result.empty, reference.empty)
        np.testing.assert_array_equal(result.starts, reference.starts)


def _header(**fields) -> pb.EmbedRecordingRequest:
    values = {"sample_rate": 16_000, "channels": 1, "encoding": pb.AUDIO_ENCODING_PCM_F32LE, **fields}
    return pb.EmbedRecordingRequest(header=pb.RecordingHeader(**values))


def _audio(values: list[float] | np.ndarray, dtype: str = "<f4") -> pb.EmbedRecordingRequest:
    return pb.EmbedRecordingRequest(audio=np.asarray(values, dtype=dtype).tobytes())


def _masks(shape: tuple[int, ...], windows: int = 1) -> pb.EmbedRecordingRequest:
    tensor = pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=list(shape), data=np.ones(shape, "<f4").tobytes())
    return pb.EmbedRecordingRequest(masks=pb.RecordingMasks(windows=windows, masks=tensor))


SECOND = np.full(16_000, 0.1)  # 1 s of audio: one padded window
BAD_CALLS = {
    "rate 0": ([_header(sample_rate=0)], r"header\.sample_rate: 0 Hz, expected 1\.\.192000"),
    "rate negative": ([_header(sample_rate=-8000)], r"header\.sample_rate: -8000 Hz"),
    "rate above 192k": ([_header(sample_rate=192_001)], r"header\.sample_rate: 192001 Hz"),
    "channels 0": ([_header(channels=0)], r"header\.channels: 0, expected 1\.\.8"),
    "channels 9": ([_header(channels=9)], r"header\.channels: 9, expected 1\.\.8"),
    "no encoding": ([_header(encoding=0)], r"header\.encoding: AUDIO_ENCODING_UNSPECIFIED"),
    "window 5 s": ([_header(window_s=5.0)], r"header\.window_s: 5\.0 s, expected 10"),
    "step 12.3 ms": ([_header(step_s=0.0123)], r"header\.step_s: 0\.0123 s"),
    "two headers": ([_header(), _header()], r"header: sent twice"),
    "partial frame": (
        [
            _header(channels=2, encoding=pb.AUDIO_ENCODING_PCM_S16LE),
            _audio([1, 2, 3], "<i2"),
            _masks((1, 1, 589)),
        ],
        r"audio: 6 bytes is not a whole number of 2-channel s16 frames \(4 bytes each\)",
    ),
    "f32 NaN": ([_header(), _audio([0.1, np.nan])], r"audio: frame 1 holds NaN or Inf"),
    "f32 Inf": ([_header(), _audio([np.inf])], r"audio: frame 0 holds NaN or Inf"),
    "f32 beyond 1": ([_header(), _audio([0.1, -1.25])], r"audio: \|sample\| = 1\.25"),
    "no audio": ([_header(), _masks((1, 1, 589))], r"audio: no samples; a recording needs at least one"),
    "window count": (
        [_header(), _audio(SECOND), _masks((2, 1, 589), windows=2)],
        r"masks\.windows: 2, but the 1\.000 s of audio received make 1 10 s windows every 1 s",
    ),
    "audio beyond the declared windows": (
        [_header(), _masks((1, 1, 589)), _audio(np.full(12 * 16_000, 0.1))],
        r"masks\.windows: 1, but the 12\.000 s of audio received so far already make 3 10 s windows",
    ),
    "windows against header.frames": (
        [_header(frames=16_000), _masks((1, 1, 589), windows=2)],
        r"masks\.windows: 2, but header\.frames = 16000 make 1 10 s windows every 1 s",
    ),
    "windows changed": (
        [_header(), _masks((1, 1, 589), windows=3), _masks((1, 1, 589), windows=2)],
        r"masks\.windows: 2, but the first masks message said 3",
    ),
    "windows beyond the limit": (
        [_header(), _masks((1, 1, 589), windows=10**9)],
        r"masks\.windows: 1000000000, expected 1\.\.10791 ",
    ),
    "frames negative": ([_header(frames=-1)], r"header\.frames: -1, expected the PCM frames to send or 0"),
    "audio beyond header.frames": (
        [_header(frames=8_000), _audio(SECOND)],
        r"audio: more than the 8000 frames header\.frames announced",
    ),
    "audio short of header.frames": (
        [_header(frames=32_000), _masks((1, 1, 589)), _audio(SECOND)],
        r"audio: the call ended after 16000 frames, header\.frames announced 32000",
    ),
    "too many rows": (
        [_header(), _audio(SECOND), _masks((2, 1, 589))],
        r"masks\.masks: shape \[2, 1, 589\], expected \[k, s, F\] with 1 <= k <= 1",
    ),
    "four speakers": ([_header(), _audio(SECOND), _masks((1, 4, 589))], r"masks\.masks: shape \(1, 4, 589\)"),
    "zero frames": (
        [_header(), _audio(SECOND), _masks((1, 1, 0))],
        r"masks\.masks: 0 frames, expected 1\.\.",
    ),
    "ends before masks": (
        [_header(), _audio(SECOND)],
        r"masks: the call ended after 0 mask rows, expected 1",
    ),
    "ends before header": ([], r"header: the call ended before its header"),
    "audio before header": ([_audio(SECOND)], r"header: the first message must be the header, got audio"),
    "request id with a newline": ([_header(request_id="a\nb")], r"header\.request_id: control or separator"),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_bad_input_is_invalid_argument_naming_the_field(stub, case: str) -> None:
    messages, message = BAD_CALLS[case]
    with pytest.raises(grpc.RpcError) as raised:
        list(stub.EmbedRecording(iter(messages), timeout=60))
    error = raised.value
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (case, error.code(), error.details())
    assert re.search(message, error.details()), (case, error.details())
    field = message.split(":")[0].replace("\\", "")
    assert [f for f, _ in field_violations(error)] == [field], (case, field_violations(error))


def _settled(server, timeout_s: float = 120.0) -> dict[str, float]:
    """Metrics once the engine has stopped: two scrapes 2 s apart with the same chunk count."""
    deadline, previous = time.monotonic() + timeout_s, scrape(server)
    while time.monotonic() < deadline:
        time.sleep(2.0)
        current = scrape(server)
        if current.get(EMBEDDED) == previous.get(EMBEDDED):
            return current
        previous = current
    raise AssertionError(f"the engine kept running for {timeout_s} s")


def _windows_sent_before_cancel(server, timeout_s: float = 10.0) -> int:
    """N of the server's last "EmbedRecording <id>: cancelled after N windows sent" line."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:  # the log pump may lag behind the metric
        found = re.findall(r"EmbedRecording \S+: cancelled after (\d+) windows sent", server.log())
        if found:
            return int(found[-1])
        time.sleep(0.1)
    raise AssertionError(f"no cancellation logged in {timeout_s} s:\n{server.log()[-2000:]}")


def _wait_for_embedded(server, chunks: float, timeout_s: float = WORK_SEEN_S) -> None:
    """Return once the server's engine has embedded `chunks` chunks since it started."""
    deadline = time.monotonic() + timeout_s
    while (embedded := scrape(server).get(EMBEDDED, 0.0)) < chunks:
        assert time.monotonic() < deadline, f"{embedded:.0f} of {chunks:.0f} chunks embedded in {timeout_s} s"
        time.sleep(SCRAPE_EVERY_S)


@pytest.mark.parametrize("unread", [0, WRITE_BLOCKED_WINDOWS], ids=("awaiting-a-batch", "writing-a-response"))
def test_cancel_mid_recording_costs_no_further_engine_work(server, unread: int) -> None:
    """A minute (51 windows, more than twice the bound below); cancel after the first batch
    of rows: the server sees the cancellation at once, counts it, and the engine runs at most
    the batches already submitted (IN_FLIGHT_AFTER_ANSWERS beyond the windows the server had
    sent). Cancelled at once, the handler is awaiting a batch (asyncio cancels it); once the
    engine has computed `unread` windows beyond those the client took, the answers fill the
    call's receive window and the handler is blocked writing a response the client does not
    take (where gRPC may close the generator instead of cancelling it: both ways must count
    the cancellation and stop the call's batches). The call has a channel of its own, as a
    client that goes away does, with a small receive window (CANCELLED_CALL_WINDOW_BYTES)."""
    samples = (np.random.default_rng(7).standard_normal(60 * 16_000) * 0.1).astype(np.float32)
    windows = len(chunk_recording(samples))
    masks = np.ones((windows, 1, 589), dtype=np.float32)
    before = _settled(server)
    small_window = [("grpc.http2.lookahead_bytes", CANCELLED_CALL_WINDOW_BYTES), ("grpc.http2.bdp_probe", 0)]
    with grpc.insecure_channel(server.target, options=small_window) as channel:
        stub = pb_grpc.SpeakerEmbeddingStub(channel)
        call = stub.EmbedRecording(recording_requests(samples, 16_000, masks), timeout=TIMEOUT_S)
        received = len(next(call).starts)
        _wait_for_embedded(server, before.get(EMBEDDED, 0.0) + received + unread)
        call.cancel()
        cancelled_at = time.monotonic()
        while scrape(server).get(CANCELLED, 0.0) == before.get(CANCELLED, 0.0):
            waited = time.monotonic() - cancelled_at
            assert waited < CANCEL_SEEN_S, f"no cancellation seen in {waited:.1f} s"
            time.sleep(SCRAPE_EVERY_S)
        seen_s = time.monotonic() - cancelled_at
    after = _settled(server)
    embedded = after[EMBEDDED] - before[EMBEDDED]
    sent = _windows_sent_before_cancel(server)  # >= received: answers may wait unread
    bound = sent + IN_FLIGHT_AFTER_ANSWERS * MAX_BATCH
    print(f"\n{windows} windows, cancelled {unread} computed windows after {received} received, {sent} sent "
          f"(seen in {seen_s:.2f} s): {embedded:.0f} embedded (bound {bound})")  # fmt: skip
    assert embedded <= bound < windows, (embedded, bound, windows)
    assert after.get(CANCELLED, 0.0) - before.get(CANCELLED, 0.0) == 1.0, after.get(CANCELLED)


def test_async_client_and_cli_give_the_same_rows(server, client: SpeakerClient, speech, tmp_path) -> None:
    """AsyncSpeakerClient.embed_recording and `client embed --audio WAV --masks NPY` (16-bit
    stereo WAV at 44.1 kHz) agree with the blocking client on the same recording (the first
    CLIENTS_S of `speech`: 2 windows, the last zero-padded)."""
    rate = 44_100
    samples = speech.samples[: int(CLIENTS_S * 16_000)]
    pcm = np.round(np.stack([resample(samples, 16_000, rate)] * 2, axis=1) * 32767).astype(np.int16)
    windows = len(chunk_recording(resample(pcm[:, 0].astype(np.float32) / 32768, rate, 16_000)))
    masks = np.ones((windows, 1, 589), dtype=np.float32)
    blocking = client.embed_recording(pcm, rate, masks)

    async def embed_async():
        async with AsyncSpeakerClient(server.target, timeout_s=TIMEOUT_S) as aio:
            return await aio.embed_recording(pcm, rate, masks)

    via_async = asyncio.run(embed_async())
    np.testing.assert_array_equal(via_async.embeddings, blocking.embeddings)
    wav, masks_path, out = tmp_path / "rec.wav", tmp_path / "masks.npy", tmp_path / "out.npz"
    with wave.open(str(wav), "wb") as writer:
        writer.setnchannels(2)
        writer.setsampwidth(2)
        writer.setframerate(rate)
        writer.writeframes(pcm.astype("<i2").tobytes())
    np.save(masks_path, masks)
    argv = [
        "embed",
        "--target",
        server.target,
        "--audio",
        str(wav),
        "--masks",
        str(masks_path),
        "--output",
        str(out),
    ]
    assert cli_main(argv) == 0
    with np.load(out) as saved:
        np.testing.assert_array_equal(saved["embeddings"], blocking.embeddings)
        np.testing.assert_array_equal(saved["starts"], blocking.starts)


#: What `unsized_load` has the load's probe say: a chunk in a millisecond, so that sizing
#: lengthens neither the 0.5 s counted window nor the warm-up of 0 s.
QUICK_PROBE_S = 1e-3


@pytest.fixture
def unsized_load(monkeypatch) -> None:
    """`client load` runs the window asked for, one recording, instead of sizing itself for
    the CPU server: its probe (GetModelInfo and a timed EmbedChunks, load_sizing.py) would
    lengthen 0.5 s to three recordings and a warm-up one, 4-5x the engine work, for the same
    report fields. The probe and that lengthening, recording mode included, are
    test_load_sizing's, against a real server (test_a_recording_load_gets_a_deadline_it_can_meet)."""
    quick = load_sizing.Probe(engine="cpu-onnxruntime", max_batch=MAX_BATCH, seconds=QUICK_PROBE_S)
    monkeypatch.setattr(load_sizing, "probe", lambda args: quick)


@pytest.mark.parametrize(
    "order", [[], ["--masks-after-audio", "--piece-kib", "64"]], ids=("masks-first", "masks-after-audio")
)
def test_load_generator_recording_mode(server, capsys, unsized_load, order: list[str]) -> None:
    """`client load --recording 11`: 11 s make 2 windows; the JSON counts them per second."""
    argv = ["load", "--target", server.target, "--recording", "11", "--seconds", "0.5", "--warmup", "0",
            "--streams", "1", "--timeout", "300", *order]  # fmt: skip
    assert cli_main(argv) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["ok"] and report["failed_calls"] == 0, report
    assert report["masks"] == ("after the audio" if order else "first"), report
    assert report["piece_kib"] == (64 if order else PIECE_BYTES >> 10), report
    assert report["windows_per_recording"] == 2 and report["recordings_ok"] >= 1, report
    assert report["windows_per_s"] > 0, report
    # the audio travels once: binary masks go as uint8, so the call sends at most 1.1x the PCM
    assert report["pcm_bytes"] == 11 * 16_000 * 2, report
    assert report["bytes_sent_over_pcm"] <= 1.1, report


def test_load_generator_recording_mode_at_another_rate(server, capsys, unsized_load) -> None:
    """`client load --recording 10.3 --sample-rate 44100 --channels 2`: the masks match the
    server's window count of the resampled audio (2 windows, the last padded)."""
    argv = ["load", "--target", server.target, "--recording", "10.3", "--sample-rate", "44100",
            "--channels", "2", "--seconds", "0.5", "--warmup", "0", "--streams", "1",
            "--timeout", "300"]  # fmt: skip
    assert cli_main(argv) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["ok"] and report["failed_calls"] == 0, report
    assert report["windows_per_recording"] == 2 and report["sample_rate"] == 44_100, report
    assert report["pcm_bytes"] == int(10.3 * 44_100) * 2 * 2, report

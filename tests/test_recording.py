"""speakerd.model.recording / resample: a recording prepared as a pyannote.audio 4.0.7 pipeline does.

Resampling is checked against torchaudio where it imports (CI's, see .ci/run; the GPU machine's) and
everywhere against an independent float64 evaluation of the windowed-sinc formula written
here in Hz (not in torchaudio's reduced-rate polyphase form); windows against the numbers
`Inference.slide` gives; shared-frame fbank against the per-window fbank and
kaldi-native-fbank; `exclude_overlap` on masks drawn by hand.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import speakerd.model.recording as recording_module
from speakerd.model.architecture import CHUNK_SAMPLES, FRAMES, MASK_FRAMES, MEL_BINS, SAMPLE_RATE
from speakerd.model.audio import synthetic_recording
from speakerd.model.fbank import _log_mel, chunk_recording, chunk_starts, fbank
from speakerd.model.inputs import InputError
from speakerd.model.recording import (
    Encoding,
    RecordingDecoder,
    SharedFrames,
    check_format,
    decode_pcm,
    downmix,
    exclude_overlap,
    min_num_frames,
    step_samples,
    window_count,
)
from speakerd.model.resample import StreamingResampler, output_length, resample
from tests.test_fbank import INT16_SCALE, KNF_BOUND, NULL_BOUND, RESOLVED_RANGE, knf_fbank

#: Rates pyannote users feed most (telephone, half-CD, CD, video).
RATES = (8_000, 22_050, 44_100, 48_000)
#: float32 filters and sums against float64: ~40-480 terms of |x| <= 1 (measured <= 1.7e-7).
RESAMPLE_F64_BOUND = 2e-5
#: torchaudio computes its filters in float32 too: the two float32 pipelines differ by rounding.
RESAMPLE_TORCHAUDIO_BOUND = 2e-5
#: Shared frames vs per-window fbank: both round float64 log-mel to float32 once, at
#: different points (frames vs mean-removed features): a few float32 ulps of values ~30.
SHARED_FBANK_BOUND = 4e-4


def _test_signal(rate: int, seconds: float, seed: int) -> np.ndarray:
    """Noise plus tones below and above 8 kHz (the anti-alias filter's job), in [-0.9, 0.9]."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(rate * seconds)) / rate
    tones = sum(0.2 * np.sin(2 * np.pi * f * t) for f in (220.0, 3_000.0, min(11_000.0, rate * 0.45)))
    x = tones + 0.2 * rng.standard_normal(t.shape[0])
    return (0.9 * x / np.max(np.abs(x))).astype(np.float32)


def _sinc_resample_f64(x: np.ndarray, orig_hz: int, new_hz: int) -> np.ndarray:
    """y[m] = sum_i x[i] h(i / orig - m / new): h a Hann-windowed sinc cut at 6 zero crossings
    of the cutoff min(orig, new) / 2 * 0.99, gain cutoff * 2 / orig, in float64 and in Hz."""
    cutoff = min(orig_hz, new_hz) * 0.99
    length = math.ceil(new_hz * x.shape[0] / orig_hz)
    reach = int(np.ceil(6 * orig_hz / cutoff)) + 2  # input samples each side with |t| < 6
    m = np.arange(length)
    centre = (m * orig_hz) // new_hz
    i = centre[:, None] + np.arange(-reach, reach + 2)[None, :]
    t = (i / orig_hz - m[:, None] / new_hz) * cutoff
    h = np.where(np.abs(t) < 6, np.sinc(t) * np.cos(np.pi * t / 12) ** 2, 0.0) * cutoff / orig_hz
    inside = (i >= 0) & (i < x.shape[0])
    values = np.where(inside, x.astype(np.float64)[np.clip(i, 0, x.shape[0] - 1)], 0.0)
    return np.sum(values * h, axis=1)


@pytest.mark.parametrize("rate", RATES)
def test_resample_matches_float64_formula(rate: int) -> None:
    x = _test_signal(rate, 0.73, seed=rate)
    ours = resample(x, rate, SAMPLE_RATE)
    reference = _sinc_resample_f64(x, rate, SAMPLE_RATE)
    assert ours.shape == reference.shape == (output_length(x.shape[0], rate, SAMPLE_RATE),)
    worst = float(np.max(np.abs(ours - reference)))
    print(f"\n{rate} Hz -> 16 kHz: max |ours - float64| = {worst:.3e}")
    assert worst < RESAMPLE_F64_BOUND, f"{rate} Hz: max abs {worst:.3e} >= {RESAMPLE_F64_BOUND}"


@pytest.mark.parametrize("rate", RATES)
def test_resample_matches_torchaudio(rate: int) -> None:
    torch = pytest.importorskip("torch")
    functional = pytest.importorskip("torchaudio.functional", reason="torchaudio does not import here")
    x = _test_signal(rate, 1.37, seed=rate + 1)
    theirs = functional.resample(torch.from_numpy(x)[None], rate, SAMPLE_RATE)[0].numpy()
    ours = resample(x, rate, SAMPLE_RATE)
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    worst = float(np.max(np.abs(ours - theirs)))
    print(f"\n{rate} Hz -> 16 kHz: max |ours - torchaudio| = {worst:.3e}")
    assert worst < RESAMPLE_TORCHAUDIO_BOUND, f"{rate} Hz: max abs {worst:.3e} >= {RESAMPLE_TORCHAUDIO_BOUND}"


@pytest.mark.parametrize("rate", (16_000, *RATES))
def test_streaming_resampler_equals_one_shot(rate: int) -> None:
    """Pieces of awkward sizes (1 sample, less than a filter, several frames) change nothing,
    to the bit (a product of another shape sums in another order: centroids ~2e-7 apart);
    the output length is torchaudio's."""
    x = _test_signal(rate, 0.9, seed=3)
    whole = resample(x, rate, SAMPLE_RATE)
    resampler, pieces, at = StreamingResampler(rate, SAMPLE_RATE), [], 0
    for size in [1, 7, 1000, 3, 4096] * 100:
        pieces.append(resampler.push(x[at : at + size]))
        at += size
        if at >= x.shape[0]:
            break
    pieces.append(resampler.finish())
    streamed = np.concatenate(pieces)
    assert streamed.shape == whole.shape, (streamed.shape, whole.shape)
    worst = float(np.max(np.abs(streamed - whole)))
    assert np.array_equal(streamed, whole), f"{rate} Hz: streamed vs one-shot max abs {worst:.3e}"


def test_resample_refuses_a_rate_with_a_huge_filter() -> None:
    with pytest.raises(InputError, match=r"header\.sample_rate: 7919 Hz .* coefficients"):
        check_format(7_919, 1)


def test_pcm_decode_and_downmix() -> None:
    """s16 is int16 / 32768 exactly; channels are averaged; f32 passes through."""
    frames = np.array([[32767, -32768], [2, 4], [-1, 1]], dtype="<i2")
    decoded = decode_pcm(frames.tobytes(), Encoding.S16, channels=2)
    np.testing.assert_array_equal(decoded, frames.astype(np.float32) / 32768)
    mono = downmix(decoded)
    expected = np.array([(32767 - 32768) / 2, 3, 0], dtype=np.float64) / 32768
    np.testing.assert_allclose(mono, expected, rtol=0, atol=1e-9)
    three = np.array([[0.5, -0.25, 1.0]], dtype="<f4")
    assert downmix(decode_pcm(three.tobytes(), Encoding.F32, channels=3))[0] == pytest.approx(1.25 / 3)


@pytest.mark.parametrize(
    ("data", "encoding", "channels", "message"),
    [
        (b"\x00" * 6, Encoding.S16, 4, r"audio: 6 bytes is not a whole number of 4-channel s16 frames \(8"),
        (np.array([0.5, np.nan], "<f4").tobytes(), Encoding.F32, 1, r"audio: frame 1 holds NaN or Inf"),
        (np.array([0.5, np.inf], "<f4").tobytes(), Encoding.F32, 2, r"audio: frame 0 holds NaN or Inf"),
        (
            np.array([0.5, -1.5], "<f4").tobytes(),
            Encoding.F32,
            1,
            r"audio: \|sample\| = 1.5 \(first at frame 1",
        ),
    ],
)
def test_bad_pcm_is_an_input_error(data: bytes, encoding: Encoding, channels: int, message: str) -> None:
    with pytest.raises(InputError, match=message):
        decode_pcm(data, encoding, channels)


@pytest.mark.parametrize(
    ("rate", "channels", "field"),
    [
        (0, 1, "sample_rate"),
        (-8000, 1, "sample_rate"),
        (192_001, 1, "sample_rate"),
        (16_000, 0, "channels"),
        (16_000, 9, "channels"),
    ],
)
def test_bad_format_names_its_field(rate: int, channels: int, field: str) -> None:
    with pytest.raises(InputError, match=rf"header\.{field}: .*expected 1\.\."):
        check_format(rate, channels)


def test_decoder_takes_pieces_that_split_frames() -> None:
    """The same stereo s16 recording in pieces cutting through frames gives the same fbank;
    a total that is not whole frames is an error at the end."""
    rng = np.random.default_rng(5)
    pcm = (rng.standard_normal((16_000 * 12 + 77, 2)) * 3000).astype("<i2").tobytes()
    whole = RecordingDecoder(16_000, 2, Encoding.S16)
    whole.push(pcm)
    pieced = RecordingDecoder(16_000, 2, Encoding.S16)
    for at in range(0, len(pcm), 100_003):
        pieced.push(pcm[at : at + 100_003])
    assert whole.finish() == pieced.finish() == 4
    np.testing.assert_array_equal(whole.source.windows(0, 4), pieced.source.windows(0, 4))
    torn = RecordingDecoder(16_000, 2, Encoding.S16)
    torn.push(pcm[:-1])
    with pytest.raises(InputError, match=r"audio: \d+ bytes is not a whole number of 2-channel s16"):
        torn.finish()


def test_decoder_refuses_audio_beyond_its_limit() -> None:
    decoder = RecordingDecoder(8_000, 1, Encoding.S16, max_seconds=2.0)
    decoder.push(b"\x00\x00" * 16_000)
    with pytest.raises(InputError, match=r"audio: more than 2 s of audio"):
        decoder.push(b"\x00\x00")


@pytest.mark.parametrize(
    ("samples", "windows", "padded"),
    [
        (3_600 * SAMPLE_RATE, 3_591, False),  # an hour
        (30 * SAMPLE_RATE, 21, False),
        (30 * SAMPLE_RATE + 1, 22, True),
        (CHUNK_SAMPLES, 1, False),
        (CHUNK_SAMPLES - 1, 1, True),
        (1, 1, True),
        (CHUNK_SAMPLES + SAMPLE_RATE - 1, 2, True),
    ],
)
def test_window_count_is_inference_slide(samples: int, windows: int, padded: bool) -> None:
    assert window_count(samples) == windows, f"{samples} samples: {window_count(samples)} windows"
    starts = chunk_starts(samples)
    assert len(starts) == windows, (len(starts), windows)
    assert (samples - int(starts[-1]) < CHUNK_SAMPLES) == padded, (samples, starts[-1])


def test_window_count_agrees_with_chunk_starts_everywhere() -> None:
    for samples in range(1, 3 * CHUNK_SAMPLES, 997):
        assert window_count(samples) == len(chunk_starts(samples)), samples


def test_step_must_be_whole_frames() -> None:
    assert step_samples(1.0) == SAMPLE_RATE
    assert step_samples(0.5) == 8_000
    for bad in (0.0, -1.0, 0.0123, 10.5, float("nan")):
        with pytest.raises(InputError, match=r"header\.step_s: .*multiple of 0\.01 s"):
            step_samples(bad)


def _frames_of(samples: np.ndarray) -> SharedFrames:
    source = SharedFrames()
    for at in range(0, samples.shape[0], 48_000):
        source.push(samples[at : at + 48_000])
    source.finish()
    return source


@pytest.mark.parametrize("seconds", [23.5, 30.0, 6.2])
def test_shared_frames_equal_per_window_fbank(seconds: float) -> None:
    """Window k = recording frames [100 k, 100 k + 998) minus their mean; the padded last
    window has frames of its own."""
    recording = synthetic_recording(seconds, seed=11).samples
    chunks = chunk_recording(recording)
    source = _frames_of(recording)
    shared = source.windows(0, len(chunks))
    per_window = fbank(chunks.waveforms)
    assert shared.shape == (len(chunks), FRAMES, MEL_BINS), shared.shape
    worst = float(np.max(np.abs(shared - per_window)))
    print(f"\n{seconds} s, {len(chunks)} windows: max |shared - per-window| = {worst:.3e}")
    assert worst < SHARED_FBANK_BOUND, f"max abs {worst:.3e} >= {SHARED_FBANK_BOUND}"
    last = len(chunks)
    np.testing.assert_array_equal(source.windows(last - 1, last), shared[last - 1 :])


def test_windows_read_while_finish_runs_are_only_ready_ones(monkeypatch) -> None:
    """Another thread (the batcher's) reads `ready()` windows while the reader thread is in
    `finish`: every window `ready()` names must be readable at every moment of it. Made
    deterministic by reading from inside finish's padded-window fbank, the step that takes time."""
    samples = synthetic_recording(11.5, seed=11).samples  # 2 full windows and a padded third
    source = SharedFrames()
    source.push(samples)
    seen: list[int] = []
    real = recording_module.log_mel_frames

    def reading_meanwhile(window: np.ndarray) -> np.ndarray:
        seen.append(source.ready())
        source.windows(0, seen[-1])  # raised (INTERNAL for the call) when ready() ran ahead
        return real(window)

    monkeypatch.setattr(recording_module, "log_mel_frames", reading_meanwhile)
    assert source.finish() == 3
    assert seen == [2], seen  # the padded window was not ready while its frames were made
    assert source.windows(0, 3).shape == (3, FRAMES, MEL_BINS)


def test_shared_frames_match_kaldi_native_fbank() -> None:
    """The first, a middle and the padded last window against kaldi-native-fbank, with
    test_fbank's bounds (resolved bins within KNF_BOUND, spectral nulls within NULL_BOUND)."""
    recording = synthetic_recording(23.5, seed=11).samples
    chunks = chunk_recording(recording)
    shared = _frames_of(recording).windows(0, len(chunks))
    for k in (0, 6, len(chunks) - 1):
        reference = knf_fbank(chunks.waveforms[k])
        energy = _log_mel(chunks.waveforms[k][None].astype(np.float64) * INT16_SCALE)[0]
        resolved = energy >= energy.max(axis=1, keepdims=True) - RESOLVED_RANGE
        diff = np.abs(shared[k].astype(np.float64) - reference)
        assert diff[resolved].max() < KNF_BOUND, f"window {k}: {diff[resolved].max():.3e}"
        assert diff.max() < NULL_BOUND, f"window {k}: {diff.max():.3e}"


def test_min_num_frames_is_two_for_segmentation_3() -> None:
    assert min_num_frames(MASK_FRAMES) == 2
    assert min_num_frames(400) == 1


def test_exclude_overlap_on_hand_made_masks() -> None:
    """Speaker 0 on frames 0-99, speaker 1 on 50-149; speaker 2 on 148-150 in window 0 and on
    146-152 in window 1. Window 0: overlap on 50-99 and 148-149, so speaker 0 keeps 0-49,
    speaker 1 100-147, and speaker 2's clean part is frame 150 alone (1 frame, not > 2): it
    keeps its full mask. Window 1: speaker 2's clean part is 150-152 (3 frames > 2)."""
    masks = np.zeros((2, 3, MASK_FRAMES), dtype=np.float32)
    masks[:, 0, 0:100] = 1
    masks[:, 1, 50:150] = 1
    masks[0, 2, 148:151] = 1  # clean part: frame 150 only -> 1 frame <= 2 -> full mask kept
    masks[1, 2, 146:153] = 1  # clean part: frames 150-152 -> 3 frames > 2 -> clean mask
    expected = np.zeros_like(masks)
    expected[:, 0, 0:50] = 1
    expected[0, 1, 100:148] = 1
    expected[1, 1, 100:146] = 1
    expected[0, 2, 148:151] = 1
    expected[1, 2, 150:153] = 1
    np.testing.assert_array_equal(exclude_overlap(masks), expected)


def test_exclude_overlap_counts_three_speakers_and_soft_masks() -> None:
    """A frame is overlapped when the speakers' mask values sum to 2 or more, as
    get_embeddings sums the (binarized) masks it is given."""
    masks = np.zeros((1, 3, 20), dtype=np.float32)
    masks[0, :, 0:10] = 1  # all three overlap on 0-9
    masks[0, 0, 10:20] = 1  # speaker 0 alone on 10-19
    masks[0, 1, 12:14] = 0.5  # 1.5 < 2: still clean for speaker 0
    out = exclude_overlap(masks)
    np.testing.assert_array_equal(out[0, 0], np.r_[np.zeros(10), np.ones(10)])
    np.testing.assert_array_equal(out[0, 1], masks[0, 1])  # clean weight 2 x 0.5 = 1, not > 2
    np.testing.assert_array_equal(out[0, 2], masks[0, 2])  # nothing clean: full mask


def test_client_reads_audio_files_through_libsndfile(tmp_path) -> None:
    """`client embed --audio`: a 16-bit WAV comes back as the same int16 samples (sent as s16),
    a 24-bit FLAC as float32 within one 24-bit step of what was written (sent as f32)."""
    import soundfile

    from speakerd.client.recording import read_audio

    rng = np.random.default_rng(3)
    stereo = np.clip(rng.standard_normal((44_100, 2)) * 0.2, -1, 1)
    wav, flac = tmp_path / "rec.wav", tmp_path / "rec.flac"
    soundfile.write(wav, stereo, 44_100, subtype="PCM_16")
    soundfile.write(flac, stereo, 48_000, subtype="PCM_24")
    samples, rate = read_audio(wav)
    written16, _ = soundfile.read(wav, dtype="int16", always_2d=True)
    assert rate == 44_100 and samples.dtype == np.int16 and np.array_equal(samples, written16)
    samples, rate = read_audio(flac)
    assert rate == 48_000 and samples.dtype == np.float32 and samples.shape == (44_100, 2), samples.shape
    step = 2.0**-23
    assert np.max(np.abs(samples - stereo)) <= step, (
        f"max abs {np.max(np.abs(samples - stereo)):.3e} > {step:.3e}"
    )

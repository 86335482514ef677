"""speakerd.model.fbank against kaldi-native-fbank (an independent C++ Kaldi), and pyannote's chunking."""

from __future__ import annotations

import numpy as np
import pytest

from speakerd.model.architecture import CHUNK_SAMPLES, FRAMES, MEL_BINS, SAMPLE_RATE
from speakerd.model.audio import synthetic_recording
from speakerd.model.fbank import (
    FRAME_LENGTH,
    INT16_SCALE,
    _log_mel,
    chunk_recording,
    chunk_starts,
    fbank,
    hamming_window,
    mel_banks,
    num_frames,
)
from speakerd.model.inputs import InputError

#: The bound on |numpy - kaldi-native-fbank| of the mean-normalised features.
KNF_BOUND = 1e-3
#: kaldi-native-fbank computes in float32. A mel bin 80 dB or more below its frame's strongest
#: bin is a spectral null (the low filters hold one FFT bin, whose power is exponentially
#: distributed) that a float32 FFT resolves only to ~1e-3 relative: there our own pipeline run
#: in float32 differs from itself in float64 by the same amount (1.8e-3 measured, seed 3). Such
#: entries (~0.01 %) are held to the looser float32 bound, all others to KNF_BOUND.
RESOLVED_RANGE = np.log(1e8)  # 80 dB in power, in natural-log units
NULL_BOUND = 1e-2
MEAN_BOUND = 5e-5


def knf_fbank(waveform: np.ndarray) -> np.ndarray:
    """kaldi-native-fbank configured as torchaudio's kaldi.fbank in pyannote, then mean-normalised."""
    knf = pytest.importorskip("kaldi_native_fbank", reason="kaldi-native-fbank is in the dev extra")
    options = knf.FbankOptions()
    options.frame_opts.samp_freq = SAMPLE_RATE
    options.frame_opts.frame_length_ms = 25
    options.frame_opts.frame_shift_ms = 10
    options.frame_opts.dither = 0.0
    options.frame_opts.snip_edges = True
    options.frame_opts.window_type = "hamming"
    options.frame_opts.preemph_coeff = 0.97
    options.frame_opts.remove_dc_offset = True
    options.frame_opts.round_to_power_of_two = True
    options.mel_opts.num_bins = MEL_BINS
    options.mel_opts.low_freq = 20.0
    options.mel_opts.high_freq = 8000.0
    options.mel_opts.htk_mode = False
    options.mel_opts.is_librosa = False
    options.use_energy = False
    options.use_log_fbank = True
    options.use_power = True
    computer = knf.OnlineFbank(options)
    computer.accept_waveform(SAMPLE_RATE, (waveform.astype(np.float64) * INT16_SCALE).tolist())
    computer.input_finished()
    features = np.stack([computer.get_frame(i) for i in range(computer.num_frames_ready)])
    return features - features.mean(axis=0, keepdims=True)


@pytest.fixture(scope="module")
def speech_chunks() -> np.ndarray:
    """A full chunk of 3-speaker speech, one with a pause, and a zero-padded last chunk."""
    recording = synthetic_recording(23.5, seed=11)
    chunks = chunk_recording(recording.samples)
    assert chunks.lengths[-1] < CHUNK_SAMPLES, chunks.lengths
    return chunks.waveforms[[0, 6, len(chunks) - 1]]


def test_matches_kaldi_native_fbank_on_speech(speech_chunks: np.ndarray) -> None:
    ours = fbank(speech_chunks)
    raw = _log_mel(speech_chunks.astype(np.float64) * INT16_SCALE)  # before mean normalisation
    print("\ncase         max_abs(<80dB)  max_abs(all)  mean_abs  nulls")
    worst = worst_all = worst_mean = 0.0
    for name, chunk, features, energy in zip(
        ("full", "pause", "padded_last"), speech_chunks, ours, raw, strict=True
    ):
        reference = knf_fbank(chunk)
        assert reference.shape == (FRAMES, MEL_BINS), reference.shape
        diff = np.abs(features.astype(np.float64) - reference)
        resolved = energy >= energy.max(axis=1, keepdims=True) - RESOLVED_RANGE
        row = (float(diff[resolved].max()), float(diff.max()), float(diff.mean()), int((~resolved).sum()))
        print(f"{name:<12} {row[0]:.3e}       {row[1]:.3e}     {row[2]:.1e}   {row[3]}")
        worst, worst_all, worst_mean = max(worst, row[0]), max(worst_all, row[1]), max(worst_mean, row[2])
    print(f"fbank vs kaldi-native-fbank: max abs {worst:.3e} within 80 dB of the frame peak ({KNF_BOUND}),")
    print(f"  {worst_all:.3e} over all entries ({NULL_BOUND}), mean abs {worst_mean:.2e} ({MEAN_BOUND})")
    assert worst < KNF_BOUND, f"max abs diff {worst:.3e} >= {KNF_BOUND} on resolved bins"
    assert worst_all < NULL_BOUND, f"max abs diff {worst_all:.3e} >= {NULL_BOUND} on spectral nulls"
    assert worst_mean < MEAN_BOUND, f"mean abs diff {worst_mean:.2e} >= {MEAN_BOUND}"


def test_shapes_batch_and_single_agree(speech_chunks: np.ndarray) -> None:
    batch = fbank(speech_chunks)
    assert batch.shape == (3, FRAMES, MEL_BINS) and batch.dtype == np.float32, (batch.shape, batch.dtype)
    single = fbank(speech_chunks[1])
    assert single.shape == (FRAMES, MEL_BINS), single.shape
    np.testing.assert_array_equal(single, batch[1])
    # mean normalisation: every bin's mean over the 998 frames is 0 up to float32 rounding
    worst = float(np.abs(batch.astype(np.float64).mean(axis=1)).max())
    assert worst < 1e-5, f"per-bin mean {worst:.2e}"


def test_silence_is_the_log_floor_exactly() -> None:
    """All-zero audio: every energy is floored at float32 eps, so the normalised fbank is ~0."""
    features = fbank(np.zeros(CHUNK_SAMPLES, dtype=np.float32))
    assert float(np.abs(features).max()) < 1e-9, float(np.abs(features).max())  # log(eps) - mean


def test_window_and_mel_banks() -> None:
    window = hamming_window()
    assert window.shape == (FRAME_LENGTH,)
    np.testing.assert_allclose(window, np.hamming(FRAME_LENGTH), rtol=0, atol=1e-15)  # symmetric form
    banks = mel_banks()
    assert banks.shape == (257, MEL_BINS), banks.shape
    assert np.all(banks[-1] == 0.0), "the Nyquist bin carries no weight in Kaldi's banks"
    assert np.all(banks.max(axis=0) > 0.2), "every mel filter covers at least one FFT bin"
    assert np.all(banks[0] == 0.0), "bin 0 (0 Hz) lies below the 20 Hz low edge"
    peaks = banks.argmax(axis=0)
    assert np.all(np.diff(peaks) >= 0), f"filter centres not ascending: {peaks}"
    assert num_frames(CHUNK_SAMPLES) == FRAMES and num_frames(FRAME_LENGTH - 1) == 0


@pytest.mark.parametrize(
    ("bad", "expected"),
    [
        (np.zeros(159_999, dtype=np.float32), "expected [n, 160000]"),
        (np.zeros((2, 160_000), dtype=np.int16), "dtype int16"),
        (np.full(160_000, 2.0, dtype=np.float32), "[-1, 1]"),
        (np.full(160_000, np.nan, dtype=np.float32), "NaN"),
    ],
)
def test_bad_waveform_names_the_field(bad: np.ndarray, expected: str) -> None:
    with pytest.raises(InputError, match="waveform") as error:
        fbank(bad)
    assert expected in str(error.value), str(error.value)


@pytest.mark.parametrize(
    ("samples", "starts", "last_length"),
    [
        (160_000, [0], 160_000),  # exactly one window: no padded extra
        (176_000, [0, 16_000], 160_000),  # windows end exactly at the end
        (170_000, [0, 16_000], 154_000),  # partial last window at the next 1 s step, padded
        (50_000, [0], 50_000),  # shorter than 10 s: one padded window
        (1, [0], 1),
        (400_000, [*range(0, 240_001, 16_000)], 160_000),
        (407_999, [*range(0, 240_001, 16_000), 256_000], 151_999),
    ],
)
def test_chunk_starts_follow_pyannote_slide(samples: int, starts: list[int], last_length: int) -> None:
    got = chunk_starts(samples)
    assert got.tolist() == starts, (samples, got.tolist())
    assert min(CHUNK_SAMPLES, samples - int(got[-1])) == last_length


def test_chunk_recording_copies_and_pads() -> None:
    rng = np.random.default_rng(3)
    samples = rng.uniform(-0.5, 0.5, 170_000).astype(np.float32)
    chunks = chunk_recording(samples)
    assert chunks.waveforms.shape == (2, CHUNK_SAMPLES) and chunks.waveforms.dtype == np.float32
    assert chunks.lengths.tolist() == [160_000, 154_000] and len(chunks) == 2
    np.testing.assert_array_equal(chunks.waveforms[0], samples[:160_000])
    np.testing.assert_array_equal(chunks.waveforms[1, :154_000], samples[16_000:])
    assert np.all(chunks.waveforms[1, 154_000:] == 0.0)


def test_chunk_recording_rejects_bad_input() -> None:
    with pytest.raises(InputError, match="samples"):
        chunk_recording(np.zeros((2, 100), dtype=np.float32))
    with pytest.raises(InputError, match="samples"):
        chunk_recording(np.zeros(0, dtype=np.float32))

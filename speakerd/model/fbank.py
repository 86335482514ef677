"""Kaldi log-mel filterbank features and 10 s chunking, exactly as pyannote.audio 4.0.7 does them.

pyannote's `BaseWeSpeakerResNet.compute_fbank` calls `torchaudio.compliance.kaldi.fbank` on
`waveform * 32768` (25 ms frames, 10 ms shift, snip_edges, Hamming, 80 mel bins, dither 0,
no energy term) and then subtracts each mel bin's mean over the chunk's frames (docs/model.md).
This module reproduces that in NumPy so that neither the service nor its tests need torch.
The arithmetic runs in float64 and is rounded once to float32 at the end, so the only
difference from torchaudio's float32 pipeline is torchaudio's own rounding (~1e-5).

`chunk_recording` cuts a recording into the windows pyannote's `Inference.slide` feeds the
models: 10 s windows every 1 s, then one last window starting where the next regular one
would, zero-padded to 10 s, whenever the regular windows do not end exactly at the end.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from speakerd.model.architecture import CHUNK_SAMPLES, FRAMES, MEL_BINS, SAMPLE_RATE
from speakerd.model.inputs import InputError, check_waveform

#: torchaudio's kaldi.fbank expects int16-scaled samples; pyannote multiplies by 1 << 15.
INT16_SCALE = 32768.0
#: 25 ms frame and 10 ms shift at 16 kHz.
FRAME_LENGTH = 400
FRAME_SHIFT = 160
#: round_to_power_of_two: the 400-sample frame is zero-padded to the next power of two.
FFT_SIZE = 512
PREEMPHASIS = 0.97
#: Kaldi's default low mel edge; the high edge 0 means "Nyquist", i.e. 8000 Hz at 16 kHz.
LOW_FREQ = 20.0
HIGH_FREQ = SAMPLE_RATE / 2
#: log(max(energy, eps)) with eps = torch.finfo(torch.float).eps, as torchaudio floors it.
LOG_FLOOR = float(np.finfo(np.float32).eps)
#: Chunks per vectorised block: bounds the float64 frame buffer to ~8 x 998 x 512 x 8 B = 33 MB.
BLOCK_CHUNKS = 8

#: pyannote segmentation-3.0 / diarization pipeline windowing: 10 s every 1 s.
STEP_SAMPLES = SAMPLE_RATE  # 1 s


def num_frames(samples: int) -> int:
    """Kaldi frame count with snip_edges: only frames lying entirely inside the signal."""
    if samples < FRAME_LENGTH:
        return 0
    return 1 + (samples - FRAME_LENGTH) // FRAME_SHIFT


assert num_frames(CHUNK_SAMPLES) == FRAMES, (
    f"{num_frames(CHUNK_SAMPLES)} frames per chunk, the model needs {FRAMES}"
)


def mel_scale(freq: np.ndarray | float) -> np.ndarray:
    """Kaldi's mel scale, 1127 ln(1 + f / 700)."""
    return 1127.0 * np.log1p(np.asarray(freq, dtype=np.float64) / 700.0)


@lru_cache(maxsize=1)
def hamming_window() -> np.ndarray:
    """Symmetric Hamming window 0.54 - 0.46 cos(2 pi n / (N - 1)), torchaudio's periodic=False."""
    n = np.arange(FRAME_LENGTH, dtype=np.float64)
    window = 0.54 - 0.46 * np.cos(2.0 * np.pi * n / (FRAME_LENGTH - 1))
    window.setflags(write=False)
    return window


@lru_cache(maxsize=1)
def mel_banks() -> np.ndarray:
    """[257, 80] triangular filters on the power-spectrum bins (the Nyquist bin has weight 0).

    Triangles are equally spaced on the mel scale between LOW_FREQ and HIGH_FREQ and are
    evaluated at the mel value of each FFT bin's centre frequency, as Kaldi's MelBanks does.
    """
    fft_bins = FFT_SIZE // 2
    bin_mel = mel_scale(np.arange(fft_bins, dtype=np.float64) * (SAMPLE_RATE / FFT_SIZE))
    mel_low, mel_high = float(mel_scale(LOW_FREQ)), float(mel_scale(HIGH_FREQ))
    delta = (mel_high - mel_low) / (MEL_BINS + 1)
    index = np.arange(MEL_BINS, dtype=np.float64)[:, None]
    left, center, right = (
        mel_low + index * delta,
        mel_low + (index + 1) * delta,
        mel_low + (index + 2) * delta,
    )
    up = (bin_mel[None, :] - left) / (center - left)
    down = (right - bin_mel[None, :]) / (right - center)
    banks = np.maximum(0.0, np.minimum(up, down))  # [80, 256]
    padded = np.zeros((fft_bins + 1, MEL_BINS), dtype=np.float64)
    padded[:fft_bins] = banks.T
    padded.setflags(write=False)
    return padded


def _log_mel(waveforms: np.ndarray) -> np.ndarray:
    """[b, samples] int16-scaled float64 -> [b, frames, 80] float64 log-mel energies."""
    frames = np.lib.stride_tricks.sliding_window_view(waveforms, FRAME_LENGTH, axis=-1)[:, ::FRAME_SHIFT]
    frames = frames - frames.mean(axis=-1, keepdims=True)  # remove_dc_offset, per frame
    previous = np.concatenate([frames[..., :1], frames[..., :-1]], axis=-1)  # sample 0 is its own predecessor
    frames = (frames - PREEMPHASIS * previous) * hamming_window()
    spectrum = np.fft.rfft(frames, n=FFT_SIZE, axis=-1)
    power = spectrum.real**2 + spectrum.imag**2
    return np.log(np.maximum(power @ mel_banks(), LOG_FLOOR))


def fbank(waveform: np.ndarray) -> np.ndarray:
    """pyannote's mean-normalised fbank: [160000] -> [998, 80] or [n, 160000] -> [n, 998, 80] float32.

    `waveform` is float audio in [-1, 1] (validated by speakerd.model.inputs.check_waveform, so a bad
    shape or an int16 array is an InputError naming `waveform`).
    """
    single = waveform.ndim == 1
    batch = check_waveform(waveform[None] if single else waveform)
    out = np.empty((batch.shape[0], FRAMES, MEL_BINS), dtype=np.float32)
    for start in range(0, batch.shape[0], BLOCK_CHUNKS):
        block = batch[start : start + BLOCK_CHUNKS].astype(np.float64) * INT16_SCALE
        features = _log_mel(block)
        out[start : start + BLOCK_CHUNKS] = features - features.mean(axis=1, keepdims=True)
    return out[0] if single else out


@dataclass(frozen=True)
class Chunks:
    """A recording cut into pyannote's 10 s windows."""

    waveforms: np.ndarray  # [n, 160000] float32, the last window zero-padded when partial
    starts: np.ndarray  # [n] int64 sample offset of each window in the recording
    lengths: np.ndarray  # [n] int64 samples of real audio in each window (< 160000 when padded)

    def __len__(self) -> int:
        return int(self.starts.shape[0])


def chunk_starts(samples: int, window: int = CHUNK_SAMPLES, step: int = STEP_SAMPLES) -> np.ndarray:
    """Sample offsets of pyannote `Inference.slide`'s windows for a recording of `samples`.

    Regular windows start at 0, step, 2 step, ... while they fit entirely; when they do not
    end exactly at the last sample (or the recording is shorter than one window) one more
    window starts at the next multiple of `step` and is zero-padded on the right.
    """
    if samples < 1:
        raise InputError("samples", f"{samples} samples; a recording needs at least one")
    regular = (samples - window) // step + 1 if samples >= window else 0
    starts = list(range(0, regular * step, step))
    if samples < window or (samples - window) % step > 0:
        starts.append(regular * step)
    return np.asarray(starts, dtype=np.int64)


def chunk_recording(samples: np.ndarray, window: int = CHUNK_SAMPLES, step: int = STEP_SAMPLES) -> Chunks:
    """Cut mono float audio [N] into [n, window] windows as pyannote does (see chunk_starts)."""
    samples = np.asarray(samples)
    if samples.ndim != 1:
        raise InputError("samples", f"shape {tuple(samples.shape)}, expected a mono recording [N]")
    starts = chunk_starts(samples.shape[0], window, step)
    lengths = np.minimum(window, samples.shape[0] - starts)
    waveforms = np.zeros((starts.shape[0], window), dtype=np.float32)
    for row, (start, length) in enumerate(zip(starts, lengths, strict=True)):
        waveforms[row, :length] = samples[start : start + length]
    return Chunks(waveforms, starts, lengths.astype(np.int64))


#: Frames per block of `log_mel_frames`: bounds its float64 work buffers to ~10 MB.
BLOCK_FRAMES = 1000


def log_mel_frames(samples: np.ndarray) -> np.ndarray:
    """[N] float audio in [-1, 1] -> [num_frames(N), 80] float32 log-mel frames, no mean removed.

    The per-frame part of `fbank` for a whole recording: frame f reads samples [160 f,
    160 f + 400) only, so a window starting at a multiple of 160 samples has the recording's
    frames as its own (what recordings use to compute each frame once, not 10 times).
    """
    samples = np.asarray(samples)
    if samples.ndim != 1:
        raise InputError("samples", f"shape {tuple(samples.shape)}, expected mono audio [N]")
    total = num_frames(samples.shape[0])
    out = np.empty((total, MEL_BINS), dtype=np.float32)
    for first in range(0, total, BLOCK_FRAMES):
        count = min(BLOCK_FRAMES, total - first)
        span = samples[first * FRAME_SHIFT : (first + count - 1) * FRAME_SHIFT + FRAME_LENGTH]
        out[first : first + count] = _log_mel(span[None].astype(np.float64) * INT16_SCALE)[0]
    return out

"""Streaming resampling to 16 kHz, the arithmetic of `torchaudio.functional.resample`'s defaults.

pyannote's `Audio` resamples any other rate with torchaudio's defaults (windowed sinc, Hann
window, lowpass_filter_width 6, rolloff 0.99). torchaudio reduces the two rates by their gcd
to `orig` and `new`, builds `new` filters of 2 width + orig taps (one per output phase),
zero-pads the signal by `width` on the left and `width + orig` on the right, runs them as a
conv1d of stride `orig` and keeps the first ceil(new * N / orig) outputs.

Output frame j (outputs j new .. j new + new - 1) reads padded samples [j orig, j orig + K)
only, so the same sums can be taken as the samples arrive: `StreamingResampler` keeps the
samples the next frames still need and emits frames whose input is complete, DRAIN_FRAMES
at a time (the last group zero-filled at the end). Each group is one float32 matrix product
of the same shape, its frames at the same rows, whatever the piece sizes: BLAS's summation
order depends on the product's shape, so a recording gives the same bits however it was cut
into pieces.

Like torchaudio called on a float32 waveform, the filters and the sums are float32 (the
filters are evaluated in float64 and rounded once, torchaudio evaluates them in float32:
the two differ by ~1e-7 relative, far below the fbank's own rounding).
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from speakerd.model.inputs import InputError

#: torchaudio.functional.resample defaults, which pyannote's Audio uses.
LOWPASS_FILTER_WIDTH = 6
ROLLOFF = 0.99
#: Output frames one matrix product computes (module doc): about 0.6 s of audio held back
#: at most, whatever the rates (a frame is `orig` input samples).
DRAIN_FRAMES = 64
#: Filter coefficients one resampler may hold (new x (2 width + orig) float32): 4 Mi is
#: 16 MiB. Every common rate (8 to 192 kHz, the 44.1 kHz family included) needs < 0.4 Mi;
#: a rate like 7,919 Hz (prime) would need 127 Mi and is refused instead of allocated.
MAX_KERNEL_COEFFICIENTS = 1 << 22


def reduced_rates(orig_freq: int, new_freq: int) -> tuple[int, int]:
    """The two rates divided by their gcd, as torchaudio reduces them."""
    gcd = math.gcd(orig_freq, new_freq)
    return orig_freq // gcd, new_freq // gcd


def kernel_width(orig: int, new: int) -> int:
    """Taps each side of a filter: ceil(lowpass_filter_width * orig / (min(orig, new) * rolloff))."""
    return math.ceil(LOWPASS_FILTER_WIDTH * orig / (min(orig, new) * ROLLOFF))


def kernel_coefficients(orig_freq: int, new_freq: int) -> int:
    """Filter coefficients torchaudio builds for this pair of rates: new x (2 width + orig)."""
    orig, new = reduced_rates(orig_freq, new_freq)
    return new * (2 * kernel_width(orig, new) + orig)


def check_rates(orig_freq: int, new_freq: int, field: str = "sample_rate") -> None:
    """InputError naming `field` when the rates' filters would exceed MAX_KERNEL_COEFFICIENTS."""
    coefficients = kernel_coefficients(orig_freq, new_freq)
    if coefficients > MAX_KERNEL_COEFFICIENTS:
        orig, new = reduced_rates(orig_freq, new_freq)
        raise InputError(
            field,
            f"{orig_freq} Hz reduces against {new_freq} Hz to {orig}:{new}, a resampling filter of "
            f"{coefficients} coefficients (limit {MAX_KERNEL_COEFFICIENTS}); resample to a common rate first",
        )


@lru_cache(maxsize=8)
def sinc_kernel(orig_freq: int, new_freq: int) -> tuple[np.ndarray, int]:
    """([new, 2 width + orig] float32 filters, width) for reduced rates, torchaudio's formula.

    Filter p, tap i: t = (i - width) / orig - p / new, scaled by base = min(orig, new) *
    rolloff and clamped to +-6; value sinc(pi t) * cos(pi t / 12)^2 * base / orig.
    """
    check_rates(orig_freq, new_freq)
    orig, new = reduced_rates(orig_freq, new_freq)
    width = kernel_width(orig, new)
    base = min(orig, new) * ROLLOFF
    index = np.arange(-width, width + orig, dtype=np.float64)[None, :] / orig
    t = (-np.arange(new, dtype=np.float64)[:, None] / new + index) * base
    t = np.clip(t, -LOWPASS_FILTER_WIDTH, LOWPASS_FILTER_WIDTH)
    window = np.cos(t * math.pi / LOWPASS_FILTER_WIDTH / 2) ** 2
    t = t * math.pi
    sinc = np.where(t == 0, 1.0, np.sin(t) / np.where(t == 0, 1.0, t))
    kernel = (sinc * window * (base / orig)).astype(np.float32)
    kernel.setflags(write=False)
    return kernel, width


def output_length(samples: int, orig_freq: int, new_freq: int) -> int:
    """torchaudio's output length ceil(new * N / orig), in integers."""
    orig, new = reduced_rates(orig_freq, new_freq)
    return -(-new * samples // orig)


class StreamingResampler:
    """Resamples float32 mono audio piece by piece; `push` and `finish` return the new samples."""

    def __init__(self, orig_freq: int, new_freq: int) -> None:
        self.orig_freq, self.new_freq = orig_freq, new_freq
        self.identity = orig_freq == new_freq  # torchaudio returns the waveform unchanged
        self._orig, self._new = reduced_rates(orig_freq, new_freq)
        self._samples_in = 0
        self._samples_out = 0
        self._finished = False
        if not self.identity:
            self._kernel, self._width = sinc_kernel(orig_freq, new_freq)
            self._taps = self._kernel.shape[1]
            # padded samples from the next frame's first tap on: `width` zeros to start with
            self._buffer = np.zeros(self._width, dtype=np.float32)

    def push(self, samples: np.ndarray) -> np.ndarray:
        """Feed the next samples; return every output sample whose inputs are now all known."""
        if self._finished:
            raise RuntimeError("push after finish")
        samples = np.asarray(samples, dtype=np.float32)
        self._samples_in += samples.shape[0]
        if self.identity:
            self._samples_out += samples.shape[0]
            return samples
        self._buffer = np.concatenate([self._buffer, samples])
        return self._drain()

    def finish(self) -> np.ndarray:
        """The last output samples (the right zero padding), trimmed to ceil(new * N / orig)."""
        if self._finished:
            raise RuntimeError("finish called twice")
        self._finished = True
        if self.identity:
            return np.zeros(0, dtype=np.float32)
        self._buffer = np.concatenate([self._buffer, np.zeros(self._width + self._orig, dtype=np.float32)])
        out = self._drain(last=True)
        keep = output_length(self._samples_in, self.orig_freq, self.new_freq) - (
            self._samples_out - out.shape[0]
        )
        self._samples_out -= out.shape[0] - keep
        return out[:keep]

    def _drain(self, last: bool = False) -> np.ndarray:
        """The complete frames in whole groups of DRAIN_FRAMES; with `last`, all of them (the
        last group's missing frames computed on zeros and dropped)."""
        ready = (self._buffer.shape[0] - self._taps) // self._orig + 1
        frames = ready if last else ready // DRAIN_FRAMES * DRAIN_FRAMES
        if frames <= 0:
            return np.zeros(0, dtype=np.float32)
        groups = -(-frames // DRAIN_FRAMES)
        need = (groups * DRAIN_FRAMES - 1) * self._orig + self._taps
        buffer = self._buffer
        if buffer.shape[0] < need:
            buffer = np.concatenate([buffer, np.zeros(need - buffer.shape[0], dtype=np.float32)])
        view = np.lib.stride_tricks.sliding_window_view(buffer, self._taps)[:: self._orig]
        products = [view[g * DRAIN_FRAMES : (g + 1) * DRAIN_FRAMES] @ self._kernel.T for g in range(groups)]
        out = np.concatenate(products).reshape(-1)[: frames * self._new]
        self._buffer = self._buffer[frames * self._orig :].copy()
        self._samples_out += out.shape[0]
        return out


def resample(samples: np.ndarray, orig_freq: int, new_freq: int) -> np.ndarray:
    """One-shot `torchaudio.functional.resample(samples, orig_freq, new_freq)` for mono float32."""
    resampler = StreamingResampler(orig_freq, new_freq)
    return np.concatenate([resampler.push(samples), resampler.finish()])

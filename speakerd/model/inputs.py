"""Validation of engine inputs: one place that says what a well-formed request is.

The offline CLI, the gRPC service and every engine call these, so an error names the
same field and the same expected shape wherever the bad input came from.
"""

from __future__ import annotations

import numpy as np

from speakerd.model.architecture import CHUNK_SAMPLES, FRAMES, MAX_SPEAKERS, MEL_BINS

#: A mask needs at least one frame; more than this is surely a unit mistake (samples
#: instead of frames): 10 s at 1 kHz frame rate.
MAX_MASK_FRAMES = 10_000
#: Largest |value| accepted in an fbank. A Kaldi log-mel energy lies between log(float32
#: epsilon) = -15.9 and log((400 * 32768)^2) = 32.8 for full-scale 16-bit audio, so a
#: mean-removed fbank stays within about +-50; 1e4 is 200x that (room for other front-ends'
#: scaling) and 15 orders of magnitude below ~1e19, where the trunk's statistics pooling
#: squares values past float32's range and the embedding turns NaN.
MAX_FBANK_MAGNITUDE = 1e4


class InputError(ValueError):
    """A malformed input. `field` is the offending array; the message says what was expected."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class InputLengthError(InputError):
    """A flat buffer of the wrong length for the plan it is written into."""

    def __init__(self, field: str, expected: int, given: int) -> None:
        super().__init__(field, f"expected {expected} elements, given {given}")
        self.expected = expected
        self.given = given


def _finite(field: str, array: np.ndarray) -> None:
    if not np.all(np.isfinite(array)):
        bad = int(np.size(array) - np.count_nonzero(np.isfinite(array)))
        raise InputError(field, f"holds {bad} NaN or Inf values; every value must be finite")


def check_fbank(fbank: np.ndarray, field: str = "fbank") -> np.ndarray:
    """[n, 998, 80] float32 or float16, finite -> float32 (a view when already float32)."""
    if fbank.ndim != 3 or fbank.shape[1:] != (FRAMES, MEL_BINS) or fbank.shape[0] < 1:
        raise InputError(field, f"shape {tuple(fbank.shape)}, expected [n, {FRAMES}, {MEL_BINS}] with n >= 1")
    if fbank.dtype not in (np.float32, np.float16):
        raise InputError(field, f"dtype {fbank.dtype}, expected float32 or float16")
    fbank = np.ascontiguousarray(fbank, dtype=np.float32)
    _finite(field, fbank)
    return fbank


def check_fbank_magnitude(fbank: np.ndarray, field: str = "fbank") -> np.ndarray:
    """Finite fbank -> itself when every |value| <= MAX_FBANK_MAGNITUDE. Kept apart from
    check_fbank (which engines call on every batch): a service takes only values a real
    front-end makes, so an embedding can never overflow to NaN because of its input."""
    if fbank.size:
        peak = max(float(fbank.max()), -float(fbank.min()))  # no |x| temporary of 10 MB
        if peak > MAX_FBANK_MAGNITUDE:
            raise InputError(
                field,
                f"peak |x| = {peak:.4g}; a log-mel fbank lies within +-{MAX_FBANK_MAGNITUDE:g} "
                "(a real one within about +-50)",
            )
    return fbank


def check_waveform(waveform: np.ndarray, field: str = "waveform") -> np.ndarray:
    """[n, 160000] float32 in [-1, 1], finite."""
    if waveform.ndim != 2 or waveform.shape[1] != CHUNK_SAMPLES or waveform.shape[0] < 1:
        raise InputError(field, f"shape {tuple(waveform.shape)}, expected [n, {CHUNK_SAMPLES}] with n >= 1")
    if waveform.dtype != np.float32:  # the contract: float16 audio would lose 5 bits of the signal
        raise InputError(field, f"dtype {waveform.dtype}, expected float32")
    waveform = np.ascontiguousarray(waveform, dtype=np.float32)
    _finite(field, waveform)
    peak = float(np.max(np.abs(waveform)))
    if peak > 1.0:
        raise InputError(field, f"peak |x| = {peak:.4g}; samples must lie in [-1, 1]")
    return waveform


def check_masks(masks: np.ndarray, chunks: int, field: str = "masks") -> np.ndarray:
    """[n, s, F] float32 or uint8 with s in 1..3, values in [0, 1] -> float32."""
    if masks.ndim != 3 or masks.shape[0] != chunks or not 1 <= masks.shape[1] <= MAX_SPEAKERS:
        raise InputError(
            field, f"shape {tuple(masks.shape)}, expected [{chunks}, s, F] with s in 1..{MAX_SPEAKERS}"
        )
    if not 1 <= masks.shape[2] <= MAX_MASK_FRAMES:
        raise InputError(field, f"{masks.shape[2]} frames, expected 1..{MAX_MASK_FRAMES}")
    if masks.dtype == np.uint8:
        if masks.size and int(masks.max()) > 1:
            raise InputError(field, "uint8 masks must hold 0 or 1")
        return masks.astype(np.float32)
    if masks.dtype != np.float32:
        raise InputError(field, f"dtype {masks.dtype}, expected float32 or uint8")
    masks = np.ascontiguousarray(masks)
    _finite(field, masks)
    if masks.size and (float(masks.min()) < 0.0 or float(masks.max()) > 1.0):
        raise InputError(field, "values must lie in [0, 1]")
    return masks

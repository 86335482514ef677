"""A whole recording to embedding inputs, the way a pyannote.audio 4.0.7 pipeline prepares it.

Steps, each pyannote's (docs/recordings.md tells the story):
- PCM (s16 or f32 little-endian, interleaved channels) -> float32, int16 / 32768;
- channels averaged (`Audio(mono="downmix")`);
- resampled to 16 kHz with torchaudio's defaults (speakerd.model.resample);
- cut into `Inference.slide`'s windows: 10 s every `step`, plus a zero-padded last window
  when the regular ones do not end at the last sample (speakerd.model.fbank.chunk_starts);
- fbank per window = the recording's own log-mel frames [step_frames k, step_frames k + 998)
  minus that window's per-bin mean; only the padded last window has frames of its own;
- masks [n, s, F] with `exclude_overlap` exactly as `SpeakerDiarization.get_embeddings`.

`RecordingDecoder` takes the PCM in pieces of any size with bounded memory: it keeps the
recording's log-mel frames (32 KB per second of audio, 115 MB an hour) and the last 10 s of
16 kHz samples, never the PCM. The frames live behind `FbankSource`, the one interface an
engine that computes fbank itself (on a GPU) replaces.
"""

from __future__ import annotations

import enum
import math
from typing import Protocol

import numpy as np

from speakerd.model.architecture import CHUNK_SAMPLES, FRAMES, MEL_BINS, SAMPLE_RATE
from speakerd.model.fbank import FRAME_LENGTH, FRAME_SHIFT, STEP_SAMPLES, chunk_starts, log_mel_frames
from speakerd.model.inputs import InputError
from speakerd.model.resample import StreamingResampler, check_rates

#: Rates a header may give: 192 kHz is the highest rate audio interfaces record at.
MAX_SAMPLE_RATE = 192_000
#: Channels a header may give: 7.1 surround is the widest layout a speech file plausibly has.
MAX_CHANNELS = 8
#: pyannote's smallest WeSpeaker input (its own bisection finds 400 samples: one fbank frame).
MIN_NUM_SAMPLES = FRAME_LENGTH
#: Windows must start on a fbank frame so that they share the recording's frames.
STEP_QUANTUM_SAMPLES = FRAME_SHIFT


class Encoding(enum.Enum):
    """PCM sample formats: NumPy dtype of one sample, little-endian."""

    S16 = "<i2"
    F32 = "<f4"

    @property
    def itemsize(self) -> int:
        return np.dtype(self.value).itemsize


def check_format(sample_rate: int, channels: int, field: str = "header") -> None:
    """InputError naming `field.sample_rate` / `field.channels` unless both are usable."""
    if not 1 <= sample_rate <= MAX_SAMPLE_RATE:
        raise InputError(f"{field}.sample_rate", f"{sample_rate} Hz, expected 1..{MAX_SAMPLE_RATE}")
    if not 1 <= channels <= MAX_CHANNELS:
        raise InputError(f"{field}.channels", f"{channels}, expected 1..{MAX_CHANNELS}")
    if sample_rate != SAMPLE_RATE:
        check_rates(sample_rate, SAMPLE_RATE, f"{field}.sample_rate")


def decode_pcm(
    data: bytes | memoryview, encoding: Encoding, channels: int, field: str = "audio", offset: int = 0
) -> np.ndarray:
    """Interleaved PCM of whole frames -> [frames, channels] float32 in [-1, 1].

    s16 becomes int16 / 32768 exactly; f32 must be finite and in [-1, 1] (pyannote does not
    clip or normalise, and the fbank assumes that range), else InputError naming `field` and
    the bad frame's index (`offset` = frames before this piece).
    """
    frame_bytes = encoding.itemsize * channels
    if len(data) % frame_bytes:
        raise InputError(
            field,
            f"{len(data)} bytes is not a whole number of {channels}-channel "
            f"{encoding.name.lower()} frames ({frame_bytes} bytes each)",
        )
    raw = np.frombuffer(data, dtype=encoding.value).reshape(-1, channels)
    if encoding is Encoding.S16:
        return raw.astype(np.float32) / np.float32(32768.0)
    samples = raw.astype(np.float32)
    finite = np.isfinite(samples)
    if not finite.all():
        first = offset + int(np.argmin(finite.all(axis=1)))
        raise InputError(field, f"frame {first} holds NaN or Inf; f32 samples must be finite")
    peak = float(np.max(np.abs(samples))) if samples.size else 0.0
    if peak > 1.0:
        first = offset + int(np.argmax(np.any(np.abs(samples) > 1.0, axis=1)))
        raise InputError(
            field, f"|sample| = {peak:.6g} (first at frame {first}); f32 samples must lie in [-1, 1]"
        )
    return samples


def downmix(frames: np.ndarray) -> np.ndarray:
    """[frames, channels] -> [frames] float32: the channels' mean, pyannote's mono="downmix"."""
    if frames.shape[1] == 1:
        return np.ascontiguousarray(frames[:, 0], dtype=np.float32)
    return frames.mean(axis=1, dtype=np.float64).astype(np.float32)


def step_samples(step_s: float, field: str = "header.step_s") -> int:
    """A window step in seconds -> 16 kHz samples; a whole number of 10 ms frames in (0, 10 s]."""
    samples = step_s * SAMPLE_RATE
    if math.isfinite(samples) and 0 < samples <= CHUNK_SAMPLES:
        quanta = round(samples / STEP_QUANTUM_SAMPLES)
        if abs(samples - quanta * STEP_QUANTUM_SAMPLES) <= 1e-6 * STEP_QUANTUM_SAMPLES:
            return quanta * STEP_QUANTUM_SAMPLES
    raise InputError(field, f"{step_s} s, expected a multiple of 0.01 s in (0, 10]")


def complete_windows(samples: int, step: int) -> int:
    """Windows inside the first `samples` (window k covers [k step, k step + 160,000)): full
    windows of the final recording whatever follows, so their fbank is final already."""
    return (samples - CHUNK_SAMPLES) // step + 1 if samples >= CHUNK_SAMPLES else 0


def window_count(samples: int, step: int = STEP_SAMPLES) -> int:
    """Windows `Inference.slide` gives N samples: 1 + (N - W) // S full ones (N >= W), plus a
    padded one iff N < W or (N - W) % S > 0."""
    if samples < 1:
        return 0
    padded = samples < CHUNK_SAMPLES or (samples - CHUNK_SAMPLES) % step > 0
    return complete_windows(samples, step) + int(padded)


def min_num_frames(mask_frames: int) -> int:
    """get_embeddings' ceil(F * min_num_samples / window samples): 2 for F = 589."""
    return -(-mask_frames * MIN_NUM_SAMPLES // CHUNK_SAMPLES)


def exclude_overlap(masks: np.ndarray) -> np.ndarray:
    """[n, s, F] float32 -> the masks `get_embeddings(exclude_overlap=True)` pools under.

    clean = mask * (sum over speakers < 2) per frame; a speaker keeps its clean mask iff
    sum(clean) > min_num_frames(F), else its full mask.
    """
    masks = np.asarray(masks, dtype=np.float32)
    clean = masks * (masks.sum(axis=1, keepdims=True) < 2).astype(np.float32)
    keep_clean = clean.sum(axis=2, keepdims=True) > min_num_frames(masks.shape[2])
    return np.where(keep_clean, clean, masks)


class FbankSource(Protocol):
    """Per-window fbank of one recording, fed 16 kHz mono float32 samples in order.

    Windows become `ready` while the samples arrive (each full window as soon as its last
    sample is in), so their embeddings can be computed before the recording has ended; the
    zero-padded last window is ready after `finish`. The CPU implementation is
    `SharedFrames`; an engine computing fbank on its device implements the same calls.
    """

    def push(self, samples: np.ndarray) -> None:
        """The next 16 kHz samples of the recording."""

    def ready(self) -> int:
        """Windows [0, ready) can be asked for now."""

    def finish(self) -> int:
        """No more samples: return the recording's window count (all of them ready)."""

    def windows(self, start: int, stop: int) -> np.ndarray:
        """[stop - start, 998, 80] float32 fbank of windows [start, stop), each mean-removed;
        stop <= ready()."""


class SharedFrames:
    """FbankSource on the host: the recording's log-mel frames computed once, sliced per window."""

    def __init__(self, step: int = STEP_SAMPLES) -> None:
        self.step = step
        self.step_frames = step // FRAME_SHIFT
        self.samples = 0
        self._frames = np.empty((0, MEL_BINS), dtype=np.float32)
        self._frame_count = 0
        self._pending = np.zeros(0, dtype=np.float32)  # samples from frame _frame_count's first on
        self._recent = np.zeros(0, dtype=np.float32)  # the last CHUNK_SAMPLES samples
        self._count: int | None = None
        self._full = 0
        self._padded: np.ndarray | None = None  # [998, 80] frames of the zero-padded last window

    def push(self, samples: np.ndarray) -> None:
        if self._count is not None:
            raise RuntimeError("push after finish")
        samples = np.asarray(samples, dtype=np.float32)
        self._recent = np.concatenate([self._recent, samples])[-CHUNK_SAMPLES:]
        self._pending = np.concatenate([self._pending, samples])
        new = log_mel_frames(self._pending)
        if new.shape[0]:
            self._append(new)
            self._pending = self._pending[new.shape[0] * FRAME_SHIFT :].copy()
        # counted last: `ready()` (read by other threads) never runs ahead of the frames
        self.samples += samples.shape[0]

    def _append(self, new: np.ndarray) -> None:
        """Grow the frame store geometrically so pushes cost amortised O(new frames)."""
        needed = self._frame_count + new.shape[0]
        if needed > self._frames.shape[0]:
            grown = np.empty((max(needed, 2 * self._frames.shape[0]), MEL_BINS), dtype=np.float32)
            grown[: self._frame_count] = self._frames[: self._frame_count]
            self._frames = grown
        self._frames[self._frame_count : needed] = new
        self._frame_count = needed

    def ready(self) -> int:
        return self._count if self._count is not None else complete_windows(self.samples, self.step)

    def finish(self) -> int:
        if self._count is not None:
            return self._count
        if self.samples < 1:
            raise InputError("audio", "no samples; a recording needs at least one")
        starts = chunk_starts(self.samples, CHUNK_SAMPLES, self.step)
        count = int(starts.shape[0])
        self._full = complete_windows(self.samples, self.step)
        if self._full < count:  # the padded last window: its own frames
            tail = self._recent[self._recent.shape[0] - (self.samples - int(starts[-1])) :]
            window = np.zeros(CHUNK_SAMPLES, dtype=np.float32)
            window[: tail.shape[0]] = tail
            self._padded = log_mel_frames(window)
        self._pending = np.zeros(0, dtype=np.float32)
        self._recent = np.zeros(0, dtype=np.float32)
        # set last, as `push` counts its samples last: once `ready()` (read by the engine's
        # threads) says every window, the padded one's frames are there
        self._count = count
        return count

    def windows(self, start: int, stop: int) -> np.ndarray:
        ready = self.ready()
        if not 0 <= start <= stop <= ready:
            raise IndexError(f"windows [{start}, {stop}) of {ready} ready")
        full = self._full if self._count is not None else ready
        out = np.empty((stop - start, FRAMES, MEL_BINS), dtype=np.float32)
        for row, k in enumerate(range(start, stop)):
            if k < full:
                first = k * self.step_frames
                frames = self._frames[first : first + FRAMES]
            else:
                assert self._padded is not None
                frames = self._padded
            out[row] = frames - frames.mean(axis=0, dtype=np.float64)
        return out


class RecordingDecoder:
    """PCM pieces -> 16 kHz mono -> an FbankSource; pieces may split frames anywhere."""

    def __init__(
        self,
        sample_rate: int,
        channels: int,
        encoding: Encoding,
        source: FbankSource | None = None,
        step: int = STEP_SAMPLES,
        max_seconds: float | None = None,
    ) -> None:
        check_format(sample_rate, channels)
        self.sample_rate, self.channels, self.encoding = sample_rate, channels, encoding
        self.frame_bytes = encoding.itemsize * channels
        self.source: FbankSource = source if source is not None else SharedFrames(step)
        self.max_frames = None if max_seconds is None else int(max_seconds * sample_rate)
        self.frames_in = 0
        self._carry = b""  # bytes of an incomplete PCM frame at a piece's end
        self._resampler = StreamingResampler(sample_rate, SAMPLE_RATE)
        # a source on a device that decodes PCM itself (the GPU engine's) gets the raw bytes:
        # decoding, downmix and resampling then cost the host nothing
        self._raw = hasattr(self.source, "begin_pcm")
        if self._raw:
            self.source.begin_pcm(sample_rate, channels, encoding)  # type: ignore[attr-defined]

    @property
    def seconds(self) -> float:
        return self.frames_in / self.sample_rate

    def ready(self) -> int:
        """Windows whose fbank the source can give now (all of them after `finish`)."""
        return self.source.ready()

    def push(self, data: bytes) -> None:
        """Decode, downmix, resample and feed one piece; InputError naming `audio` if bad."""
        data = self._carry + data if self._carry else data
        whole = len(data) - len(data) % self.frame_bytes
        self._carry = bytes(data[whole:])
        if self._raw:  # the source decodes (and checks f32 values) on its device
            self.frames_in += whole // self.frame_bytes
            self._check_length()
            self.source.push_pcm(memoryview(data)[:whole])  # type: ignore[attr-defined]
            return
        frames = decode_pcm(memoryview(data)[:whole], self.encoding, self.channels, offset=self.frames_in)
        self.frames_in += frames.shape[0]
        self._check_length()
        self.source.push(self._resampler.push(downmix(frames)))

    def _check_length(self) -> None:
        if self.max_frames is not None and self.frames_in > self.max_frames:
            limit = self.max_frames / self.sample_rate
            raise InputError(
                "audio", f"more than {limit:.0f} s of audio; the server's limit is {limit:.0f} s"
            )

    def finish(self) -> int:
        """End of audio: flush the resampler; the recording's window count."""
        if self._carry:
            total = self.frames_in * self.frame_bytes + len(self._carry)
            kind = f"{self.channels}-channel {self.encoding.name.lower()}"
            raise InputError(
                "audio",
                f"{total} bytes is not a whole number of {kind} frames ({self.frame_bytes} bytes each)",
            )
        if self.frames_in == 0:
            raise InputError("audio", "no samples; a recording needs at least one")
        if not self._raw:
            self.source.push(self._resampler.finish())
        return self.source.finish()


def window_starts_s(start: int, stop: int, step: int = STEP_SAMPLES) -> np.ndarray:
    """Start times in seconds of windows [start, stop) (the padded last one included), float64."""
    return np.arange(start, stop, dtype=np.float64) * step / SAMPLE_RATE

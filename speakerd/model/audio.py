"""Deterministic synthetic multi-speaker "speech" with known speaker turns, and its masks.

No speech corpus or TTS voice can be fetched on these machines, yet BatchNorm calibration
and the reference cases need audio whose fbank looks like speech (harmonic stacks under
moving formants, a syllabic rhythm, fricative noise, pauses) and masks that come from known
turns. This module synthesises that in pure NumPy, fast (a 40 s recording in ~0.1 s):

- each speaker has its own pitch (F0), vocal-tract length (formant scale) and loudness;
- a turn is a run of syllables (~4 per second); a syllable is an optional unvoiced noise
  burst (fricative) followed by a voiced vowel: a glottal pulse train at a gliding F0,
  filtered by three formant resonances that glide from one vowel to the next;
- the schedule alternates conversation among all speakers (with overlaps and short gaps),
  pauses of silence, and a long duet in which one speaker is absent from whole chunks.

`speaker_masks` turns the known turns into pyannote segmentation-3.0 frame masks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from speakerd.model.architecture import MASK_FRAMES, MAX_SPEAKERS, SAMPLE_RATE

# pyannote segmentation-3.0 (PyanNet, SincNet stride 10) frame timing, from its receptive field:
# conv1d k=251 stride 10, then three max-pools k=3 stride 3 around two conv1d k=5. One output
# frame advances 10 * 3 * 3 * 3 = 270 samples (16.875 ms) and sees 991 samples (61.94 ms),
# centred 495 samples after its first sample: 589 frames per 160,000-sample chunk. (The
# segmentation package derives the same numbers from its layers and imports this module, so
# they are stated here rather than imported from it.)
SEGMENTATION_STEP_SAMPLES = 270
SEGMENTATION_FIELD_SAMPLES = 991
SEGMENTATION_CENTER_SAMPLES = (SEGMENTATION_FIELD_SAMPLES - 1) // 2

#: Peak level of the mix: speech-like headroom, well inside [-1, 1].
PEAK = 0.5
#: A microphone noise floor (~ -74 dBFS) so that silence is not digital zero.
NOISE_FLOOR = 1e-3
#: Syllable durations (s): ~4 syllables per second.
SYLLABLE_S = (0.16, 0.34)
#: Turn durations (s) and the gap before the next turn: negative gaps are overlaps.
TURN_S = (0.9, 3.0)
OVERLAP_S = (0.25, 0.8)
GAP_S = (0.05, 0.4)
#: Section lengths (s): the duet is long enough (>= 10 s + 1 s step) that some 10 s chunk
#: lies entirely inside it, so the third speaker is absent from that chunk.
CONVERSATION_S = 9.0
PAUSE_S = 1.6
DUET_S = 12.5
#: (F1, F2, F3) in Hz of a few vowels for an adult male vocal tract (i, e, a, o, u, schwa).
VOWELS = np.array(
    [
        [270, 2290, 3010],
        [530, 1840, 2480],
        [730, 1090, 2440],
        [570, 840, 2410],
        [300, 870, 2240],
        [500, 1500, 2500],
    ],
    dtype=np.float64,
)
#: Formant bandwidths (Hz) of the three resonances.
BANDWIDTHS = np.array([80.0, 110.0, 160.0])
#: The glottal source rolls off above this corner (first order, -6 dB/oct), on top of the
#: resonances' own -12 dB/oct: speech's high bands sit 20-30 dB below its formants.
GLOTTAL_CORNER_HZ = 300.0
#: Formant kernel length: the resonances have decayed by > 60 dB after 25 ms.
KERNEL_SAMPLES = 400


@dataclass(frozen=True)
class Turn:
    """One speaker talking from start_s to end_s (seconds from the recording's start)."""

    speaker: int
    start_s: float
    end_s: float


@dataclass(frozen=True)
class Recording:
    """Mono float32 audio in [-1, 1] with the turns that produced it."""

    samples: np.ndarray  # [N] float32
    turns: tuple[Turn, ...]
    sample_rate: int = SAMPLE_RATE

    @property
    def seconds(self) -> float:
        return self.samples.shape[0] / self.sample_rate

    @property
    def speakers(self) -> int:
        return 1 + max((turn.speaker for turn in self.turns), default=-1)


@dataclass(frozen=True)
class _Voice:
    f0: float  # mean pitch (Hz)
    tract: float  # formant scale: shorter tracts (higher voices) have higher formants
    gain: float


def _voices(rng: np.random.Generator, speakers: int) -> list[_Voice]:
    """Distinct voices: low male, high female, in between; jittered per seed."""
    base = [(110.0, 1.0), (215.0, 1.17), (160.0, 1.08)]
    return [
        _Voice(
            f0=base[k % 3][0] * rng.uniform(0.92, 1.08),
            tract=base[k % 3][1] * rng.uniform(0.97, 1.03),
            gain=rng.uniform(0.7, 1.0),
        )
        for k in range(speakers)
    ]


def _schedule(rng: np.random.Generator, seconds: float, speakers: int) -> list[Turn]:
    """Turns for conversation / pause / duet sections, cycling until `seconds`."""
    turns: list[Turn] = []
    t = 0.4  # a short leading silence, as recordings have
    section = 0
    while t < seconds - 0.3:
        kind = ("conversation", "pause", "duet", "pause")[section % 4]
        section += 1
        if kind == "pause":
            t += PAUSE_S
            continue
        cast = list(range(speakers)) if kind == "conversation" or speakers < 3 else [0, 1]
        end_of_section = min(seconds, t + (CONVERSATION_S if kind == "conversation" else DUET_S))
        previous = -1
        while t < end_of_section - 0.3:
            choices = [s for s in cast if s != previous] or cast
            speaker = int(choices[rng.integers(len(choices))])
            # a speaker never overlaps themself: start after their own previous turn
            t = max([t] + [turn.end_s + 0.1 for turn in turns if turn.speaker == speaker])
            if t >= end_of_section - 0.3:
                break
            end = min(end_of_section, t + rng.uniform(*TURN_S))
            turns.append(Turn(speaker, round(t, 4), round(end, 4)))
            previous = speaker
            overlap = len(cast) > 1 and rng.uniform() < 0.35
            t = end - rng.uniform(*OVERLAP_S) if overlap else end + rng.uniform(*GAP_S)
            t = max(t, turns[-1].start_s + 0.3)
        t = max(t, end_of_section)
    return turns


def _formant_kernel(formants: np.ndarray) -> np.ndarray:
    """Impulse response of three parallel resonances with a glottal roll-off built in."""
    time = np.arange(KERNEL_SAMPLES) / SAMPLE_RATE
    decay = np.exp(-np.pi * BANDWIDTHS[:, None] * time[None, :])
    gains = np.array([1.0, 0.7, 0.5])[:, None]  # with the glottal tilt, F1 dominates as in speech
    kernel = (gains * decay * np.sin(2 * np.pi * formants[:, None] * time[None, :])).sum(axis=0)
    return kernel / np.abs(kernel).sum()


def _syllable(
    rng: np.random.Generator, voice: _Voice, samples: int, f0_start: float
) -> tuple[np.ndarray, float]:
    """One syllable: optional fricative burst, then a voiced vowel gliding between two vowels."""
    out = np.zeros(samples)
    burst = min(samples // 3, int(rng.uniform(0.02, 0.07) * SAMPLE_RATE)) if rng.uniform() < 0.5 else 0
    if burst:
        spectrum = rng.standard_normal(burst // 2 + 1) + 1j * rng.standard_normal(burst // 2 + 1)
        freqs = np.fft.rfftfreq(burst, 1 / SAMPLE_RATE)
        center = rng.uniform(2500, 6500)
        spectrum *= np.exp(-0.5 * ((freqs - center) / 1200.0) ** 2)
        noise = np.fft.irfft(spectrum, n=burst)
        out[:burst] = 0.35 * noise / (np.abs(noise).max() + 1e-12) * np.hanning(burst)
    voiced = samples - burst
    f0_end = f0_start * rng.uniform(0.85, 1.12)
    if voiced > KERNEL_SAMPLES // 2:
        f0 = np.linspace(f0_start, f0_end, voiced) * (
            1 + 0.01 * np.sin(np.arange(voiced) * 2 * np.pi * 5.5 / SAMPLE_RATE)
        )
        phase = np.cumsum(f0) / SAMPLE_RATE
        pulses = np.zeros(voiced)
        pulses[np.flatnonzero(np.diff(np.floor(phase), prepend=0.0) > 0)] = 1.0
        first, second = VOWELS[rng.integers(len(VOWELS), size=2)] * voice.tract
        size = 1 << int(np.ceil(np.log2(voiced + KERNEL_SAMPLES)))
        tilt = 1.0 / (1.0 + 1j * np.fft.rfftfreq(size, 1 / SAMPLE_RATE) / GLOTTAL_CORNER_HZ)
        spectrum = np.fft.rfft(pulses, size) * tilt
        sounds = [
            np.fft.irfft(spectrum * np.fft.rfft(_formant_kernel(f), size), size)[:voiced]
            for f in (first, second)
        ]
        glide = np.linspace(0.0, 1.0, voiced)
        vowel = (1 - glide) * sounds[0] + glide * sounds[1]
        envelope = np.sin(np.pi * np.linspace(0, 1, voiced)) ** 0.7  # syllabic rise and fall
        out[burst:] = vowel * envelope / (np.abs(vowel).max() + 1e-12)
    return out, f0_end


def _speak(rng: np.random.Generator, voice: _Voice, samples: int) -> np.ndarray:
    """A turn of `samples`: syllables back to back, pitch declining over the phrase."""
    out = np.zeros(samples)
    position = 0
    f0 = voice.f0 * rng.uniform(1.0, 1.15)
    while position < samples:
        length = min(samples - position, int(rng.uniform(*SYLLABLE_S) * SAMPLE_RATE))
        piece, f0 = _syllable(rng, voice, length, f0)
        out[position : position + length] = piece
        position += length
        f0 = float(
            np.clip(0.5 * f0 + 0.5 * voice.f0 * rng.uniform(0.9, 1.1), 0.75 * voice.f0, 1.3 * voice.f0)
        )
    fade = min(samples // 2, SAMPLE_RATE // 100)  # 10 ms fades: no clicks at turn edges
    if fade:
        ramp = np.linspace(0.0, 1.0, fade)
        out[:fade] *= ramp
        out[samples - fade :] *= ramp[::-1]
    return out * voice.gain


def synthetic_recording(seconds: float, seed: int, speakers: int = MAX_SPEAKERS) -> Recording:
    """A deterministic speech-like recording of `seconds` with known turns (see module doc)."""
    if not 1 <= speakers <= MAX_SPEAKERS:
        raise ValueError(
            f"speakers={speakers}, expected 1..{MAX_SPEAKERS} (the masks have {MAX_SPEAKERS} rows)"
        )
    if seconds <= 0:
        raise ValueError(f"seconds={seconds}, expected > 0")
    rng = np.random.default_rng(seed)
    voices = _voices(rng, speakers)
    turns = _schedule(rng, seconds, speakers)
    total = round(seconds * SAMPLE_RATE)
    mix = np.zeros(total)
    for turn in turns:
        start, end = round(turn.start_s * SAMPLE_RATE), round(turn.end_s * SAMPLE_RATE)
        mix[start:end] += _speak(rng, voices[turn.speaker], end - start)
    mix *= PEAK / max(float(np.abs(mix).max()), 1e-12)
    mix += NOISE_FLOOR * rng.standard_normal(total)
    return Recording(np.clip(mix, -1.0, 1.0).astype(np.float32), tuple(turns))


def speaker_masks(recording: Recording, starts: np.ndarray, frames: int = MASK_FRAMES) -> np.ndarray:
    """[n, 3, frames] float32: 1 where a speaker's turn covers the frame's centre, else 0.

    Frame i of the chunk starting at sample `start` is centred at start + 495 + 270 i samples
    (segmentation-3.0 timing above) when frames = 589; for another frame count the step is
    scaled so the frames still tile the 10 s chunk. Speaker k is local speaker k; beyond the
    recording's end (a padded last chunk) every mask is 0.
    """
    starts = np.asarray(starts, dtype=np.int64)
    offsets = (
        SEGMENTATION_CENTER_SAMPLES
        + (np.arange(frames) * (MASK_FRAMES * SEGMENTATION_STEP_SAMPLES)) // frames
    )
    centers = (starts[:, None] + offsets[None, :]) / recording.sample_rate  # seconds, [n, frames]
    masks = np.zeros((starts.shape[0], MAX_SPEAKERS, frames), dtype=np.float32)
    inside = centers < recording.seconds
    for turn in recording.turns:
        masks[:, turn.speaker] += (centers >= turn.start_s) & (centers < turn.end_s) & inside
    return np.minimum(masks, 1.0)

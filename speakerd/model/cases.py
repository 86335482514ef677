"""Reference cases (docs/model.md): their inputs, and reading the files that hold ONNX Runtime's outputs.

The inputs are pure functions of fixed seeds (NumPy only), so the thin client's `verify`,
the server's self-check and the tests all build the same chunks; `speakerd.reference`
(which needs ONNX Runtime) runs the reference on them and writes the files.

Inputs come from synthetic speech-like recordings with known speaker turns
(`speakerd.model.audio`), chunked as pyannote does (`speakerd.model.fbank.chunk_recording`), so the masks
have overlap, silence, absent speakers and a zero-padded last chunk for real reasons:

| case | what it is |
|---|---|
| first_b1 | the first 10 s chunk of a 25.5 s three-speaker conversation |
| last_partial_b1 | that recording's last chunk: 9.5 s of audio, zero-padded |
| short_partial_b1 | a 6.5 s two-speaker recording: one chunk, 3.5 s of padding, speaker 2 empty |
| empty_mask_b1 | a chunk with masks [its speaker 0, all zero, all one] |
| one_frame_b1 | a chunk whose speakers each have one active trunk frame (t = 0, 62, 124) |
| soft_masks_b1 | a chunk with soft masks in (0, 1): the turns smoothed and rescaled |
| mixed_b32 | 32 chunks: the 17 of the conversation (first and last among them), the short, |
|  | empty-mask, one-frame and soft-mask chunks, and 11 chunks of a third recording |

Determinism: inputs are pure functions of fixed seeds, ORT runs one thread sequentially,
the safetensors writer serialises keys in a fixed order and the metadata holds no time or
path, so two runs on one machine give byte-identical files.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from speakerd.model.architecture import MASK_FRAMES, MAX_SPEAKERS, TAP_NAMES, TRUNK_FRAMES
from speakerd.model.audio import Recording, speaker_masks, synthetic_recording
from speakerd.model.fbank import chunk_recording, fbank

#: Seeds of the reference recordings; distinct from the synthetic model's calibration audio.
CONVERSATION_SEED = 1
SHORT_SEED = 2
EXTRA_SEED = 3
#: 25.5 s: 16 full windows and a last one with 9.5 s of audio (pyannote's 1 s step).
CONVERSATION_SECONDS = 25.5
#: Shorter than one chunk: pyannote pads it to 10 s; two speakers leave speaker 2 empty.
SHORT_SECONDS = 6.5
SHORT_SPEAKERS = 2
#: 20 s gives 11 full windows, exactly filling mixed_b32 up to 32 chunks.
EXTRA_SECONDS = 20.0
#: The conversation chunk the edge cases reuse (a chunk with all three speakers active).
EDGE_CHUNK = 3
#: Trunk frames each speaker of one_frame_b1 keeps; mask frame floor(t * 589 / 125) feeds t.
ONE_FRAME_TRUNK_FRAMES = (0, TRUNK_FRAMES // 2, TRUNK_FRAMES - 1)
#: Soft masks: turns smoothed by a 25-frame (~0.4 s) moving average, mapped into [0.1, 0.9].
SOFT_SMOOTHING_FRAMES = 25
SOFT_FLOOR, SOFT_CEIL = 0.1, 0.9
BATCH_CASE = "mixed_b32"
B1_CASES = (
    "first_b1",
    "last_partial_b1",
    "short_partial_b1",
    "empty_mask_b1",
    "one_frame_b1",
    "soft_masks_b1",
)
CASE_NAMES = (*B1_CASES, BATCH_CASE)
FILE_SUFFIX = ".safetensors"
#: The one safetensors metadata key; its value is the case's metadata as sorted JSON.
METADATA_KEY = "speakerd"


@dataclass(frozen=True)
class ReferenceCase:
    """One reference file: inputs, every stored tap (incl. `output`), and the output itself."""

    name: str
    fbank: np.ndarray  # [n, 998, 80] float32
    masks: np.ndarray  # [n, 3, 589] float32
    taps: dict[str, np.ndarray]  # tap -> float32; every TAP_NAMES entry in b1 cases, else `output` only
    output: np.ndarray  # [n * 3, 256] float32, row = chunk * 3 + speaker
    metadata: dict[str, str]

    @property
    def chunks(self) -> int:
        return int(self.fbank.shape[0])


@dataclass(frozen=True)
class _Chunked:
    fbank: np.ndarray  # [n, 998, 80]
    masks: np.ndarray  # [n, 3, 589]


def _chunked(recording: Recording) -> _Chunked:
    chunks = chunk_recording(recording.samples)
    return _Chunked(fbank(chunks.waveforms), speaker_masks(recording, chunks.starts, MASK_FRAMES))


def _one_frame_masks() -> np.ndarray:
    """[3, 589]: speaker s has the single mask frame that trunk frame ONE_FRAME_TRUNK_FRAMES[s] reads."""
    masks = np.zeros((MAX_SPEAKERS, MASK_FRAMES), dtype=np.float32)
    for speaker, trunk_frame in enumerate(ONE_FRAME_TRUNK_FRAMES):
        masks[speaker, (trunk_frame * MASK_FRAMES) // TRUNK_FRAMES] = 1.0
    return masks


def _soft_masks(hard: np.ndarray) -> np.ndarray:
    """[3, 589] binary -> soft values in [SOFT_FLOOR, SOFT_CEIL] (never 0, never 1)."""
    kernel = np.full(SOFT_SMOOTHING_FRAMES, 1.0 / SOFT_SMOOTHING_FRAMES)
    smooth = np.stack([np.convolve(row.astype(np.float64), kernel, mode="same") for row in hard])
    return (SOFT_FLOOR + (SOFT_CEIL - SOFT_FLOOR) * smooth).astype(np.float32)


@lru_cache(maxsize=1)
def _conversation() -> Recording:
    return synthetic_recording(CONVERSATION_SECONDS, CONVERSATION_SEED)


@lru_cache(maxsize=1)
def _first_chunk() -> tuple[np.ndarray, np.ndarray]:
    """first_b1 alone: the conversation's first chunk, without the other 16 chunks' fbank or
    the other recordings. It is the server's self-check case, made at every start, where the
    whole set took 0.95 s of CPU and this 0.2 s; `_all_inputs` asserts the two agree to the bit."""
    recording = _conversation()
    chunks = chunk_recording(recording.samples)
    first_fbank = np.ascontiguousarray(fbank(chunks.waveforms[:1]))
    return first_fbank, np.ascontiguousarray(speaker_masks(recording, chunks.starts[:1], MASK_FRAMES))


@dataclass(frozen=True)
class _Inputs:
    cases: dict[str, tuple[np.ndarray, np.ndarray]]  # name -> (fbank, masks)
    mixed_rows: dict[str, int]  # b1 case -> its chunk index in mixed_b32


@lru_cache(maxsize=1)
def _all_inputs() -> _Inputs:
    """Every case's (fbank, masks), from the seeded recordings; independent of the weights."""
    conversation = _chunked(_conversation())
    short = _chunked(synthetic_recording(SHORT_SECONDS, SHORT_SEED, speakers=SHORT_SPEAKERS))
    extra = _chunked(synthetic_recording(EXTRA_SECONDS, EXTRA_SEED))
    assert short.fbank.shape[0] == 1, f"short recording gave {short.fbank.shape[0]} chunks, expected 1"
    edge_fbank = conversation.fbank[EDGE_CHUNK : EDGE_CHUNK + 1]
    edge_masks = conversation.masks[EDGE_CHUNK]
    empty = np.stack([edge_masks[0], np.zeros(MASK_FRAMES), np.ones(MASK_FRAMES)]).astype(np.float32)
    cases = {
        "first_b1": (conversation.fbank[:1], conversation.masks[:1]),
        "last_partial_b1": (conversation.fbank[-1:], conversation.masks[-1:]),
        "short_partial_b1": (short.fbank, short.masks),
        "empty_mask_b1": (edge_fbank, empty[None]),
        "one_frame_b1": (edge_fbank, _one_frame_masks()[None]),
        "soft_masks_b1": (edge_fbank, _soft_masks(edge_masks)[None]),
    }
    last = conversation.fbank.shape[0] - 1
    rows = {"first_b1": 0, "last_partial_b1": last}
    pieces = [(conversation.fbank, conversation.masks)]
    for offset, name in enumerate(("short_partial_b1", "empty_mask_b1", "one_frame_b1", "soft_masks_b1"), 1):
        rows[name] = last + offset
        pieces.append(cases[name])
    pieces.append((extra.fbank, extra.masks))
    cases[BATCH_CASE] = (
        np.concatenate([piece[0] for piece in pieces]),
        np.concatenate([piece[1] for piece in pieces]),
    )
    assert cases[BATCH_CASE][0].shape[0] == 32, f"mixed case has {cases[BATCH_CASE][0].shape[0]} chunks"
    for name, row in rows.items():
        assert np.array_equal(cases[BATCH_CASE][0][row], cases[name][0][0]), f"{name} is not chunk {row}"
    first_fbank, first_masks = _first_chunk()
    assert np.array_equal(cases["first_b1"][0], first_fbank) and np.array_equal(
        cases["first_b1"][1], first_masks
    ), "first_b1 made alone differs from the conversation's first chunk"
    contiguous = {name: (np.ascontiguousarray(f), np.ascontiguousarray(m)) for name, (f, m) in cases.items()}
    return _Inputs(contiguous, rows)


def mixed_rows() -> dict[str, int]:
    """Which chunk of mixed_b32 each b1 case is, for batch-invariance checks."""
    return dict(_all_inputs().mixed_rows)


def case_inputs(name: str) -> tuple[np.ndarray, np.ndarray]:
    """(fbank [n, 998, 80], masks [n, 3, 589]) of a case, as copies the caller may modify."""
    if name == "first_b1":  # the self-check's case: made alone (_first_chunk)
        fbank_in, masks_in = _first_chunk()
    else:
        inputs = _all_inputs().cases
        if name not in inputs:
            raise KeyError(f"unknown reference case {name!r}; cases are {', '.join(CASE_NAMES)}")
        fbank_in, masks_in = inputs[name]
    return fbank_in.copy(), masks_in.copy()


def save_case(
    path: str | Path,
    fbank: np.ndarray,
    masks: np.ndarray,
    taps: dict[str, np.ndarray],
    metadata: dict[str, str],
) -> None:
    """Write one case file as `load_case` reads it: `input/fbank`, `input/masks`, a
    `tensor/<tap>` per tap (`output` among them). safetensors writes metadata from a hash map
    (its key order varies between runs), so it all goes under METADATA_KEY as sorted JSON and
    the tensors in sorted key order: the same case gives the same bytes every run."""
    tensors = {f"tensor/{tap}": value for tap, value in taps.items()}
    tensors["input/fbank"] = fbank
    tensors["input/masks"] = masks
    packed = {METADATA_KEY: json.dumps(metadata, sort_keys=True)}
    save_file({key: tensors[key] for key in sorted(tensors)}, str(path), metadata=packed)


def load_case(path: str | Path) -> ReferenceCase:
    """Read one reference file; KeyError naming the missing key when it is not a case."""
    tensors: dict[str, np.ndarray] = {}
    with safe_open(str(path), framework="numpy") as handle:
        stored = dict(handle.metadata() or {})
        metadata = json.loads(stored[METADATA_KEY]) if METADATA_KEY in stored else stored
        for key in handle.keys():  # noqa: SIM118 - safe_open is not a Mapping
            tensors[key] = handle.get_tensor(key)
    for key in ("input/fbank", "input/masks", "tensor/output"):
        if key not in tensors:
            raise KeyError(f"{path}: no {key!r}; not a reference case")
    taps = {key.removeprefix("tensor/"): value for key, value in tensors.items() if key.startswith("tensor/")}
    unknown = sorted(set(taps) - set(TAP_NAMES))
    if unknown:
        raise KeyError(f"{path}: unknown tap {unknown[0]!r}")
    name = metadata.get("case", Path(path).name.removesuffix(FILE_SUFFIX))
    return ReferenceCase(
        name, tensors["input/fbank"], tensors["input/masks"], taps, tensors["tensor/output"], metadata
    )


def load_cases(directory: str | Path) -> list[ReferenceCase]:
    """Every case in `directory`, in CASE_NAMES order; FileNotFoundError naming a missing one."""
    cases = []
    for name in CASE_NAMES:
        path = Path(directory) / f"{name}{FILE_SUFFIX}"
        if not path.is_file():
            raise FileNotFoundError(f"reference case {name} missing: no {path} (run make-references)")
        cases.append(load_case(path))
    return cases

"""The files a client command reads and writes, each checked before any call is made.

A user's file that cannot be used (missing, empty, text where audio or an array was meant,
an archive without the array it needs) is a `UsageError` naming the flag, the file and what
was expected: the command line prints that one line and exits 2, instead of the reader's
traceback (libsndfile's, NumPy's pickle refusal, a KeyError) and before a call is made.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np

#: What `embed --input` expects, said in every message about it.
INPUT_LAYOUT = "an .npz (numpy.savez) of fbank [n, 998, 80] or waveform [n, 160000], and masks [n, s, F]"
#: What `embed --masks` expects.
MASKS_LAYOUT = "a .npy (numpy.save) of masks [n, s, F], float32 in [0, 1] or uint8, one row per window"
#: What `embed --audio` expects.
AUDIO_LAYOUT = (
    "audio libsndfile reads (WAV, FLAC, OGG, ...), or a .npy [N] or [N, channels] with --sample-rate"
)
#: soundfile subtypes whose samples are exactly 16-bit integers: sent as PCM s16 (half the
#: bytes of f32, and bit-exact); any other file is read as float32 and sent as f32.
INT16_SUBTYPES = frozenset({"PCM_16"})


class UsageError(ValueError):
    """A flag or file the command cannot use: one line naming it and what was expected (exit 2)."""


def _existing(flag: str, path: str | Path, expected: str) -> Path:
    path = Path(path)
    if not path.exists():
        raise UsageError(f"{flag} {path}: no such file (expected {expected})")
    if path.is_dir():
        raise UsageError(f"{flag} {path}: is a directory (expected {expected})")
    if path.stat().st_size == 0:
        raise UsageError(f"{flag} {path}: the file is empty (expected {expected})")
    return path


def _array(flag: str, path: Path, expected: str) -> np.ndarray | np.lib.npyio.NpzFile:
    """np.load without pickles; a file that is not NumPy's is a UsageError, not NumPy's message
    (which, for any file that is not .npy or .npz, speaks of pickled data)."""
    try:
        return np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError, zipfile.BadZipFile):
        raise UsageError(f"{flag} {path}: not a NumPy .npy or .npz file (expected {expected})") from None


def _first_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return text[:160] or type(error).__name__


def read_chunks(path: str | Path) -> tuple[str, np.ndarray, np.ndarray]:
    """`embed --input`: ("fbank" or "waveform", that array, masks) of an .npz."""
    path = _existing("--input", path, INPUT_LAYOUT)
    data = _array("--input", path, INPUT_LAYOUT)
    if not isinstance(data, np.lib.npyio.NpzFile):
        raise UsageError(f"--input {path}: a single array (.npy), expected {INPUT_LAYOUT}")
    with data:
        names = sorted(data.files)
        kind = next((name for name in ("fbank", "waveform") if name in names), None)
        if kind is None or "masks" not in names:
            absent = (("fbank or waveform", kind is None), ("masks", "masks" not in names))
            missing = " and ".join(part for part, is_absent in absent if is_absent)
            raise UsageError(f"--input {path}: holds {', '.join(names) or 'no arrays'}, no {missing} "
                             f"(expected {INPUT_LAYOUT})")  # fmt: skip
        try:
            return kind, data[kind], data["masks"]
        except (ValueError, OSError, zipfile.BadZipFile) as error:
            raise UsageError(f"--input {path}: cannot read its arrays ({_first_line(error)})") from None


def read_masks(path: str | Path) -> np.ndarray:
    """`embed --masks`: a [n, s, F] array from a .npy (or the `masks` of an .npz)."""
    path = _existing("--masks", path, MASKS_LAYOUT)
    data = _array("--masks", path, MASKS_LAYOUT)
    if isinstance(data, np.lib.npyio.NpzFile):
        with data:
            if "masks" not in data.files:
                raise UsageError(f"--masks {path}: an .npz without masks (expected {MASKS_LAYOUT})")
            data = data["masks"]
    if data.ndim != 3:
        raise UsageError(f"--masks {path}: shape {tuple(data.shape)}, expected {MASKS_LAYOUT}")
    return data


def read_audio(
    path: str | Path, sample_rate: int | None = None, flag: str = "--audio"
) -> tuple[np.ndarray, int]:
    """(samples [N, C], rate) of any file libsndfile reads (WAV, FLAC, OGG, ...), or of a .npy
    array [N] / [N, C] with `sample_rate`. 16-bit files stay int16; others become float32
    in [-1, 1], the samples pyannote's `Audio` reads. UsageError naming `flag` and the file
    when it cannot be read or holds no samples."""
    path = _existing(flag, path, AUDIO_LAYOUT)
    if path.suffix == ".npy":
        if sample_rate is None:
            raise UsageError(f"{flag} {path}: a .npy recording needs --sample-rate HZ")
        samples = _array(flag, path, AUDIO_LAYOUT)
        if isinstance(samples, np.lib.npyio.NpzFile) or samples.ndim not in (1, 2) or samples.size == 0:
            raise UsageError(f"{flag} {path}: not samples [N] or [N, channels] (expected {AUDIO_LAYOUT})")
        return samples, sample_rate
    import soundfile  # the client's audio reader (libsndfile), loaded only for audio files

    try:
        info = soundfile.info(str(path))
        dtype = "int16" if info.subtype in INT16_SUBTYPES else "float32"
        samples, rate = soundfile.read(str(path), dtype=dtype, always_2d=True)
    except (soundfile.SoundFileError, RuntimeError) as error:
        raise UsageError(f"{flag} {path}: not audio libsndfile can read ({_first_line(error)}; "
                         f"expected {AUDIO_LAYOUT})") from None  # fmt: skip
    if samples.shape[0] == 0:
        raise UsageError(f"{flag} {path}: holds no samples (expected {AUDIO_LAYOUT})")
    return samples, int(rate)


def writable(flag: str, path: str | Path) -> Path:
    """`--output`: a path whose directory exists, checked before the call (so no work is lost)."""
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"{flag} {path}: is a directory (expected a file to write)")
    if not path.parent.is_dir():
        raise UsageError(f"{flag} {path}: directory {path.parent} does not exist")
    return path

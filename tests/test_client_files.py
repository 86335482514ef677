"""A user's file that a client command cannot use is one line naming it, exit 2, no traceback.

Every file a command reads is checked before any call: a missing, empty or text file given
as audio, an .npz without masks, a text file as --masks, a directory of non-cases as
--references, a TLS file that is not there, an --output whose directory does not exist. The
line names the flag, the file and what was expected. No server runs here: nothing listens
on the target, so a command that got as far as calling would fail with exit 1 instead.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import soundfile

from speakerd.client.cli import main
from speakerd.model.architecture import FRAMES, MASK_FRAMES, MEL_BINS
from speakerd.model.cases import CASE_NAMES, FILE_SUFFIX


def _closed_target() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


def _text(path: Path) -> Path:
    path.write_text("this is not audio, nor an array\n")
    return path


def _empty(path: Path) -> Path:
    path.write_bytes(b"")
    return path


def _wav(path: Path, seconds: float = 1.0) -> Path:
    soundfile.write(path, np.zeros(int(16_000 * seconds), np.int16), 16_000, subtype="PCM_16")
    return path


def _masks(path: Path) -> Path:
    np.save(path, np.ones((1, 3, MASK_FRAMES), np.float32))
    return path


def _npz_without_masks(path: Path) -> Path:
    np.savez(path, fbank=np.zeros((1, FRAMES, MEL_BINS), np.float32))
    return path


def _npz_without_chunks(path: Path) -> Path:
    np.savez(path, masks=np.ones((1, 3, MASK_FRAMES), np.float32))
    return path


def _masks_2d(path: Path) -> Path:
    np.save(path, np.ones((3, MASK_FRAMES), np.float32))
    return path


def _not_cases(path: Path) -> Path:
    path.mkdir()
    for name in CASE_NAMES:
        _text(path / f"{name}{FILE_SUFFIX}")
    return path


#: (case id, argv with {placeholders} for files made by the makers, makers, what the line says)
CASES: list[tuple[str, list[str], dict[str, Callable[[Path], Path]], list[str]]] = [
    ("audio-missing", ["embed", "--audio", "{missing}", "--masks", "{masks}", "--output", "{out}"],
     {"masks": _masks}, ["--audio", "missing.wav", "no such file", "WAV, FLAC"]),
    ("audio-text", ["embed", "--audio", "{audio}", "--masks", "{masks}", "--output", "{out}"],
     {"audio": _text, "masks": _masks}, ["--audio", "audio.wav", "not audio libsndfile can read"]),
    ("audio-empty", ["embed", "--audio", "{audio}", "--masks", "{masks}", "--output", "{out}"],
     {"audio": _empty, "masks": _masks}, ["--audio", "audio.wav", "the file is empty"]),
    ("audio-no-samples", ["embed", "--audio", "{audio}", "--masks", "{masks}", "--output", "{out}"],
     {"audio": lambda p: _wav(p, 0.0), "masks": _masks}, ["--audio", "audio.wav", "holds no samples"]),
    ("audio-without-masks", ["embed", "--audio", "{audio}", "--output", "{out}"],
     {"audio": _wav}, ["--audio needs --masks"]),
    ("masks-text", ["embed", "--audio", "{audio}", "--masks", "{masks}", "--output", "{out}"],
     {"audio": _wav, "masks": _text}, ["--masks", "masks.npy", "not a NumPy .npy or .npz file", "[n, s, F]"]),
    ("masks-2d", ["embed", "--audio", "{audio}", "--masks", "{masks}", "--output", "{out}"],
     {"audio": _wav, "masks": _masks_2d}, ["--masks", "masks.npy", "shape (3, 589)", "[n, s, F]"]),
    ("input-without-masks", ["embed", "--input", "{input}", "--output", "{out}"],
     {"input": _npz_without_masks}, ["--input", "input.npz", "holds fbank, no masks"]),
    ("input-without-chunks", ["embed", "--input", "{input}", "--output", "{out}"],
     {"input": _npz_without_chunks}, ["--input", "input.npz", "no fbank or waveform"]),
    ("input-text", ["embed", "--input", "{input}", "--output", "{out}"],
     {"input": _text}, ["--input", "input.npz", "not a NumPy .npy or .npz file", "fbank [n, 998, 80]"]),
    ("input-missing", ["embed", "--input", "{missing}", "--output", "{out}"],
     {}, ["--input", "missing.wav", "no such file"]),
    ("no-input", ["embed", "--output", "{out}"], {}, ["give --input FILE.npz, or --audio FILE"]),
    ("output-directory-missing", ["embed", "--input", "{input}", "--output", "{missing}/out.npz"],
     {"input": _masks}, ["--output", "missing.wav/out.npz", "does not exist"]),
    ("references-missing", ["verify", "--references", "{missing}"],
     {}, ["--references", "missing.wav", "reference case first_b1 missing"]),
    ("references-not-cases", ["verify", "--references", "{references}"],
     {"references": _not_cases}, ["--references", "is not a reference case", "make-references"]),
    ("tls-ca-missing", ["info", "--tls-ca", "{missing}"], {}, ["--tls-ca", "missing.wav", "no such file"]),
    ("token-file-empty", ["info", "--token-file", "{token}"], {"token": _empty},
     ["--token-file", "no token"]),
    ("load-seconds", ["load", "--seconds", "0"], {}, ["--seconds 0", "expected seconds > 0"]),
    ("load-streams", ["load", "--streams", "0"], {}, ["--streams 0", "expected 1 or more"]),
    ("load-recording", ["load", "--recording", "-5"], {}, ["--recording -5", "expected positive numbers"]),
]  # fmt: skip
#: File names the placeholders stand for (suffixes as a user would give them).
NAMES = {"audio": "audio.wav", "masks": "masks.npy", "input": "input.npz", "references": "refs",
         "token": "token", "missing": "missing.wav", "out": "out.npz"}  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "makers", "expected"), [case[1:] for case in CASES], ids=[c[0] for c in CASES]
)
def test_unusable_file_is_one_line_exit_2(
    argv: list[str], makers: dict[str, Callable[[Path], Path]], expected: list[str], tmp_path: Path, capsys
) -> None:
    paths = {key: tmp_path / name for key, name in NAMES.items()}
    for key, make in makers.items():
        make(paths[key])
    filled = [part.format(**{key: str(path) for key, path in paths.items()}) for part in argv]
    code = main([*filled, "--target", _closed_target()])
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2, (code, captured.err)
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    assert all(text in lines[0] for text in expected), (expected, lines[0])
    assert captured.out == "", captured.out  # nothing printed as if it had worked
    assert not paths["out"].exists()

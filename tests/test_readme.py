"""The README's Quick start, run as written against a CPU server, its outputs checked.

Every shell block of the Quick start is split into its commands (a heredoc or a `\\`
continuation stays with its command), and each runs in order in one scratch directory, with
this test's interpreter standing in for `.venv/bin/` and SPEAKERD_TARGET pointing the client
at a server this test starts (the default model and plans, the CPU engine: what `make
serve` gives a machine without a GPU). Every command must exit 0. A `# ...` line right
after a command is what the README says it prints, and is checked:

- a JSON object: every key it shows is in the command's JSON, with the same value, except a
  string ending in `...` (a prefix) and a float (any number: a rate or a latency); a nested
  object is matched the same way, a list item by item;
- text: the output has a line matching it, `...` standing for anything.

Then what the README says of the files is checked: `served-chunks.npz` and `offline.npz`
identical to the bit, `served.npz` within cosine 0.9995 of them but not identical. A README
that drifts from the code fails here.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from speakerd.model.numerics import compare
from tests.serving import ServerProcess, serve_module

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
#: One command's limit: the recording load on a busy 2-core machine stays well inside it.
COMMAND_TIMEOUT_S = 600
#: What the README says the recording path's embeddings keep of the chunks' (cosine): the
#: WAV's 16-bit rounding moved the example's row with the least speech (306 frames of
#: speaker 3) to 0.99985.
RECORDING_COSINE = 0.9995
#: `.venv/bin/X` in the README -> this interpreter (the same environment in CI's `make test`).
VENV_COMMANDS = {
    ".venv/bin/speakerd-client": f"{sys.executable} -m speakerd.client",
    ".venv/bin/speakerd": f"{sys.executable} -m speakerd",
    ".venv/bin/python": sys.executable,
}

pytestmark = pytest.mark.slow


@dataclass
class Command:
    """One README command and the output lines the README shows after it."""

    text: str
    expected: list[str] = field(default_factory=list)


def quick_start_blocks(readme: str) -> list[str]:
    """The ```bash blocks between `## Quick start` and the next `## ` heading."""
    start = readme.index("\n## Quick start\n")
    end = readme.index("\n## ", start + 1)
    return re.findall(r"```bash\n(.*?)```", readme[start:end], flags=re.DOTALL)


def commands(block: str) -> list[Command]:
    """A block's commands: heredocs and continued lines joined; `# ` lines right after a
    command are its expected output (a `#` after a command on its own line is prose)."""
    found: list[Command] = []
    lines = block.splitlines()
    at = 0
    while at < len(lines):
        line = lines[at]
        at += 1
        if not line.strip():
            continue
        if line.startswith("# "):
            assert found, f"expected output before any command: {line}"
            found[-1].expected.append(line[2:])
            continue
        text = [line]
        heredoc = re.search(r"<<'(\w+)'", line)
        while text[-1].endswith("\\") or heredoc:
            text.append(lines[at])
            at += 1
            if heredoc and text[-1] == heredoc.group(1):
                heredoc = None
        found.append(Command("\n".join(text)))
    return found


def runnable(text: str) -> str:
    """`text` with each `.venv/bin/X` replaced by this environment's (in one pass: a
    replacement holds `.venv/bin/python` itself when the interpreter is a venv's)."""
    names = "|".join(re.escape(venv) for venv in VENV_COMMANDS)  # speakerd-client before speakerd
    return re.sub(rf"(?<![\w/])({names})(?![\w-])", lambda match: VENV_COMMANDS[match.group(1)], text)


def json_matches(expected: object, actual: object) -> bool:
    if isinstance(expected, dict):  # the keys shown, each matching; others may be there too
        return isinstance(actual, dict) and all(
            key in actual and json_matches(value, actual[key]) for key, value in expected.items()
        )
    if isinstance(expected, list):  # as many items, each matching
        return (
            isinstance(actual, list)
            and len(actual) == len(expected)
            and all(json_matches(shown, item) for shown, item in zip(expected, actual, strict=True))
        )
    if isinstance(expected, str) and expected.endswith("..."):
        return isinstance(actual, str) and actual.startswith(expected[:-3])
    if isinstance(expected, float):
        return isinstance(actual, (int, float)) and not isinstance(actual, bool)
    return expected == actual


def _last_json_object(stdout: str) -> dict[str, object]:
    """The output as one JSON document (`info` indents it), else its last one-line object."""
    try:
        return json.loads(stdout)
    except json.JSONDecodeError:
        lines = [line for line in stdout.splitlines() if line.startswith("{") and line.endswith("}")]
        assert lines, f"no JSON object in:\n{stdout}"
        return json.loads(lines[-1])


def check_output(command: Command, stdout: str, stderr: str) -> None:
    for shown in command.expected:
        if shown.startswith("{"):
            expected = json.loads(shown)
            actual = _last_json_object(stdout)
            wrong = {key: actual.get(key, "<missing>") for key, value in expected.items()
                     if key not in actual or not json_matches(value, actual[key])}  # fmt: skip
            assert not wrong, f"{command.text}\nREADME shows {shown}\nbut printed {wrong} (of {actual})"
        else:
            pattern = ".*?".join(re.escape(piece) for piece in shown.split("..."))
            lines = (stdout + stderr).splitlines()
            assert any(re.fullmatch(pattern, line.strip()) for line in lines), (
                f"{command.text}\nREADME shows: {shown}\nprinted:\n{stdout}{stderr}"
            )


@pytest.fixture(scope="module")
def server(weights_path):
    yield from serve_module(weights_path)


@pytest.fixture(scope="module")
def ran(server: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every Quick start command run in order in one directory; that directory."""
    workdir = tmp_path_factory.mktemp("readme")
    found = [command for block in quick_start_blocks(README.read_text()) for command in commands(block)]
    # the Quick start shows health, info, the example, three embeds and two loads
    assert len(found) >= 8 and sum(len(c.expected) for c in found) >= 7, [c.text for c in found]
    env = {**os.environ, "SPEAKERD_TARGET": server.target, "PYTHONPATH": str(REPO),
           "PYANNOTE_METRICS_ENABLED": "false"}  # fmt: skip
    for command in found:
        done = subprocess.run(["bash", "-o", "pipefail", "-c", runnable(command.text)], cwd=workdir, env=env,
                              capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)  # fmt: skip
        assert done.returncode == 0, f"{command.text}\nexit {done.returncode}:\n{done.stdout}{done.stderr}"
        assert "Traceback" not in done.stderr, f"{command.text}\n{done.stderr}"
        check_output(command, done.stdout, done.stderr)
    return workdir


def test_quick_start_runs_as_written(ran: Path) -> None:
    for name in ("example.wav", "served.npz", "served-chunks.npz", "offline.npz"):
        assert (ran / name).is_file(), f"{name} was not written"


def _load(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as data:
        return {key: data[key] for key in data.files}


def test_what_the_readme_says_of_the_files(ran: Path) -> None:
    said = " ".join(README.read_text().split())
    assert "On the CPU engine `served-chunks.npz` and `offline.npz` are identical to the bit." in said
    assert f"`served.npz` agrees with them to a cosine of {RECORDING_COSINE}, not to the bit" in said
    names = ("served.npz", "served-chunks.npz", "offline.npz")
    served, chunks, offline = (_load(ran / name) for name in names)
    for name, arrays in (("served.npz", served), ("served-chunks.npz", chunks)):
        assert {"embeddings", "empty", "active_frames"} <= set(arrays), (name, sorted(arrays))
        assert arrays["embeddings"].shape == (5, 3, 256), (name, arrays["embeddings"].shape)
    assert np.array_equal(chunks["embeddings"], offline["embeddings"]), "served-chunks.npz != offline.npz"
    assert np.array_equal(served["empty"], chunks["empty"])
    rows = ~served["empty"]
    parity = compare(served["embeddings"][rows], chunks["embeddings"][rows])
    assert parity.min_cosine >= RECORDING_COSINE, parity
    assert not np.array_equal(served["embeddings"], chunks["embeddings"]), "the README says they differ"

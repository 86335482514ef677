"""What the tests of loading by name share: a clean environment for a `speakerd` subprocess
that talks to a test hub (tests/hub_server.py) or none, and reading its answers.

Each subprocess gets caches under the test's tmp_path and none of this shell's hub or model
variables, so no test reads the user's Hugging Face cache or the network, and no two tests
share a cache unless they mean to.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

#: The variables a test's subprocess must not inherit: they would point it at the user's
#: hub, token, caches or models.
HUB_ENV = ("HF_HOME", "HF_HUB_CACHE", "HF_ENDPOINT", "HF_TOKEN", "HF_HUB_OFFLINE", "SPEAKERD_MODEL",
           "SPEAKERD_WEIGHTS", "SPEAKERD_SEGMENTATION_MODEL", "SPEAKERD_PLDA", "SPEAKERD_CACHE")  # fmt: skip
#: A command's limit: a conversion on a busy 2-core machine stays well inside it.
COMMAND_TIMEOUT_S = 300


def environment(tmp_path: Path, **values: str) -> dict[str, str]:
    """This process's environment without HUB_ENV, the caches under `tmp_path`, plus `values`."""
    env = {key: value for key, value in os.environ.items() if key not in HUB_ENV}
    env.update(HF_HOME=str(tmp_path / "hf"), SPEAKERD_CACHE=str(tmp_path / "speakerd"),
               HF_HUB_DISABLE_PROGRESS_BARS="1", HF_HUB_DISABLE_TELEMETRY="1")  # fmt: skip
    env.update(values)
    return env


def speakerd(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`python -m speakerd ARGS` in `env`, its output captured."""
    return subprocess.run([sys.executable, "-m", "speakerd", *args], env=env, capture_output=True, text=True,
                          timeout=COMMAND_TIMEOUT_S)  # fmt: skip


def fetched(done: subprocess.CompletedProcess[str], kind: str, fields: tuple[str, ...]) -> dict[str, str]:
    """fetch-model's `KIND FIELD VALUE` lines for `fields`: {field: value}; asserts exit 0
    and every field said."""
    assert done.returncode == 0, done.stderr
    out = {}
    for line in done.stdout.splitlines():
        for field in fields:
            if line.startswith(f"{kind} {field} "):
                out[field] = line.removeprefix(f"{kind} {field} ")
    assert len(out) == len(fields), done.stdout
    return out


def one_line(done: subprocess.CompletedProcess[str]) -> str:
    """The one line a failed command wrote; asserts exit code 2 and no traceback."""
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    print(f"\n{lines[0]}")
    return lines[0]

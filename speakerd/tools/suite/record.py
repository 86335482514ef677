"""The measurement record: one JSON object per result, one line each in a `.jsonl` file.

Why one schema: a figure is only worth quoting with what it was measured on (commit, GPU,
driver, CUDA), the command that reproduces it, and the anchor timed in the same run, since
clocks, drivers and machines differ from run to run and only a same-run ratio carries over.
measurements/ keeps records of this schema only; `python -m speakerd.tools.suite --check
FILE` validates files against it.

Fields (all present in every record):

- `schema`: "speakerd.measurement/1".
- `suite`: the suite that wrote it (`engine`, `service`, ...; `kernel-stages` for the
  timings of scripts/time_wgmma_variants.py kept in measurements/).
- `name`: what was measured, e.g. "b32 fp16 graph" or "load 16x32 fp16 receivers=4".
- `commit`: the git commit measured: $SPEAKERD_COMMIT when set, else the checkout's (12 hex
  digits, "-dirty" when the tree differed from it), else "unknown".
- `gpu`, `driver`, `cuda`: the GPU's name, the NVIDIA driver version and the CUDA runtime
  version; null on a machine without a GPU, or where the run did not record them.
- `command`: the command line that produced the figure.
- `ok`: false when the step behind the figure failed (a failed test, a failed parity check).
- `figure`: {"value": number, "unit": str, "better": "lower" | "higher"}.
- `anchors`: a list (possibly empty) of {"name", "value", "unit", "better", "ratio",
  "command"}: the comparison timed in the same run, and `ratio`, how many times better the
  figure is than the anchor (> 1: speakerd is faster; for a share of an upper bound such as
  the engine's own speed, below 1).
- `detail`: the raw output the figure was taken from (free form).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA = "speakerd.measurement/1"
#: Where a run has no git checkout (the device machine gets a copy of the tree), the commit
#: comes from this variable; without it records say "unknown" rather than guess.
COMMIT_ENV = "SPEAKERD_COMMIT"
BETTER = ("lower", "higher")
_TOP_FIELDS = (
    "schema",
    "suite",
    "name",
    "commit",
    "gpu",
    "driver",
    "cuda",
    "command",
    "ok",
    "figure",
    "anchors",
    "detail",
)
_COMMIT = re.compile(r"^([0-9a-f]{7,40}(-dirty)?|unknown)$")


@dataclass(frozen=True)
class Environment:
    """What every record of one run shares."""

    commit: str
    gpu: str | None
    driver: str | None
    cuda: str | None
    gpu_count: int


def figure(value: float, unit: str, better: str) -> dict[str, Any]:
    if better not in BETTER:
        raise ValueError(f"better: {better!r}, expected one of {BETTER}")
    return {"value": value, "unit": unit, "better": better}


def anchor(
    name: str, value: float, unit: str, better: str, of: Mapping[str, Any], command: str
) -> dict[str, Any]:
    """An anchor of figure `of`, with the ratio of the two (same unit required)."""
    if unit != of["unit"]:
        raise ValueError(f"anchor {name}: unit {unit!r}, the figure's is {of['unit']!r}")
    ours = float(of["value"])
    ratio = None
    if ours > 0 and value > 0:
        ratio = round(value / ours if better == "lower" else ours / value, 4)
    return {"name": name, "value": value, "unit": unit, "better": better, "ratio": ratio, "command": command}


def make_record(
    env: Environment,
    suite: str,
    name: str,
    command: str,
    fig: Mapping[str, Any],
    anchors: Iterable[Mapping[str, Any]] = (),
    detail: Mapping[str, Any] | None = None,
    ok: bool = True,
) -> dict[str, Any]:
    record = {
        "schema": SCHEMA,
        "suite": suite,
        "name": name,
        "commit": env.commit,
        "gpu": env.gpu,
        "driver": env.driver,
        "cuda": env.cuda,
        "command": command,
        "ok": ok,
        "figure": dict(fig),
        "anchors": [dict(a) for a in anchors],
        "detail": dict(detail or {}),
    }
    problems = validate(record)
    if problems:
        raise ValueError(f"record {name!r} breaks the schema: {'; '.join(problems)}")
    return record


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_measure(where: str, item: Any, extra: tuple[str, ...]) -> list[str]:
    if not isinstance(item, dict):
        return [f"{where}: {type(item).__name__}, expected an object"]
    problems = []
    missing = [key for key in ("value", "unit", "better", *extra) if key not in item]
    if missing:
        problems.append(f"{where}: missing {', '.join(missing)}")
    if "value" in item and not _number(item["value"]):
        problems.append(f"{where}.value: {item['value']!r}, expected a number")
    if "unit" in item and not (isinstance(item["unit"], str) and item["unit"]):
        problems.append(f"{where}.unit: {item['unit']!r}, expected a non-empty string")
    if "better" in item and item["better"] not in BETTER:
        problems.append(f"{where}.better: {item['better']!r}, expected one of {BETTER}")
    return problems


def validate(record: Any) -> list[str]:
    """Every way `record` breaks the schema, one phrase each (empty: it is a valid record)."""
    if not isinstance(record, dict):
        return [f"a record is a JSON object, got {type(record).__name__}"]
    problems = []
    missing = [key for key in _TOP_FIELDS if key not in record]
    if missing:
        return [f"missing {', '.join(missing)}"]
    unknown = sorted(set(record) - set(_TOP_FIELDS))
    if unknown:
        problems.append(f"unknown fields {', '.join(unknown)}")
    if record["schema"] != SCHEMA:
        problems.append(f"schema: {record['schema']!r}, expected {SCHEMA!r}")
    for key in ("suite", "name", "command"):
        if not (isinstance(record[key], str) and record[key]):
            problems.append(f"{key}: {record[key]!r}, expected a non-empty string")
    if not (isinstance(record["commit"], str) and _COMMIT.match(record["commit"])):
        problems.append(f"commit: {record['commit']!r}, expected hex digits (and -dirty) or 'unknown'")
    for key in ("gpu", "driver", "cuda"):
        if record[key] is not None and not isinstance(record[key], str):
            problems.append(f"{key}: {record[key]!r}, expected a string or null")
    if not isinstance(record["ok"], bool):
        problems.append(f"ok: {record['ok']!r}, expected true or false")
    problems += _check_measure("figure", record["figure"], ())
    if not isinstance(record["anchors"], list):
        problems.append("anchors: expected a list")
    else:
        for index, item in enumerate(record["anchors"]):
            where = f"anchors[{index}]"
            problems += _check_measure(where, item, ("name", "ratio", "command"))
            if isinstance(item, dict) and item.get("ratio") is not None and not _number(item["ratio"]):
                problems.append(f"{where}.ratio: {item['ratio']!r}, expected a number or null")
    if not isinstance(record["detail"], dict):
        problems.append("detail: expected an object")
    return problems


def validate_file(path: Path) -> list[str]:
    """Problems of a records file, each prefixed with its line number."""
    problems = []
    lines = path.read_text().splitlines()
    if not any(line.strip() for line in lines):
        return [f"{path}: no records"]
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            problems.append(f"{path}:{number}: not JSON ({error})")
            continue
        problems += [f"{path}:{number}: {problem}" for problem in validate(record)]
    return problems


# ----- what the run measures on -----------------------------------------------------------
def _output(argv: list[str], cwd: Path | None = None) -> str | None:
    try:
        done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def commit_of(repo: Path) -> str:
    """$SPEAKERD_COMMIT when it is set (a copy of the tree on another machine may carry a
    stale .git: the caller knows what it copied), else HEAD's commit (12 digits, -dirty when
    tracked files differ)."""
    given = os.environ.get(COMMIT_ENV, "").strip().lower()
    if given and _COMMIT.match(given):
        return given
    if shutil.which("git") and (repo / ".git").exists():
        head = _output(["git", "rev-parse", "--short=12", "HEAD"], repo)
        if head:
            changed = _output(["git", "status", "--porcelain", "--untracked-files=no"], repo)
            return f"{head}-dirty" if changed else head
    return "unknown"


def _cuda_runtime() -> str | None:
    try:
        import cupy

        version = cupy.cuda.runtime.runtimeGetVersion()
    except Exception:  # no CuPy, or its CUDA libraries do not load: nothing to report
        return None
    return f"{version // 1000}.{version % 1000 // 10}"


def environment(repo: Path) -> Environment:
    """The commit, and the GPU as nvidia-smi and CuPy see it (None where there is none)."""
    gpu = driver = None
    count = 0
    if shutil.which("nvidia-smi"):
        listing = _output(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"])
        rows = [row.split(",") for row in (listing or "").splitlines() if row.strip()]
        if rows:
            gpu, driver = rows[0][0].strip(), rows[0][-1].strip()
            count = len(rows)
    return Environment(commit_of(repo), gpu, driver, _cuda_runtime() if gpu else None, count)

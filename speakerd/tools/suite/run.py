"""What every suite does: run one command inside what is left of its budget, keep its log,
start and stop a server, and write records.

Commands run as child processes of the interpreter running the harness, so a record's
`command` is exactly what a maintainer types to repeat one step (with `python` for
`sys.executable`).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from speakerd.tools.suite.record import Environment, make_record

#: Seconds a server gets to drain and exit after SIGTERM before it is killed.
SERVER_STOP_S = 30
#: A fresh machine once took 119 s to build an FP16 engine's cuDNN graphs: a server gets this
#: long to report SERVING (within what is left of the suite's budget).
SERVER_START_S = 240


class StepFailed(Exception):
    """A step's command failed or ran out of time: the suite stops, the run goes on."""


def shown(argv: Sequence[str]) -> str:
    """The command as a maintainer would type it (`python` for this interpreter)."""
    return shlex.join(["python" if arg == sys.executable else arg for arg in argv])


def json_lines(text: str) -> list[dict[str, Any]]:
    """The JSON objects among a command's output lines (others are ignored)."""
    objects = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(value, dict):
                objects.append(value)
    return objects


def last_stderr_line(log: Path) -> str:
    """The last line a failed step wrote to stderr: where a maintainer looks first."""
    lines = log.read_text().split("\n--- stdout ---\n")[0].strip().splitlines()
    return lines[-1][:300] if lines else "(nothing on stderr)"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class Context:
    """One suite's run: its environment, options, output folder and deadline."""

    suite: str
    env: Environment
    options: Any  # the harness's argparse namespace
    repo: Path
    out: Path
    deadline: float
    records_file: Path
    records: list[dict[str, Any]] = field(default_factory=list)
    headlines: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def say(self, line: str) -> None:
        print(f"{self.suite}: {line}", flush=True)

    def skip(self, what: str, why: str) -> None:
        """A part of the suite not run: one line now, and in the suite's summary."""
        self.say(f"{what} skipped: {why}")
        self.notes.append(f"{what} skipped")

    def log_path(self, name: str) -> Path:
        (self.out / "logs").mkdir(parents=True, exist_ok=True)
        return self.out / "logs" / f"{self.suite}-{name}.log"

    def python(self, *args: str) -> list[str]:
        return [sys.executable, *args]

    def run(
        self,
        name: str,
        argv: Sequence[str],
        limit_s: float,
        env: Mapping[str, str] | None = None,
        check: bool = True,
        keep_partial: bool = False,
    ) -> subprocess.CompletedProcess[str]:
        """Run `argv` for at most `limit_s` (and what is left of the budget); stdout is
        returned and, with stderr, kept in logs/. check: a non-zero exit is StepFailed.
        keep_partial: running out of time returns what it printed (returncode -9) instead
        of failing, for a step whose every line is a result of its own (an anchor script)."""
        limit = min(limit_s, self.left())
        if limit < 1:
            raise StepFailed(f"{name}: no time left of the suite's budget")
        child_env = {**os.environ, **(env or {})}
        log = self.log_path(name)
        started = time.monotonic()
        with log.open("w") as err:
            # a session of its own, so that running out of time ends the step's children too
            # (`client load`'s worker processes, a test's server)
            process = subprocess.Popen(
                list(argv), cwd=self.repo, env=child_env, stdout=subprocess.PIPE, stderr=err, text=True,
                start_new_session=True,
            )  # fmt: skip
            try:
                stdout, _ = process.communicate(timeout=limit)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                stdout, _ = process.communicate()
                with log.open("a") as tail:
                    tail.write(f"\n--- stdout ---\n{stdout}")
                if keep_partial:
                    self.say(f"{name}: cut off at {limit:.0f} s, its lines so far kept")
                    return subprocess.CompletedProcess(list(argv), -signal.SIGKILL, stdout, "")
                raise StepFailed(f"{name}: ran out of its {limit:.0f} s ({shown(argv)}); log {log}") from None
        with log.open("a") as tail:
            tail.write(f"\n--- stdout ---\n{stdout}")
        code = process.returncode
        why = f": {last_stderr_line(log)}" if code != 0 else ""
        self.say(f"{name}: exit {code} after {time.monotonic() - started:.0f} s{why}")
        if check and code != 0:
            raise StepFailed(f"{name}: exit {code} ({shown(argv)}){why}")
        return subprocess.CompletedProcess(list(argv), code, stdout, "")

    def record(
        self,
        name: str,
        command: str,
        fig: Mapping[str, Any],
        anchors: Sequence[Mapping[str, Any]] = (),
        detail: Mapping[str, Any] | None = None,
        ok: bool = True,
        headline: bool = False,
    ) -> dict[str, Any]:
        """Validate, keep and append one record to the run's records file."""
        record = make_record(self.env, self.suite, name, command, fig, anchors, detail, ok)
        self.records.append(record)
        with self.records_file.open("a") as out:
            out.write(json.dumps(record) + "\n")
        if headline or not ok:
            text = f"{name} {fig['value']:g} {fig['unit']}"
            if anchors and anchors[0].get("ratio") is not None:
                text += f" ({anchors[0]['ratio']:g}x {anchors[0]['name']})"
            self.headlines.append(text if ok else f"{text} FAILED")
        return record

    @contextmanager
    def server(
        self, name: str, flags: Sequence[str], env: Mapping[str, str | None] | None = None
    ) -> Iterator[dict[str, str]]:
        """`speakerd serve FLAGS` on free ports until the block ends; yields its target,
        metrics URL, command and log's path. `env`: variables set for it (None: unset). Not
        SERVING in time (or exited): StepFailed."""
        port, metrics = free_port(), free_port()
        # a benchmark keeps no voiceprints: no SQLite store, so no --data-dir to hold
        # (serving/server/data_dir.py) beside a server the machine may run already
        keep = () if "--voiceprints" in flags else ("--voiceprints", "off")
        argv = self.python(
            "-m", "speakerd", "serve", "--port", str(port), "--metrics-port", str(metrics), *keep, *flags
        )
        log = self.log_path(f"serve-{name}")
        with log.open("w") as out:
            environ = dict(os.environ)
            for variable, value in (env or {}).items():
                if value is None:
                    environ.pop(variable, None)
                else:
                    environ[variable] = value
            process = subprocess.Popen(argv, cwd=self.repo, stdout=out, stderr=subprocess.STDOUT, env=environ)
        target = f"127.0.0.1:{port}"
        try:
            wait = max(1, int(min(SERVER_START_S, self.left() - 5)))
            health = self.python("-m", "speakerd.client", "health", "--target", target, "--wait", str(wait))
            started = time.monotonic()
            done = subprocess.run(health, cwd=self.repo, capture_output=True, text=True, timeout=wait + 30)
            if done.returncode != 0 or process.poll() is not None:
                tail = " | ".join(log.read_text().strip().splitlines()[-2:])[:300]
                raise StepFailed(f"server {name} not SERVING after {wait} s ({shown(argv)}): {tail}")
            self.say(f"server {name} SERVING after {time.monotonic() - started:.0f} s")
            yield {
                "target": target,
                "metrics_url": f"http://127.0.0.1:{metrics}/metrics",
                "command": shown(argv),
                "log": str(log),
            }
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(SERVER_STOP_S)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()

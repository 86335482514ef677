"""The harness's command line: which suites to run, within what budget, and the exit code.

Exit codes: 0 every suite asked for ran and passed, or was skipped with its reason printed
(no GPU, no second GPU, no pyannote.audio, no budget left); 1 a step failed (a test, a
parity check, a command that errored or ran out of its time; with --require-gpu, also a
suite skipped for want of a GPU); 2 a usage error (unknown suite, bad flags, an invalid
records file for --check).
"""

from __future__ import annotations

import argparse
import os
import sys
import tarfile
import time
from pathlib import Path

from speakerd.tools.suite.record import environment, validate_file
from speakerd.tools.suite.run import Context, StepFailed
from speakerd.tools.suite.steps import gpu_problem
from speakerd.tools.suite.suites import SUITES, Suite

#: A device call runs at most 600 s; the harness keeps 30 of them for starting and packing.
DEFAULT_BUDGET_S = 570
#: The load suites' counted seconds per `client load` run, and how many runs.
DEFAULT_LOAD_SECONDS = 10.0
DEFAULT_LOAD_RUNS = 3
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def parser() -> argparse.ArgumentParser:
    names = ", ".join(SUITES)
    parser = argparse.ArgumentParser(
        prog="python -m speakerd.tools.suite",
        description=f"Run benchmark suites ({names}) and write one JSON record per result.",
        epilog="Exit: 0 ran or skipped with a reason, 1 a step failed, 2 usage. See docs/performance.md.",
    )
    parser.add_argument("suites", nargs="*", metavar="NAME", help=f"suites to run, in order ({names})")
    parser.add_argument("--list", action="store_true", help="list the suites with their budgets and exit")
    parser.add_argument(
        "--check", nargs="+", metavar="FILE", help="validate records files against the schema"
    )
    parser.add_argument(
        "--out", default=None, help="folder for records.jsonl and logs (default $OUT, else suite-out)"
    )
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="the whole run's seconds")
    parser.add_argument(
        "--anchors", default=None, help="folder of the PyTorch anchor scripts [SPEAKERD_ANCHORS]"
    )
    parser.add_argument(
        "--engine",
        choices=("gpu", "cpu"),
        default="gpu",
        help="service, pyannote: cpu runs them on the CPU engine",
    )
    parser.add_argument(
        "--math",
        default=None,
        help="engine: maths to bench (all three); serving suites: the math served (fp16)",
    )
    parser.add_argument(
        "--seconds", type=float, default=DEFAULT_LOAD_SECONDS, help="counted seconds per load run"
    )
    parser.add_argument("--runs", type=int, default=DEFAULT_LOAD_RUNS, help="load runs per server")
    parser.add_argument(
        "--references", default=None, help="make-references output to use (default: made in --out)"
    )
    parser.add_argument(
        "--segmentation", default=None, help="pyannote, diarize: segmentation-3.0's pytorch_model.bin"
    )
    parser.add_argument("--speech", default=None, help="diarize: a speech clip to tile (sample.wav)")
    parser.add_argument(
        "--plda", default=None, help="diarize: a PLDA directory (xvec_transform.npz, plda.npz): VBx too"
    )
    parser.add_argument(
        "--speakrs", default=None, help="diarize: speakrs' wheel, models/ and hour.py: its hour beside ours"
    )
    parser.add_argument(
        "--require-gpu", action="store_true", help="a suite skipped for want of a GPU fails the run"
    )
    return parser


def usage_error(message: str) -> int:
    print(f"suite: {message}", file=sys.stderr)
    return EXIT_USAGE


def list_suites() -> None:
    for suite in SUITES.values():
        print(f"{suite.name:<10} {suite.budget_s:>4} s  {suite.purpose}")


def check(files: list[str]) -> int:
    problems = []
    for name in files:
        path = Path(name)
        problems += validate_file(path) if path.is_file() else [f"{name}: no such file"]
    for problem in problems:
        print(problem)
    print(f"suite --check: {len(files)} files, {len(problems)} problems")
    return EXIT_USAGE if problems else EXIT_OK


def repo_root() -> Path:
    """The checkout the package runs from (tests/ and the scripts live beside it)."""
    import speakerd

    return Path(speakerd.__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.list:
        list_suites()
        return EXIT_OK
    if args.check:
        return check(args.check)
    if not args.suites:
        return usage_error(f"name at least one suite ({', '.join(SUITES)}), or --list")
    unknown = [name for name in args.suites if name not in SUITES]
    if unknown:
        return usage_error(f"unknown suite {', '.join(unknown)}; the suites are {', '.join(SUITES)}")
    if args.engine == "cpu" and any(not SUITES[name].cpu_engine for name in args.suites):
        cpu = ", ".join(name for name, suite in SUITES.items() if suite.cpu_engine)
        return usage_error(f"--engine cpu: only these suites run on the CPU engine: {cpu}")
    if args.math and "," in args.math and any(name != "engine" for name in args.suites):
        return usage_error(
            f"--math {args.math}: only the engine suite takes several maths; the others serve one"
        )
    if args.runs < 1 or args.seconds <= 0 or args.budget_s <= 0:
        return usage_error("--runs, --seconds and --budget-s must be positive")
    return run(args, [SUITES[name] for name in dict.fromkeys(args.suites)])


def run(args: argparse.Namespace, suites: list[Suite]) -> int:
    repo = repo_root()
    out = Path(args.out or os.environ.get("OUT") or "suite-out").resolve()
    out.mkdir(parents=True, exist_ok=True)
    records_file = out / "records.jsonl"
    env = environment(repo)
    started = time.monotonic()
    end = started + args.budget_s
    print(
        f"suite: commit {env.commit}, GPU {env.gpu or 'none'} (driver {env.driver}, CUDA {env.cuda}); "
        f"records to {records_file}",
        flush=True,
    )
    failed, skipped, written = [], [], 0
    for suite in suites:
        needs_gpu = not (suite.cpu_engine and args.engine == "cpu")
        problem = gpu_problem() if needs_gpu else None
        left = end - time.monotonic()
        if problem is not None:
            print(f"{suite.name}: skipped: no usable GPU ({problem})", flush=True)
            skipped.append(suite.name)
            if args.require_gpu:
                failed.append(suite.name)
            continue
        budget = suite.budget(args.engine)
        if left < budget:
            print(
                f"{suite.name}: skipped: its budget is {budget} s, {left:.0f} s left of --budget-s "
                f"{args.budget_s:g} (run it in a call of its own)",
                flush=True,
            )
            skipped.append(suite.name)
            continue
        ctx = Context(suite.name, env, args, repo, out, time.monotonic() + budget, records_file)
        suite_started = time.monotonic()
        error = None
        try:
            suite.run(ctx)
        except StepFailed as failure:
            error = str(failure)
        bad = [record["name"] for record in ctx.records if not record["ok"]]
        if error or bad:
            failed.append(suite.name)
        written += len(ctx.records)
        parts = [
            f"{len(ctx.records)} records in {time.monotonic() - suite_started:.0f} s",
            *ctx.headlines,
            *ctx.notes,
        ]
        if error:
            parts.append(f"stopped: {error}")
        print(f"{suite.name}: {'; '.join(parts)}", flush=True)
    pack_logs(out)
    verdict = f"FAILED: {', '.join(failed)}" if failed else "ok"
    print(
        f"suite: {written} records in {records_file}; skipped: {', '.join(skipped) or 'none'}; "
        f"{time.monotonic() - started:.0f} s; {verdict}",
        flush=True,
    )
    return EXIT_FAILED if failed else EXIT_OK


def pack_logs(out: Path) -> None:
    """The logs as one logs.tgz: a device call returns a few files, not a folder of them."""
    folder = out / "logs"
    if not folder.is_dir():
        return
    with tarfile.open(out / "logs.tgz", "w:gz") as archive:
        for path in sorted(folder.iterdir()):
            archive.add(path, arcname=f"logs/{path.name}")
    for path in folder.iterdir():
        path.unlink()
    folder.rmdir()

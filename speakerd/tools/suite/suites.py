"""The suites: what each one runs, what it needs, its time budget, and its records.

Budgets are what one suite may take of a device call's ten minutes, measured from the
longest step seen (a fresh machine builds an FP16 engine's cuDNN graphs in up to ~120 s);
a run of several suites takes each whose budget still fits and skips the rest, saying so.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from speakerd.tools.suite.record import anchor, figure
from speakerd.tools.suite.run import Context, StepFailed, json_lines, shown

#: Where the PyTorch anchor scripts are looked for when --anchors is not given (relative to
#: the repository root): `.anchors/` is what a device call carries (ignored by git), the
#: other the project's shared copy beside the checkout.
ANCHOR_DIRS = (".anchors", "../shared/anchors")
ANCHORS_ENV = "SPEAKERD_ANCHORS"
#: Where segmentation-3.0's checkpoint is looked for (scripts/pyannote_segmentation.sh and
#: scripts/prepare_pyannote_wheels.sh write these).
SEGMENTATION_PATHS = (
    ".cache/pyannote/segmentation-3.0/pytorch_model.bin",
    ".whl-pyannote/segmentation-3.0/pytorch_model.bin",
)
#: The service's load: 16 callers of 32-chunk requests from 4 processes fill the batcher's
#: queue (the requests, not the server, limited fewer), each call one b32 batch.
LOAD_STREAMS, LOAD_CHUNKS, LOAD_PROCESSES = 16, 32, 4
#: On the CPU engine (~8 chunks/s on 2 cores) a load of single chunks shows the service
#: works end to end; its throughput is not a figure anyone quotes.
CPU_LOAD_STREAMS, CPU_LOAD_CHUNKS = 2, 1
#: Receiver processes for the GPU service (docs/service.md: 4 lift FP16 throughput).
RECEIVERS = 4
#: The recording suite's hour, and the two formats it is sent in.
HOUR_S = 3600
RECORDING_FORMATS = ((16_000, 1), (48_000, 2))
#: Seconds the torch.compile anchor needs at least (its max-autotune compile takes minutes);
#: the engine suite's bench leaves it this much of the budget.
COMPILE_RESERVE_S = 240
ALL_MATHS = "fp32,tf32,fp16"


@dataclass(frozen=True)
class Suite:
    name: str
    purpose: str
    budget_s: int
    run: Callable[[Context], None]
    #: True: `--engine cpu` runs it on the CPU engine, without a GPU
    cpu_engine: bool = False


# ----- shared steps ------------------------------------------------------------------------
@functools.cache
def gpu_problem() -> str | None:
    """None when the GPU engine can run here, else why not (one phrase)."""
    from speakerd.engine.gpu import gpu_available

    usable, detail = gpu_available()
    return None if usable else detail


def anchors_dir(ctx: Context) -> Path | None:
    """The folder of the PyTorch anchor scripts: --anchors, $SPEAKERD_ANCHORS, ANCHOR_DIRS."""
    given = ctx.options.anchors or os.environ.get(ANCHORS_ENV)
    candidates = [Path(given)] if given else [ctx.repo / name for name in ANCHOR_DIRS]
    return next((path.resolve() for path in candidates if path.is_dir()), None)


def anchor_script(ctx: Context, name: str) -> Path | None:
    """An anchor script, or None after one skip line saying where it was looked for."""
    folder = anchors_dir(ctx)
    if folder is None or not (folder / name).is_file():
        where = ctx.options.anchors or os.environ.get(ANCHORS_ENV) or " or ".join(ANCHOR_DIRS)
        ctx.skip(f"anchor {name}", f"not found in {where} (pass --anchors DIR)")
        return None
    return folder / name


def references(ctx: Context) -> Path:
    """--references, else `make-references` output for the default model, made once per
    output folder (the engine and service benches read mixed_b32 and first_b1 from it)."""
    if ctx.options.references:
        return Path(ctx.options.references).resolve()
    folder = ctx.out / "refs"
    if not (folder / "mixed_b32.safetensors").exists():
        ctx.run("make-references", ctx.python("-m", "speakerd", "make-references", "--out", str(folder)), 300)
    return folder


def serving_math(ctx: Context) -> str:
    return ctx.options.math or ("fp32" if ctx.options.engine == "cpu" else "fp16")


def engine_speed(ctx: Context, math: str, refs: Path) -> dict[str, Any] | None:
    """The engine alone on b32 (bench, no PyTorch): the ceiling a server's load is a share
    of, as an anchor dict's inputs; None on the CPU engine."""
    if ctx.options.engine == "cpu":
        return None
    flags = f"--math {math} --batches 32 --no-torch --no-profile".split()
    argv = ctx.python("-m", "speakerd", "bench", *flags, "--references", str(refs))
    done = ctx.run("bench-b32", argv, 300)
    line = next(
        row for row in json_lines(done.stdout) if row.get("kind") == "ours" and row["mode"] == "graph"
    )
    return {"value": line["chunks_per_s"], "command": shown(argv), "line": line}


def load(ctx: Context, name: str, server: dict[str, str], flags: list[str], limit_s: float) -> dict[str, Any]:
    where = ["--target", server["target"], "--metrics-url", server["metrics_url"]]
    argv = ctx.python("-m", "speakerd.client", "load", *where, *flags)
    done = ctx.run(name, argv, limit_s, check=False)  # a failed load still reports what it saw
    results = json_lines(done.stdout)
    if not results:
        raise StepFailed(f"{name}: exit {done.returncode}, no JSON ({shown(argv)}); log {ctx.log_path(name)}")
    return {**results[-1], "_command": shown(argv)}


# ----- tests-gpu -----------------------------------------------------------------------------
#: Run last: its bit-for-bit checks of every one-kernel block entry point take the longest.
LAST_TEST_FILE = "test_gpu_block.py"
#: Not marked `gpu` (it compiles every kernel with NVRTC, no GPU needed) but run here too:
#: on the device it compiles with the device's own CUDA, beside the GPU engine's tests.
EXTRA_TEST_FILES = ("test_kernels_compile.py",)
_PYTEST_COUNT = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|deselected)")


def gpu_test_files(repo: Path) -> list[Path]:
    """Every test file carrying the `gpu` marker, plus EXTRA_TEST_FILES; LAST_TEST_FILE last."""
    tests = repo / "tests"
    marked = [path for path in sorted(tests.glob("test_*.py")) if "pytest.mark.gpu" in path.read_text()]
    marked = [path for path in marked if not path.name.startswith("test_pyannote")]  # the pyannote suite's
    extra = [tests / name for name in EXTRA_TEST_FILES if (tests / name).exists()]
    files = sorted({*marked, *extra})
    return sorted(files, key=lambda path: path.name == LAST_TEST_FILE)


def pytest_counts(text: str) -> dict[str, Any]:
    """passed/failed/... counts from pytest's last summary line, and the FAILED test ids."""
    summary = [line for line in text.splitlines() if _PYTEST_COUNT.search(line) and " in " in line]
    counts: dict[str, Any] = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    for number, kind in _PYTEST_COUNT.findall(summary[-1] if summary else ""):
        counts["errors" if kind.startswith("error") else kind] = int(number)
    counts["failed_tests"] = [
        line.split()[1] for line in text.splitlines() if line.startswith(("FAILED ", "ERROR "))
    ]
    return counts


def tests_gpu(ctx: Context) -> None:
    files = gpu_test_files(ctx.repo)
    if not files:
        ctx.skip("tests-gpu", f"no GPU test files under {ctx.repo / 'tests'}")
        return
    failed = []
    for path in files:
        if ctx.left() < 30:
            ctx.skip(path.name, f"{ctx.left():.0f} s left of the suite's budget")
            continue
        argv = ctx.python(
            "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", str(path.relative_to(ctx.repo))
        )
        try:
            done = ctx.run(path.stem, argv, ctx.left(), env={"REQUIRE_GPU": "1"}, check=False)
        except StepFailed as error:
            ctx.say(str(error))
            failed.append(path.name)
            continue
        counts = pytest_counts(done.stdout)
        ok = done.returncode == 0
        ctx.record(
            path.name,
            shown(argv),
            figure(counts["passed"], "tests passed", "higher"),
            detail={**counts, "exit": done.returncode},
            ok=ok,
            headline=True,
        )
        if not ok:
            failed.append(path.name)
            for test in counts["failed_tests"]:
                ctx.say(f"FAILED {test}")
    if failed:
        raise StepFailed(f"failed: {', '.join(failed)}")


# ----- engine --------------------------------------------------------------------------------
def layer_group(conv: str) -> str:
    """stem, layer1 .. layer4: the per-layer table's rows."""
    return conv.split(".")[0]


def engine_records(
    lines: Iterable[dict[str, Any]],
    command: str,
    compile_lines: Iterable[dict[str, Any]] = (),
    compile_command: str = "",
) -> list[dict[str, Any]]:
    """`speakerd bench` JSON lines (and the torch.compile anchor's) -> keyword arguments of
    Context.record: one record per (math, batch) graph plan with its same-run anchors, and
    one per (math, batch, layer group) from the per-convolution table."""
    lines = list(lines)
    ours = {(row["math"], row["batch"], row["mode"]): row for row in lines if row.get("kind") == "ours"}
    torch = {
        (row["math"], row["batch"]): row for row in lines if row.get("kind") == "torch" and "ms_median" in row
    }
    built = {row["math"]: row.get("build_s") for row in lines if row.get("kind") == "engine"}
    compiled = {
        row["batch"]: row
        for row in compile_lines
        if row.get("anchor") == "torch.compile" and "ms_median" in row
    }
    out: list[dict[str, Any]] = []
    for (math, batch, mode), row in sorted(ours.items()):
        if mode != "graph":
            continue
        fig = figure(row["compute_ms_median"], "ms", "lower")
        anchors = []
        if (math, batch) in torch:
            theirs = torch[(math, batch)]
            anchors.append(
                anchor(
                    f"PyTorch {theirs.get('torch', '')} eager, CUDA graph".replace("  ", " "),
                    theirs["ms_median"],
                    "ms",
                    "lower",
                    fig,
                    command,
                )
            )
        if math == "fp16" and batch in compiled:
            anchors.append(
                anchor(
                    f"torch.compile {compiled[batch].get('mode', 'max-autotune')}",
                    compiled[batch]["ms_median"],
                    "ms",
                    "lower",
                    fig,
                    compile_command,
                )
            )
        eager = ours.get((math, batch, "eager"))
        detail = {
            "ours": row,
            "torch": torch.get((math, batch)),
            "torch_compile": compiled.get(batch) if math == "fp16" else None,
            "eager_ms": eager["compute_ms_median"] if eager else None,
            "build_s": built.get(math),
        }
        out.append(
            {
                "name": f"b{batch} {math} graph",
                "command": command,
                "fig": fig,
                "anchors": anchors,
                "detail": detail,
                "headline": True,
            }
        )
    groups: dict[tuple[str, int, str], list[dict[str, Any]]] = defaultdict(list)
    for row in lines:
        if row.get("kind") == "conv":
            groups[(row["math"], row["batch"], layer_group(row["conv"]))].append(row)
    for (math, batch, group), rows in sorted(groups.items()):
        total = round(sum(row["ms"] for row in rows), 4)
        runners = Counter(row["runs"].split(" ")[0] for row in rows if row["ms"] > 0)
        detail = {
            "convs": len(rows),
            "runs": dict(runners),
            "rows": [
                {"conv": row["conv"], "ms": row["ms"], "runs": row["runs"], "tflops": row.get("tflops")}
                for row in rows
            ],
        }
        out.append(
            {
                "name": f"b{batch} {math} {group}",
                "command": command,
                "fig": figure(total, "ms", "lower"),
                "anchors": [],
                "detail": detail,
                "headline": False,
            }
        )
    return out


def engine(ctx: Context) -> None:
    refs = references(ctx)
    maths = ctx.options.math or ALL_MATHS
    compile_script = anchor_script(ctx, "torch_compile_resnet34.py")
    reserve = COMPILE_RESERVE_S if compile_script else 0
    flags = f"--math {maths} --batches 1,32 --convs --no-profile".split()
    argv = ctx.python("-m", "speakerd", "bench", *flags, "--references", str(refs))
    bench = ctx.run("bench", argv, ctx.left() - reserve)
    compile_lines: list[dict[str, Any]] = []
    compile_command = ""
    if compile_script is not None and "fp16" in maths:
        compile_argv = ctx.python(str(compile_script), "max-autotune")
        compile_command = shown(compile_argv)
        done = ctx.run("torch-compile", compile_argv, ctx.left(), check=False, keep_partial=True)
        compile_lines = json_lines(done.stdout)
        if not any("ms_median" in row and row.get("anchor") == "torch.compile" for row in compile_lines):
            errors = [row["error"] for row in compile_lines if "error" in row]
            ctx.skip("anchor torch.compile", errors[0] if errors else "no timing within the budget")
    for kwargs in engine_records(json_lines(bench.stdout), shown(argv), compile_lines, compile_command):
        ctx.record(**kwargs)


# ----- service -------------------------------------------------------------------------------
def verify_record(ctx: Context, server: dict[str, str], refs: Path, math: str) -> None:
    argv = ctx.python(
        "-m", "speakerd.client", "verify", "--references", str(refs), "--target", server["target"]
    )
    done = ctx.run("verify", argv, 180, check=False)
    found = re.search(r"(\d+)/(\d+) cases", done.stdout)
    passed, total = (int(found.group(1)), int(found.group(2))) if found else (0, 0)
    ctx.record(
        f"verify {math}",
        shown(argv),
        figure(passed, "cases within parity bounds", "higher"),
        detail={"cases": total, "exit": done.returncode, "server": server["command"]},
        ok=done.returncode == 0 and total > 0,
        headline=True,
    )


def against_engine(ceiling: dict[str, Any] | None, fig: dict[str, Any]) -> list[dict[str, Any]]:
    """The engine's own b32 speed as the anchor of a load's figure (none on the CPU engine)."""
    if ceiling is None:
        return []
    name = "the engine alone, bench b32 graph"
    return [anchor(name, ceiling["value"], fig["unit"], "higher", fig, ceiling["command"])]


def load_record(
    ctx: Context,
    step: str,
    server: dict[str, str],
    flags: str,
    limit_s: float,
    name: str,
    unit: str,
    ceiling: dict[str, Any] | None,
    headline: bool = False,
) -> None:
    """One `client load` (FLAGS) against `server`, recorded as `name` in `unit` per second."""
    result = load(ctx, step, server, flags.split(), limit_s)
    fig = figure(result[unit.replace("/s", "_per_s")], unit, "higher")
    command = result.pop("_command")
    detail = {**result, "server": server["command"]}
    ctx.record(name, command, fig, against_engine(ceiling, fig), detail, bool(result.get("ok")), headline)


def service(ctx: Context) -> None:
    math = serving_math(ctx)
    cpu = ctx.options.engine == "cpu"
    refs = references(ctx)
    ceiling = engine_speed(ctx, math, refs)
    receivers = 0 if cpu else RECEIVERS
    shape = (CPU_LOAD_STREAMS, CPU_LOAD_CHUNKS, 1) if cpu else (LOAD_STREAMS, LOAD_CHUNKS, LOAD_PROCESSES)
    streams, chunks, processes = shape
    seconds = ctx.options.seconds
    serve = f"--engine {ctx.options.engine} --math {math} --receivers {receivers}"
    with ctx.server("service", serve.split()) as server:
        verify_record(ctx, server, refs, math)
        flags = f"--streams {streams} --chunks {chunks} --processes {processes} --seconds {seconds:g}"
        name = f"load {streams}x{chunks} {math} receivers={receivers}"
        for run in range(1, ctx.options.runs + 1):
            load_record(ctx, f"load-{run}", server, flags, seconds + 120, name, "chunks/s", ceiling, run == 1)
        if cpu:
            ctx.skip("recording load", "an hour on the CPU engine takes longer than any budget")
            return
        counted = max(seconds, 20)
        flags = f"--recording {HOUR_S} --streams 2 --warmup 2 --seconds {counted:g} --timeout 100"
        name = f"load recording 2x{HOUR_S}s {math} receivers={receivers}"
        load_record(ctx, "load-recording", server, flags, counted + 150, name, "windows/s", ceiling)


# ----- recording -----------------------------------------------------------------------------
def hour_anchors(ctx: Context) -> dict[str, dict[str, Any]]:
    """way -> the PyTorch hour anchor's line (torch_hour_embedding.py), with its command."""
    script = anchor_script(ctx, "torch_hour_embedding.py")
    if script is None:
        return {}
    argv = ctx.python(str(script), str(HOUR_S))
    try:
        done = ctx.run("anchor-hour", argv, 200)
    except StepFailed as error:
        ctx.skip("anchor torch_hour_embedding.py", str(error))
        return {}
    return {
        row["way"]: {**row, "command": shown(argv)}
        for row in json_lines(done.stdout)
        if row.get("kind") == "anchor_hour"
    }


def recording(ctx: Context) -> None:
    math = serving_math(ctx)
    ways = hour_anchors(ctx)
    names = {
        "best": "PyTorch at its best (fbank on the GPU, multi-mask, FP16)",
        "pyannote": "PyTorch the way pyannote 4.0.7 does it",
    }
    for rate, channels in RECORDING_FORMATS:
        flags = f"--math {math} --recording {HOUR_S} --runs 3 --sample-rate {rate} --channels {channels}"
        argv = ctx.python("-m", "speakerd", "bench", *flags.split())
        done = ctx.run(f"bench-recording-{rate}x{channels}", argv, 240)
        line = next(row for row in json_lines(done.stdout) if row.get("kind") == "recording")
        ctx.record(
            f"hour {rate} Hz x{channels} {math} in process",
            shown(argv),
            figure(line["total_s"], "s", "lower"),
            detail=line,
        )
    with ctx.server("recording", ["--engine", "gpu", "--math", math]) as server:
        for rate, channels in RECORDING_FORMATS:
            flags = (
                f"--recording {HOUR_S} --sample-rate {rate} --channels {channels} --streams 1 --seconds 15"
            )
            result = load(ctx, f"load-{rate}x{channels}", server, [*flags.split(), "--timeout", "100"], 150)
            fig = figure(round(result["latency_p50_ms"] / 1e3, 4), "s", "lower")
            anchors = [
                anchor(names[way], ways[way]["wall_s"], "s", "lower", fig, ways[way]["command"])
                for way in ("best", "pyannote")
                if way in ways
            ]
            ctx.record(
                f"hour {rate} Hz x{channels} {math} through the server, p50",
                result.pop("_command"),
                fig,
                anchors,
                detail={**result, "anchors": ways, "server": server["command"]},
                ok=bool(result.get("ok")),
                headline=True,
            )


# ----- pyannote ------------------------------------------------------------------------------
def segmentation_path(ctx: Context) -> Path | None:
    given = ctx.options.segmentation
    candidates = [Path(given)] if given else [ctx.repo / path for path in SEGMENTATION_PATHS]
    return next((path for path in candidates if path.is_file()), None)


def pyannote(ctx: Context) -> None:
    if importlib.util.find_spec("pyannote") is None or importlib.util.find_spec("pyannote.audio") is None:
        ctx.skip(
            "pyannote",
            "pyannote.audio is not importable (scripts/device_pyannote.sh installs it on a device)",
        )
        return
    checkpoint = segmentation_path(ctx)
    if checkpoint is None:
        ctx.skip(
            "pyannote", "no segmentation-3.0 checkpoint (scripts/pyannote_segmentation.sh; or --segmentation)"
        )
        return
    math = serving_math(ctx)
    output = ctx.out / "pyannote-bench.json"
    with ctx.server("pyannote", ["--engine", "gpu", "--math", math]) as server:
        flags = f"--target {server['target']} --device cuda --audio-seconds {HOUR_S} --exclude-overlap"
        files = ["--segmentation", str(checkpoint), "--output", str(output)]
        argv = ctx.python("-m", "speakerd.pyannote.bench", *flags.split(), *files)
        ctx.run("pyannote-bench", argv, ctx.left() - 10, env={"PYANNOTE_METRICS_ENABLED": "false"})
    for kwargs in pyannote_records(json.loads(output.read_text()), shown(argv)):
        ctx.record(**kwargs)


def pyannote_records(report: dict[str, Any], command: str) -> list[dict[str, Any]]:
    """speakerd.pyannote.bench's JSON -> Context.record keyword arguments: the whole
    pipeline and its embedding step, each against pyannote alone in the same run."""
    ok = report.get("parity", {}).get("der", 0.0) == 0.0
    out = []
    for key, what in (("total_s", "pipeline"), ("embeddings_s", "embedding step")):
        fig = figure(report["speakerd"][key], "s", "lower")
        anchors = []
        if "pyannote" in report:  # absent with --skip-local
            alone = f"pyannote.audio {report.get('pyannote_audio', '')} alone".replace("  ", " ")
            anchors.append(anchor(alone, report["pyannote"][key], "s", "lower", fig, command))
        out.append(
            {
                "name": f"pyannote {what}, {report['audio_seconds']:g} s of audio",
                "command": command,
                "fig": fig,
                "anchors": anchors,
                "detail": report,
                "ok": ok,
                "headline": True,
            }
        )
    return out


# ----- devices -------------------------------------------------------------------------------
def devices(ctx: Context) -> None:
    if ctx.env.gpu_count < 2:
        ctx.skip("devices", f"needs 2 GPUs or more, nvidia-smi lists {ctx.env.gpu_count}")
        return
    math = serving_math(ctx)
    refs = references(ctx)
    shape = f"--streams {LOAD_STREAMS} --chunks {LOAD_CHUNKS} --processes {LOAD_PROCESSES}"
    flags = f"{shape} --seconds {ctx.options.seconds:g}".split()
    speeds: dict[str, list[dict[str, Any]]] = {}
    for devices_flag in ("0", "all"):
        with ctx.server(
            f"devices-{devices_flag}", ["--engine", "gpu", "--math", math, "--devices", devices_flag]
        ) as server:
            if devices_flag == "all":
                verify_record(ctx, server, refs, math)
            speeds[devices_flag] = [
                load(ctx, f"load-devices-{devices_flag}-{run}", server, flags, ctx.options.seconds + 120)
                for run in range(1, ctx.options.runs + 1)
            ]
            for result in speeds[devices_flag]:
                result["server"] = server["command"]
    one = speeds["0"]
    baseline = sum(result["chunks_per_s"] for result in one) / len(one)
    for index, result in enumerate(speeds["all"]):
        fig = figure(result["chunks_per_s"], "chunks/s", "higher")
        anchors = [
            anchor(
                "the same load on --devices 0 (mean)",
                round(baseline, 1),
                "chunks/s",
                "higher",
                fig,
                one[0]["_command"],
            )
        ]
        ctx.record(
            f"load {LOAD_STREAMS}x{LOAD_CHUNKS} {math} devices=all ({ctx.env.gpu_count} GPUs)",
            result.pop("_command"),
            fig,
            anchors,
            detail={**result, "devices_0": [r["chunks_per_s"] for r in one]},
            ok=bool(result.get("ok")),
            headline=index == 0,
        )


SUITES: dict[str, Suite] = {
    suite.name: suite
    for suite in (
        Suite("tests-gpu", "every GPU test file with REQUIRE_GPU=1 (a skip is a failure)", 560, tests_gpu),
        Suite(
            "engine",
            "bench of every math, b1 and b32, per-layer times; PyTorch eager and torch.compile "
            "max-autotune anchors in the same call",
            560,
            engine,
        ),
        Suite(
            "service",
            "a server checked by `client verify`, then 32-chunk and hour-recording loads against "
            "the engine's own bench in the same call (--engine cpu: briefly, on the CPU engine)",
            420,
            service,
            cpu_engine=True,
        ),
        Suite(
            "recording",
            "an hour of 16 kHz mono and 48 kHz stereo, in process and through a server, against "
            "the PyTorch hour anchors",
            420,
            recording,
        ),
        Suite(
            "pyannote",
            "pyannote.audio's whole pipeline on an hour, alone and with a speakerd server",
            420,
            pyannote,
        ),
        Suite(
            "devices",
            "32-chunk load on `serve --devices all` against `--devices 0` (2 GPUs or more)",
            480,
            devices,
        ),
    )
}

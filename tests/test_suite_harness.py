"""The benchmark harness (`python -m speakerd.tools.suite`), as far as it runs without a GPU.

What a maintainer relies on: the suites are listed with their budgets; a mistyped name or
flag is one line and exit 2; on a machine without a GPU every GPU suite prints one skip line
saying why and the run exits 0 (1 with --require-gpu); every record, live or curated in
measurements/, has the one schema; and the service suite really serves, verifies and loads
on the CPU engine, writing valid records.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import wave
from pathlib import Path

import numpy as np
import pytest

from speakerd.tools.bench_diarize import tiled
from speakerd.tools.suite import record as schema
from speakerd.tools.suite.diarize import linkage_alone
from speakerd.tools.suite.engine import engine_records
from speakerd.tools.suite.pyannote import pyannote_records
from speakerd.tools.suite.run import Context, StepFailed
from speakerd.tools.suite.speakrs import hour_wav, speakrs_anchors, speakrs_hours
from speakerd.tools.suite.suites import SUITES
from speakerd.tools.suite.tests_gpu import gpu_test_files, pytest_counts

REPO = Path(__file__).resolve().parent.parent
GPU_SUITES = list(SUITES)  # every suite needs a GPU unless told --engine cpu


def suite(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "speakerd.tools.suite", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def test_list_names_every_suite_with_its_budget_inside_a_device_call():
    done = suite("--list")
    assert done.returncode == 0, done.stderr
    listed = {line.split()[0]: int(line.split()[1]) for line in done.stdout.splitlines()}
    assert listed == {name: s.budget_s for name, s in SUITES.items()}
    names = {"tests-gpu", "engine", "service", "recording", "pyannote", "diarize", "startup", "devices"}
    assert set(listed) == names
    assert all(budget <= 570 for budget in listed.values()), "a suite must fit one 600 s device call"


@pytest.mark.parametrize(
    "args, expected",
    [
        (["benchmark"], "unknown suite benchmark; the suites are tests-gpu, engine"),
        ([], "name at least one suite"),
        (
            ["engine", "--engine", "cpu"],
            "--engine cpu: only these suites run on the CPU engine: service, pyannote, startup, devices",
        ),
        (["service", "--runs", "0"], "--runs, --seconds and --budget-s must be positive"),
        (["service", "--math", "fp16,tf32"], "--math fp16,tf32: only the engine suite takes several maths"),
    ],
)
def test_usage_errors_are_one_line_and_exit_2(args, expected):
    done = suite(*args)
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and expected in done.stderr, done.stderr


def test_without_a_gpu_every_gpu_suite_prints_one_skip_line_and_the_run_exits_0(tmp_path):
    hidden = {"CUDA_VISIBLE_DEVICES": ""}  # no GPU for CuPy, whatever the machine holds
    done = suite(*GPU_SUITES, "--out", str(tmp_path), env=hidden)
    assert done.returncode == 0, done.stdout + done.stderr
    for name in GPU_SUITES:
        lines = [line for line in done.stdout.splitlines() if line.startswith(f"{name}: ")]
        assert len(lines) == 1 and lines[0].startswith(f"{name}: skipped: no usable GPU ("), done.stdout
    assert done.stdout.splitlines()[-1].endswith("; ok")
    strict = suite("engine", "--out", str(tmp_path), "--require-gpu", env=hidden)
    assert strict.returncode == 1 and "FAILED: engine" in strict.stdout


def test_a_suite_whose_budget_does_not_fit_is_skipped_saying_so(tmp_path):
    done = suite("service", "--engine", "cpu", "--budget-s", "60", "--out", str(tmp_path))
    assert done.returncode == 0
    assert "service: skipped: its budget is 420 s, 60 s left of --budget-s 60" in done.stdout


def test_tests_gpu_runs_every_gpu_marked_file_and_the_block_tests_last():
    files = gpu_test_files(REPO)
    names = [path.name for path in files]
    assert {path.name for path in (REPO / "tests").glob("test_gpu_*.py")} <= set(names)
    assert "test_kernels_compile.py" in names
    assert names[-1] == "test_gpu_block.py"


def test_pytest_counts_reads_a_real_pytest_run(tmp_path):
    (tmp_path / "test_two.py").write_text("def test_ok():\n    pass\n\ndef test_bad():\n    assert 1 == 2\n")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", "test_two.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    counts = pytest_counts(done.stdout)
    assert (counts["passed"], counts["failed"], counts["errors"]) == (1, 1, 0)
    assert counts["failed_tests"] == ["test_two.py::test_bad"]


def _gone(pid: int) -> bool:
    """The process has exited (reaped, or a zombie waiting for its new parent to reap it)."""
    status = Path(f"/proc/{pid}/status")
    try:
        return "State:\tZ" in status.read_text()
    except FileNotFoundError:
        return True


@pytest.mark.slow
def test_a_step_out_of_time_fails_and_ends_its_children_too(tmp_path):
    ctx = Context("t", ENV, argparse.Namespace(), REPO, tmp_path, time.monotonic() + 60, tmp_path / "r.jsonl")
    pidfile = tmp_path / "child.pid"
    parent = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        f"open({str(pidfile)!r}, 'w').write(str(child.pid))\n"
        "print('{\"line\": 1}', flush=True)\n"
        "time.sleep(120)\n"
    )
    with pytest.raises(StepFailed, match="sleeper: ran out of its 3 s"):
        ctx.run("sleeper", [sys.executable, "-c", parent], 3)
    child = int(pidfile.read_text())
    until = time.monotonic() + 10
    while not _gone(child) and time.monotonic() < until:
        time.sleep(0.1)
    assert _gone(child), "the step's child outlived it"
    kept = ctx.run("sleeper-partial", [sys.executable, "-c", parent], 3, keep_partial=True)
    assert kept.stdout.strip() == '{"line": 1}'


# ----- the schema ----------------------------------------------------------------------------
ENV = schema.Environment("0123456789ab", "NVIDIA H100 80GB HBM3", "570.86.15", "12.8", 1)


def test_an_anchor_ratio_says_how_many_times_better_speakerd_is():
    ms = schema.figure(4.0, "ms", "lower")
    assert schema.anchor("torch", 10.0, "ms", "lower", ms, "x")["ratio"] == 2.5
    rate = schema.figure(6900.0, "chunks/s", "higher")
    assert schema.anchor("engine", 7300.0, "chunks/s", "higher", rate, "x")["ratio"] == pytest.approx(
        0.9452, abs=1e-4
    )
    with pytest.raises(ValueError, match="unit 's', the figure's is 'ms'"):
        schema.anchor("torch", 1.0, "s", "lower", ms, "x")


def test_validate_names_every_way_a_record_breaks_the_schema():
    good = schema.make_record(
        ENV, "engine", "b32 fp16 graph", "python -m speakerd bench", schema.figure(4.3, "ms", "lower")
    )
    assert schema.validate(good) == []
    broken = {
        **good,
        "commit": "main",
        "gpu": 3,
        "ok": "yes",
        "figure": {"value": "4.3", "unit": "ms"},
        "anchors": [
            {"name": "torch", "value": 9.0, "unit": "ms", "better": "faster", "command": "x", "ratio": "2x"}
        ],
        "extra": 1,
    }
    problems = " | ".join(schema.validate(broken))
    for phrase in (
        "unknown fields extra",
        "commit: 'main'",
        "gpu: 3",
        "ok: 'yes'",
        "figure: missing better",
        "figure.value: '4.3'",
        "anchors[0].better: 'faster'",
        "anchors[0].ratio: '2x'",
    ):
        assert phrase in problems
    assert schema.validate({"schema": schema.SCHEMA})[0].startswith("missing suite, name, commit")


def test_every_curated_measurement_is_a_valid_record():
    files = sorted((REPO / "measurements").glob("*.jsonl"))
    assert files, "measurements/ holds the records behind the README's figures"
    done = suite("--check", *map(str, files))
    assert done.returncode == 0, done.stdout
    for path in files:
        for line in path.read_text().splitlines():
            record = json.loads(line)
            # a GPU row names its GPU; a CPU row (a cpu-*.jsonl file) has none to name
            on_gpu = not path.name.startswith("cpu-")
            assert record["commit"] != "unknown" and bool(record["gpu"]) == on_gpu, (
                f"{path.name}: {record['name']}"
            )


def test_check_reports_a_bad_records_file_with_its_line_and_exits_2(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"schema": "speakerd.measurement/1"}\nnot json\n')
    done = suite("--check", str(bad))
    assert done.returncode == 2
    assert f"{bad}:1: missing suite" in done.stdout and f"{bad}:2: not JSON" in done.stdout


# ----- turning command output into records -------------------------------------------------------
def test_engine_records_pair_each_graph_plan_with_its_same_run_anchors_and_sum_layers():
    bench = [
        {"kind": "engine", "math": "fp16", "build_s": 31.5},
        {"kind": "ours", "math": "fp16", "batch": 32, "mode": "eager", "compute_ms_median": 4.9},
        {
            "kind": "ours",
            "math": "fp16",
            "batch": 32,
            "mode": "graph",
            "compute_ms_median": 4.0,
            "chunks_per_s": 8000,
        },
        {
            "kind": "conv",
            "math": "fp16",
            "batch": 32,
            "conv": "layer1.0.conv1",
            "ms": 0.25,
            "runs": "ours:wgmma_8x64",
        },
        {
            "kind": "conv",
            "math": "fp16",
            "batch": 32,
            "conv": "layer1.0.conv2",
            "ms": 0.0,
            "runs": "ours:block (in layer1.0.conv1's row)",
        },
        {
            "kind": "conv",
            "math": "fp16",
            "batch": 32,
            "conv": "layer1.1.conv1",
            "ms": 0.5,
            "runs": "cudnn:eng62",
        },
        {"kind": "conv", "math": "fp16", "batch": 32, "conv": "stem", "ms": 0.09, "runs": "ours:stem_f16"},
        {"kind": "torch", "torch": "2.11.0", "math": "fp16", "batch": 32, "ms_median": 10.0},
    ]
    compiled = [{"anchor": "torch.compile", "mode": "max-autotune", "batch": 32, "ms_median": 8.0}]
    rows = {row["name"]: row for row in engine_records(bench, "bench", compiled, "compile")}
    assert set(rows) == {"b32 fp16 graph", "b32 fp16 layer1", "b32 fp16 stem"}
    graph = rows["b32 fp16 graph"]
    assert graph["fig"] == {"value": 4.0, "unit": "ms", "better": "lower"}
    assert [(a["name"], a["ratio"], a["command"]) for a in graph["anchors"]] == [
        ("PyTorch 2.11.0 eager, CUDA graph", 2.5, "bench"),
        ("torch.compile max-autotune", 2.0, "compile"),
    ]
    assert graph["detail"]["eager_ms"] == 4.9 and graph["detail"]["build_s"] == 31.5
    layer1 = rows["b32 fp16 layer1"]
    assert layer1["fig"]["value"] == 0.75 and layer1["detail"]["runs"] == {
        "ours:wgmma_8x64": 1,
        "cudnn:eng62": 1,
    }
    for row in rows.values():
        assert (
            schema.validate(
                schema.make_record(
                    ENV, "engine", row["name"], row["command"], row["fig"], row["anchors"], row["detail"]
                )
            )
            == []
        )


def test_pyannote_records_compare_the_pipeline_and_its_embedding_step_with_pyannote_alone():
    report = {
        "audio_seconds": 3600.0,
        "pyannote_audio": "4.0.7",
        "pyannote": {"total_s": 28.5, "embeddings_s": 23.5},
        "speakerd": {"total_s": 6.6, "embeddings_s": 0.96},
        "parity": {"der": 0.0},
    }
    rows = pyannote_records(report, "python -m speakerd.pyannote.bench")
    assert [(row["name"], row["anchors"][0]["ratio"], row["ok"]) for row in rows] == [
        ("pyannote pipeline, 3600 s of audio", pytest.approx(4.3182, abs=1e-4), True),
        ("pyannote embedding step, 3600 s of audio", pytest.approx(24.4792, abs=1e-4), True),
    ]
    report["parity"]["der"] = 0.01
    assert not any(row["ok"] for row in pyannote_records(report, "x")), (
        "a diarization that changed is a failure"
    )


# ----- a real run: the service suite on the CPU engine -------------------------------------------
@pytest.mark.slow
def test_service_suite_serves_verifies_and_loads_on_the_cpu_engine(tmp_path, references_dir):
    out = tmp_path / "out"  # the session's references: the suite need not make its own
    done = suite(
        "service",
        "--engine",
        "cpu",
        "--seconds",
        "2",  # the load lengthens itself to 3 calls' estimated time: what "the load ran" needs
        "--runs",
        "1",
        "--references",
        str(references_dir),
        "--out",
        str(out),
        timeout=500,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert [record["name"] for record in records] == ["verify fp32", "load 2x1 fp32 receivers=0"]
    assert all(schema.validate(record) == [] and record["ok"] for record in records)
    verify, load = records
    cases = len(list(references_dir.glob("*.safetensors")))
    assert verify["figure"]["value"] == cases and verify["detail"]["cases"] == cases
    assert load["figure"]["unit"] == "chunks/s" and load["figure"]["value"] > 0 and load["anchors"] == []
    assert load["command"].startswith("python -m speakerd.client load --target 127.0.0.1:")
    assert "service: recording load skipped: an hour on the CPU engine" in done.stdout
    summary = [line for line in done.stdout.splitlines() if line.startswith("service: 2 records in ")]
    assert len(summary) == 1 and f"verify fp32 {cases} cases within parity bounds" in summary[0]
    assert (out / "logs.tgz").is_file() and not (out / "logs").exists()


@pytest.mark.slow
def test_startup_suite_starts_twice_on_one_cache_and_records_both(tmp_path):
    """The second server finds what the first made (here the CPU engine's default models and
    the clustering's compiled loops) and says so in its phases."""
    out = tmp_path / "out"
    done = suite("startup", "--engine", "cpu", "--out", str(out), timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert [r["name"] for r in records] == [
        "start-up to SERVING with an empty cache, fp32 cpu server",
        "start-up to SERVING from the first start's cache, fp32 cpu server",
    ]
    assert all(schema.validate(r) == [] and r["ok"] for r in records), records
    empty, cached = (r["detail"] for r in records)
    assert list(empty["phases_s"]) == ["models", "segmentation", "engine", "self-check", "plan timing",
                                       "clustering check"], empty["phases_s"]  # fmt: skip
    # the first start made the default models; the second only read them
    assert cached["phases_s"]["models"] < empty["phases_s"]["models"], (empty["phases_s"], cached["phases_s"])
    assert empty["cache_files"].get("numba", 0) > 0, empty["cache_files"]
    assert records[1]["anchors"][0]["value"] == records[0]["figure"]["value"]
    assert records[1]["anchors"][0]["command"] == records[0]["command"]


@pytest.mark.slow
def test_devices_suite_measures_a_worker_against_plain_serve_and_kills_it_under_load(tmp_path):
    """On CPU workers: verify through the worker, the 32-chunk and recording loads each
    against the plain server, then the worker SIGKILLed under load, every check in the
    record (CI's 2 cores: the figures are not the point, the rows and the checks are)."""
    out = tmp_path / "out"
    done = suite("devices", "--engine", "cpu", "--out", str(out), timeout=400)
    assert done.returncode == 0, done.stdout + done.stderr
    records = {r["name"]: r for r in map(json.loads, (out / "records.jsonl").read_text().splitlines())}
    assert all(schema.validate(r) == [] for r in records.values()), records
    assert records["verify fp32 devices=0"]["figure"]["value"] == 7, records["verify fp32 devices=0"]
    for name in ("32-chunk requests, chunks/s fp32, --devices 0",
                 "12 s of 16 kHz audio under the client's masks, p50 fp32, --devices 0"):  # fmt: skip
        anchor = records[name]["anchors"][0]
        assert anchor["name"] == "the same on plain serve (no --devices)" and anchor["ratio"] > 0, records[
            name
        ]
        assert "--devices 0" in records[name]["detail"]["server"], records[name]["detail"]["server"]
    killed = next(r for name, r in records.items() if "worker SIGKILLed under load" in name)
    assert killed["ok"] and killed["figure"]["value"] == 0, killed["detail"]
    assert all(killed["detail"]["checks"].values()) and killed["detail"]["errors"].get("UNAVAILABLE", 0) > 0
    assert "device 0 taken out: its worker process exited" in killed["detail"]["log_line"]


def test_diarize_suite_links_the_hours_rows_and_3_hours_worth_checked_against_scipy(tmp_path):
    # the diarize suite's last step, on the CPU and on a few rows: one record per size,
    # `ok` only where every linkage matrix equals the reference, SciPy's the hour's anchor
    rows = np.random.default_rng(0).standard_normal((300, 256)).astype(np.float32)
    np.savez(tmp_path / "hour.npz", clean=rows)
    ctx = Context(
        "diarize", ENV, argparse.Namespace(), REPO, tmp_path, time.monotonic() + 120, tmp_path / "r.jsonl"
    )
    linkage_alone(ctx, tmp_path / "hour.npz", three_hours_rows=400)
    hour, three_hours = ctx.records
    assert hour["name"] == "centroid linkage of the hour's 300 clean rows, host distances", hour["name"]
    assert three_hours["name"] == "centroid linkage of the 3 h's 400 clean rows, host distances"
    assert hour["ok"] and three_hours["ok"], (hour["detail"]["equal"], three_hours["detail"]["equal"])
    # SciPy runs up to bench_clustering's SCIPY_MAX_ROWS (6,000): on both here, not on 3 h's 15,000
    assert all(r["anchors"][0]["name"].startswith("SciPy's linkage") for r in (hour, three_hours))
    assert not schema.validate(hour) and not schema.validate(three_hours)


def test_speakrs_gets_the_hour_bench_diarize_tiles_and_is_skipped_without_its_files(tmp_path, capsys):
    # speakrs' hour.py tiles the clip it is given: given the suite's hour, it diarizes the
    # audio speakerd does (bench_diarize.tiled's tiling, as PCM16 it reads exactly)
    clip = (np.random.default_rng(0).standard_normal(16_000 * 3) * 3000).astype(np.int16)
    with wave.open(str(tmp_path / "clip.wav"), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(16_000)
        out.writeframes(clip.tobytes())
    hour = hour_wav(tmp_path / "clip.wav", 7.5, tmp_path / "hour.wav")
    with wave.open(str(hour)) as read:
        samples = np.frombuffer(read.readframes(read.getnframes()), "<i2")
    expected = tiled(clip[:, None].astype(np.float32), 16_000, 7.5)[:, 0]
    assert np.array_equal(samples, expected.astype(np.int16)), "hour.py's clip is not bench_diarize's hour"
    for given, why in (
        (None, "no --speakrs DIR"),
        (str(tmp_path), "lacks speakrs-*.whl, hour.py or models/"),
    ):
        ctx = Context("diarize", ENV, argparse.Namespace(speakrs=given), REPO, tmp_path,
                      time.monotonic() + 60, tmp_path / "r.jsonl")  # fmt: skip
        assert speakrs_hours(ctx, tmp_path / "clip.wav", 7.5) == {}
        assert ctx.notes == ["speakrs skipped"] and not ctx.records, (ctx.notes, ctx.records)
        assert why in capsys.readouterr().out
    assert speakrs_anchors({}, schema.figure(1.0, "s", "lower")) == []

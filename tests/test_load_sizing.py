"""`client load` sizes itself for the server it calls, and its exit status means one thing.

Exit 0: no call failed and at least one call begun in the counted window completed. Exit 1:
a call failed, or none was counted, and the JSON's `failure` says which (with `ok` false).
Exit 2: a load the command line makes impossible (a recording that cannot fit its given
deadline), one line saying what to change. Without --chunks and --streams the load is
chosen from a probe call, so the README's command works on the CPU engine on 2 cores
(about 8 chunks/s), where a fixed 16 x 8-chunk load failed every call with DEADLINE_EXCEEDED.
"""

from __future__ import annotations

import argparse
import json

import pytest

from speakerd.client.cli import main
from speakerd.client.load_sizing import (
    CALLS_PER_WINDOW,
    DEADLINE_SHARE,
    MAX_STREAMS,
    Probe,
    _fits,
    _stretch,
    chunk_sizing,
    recording_sizing,
)
from speakerd.client.loadgen_window import outcome
from tests.serving import ServerProcess

#: A one-chunk probe that took 0.125 s: the CPU engine's 8 chunks/s on 2 idle cores.
CPU_PROBE = Probe(engine="cpu-onnxruntime", max_batch=32, seconds=0.125)
#: A GPU server's: 2 ms for one chunk, round trip included.
GPU_PROBE = Probe(engine="gpu-cupy", max_batch=32, seconds=0.002)


def test_outcome_is_ok_only_when_no_call_failed_and_one_was_counted() -> None:
    assert outcome(3, {}, 10.0) == {"failed_calls": 0, "ok": True, "failure": None}
    failed = outcome(1, {"DEADLINE_EXCEEDED": 7}, 10.0)
    assert failed["ok"] is False and failed["failed_calls"] == 7, failed
    assert failed["failure"] == "7 calls failed (DEADLINE_EXCEEDED 7)", failed
    none = outcome(0, {}, 10.0)
    assert none["ok"] is False and none["failed_calls"] == 0, none
    assert none["failure"].startswith("no call began in the 10 s counted window"), none


def test_sizing_fits_the_calls_in_a_quarter_of_the_deadline() -> None:
    # CPU: 32 chunks in a quarter of 30 s at 8 chunks/s (60 would fit), and one stream of them
    assert _fits(CPU_PROBE, 30.0, 1, CPU_PROBE.max_batch) == 32
    assert _fits(CPU_PROBE, 30.0, 32, MAX_STREAMS) == 1
    # GPU: the largest plan, and the most streams
    assert _fits(GPU_PROBE, 30.0, 1, GPU_PROBE.max_batch) == 32
    assert _fits(GPU_PROBE, 30.0, 32, MAX_STREAMS) == MAX_STREAMS
    # never below one call of one chunk, however slow the server
    assert _fits(Probe("cpu-onnxruntime", 32, 100.0), 30.0, 1, 32) == 1
    assert DEADLINE_SHARE * 30.0 * CPU_PROBE.chunks_per_s >= 32


def test_window_and_warm_up_are_lengthened_to_the_calls() -> None:
    args = argparse.Namespace(seconds=10.0, warmup=1.0)
    assert _stretch(args, 0.01) == {"call_s_estimated": 0.01}
    assert (args.seconds, args.warmup) == (10.0, 1.0)
    slow = _stretch(args, 8.0)
    assert args.seconds == CALLS_PER_WINDOW * 8.0 and args.warmup == 8.0, vars(args)
    assert slow == {"call_s_estimated": 8.0, "seconds_asked": 10.0, "warmup_asked": 1.0}, slow


#: An H100 server's one-chunk probe (measured: 6.7 ms), and the batch probe it leads to at that
#: server's 32-chunk load rate (measured: 7,150 chunks/s, so 4.5 ms a batch; 15 ms here for the
#: upload of 10 MB of fbank besides).
H100_PROBE = Probe(engine="gpu-cupy", max_batch=32, seconds=0.0067)
H100_BATCH_PROBE = Probe(engine="gpu-cupy", max_batch=32, seconds=0.015, chunks=32)
#: `suite service`'s recording step: `load --recording 3600 --streams 2 --warmup 2 --seconds 20
#: --timeout 100` within 170 s (speakerd/tools/suite/service.py).
SUITE_STEP_S, HOUR_WINDOWS = 170.0, 3591


def test_a_fast_one_chunk_probe_is_followed_by_a_batch_probe() -> None:
    assert H100_PROBE.wants_batch_probe() and GPU_PROBE.wants_batch_probe()
    assert not CPU_PROBE.wants_batch_probe(), "a CPU server gets one probe: 32 chunks take it 4 s"
    assert not H100_BATCH_PROBE.wants_batch_probe(), "a batch probe is the last"
    assert H100_BATCH_PROBE.report()["probe_chunks"] == 32


def test_an_hour_recording_load_on_a_gpu_fits_the_suite_step() -> None:
    """The one-chunk rate sized a GPU's hour at 24 s a call and the suite's step past its
    budget; the batch probe's rate keeps the same command inside it."""

    def step_s(measured: Probe) -> float:
        args = argparse.Namespace(recording=3600.0, timeout=100.0, streams=2, seconds=20.0, warmup=2.0)
        sizing = recording_sizing(args, HOUR_WINDOWS, measured)
        # warm-up, the counted window, then the last call begun in it finishing
        return args.warmup + args.seconds + sizing["call_s_estimated"]

    assert step_s(H100_PROBE) > SUITE_STEP_S, step_s(H100_PROBE)
    assert step_s(H100_BATCH_PROBE) < SUITE_STEP_S / 2, step_s(H100_BATCH_PROBE)


def test_a_chunk_load_counts_about_the_seconds_asked() -> None:
    """On a CPU server a call is as many chunks as a second holds, one stream (its engine runs
    one chunk at a time): `load --seconds 10` counts 10 s, where 32-chunk calls made it 30 s
    for the same chunks/s. A GPU server still gets full batches from the most streams."""

    def sized(measured: Probe) -> argparse.Namespace:
        args = argparse.Namespace(chunks=None, streams=None, timeout=None, seconds=10.0, warmup=1.0)
        chunk_sizing(args, measured)
        return args

    cpu = sized(CPU_PROBE)
    assert (cpu.chunks, cpu.streams, cpu.seconds, cpu.warmup) == (8, 1, 10.0, 1.0), vars(cpu)
    gpu = sized(H100_BATCH_PROBE)
    assert (gpu.chunks, gpu.streams, gpu.seconds) == (32, MAX_STREAMS, 10.0), vars(gpu)


@pytest.fixture(scope="module")
def server(shared_server: ServerProcess) -> ServerProcess:
    return shared_server


def _run(argv: list[str], capsys) -> tuple[int, dict[str, object]]:
    code = main(argv)
    out = capsys.readouterr().out.strip()
    return code, json.loads(out.splitlines()[-1]) if out else {}


def test_load_sizes_itself_and_succeeds(server: ServerProcess, capsys) -> None:
    code, report = _run(["load", "--target", server.target, "--seconds", "2"], capsys)
    assert code == 0 and report["ok"] is True and report["failure"] is None, report
    sizing = report["sizing"]
    assert sizing["engine"] == "cpu-onnxruntime" and sizing["chosen"] == ["chunks", "streams"], sizing
    assert 1 <= report["chunks_per_request"] <= 8 and 1 <= report["streams"] <= MAX_STREAMS, report
    assert report["seconds"] >= max(2.0, CALLS_PER_WINDOW * sizing["call_s_estimated"] - 0.1), report
    assert report["requests_ok"] >= 1 and report["errors"] == {}, report


def test_failed_calls_are_exit_1_with_the_reason(server: ServerProcess, capsys) -> None:
    """A deadline no call can meet: the probe still runs (its own deadline), the calls fail.
    One chunk a call (a CPU plan run of ~0.25 s, ten times the deadline): a larger call only
    stretches the counted window and the warm-up to its estimated time (`_stretch`)."""
    argv = ["load", "--target", server.target, "--chunks", "1", "--streams", "1", "--seconds", "1",
            "--warmup", "0", "--timeout", "0.02"]  # fmt: skip
    code, report = _run(argv, capsys)
    assert code == 1 and report["ok"] is False, report
    assert report["failed_calls"] >= 1 and report["errors"].get("DEADLINE_EXCEEDED", 0) >= 1, report
    assert report["failure"].endswith(f"calls failed (DEADLINE_EXCEEDED {report['failed_calls']})"), report


def test_a_recording_its_deadline_cannot_hold_is_one_line_exit_2(server: ServerProcess, capsys) -> None:
    argv = ["load", "--target", server.target, "--recording", "120", "--timeout", "1"]
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and captured.out == "", captured
    assert "--recording 120: 111 windows a call" in lines[0] and "--timeout" in lines[0], lines[0]


@pytest.mark.slow
def test_a_recording_load_gets_a_deadline_it_can_meet(server: ServerProcess, capsys) -> None:
    """10 s, one window a call: the counted window and the warm-up are stretched to the calls'
    estimated time, so a longer recording costs the engine more and checks no more (how the
    sizing scales with windows: test_an_hour_recording_load_on_a_gpu_fits_the_suite_step)."""
    code, report = _run(["load", "--target", server.target, "--recording", "10", "--seconds", "1"], capsys)
    assert code == 0 and report["ok"] is True, report
    sizing = report["sizing"]
    assert sizing["chosen"] == ["timeout", "streams"] and sizing["timeout"] >= 30, sizing
    assert report["windows_per_recording"] == 1 and report["recordings_ok"] >= 1, report

"""The `devices` suite: `serve --devices` against plain `serve` on the same GPU, in one run.

A server with `--devices 0` runs its engine, the recordings' audio, the segmentation and
Diarize's linkage in one worker process (docs/devices.md); what it costs against the engine
in the server's own process is what a user moving to every GPU of a host pays per GPU. On
one GPU the suite serves the same flags both ways (FP16; segmentation-3.0 where found, as
the diarize suite finds it) and records, each against the plain server's figure:

- `client verify` of the reference cases through the worker;
- 32-chunk requests (`client load --streams 16 --chunks 32 --processes 4`), chunks/s;
- an hour of 16 kHz audio under the client's masks (`client load --recording 3600`, one
  caller), the p50 of its calls;
- with segmentation-3.0 and a speech clip (`--speech`, or pyannote's sample.wav as the
  diarize suite finds it), bench_diarize's hour: EmbedRecording with `segment`, and Diarize,
  p50 of 3 runs each;
- the worker SIGKILLed under that 32-chunk load: no call may end with any code but OK or
  UNAVAILABLE (the one GPU gone, nothing can serve: docs/devices.md), health must go
  NOT_SERVING, `speakerd_device_up{device="0"}` 0 and the failure counted, and the log must
  say which device was taken out and why.

With 2 GPUs or more, `serve --devices all` under the 32-chunk load against `--devices 0`.
With `--engine cpu` (CI), the same on CPU workers with loads a 2-core machine runs in
seconds, and no hour.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from speakerd.client.loadgen import scrape
from speakerd.tools.suite.diarize import speech_path
from speakerd.tools.suite.pyannote import segmentation_path
from speakerd.tools.suite.record import anchor, figure
from speakerd.tools.suite.run import Context, StepFailed, json_lines, shown
from speakerd.tools.suite.service import (
    CPU_LOAD_CHUNKS,
    CPU_LOAD_STREAMS,
    LOAD_CHUNKS,
    LOAD_PROCESSES,
    LOAD_STREAMS,
)
from speakerd.tools.suite.steps import HOUR_S, load, references, serving_math, verify_record

#: The recording row: one caller of an hour at a time, as a user feels it (p50 of its calls).
RECORDING_FLAGS = f"--recording {HOUR_S} --streams 1 --warmup 2 --seconds 15 --timeout 100"
#: On CPU workers: a 12 s recording (3 windows), a few calls in seconds of 2 cores.
CPU_RECORDING_S = 12
CPU_RECORDING_FLAGS = f"--recording {CPU_RECORDING_S} --streams 1 --warmup 0 --seconds 2 --timeout 100"
#: The worker's pid in the pool's start line (device_pool.py).
WORKER_PIDS = re.compile(r"worker pids \[(?P<pids>[\d, ]+)\]")
#: How long the kill step waits for a batch in flight, then for the server to notice.
KILL_WAIT_S = 30.0
#: The load the worker is killed under runs this long (it must outlast the kill).
KILL_LOAD_S = 8
#: Batches the load runs on the device before the kill: more than its probe calls
#: (load_sizing.py sends at most 2), so the kill lands in its counted run.
KILL_AFTER_BATCHES = 6


def devices(ctx: Context) -> None:
    math = serving_math(ctx)
    cpu = ctx.options.engine == "cpu"
    refs = references(ctx)
    checkpoint, speech = segmentation_path(ctx), speech_path(ctx)
    serve = ["--engine", ctx.options.engine, "--math", math]
    if checkpoint is not None:
        serve += ["--segmentation-model", str(checkpoint)]
    hour = not cpu and checkpoint is not None and speech is not None
    if not hour:
        why = "the CPU engine" if cpu else "no segmentation-3.0 checkpoint or speech clip"
        ctx.skip("devices: the hour's segmentation and Diarize rows", why)
    with ctx.server("plain", serve) as server:
        plain = _measure(ctx, "plain", server, cpu, speech if hour else None)
    with ctx.server("devices-0", [*serve, "--devices", "0"]) as server:
        verify_record(ctx, server, refs, f"{math} devices=0")
        worker = _measure(ctx, "devices-0", server, cpu, speech if hour else None)
        seconds = CPU_RECORDING_S if cpu else HOUR_S
        for key, (name, unit, better) in ROWS.items():
            if key in worker:
                named = f"{name.format(seconds=seconds)} {math}, --devices 0"
                _against_plain(ctx, named, worker[key], plain.get(key), unit, better)
        _killed_under_load(ctx, server, cpu, math)
    if ctx.env.gpu_count >= 2 and not cpu:
        _all_devices(ctx, serve, math, worker["chunks"])


#: A figure, the command that measured it, and its detail.
Measured = tuple[Any, str, dict[str, Any]]
#: What `_measure` returns, by key: the record's name, its unit, which way is better.
ROWS = {
    "chunks": ("32-chunk requests, chunks/s", "chunks/s", "higher"),
    "recording": ("{seconds} s of 16 kHz audio under the client's masks, p50", "s", "lower"),
    "segment": ("the hour's segmentation and embeddings (EmbedRecording with segment), p50", "s", "lower"),
    "diarize": ("the hour diarized (Diarize), p50", "s", "lower"),
}


def _measure(
    ctx: Context, name: str, server: dict[str, str], cpu: bool, speech: Path | None
) -> dict[str, Any]:
    """The figures of ROWS on one server, each with the command that measured it."""
    streams, chunks, processes = (CPU_LOAD_STREAMS, CPU_LOAD_CHUNKS, 1) if cpu else (
        LOAD_STREAMS, LOAD_CHUNKS, LOAD_PROCESSES)  # fmt: skip
    seconds = 3 if cpu else ctx.options.seconds
    flags = f"--streams {streams} --chunks {chunks} --processes {processes} --seconds {seconds:g}"
    loaded = load(ctx, f"load-{name}", server, flags.split(), seconds + 120)
    figures = {"chunks": (loaded["chunks_per_s"], loaded["_command"], loaded)}
    recording = load(
        ctx, f"load-recording-{name}", server, (CPU_RECORDING_FLAGS if cpu else RECORDING_FLAGS).split(), 150
    )
    figures["recording"] = (round(recording["latency_p50_ms"] / 1e3, 4), recording["_command"], recording)
    if speech is not None:
        argv = ctx.python("-m", "speakerd.tools.bench_diarize", "--target", server["target"], "--audio",
                          str(speech), "--seconds", str(HOUR_S), "--runs", "3")  # fmt: skip
        done = ctx.run(f"bench-diarize-{name}", argv, 150)
        lines = {row["kind"]: row for row in json_lines(done.stdout)}
        for key in ("segment", "diarize"):
            figures[key] = (lines[key]["p50_s"], shown(argv), lines[key])
    for _, _, detail in figures.values():
        detail["server"] = server["command"]
    return figures


def _against_plain(
    ctx: Context, name: str, ours: Measured, plain: Measured | None, unit: str, better: str
) -> None:
    value, command, detail = ours
    fig = figure(value, unit, better)
    anchors = []
    if plain is not None:
        anchors.append(
            anchor("the same on plain serve (no --devices)", plain[0], unit, better, fig, plain[1])
        )
    detail = {key: item for key, item in detail.items() if key != "_command"}
    ctx.record(name, command, fig, anchors, detail, bool(detail.get("ok", True)), headline=True)


def _killed_under_load(ctx: Context, server: dict[str, str], cpu: bool, math: str) -> None:
    """SIGKILL the one worker while a 32-chunk load runs (module docstring's last row)."""
    log = Path(server["log"])
    found = WORKER_PIDS.search(log.read_text())
    if found is None:
        raise StepFailed(f"devices: no worker pid in {log}")
    pid = int(found["pids"].split(",")[0])
    streams, chunks, processes = (CPU_LOAD_STREAMS, CPU_LOAD_CHUNKS, 1) if cpu else (
        LOAD_STREAMS, LOAD_CHUNKS, LOAD_PROCESSES)  # fmt: skip
    flags = (f"--streams {streams} --chunks {chunks} --processes {processes} --seconds {KILL_LOAD_S} "
             "--warmup 0 --timeout 20")  # fmt: skip
    argv = ctx.python("-m", "speakerd.client", "load", "--target", server["target"], *flags.split())
    before = _samples(server).get("speakerd_device_batches_total", 0.0)
    step_log = ctx.log_path("load-killed")
    with step_log.open("w") as err:
        loading = subprocess.Popen(argv, cwd=ctx.repo, stdout=subprocess.PIPE, stderr=err, text=True,
                                   start_new_session=True)  # fmt: skip

        # after the load's probe calls (load_sizing.py: at most 2), in its counted run, with a
        # batch on the device
        def running() -> bool:
            now = _samples(server)
            ran = now.get("speakerd_device_batches_total", 0.0) - before
            return ran >= KILL_AFTER_BATCHES and now.get("speakerd_device_inflight_batches", 0.0) >= 1

        in_flight = _wait_for(running)
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        noticed = _wait_for(lambda: _samples(server).get("speakerd_device_up") == 0)
        noticed_s = time.monotonic() - killed_at  # from the kill to device_up 0 (or the wait's end)
        try:
            stdout, _ = loading.communicate(timeout=KILL_LOAD_S + 60)
        except subprocess.TimeoutExpired:
            os.killpg(loading.pid, signal.SIGKILL)
            stdout, _ = loading.communicate()
    with step_log.open("a") as tail:
        tail.write(f"\n--- stdout ---\n{stdout}")
    lines = json_lines(stdout)
    report = lines[-1] if lines else {}
    errors: dict[str, int] = report.get("errors", {})
    wrong = sum(count for code, count in errors.items() if code != "UNAVAILABLE")
    health = ctx.run("health-after-kill", ctx.python("-m", "speakerd.client", "health", "--target",
                                                     server["target"]), 30, check=False)  # fmt: skip
    text = log.read_text()
    said = re.search(r"ERROR .*device 0 taken out: [^\n]*", text)
    failures = _samples(server).get("speakerd_device_failures_total")
    checks = {
        "the load ran (its JSON) with a batch in flight when the worker was killed": bool(report)
        and in_flight,
        "device_up 0 within 30 s": noticed,
        "no call ended with a code but OK or UNAVAILABLE": wrong == 0,
        "health NOT_SERVING": "NOT_SERVING" in health.stdout,
        "speakerd_device_failures_total{device=0} == 1": failures == 1,
        "the log names the device and why": said is not None,
    }
    detail = {
        "checks": checks,
        "errors": errors,
        "load": report,
        "health": health.stdout.strip(),
        "log_line": said.group(0) if said else None,
        "noticed_s": round(noticed_s, 2),
        "server": server["command"],
    }
    ctx.record(f"calls ended with another code than OK or UNAVAILABLE, worker SIGKILLed under load, {math}, "
               "--devices 0", shown(argv), figure(wrong, "calls", "lower"), [], detail, all(checks.values()),
               headline=True)  # fmt: skip


def _all_devices(ctx: Context, serve: list[str], math: str, one: Measured) -> None:
    """2 GPUs or more: the 32-chunk load on `--devices all` against `--devices 0`."""
    shape = f"--streams {LOAD_STREAMS} --chunks {LOAD_CHUNKS} --processes {LOAD_PROCESSES}"
    flags = f"{shape} --seconds {ctx.options.seconds:g}".split()
    with ctx.server("devices-all", [*serve, "--devices", "all"]) as server:
        result = load(ctx, "load-devices-all", server, flags, ctx.options.seconds + 120)
    fig = figure(result["chunks_per_s"], "chunks/s", "higher")
    anchors = [anchor("the same load on --devices 0", one[0], "chunks/s", "higher", fig, one[1])]
    command = result.pop("_command")
    name = f"32-chunk requests, chunks/s {math}, --devices all ({ctx.env.gpu_count} GPUs)"
    detail = {**result, "server": server["command"]}
    ctx.record(name, command, fig, anchors, detail, bool(result.get("ok")), headline=True)


def _samples(server: dict[str, str]) -> dict[str, float]:
    """The `--devices 0` server's /metrics, each sample summed over its labels: its one
    device's (client load's own reader)."""
    return scrape(server["metrics_url"])


def _wait_for(condition) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + KILL_WAIT_S
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return False

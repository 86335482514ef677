"""What an operator meets first: misconfigurations, a missing server, SIGTERM at any moment.

A flag the server cannot start with is one line naming the flag and what to do, exit code 2,
and no "draining" for a server that never served (it used to be a 20-line traceback). A
client whose server does not answer says so in one line naming the target and the gRPC
code, exit 1. SIGTERM ends the process within the drain time plus a small bound, whether it
comes during the warm-up or with half a minute of work in flight (what is left is failed
with UNAVAILABLE).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from safetensors.numpy import save_file

from speakerd.client.cli import main as client_main
from speakerd.client.client import DEFAULT_TARGET, NO_RETRY, SpeakerClient
from speakerd.engine.cpu import CpuEngine
from speakerd.model.architecture import (
    EMBEDDING_DIM,
    FRAMES,
    MASK_FRAMES,
    MAX_SPEAKERS,
    MEL_BINS,
    TRUNK_FRAMES,
)
from speakerd.model.cases import CASE_NAMES, FILE_SUFFIX
from speakerd.reference.self_check import check_engine, check_sizes
from speakerd.serving.server import config
from speakerd.serving.server.serve import plan_times_text
from tests.serving import scrape, start_server, wait_until

pytestmark = pytest.mark.slow  # a server start per test: seconds of 2 cores a test

#: Start-up of a subprocess that fails its front-door checks: imports, then one check.
FRONT_DOOR_TIMEOUT_S = 120
#: The drain test's --drain-seconds, and what the exit may take beyond it: failing the calls
#: left, stopping the server and exiting take well under a second; the slack is for a loaded
#: 2-core machine. The work in flight is 3 full b32 batches, ~6.5 s each on 2 cores, its
#: first begun when the SIGTERM comes: one second of drain leaves most of it to abandon
#: (the engine computes on both cores until the exit: 2 s of drain cost 2 s of CPU more).
DRAIN_S = 1.0
EXIT_SLACK_S = 8.0
HEAVY_CALLS = 3
#: Counts the calls whose first chunks left the queue for an engine worker.
TAKEN = "speakerd_queue_wait_seconds_count{}"
#: How long the drain test waits for its calls to reach the server (well under a second on
#: a quiet machine), on a loaded 2-core one.
WAIT_S = 60.0


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def serve(*flags: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "speakerd", "serve", "--port", "0", "--metrics-port", "0", *flags]
    return subprocess.run(command, capture_output=True, text=True, timeout=FRONT_DOOR_TIMEOUT_S, env=env)


def assert_one_line_usage_error(done: subprocess.CompletedProcess[str], *expected: str) -> None:
    """Exit 2; the last stderr line names what is expected; no traceback, no draining."""
    errors = done.stderr.strip().splitlines()
    assert done.returncode == 2, (done.returncode, done.stderr[-3000:])
    assert "Traceback" not in done.stderr and "draining" not in done.stderr, done.stderr[-3000:]
    assert all(text in errors[-1] for text in expected), (expected, errors[-1])


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--engine", "cpu", "--math", "fp16"], ["--math fp16", "fp32 only", "use --math fp32"]),
        (
            ["--segmentation-math", "fast"],
            ["--segmentation-math fast", "CPU segmenter", "fp32 only", "use --segmentation-math fp32"],
        ),
        (["--segmentation-math", "fp64"], ["--segmentation-math", "fp64", "fp32", "fast"]),
        (["--model", "/nonexistent/model.safetensors"], ["--model /nonexistent", "no such file"]),
        (["--host", "192.0.2.1"], ["--host 192.0.2.1", "cannot listen"]),  # TEST-NET: never local
        (["--plans", "1,64"], ["--plans", "64 exceeds 32"]),
        (["--tls-cert", "/etc/hostname"], ["--tls-cert and --tls-key go together"]),
        (["--auth-tokens", "/nonexistent/tokens"], ["--auth-tokens /nonexistent/tokens", "no such file"]),
        (["--devices", "0,999"], ["--devices 0,999", "device 999 does not exist", "CPU worker slots"]),
        (["--devices", "gpu0"], ["--devices", "expected all or comma-separated device indices"]),
        (["--receivers", "33"], ["--receivers", "expected 0 (this process receives calls) to 32"]),
    ],
    ids=[
        "fp16-on-cpu",
        "fast-segmentation-on-cpu",
        "segmentation-math-garbled",
        "missing-weights",
        "unbindable-host",
        "plan-too-large",
        "tls-half",
        "no-tokens",
        "device-missing",
        "devices-garbled",
        "too-many-receivers",
    ],
)
def test_misconfiguration_is_one_line_and_exit_2(flags: list[str], expected: list[str]) -> None:
    assert_one_line_usage_error(serve("--engine", "cpu", *flags), *expected)


def test_garbage_weights_are_one_line(tmp_path: Path) -> None:
    garbage = tmp_path / "model.safetensors"
    garbage.write_bytes(np.random.default_rng(0).bytes(4096))
    assert_one_line_usage_error(serve("--engine", "cpu", "--model", str(garbage)), "--model", "not usable")


def test_port_in_use_is_one_line() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = serve("--engine", "cpu", "--metrics-port", str(port))
    assert_one_line_usage_error(done, f"--metrics-port {port}", "cannot listen")


def test_gpu_engine_without_a_gpu_is_one_line() -> None:
    from speakerd.engine.gpu import gpu_available

    usable, _ = gpu_available()
    if usable:
        pytest.skip("this machine has a usable GPU: --engine gpu starts")
    assert_one_line_usage_error(serve("--engine", "gpu"), "--engine gpu", "--engine cpu")


def test_bad_environment_value_is_one_line_and_exit_2() -> None:
    env = {**os.environ, "SPEAKERD_ENGINE": "tpu"}
    done = serve(env=env)
    assert_one_line_usage_error(done, "SPEAKERD_ENGINE='tpu'", "expected one of auto, cpu, gpu")


@pytest.mark.parametrize(
    ("variable", "value", "expected"),
    [
        ("SPEAKERD_PORT", "abc", "expected a port number 0..65535"),
        ("SPEAKERD_METRICS_PORT", "70000", "expected 0..65535"),
        ("SPEAKERD_DRAIN_SECONDS", "soon", "expected a number >= 0"),
        ("SPEAKERD_RECEIVERS", "many", "expected a number of receiver processes"),
    ],
)
def test_bad_numeric_environment_value_names_the_variable(variable: str, value: str, expected: str) -> None:
    """A number the environment gets wrong names the variable, not argparse's parsing function
    (it said "invalid _port value")."""
    command = [sys.executable, "-m", "speakerd", "serve", "--engine", "cpu"]  # no port flags: they would win
    done = subprocess.run(command, capture_output=True, text=True, timeout=FRONT_DOOR_TIMEOUT_S,
                          env={**os.environ, variable: value})  # fmt: skip
    assert_one_line_usage_error(done, f"{variable}={value!r}", expected)
    assert "invalid _" not in done.stderr, done.stderr[-2000:]


def test_bad_port_flag_says_what_is_expected() -> None:
    done = serve("--engine", "cpu", "--port", "abc")
    assert_one_line_usage_error(done, "--port", "'abc': expected a port number 0..65535")


def test_a_bad_flag_is_refused_before_the_server_loads() -> None:
    """serve's flags are checked before the server's modules are imported (command.py), so a
    mistyped flag answers at once instead of after 1.5 s of gRPC, ONNX and SciPy imports."""
    probe = ("import sys\nfrom speakerd.cli import main\n"
             "try:\n    main(['serve', '--port', 'abc'])\n"
             "except SystemExit as error:\n    code = error.code\n"
             "print(code, sorted(m for m in ('grpc', 'onnx', 'onnxruntime', 'scipy', "
             "'speakerd.serving.server.serve') if m in sys.modules))")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=FRONT_DOOR_TIMEOUT_S)  # fmt: skip
    assert done.stdout.strip() == "2 []", done.stdout + done.stderr
    assert "--port" in done.stderr, done.stderr


def test_serve_help_shows_the_defaults() -> None:
    done = subprocess.run([sys.executable, "-m", "speakerd", "serve", "--help"], capture_output=True,
                          text=True, timeout=FRONT_DOOR_TIMEOUT_S)  # fmt: skip
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.split())
    for shown in ("(default: 127.0.0.1)", "(default: 50051)", "(default: 1,32)", "(default: 25.0)",
                  "(default: 512)", "(default: fp32)"):  # fmt: skip
        assert shown in text, f"{shown} missing from serve --help:\n{done.stdout}"
    # the default model is generated into the cache on first use, not embedded in the package
    weights = text[text.index("--model MODEL, --weights MODEL") : text.index("[SPEAKERD_MODEL]")]
    assert "embedded" not in weights and "made on first use in $SPEAKERD_CACHE" in weights, weights


def test_cpu_plan_times_say_they_are_estimated() -> None:
    """The CPU engine times one chunk and multiplies (CpuEngine.plan_times_ms): its start-up
    line says so; the GPU engine's times are measured and are printed as they are."""
    times = {1: 120.0, 32: 3840.0}
    cpu = plan_times_text(times, "cpu")
    assert cpu.startswith("b1 120.00 ms, b32 3840.00 ms") and "b x b1, estimated" in cpu, cpu
    assert plan_times_text(times, "gpu") == "b1 120.00 ms, b32 3840.00 ms"


# --- the client without a server ---------------------------------------------------------


def test_client_target_defaults_to_the_servers_default_address() -> None:
    assert f"{config.DEFAULT_HOST}:{config.DEFAULT_PORT}" == DEFAULT_TARGET


def _placeholder_cases(directory: Path) -> Path:
    """A file for every reference case name (zeros): `verify` reads them all before calling."""
    directory.mkdir()
    for name in CASE_NAMES:
        save_file({"input/fbank": np.zeros((1, FRAMES, MEL_BINS), np.float32),
                   "input/masks": np.ones((1, MAX_SPEAKERS, MASK_FRAMES), np.float32),
                   "tensor/output": np.zeros((MAX_SPEAKERS, EMBEDDING_DIM), np.float32)},
                  str(directory / f"{name}{FILE_SUFFIX}"))  # fmt: skip
    return directory


@pytest.mark.parametrize("command", ["info", "embed", "verify"])
def test_client_without_server_is_one_line_exit_1(command: str, tmp_path: Path) -> None:
    target = f"127.0.0.1:{_closed_port()}"
    source = tmp_path / "in.npz"
    np.savez(source, fbank=np.zeros((1, FRAMES, MEL_BINS), np.float32),
             masks=np.ones((1, 1, MASK_FRAMES), np.float32))  # fmt: skip
    extra = {
        "info": [],
        "embed": ["--input", str(source), "--output", str(tmp_path / "out.npz")],
        "verify": ["--references", str(_placeholder_cases(tmp_path / "refs"))],
    }[command]
    done = subprocess.run(
        [sys.executable, "-m", "speakerd.client", command, "--target", target, "--timeout", "5", *extra],
        capture_output=True, text=True, timeout=FRONT_DOOR_TIMEOUT_S,
    )  # fmt: skip
    assert done.returncode == 1, (done.returncode, done.stderr[-3000:])
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert f"no server listening at {target}" in lines[0] and "speakerd serve" in lines[0], lines[0]


def test_load_says_in_one_line_when_the_metrics_cannot_be_read(capsys) -> None:
    """A --metrics-url nobody answers ends the load with one line naming it, not a traceback."""
    port = _closed_port()
    flags = ["--target", f"127.0.0.1:{port}", "--streams", "1", "--seconds", "0.3", "--warmup", "0",
             "--chunks", "1", "--metrics-url", f"http://127.0.0.1:{port}/metrics"]  # fmt: skip
    with pytest.raises(SystemExit) as stopped:
        client_main(["load", *flags])
    message = str(stopped.value.code)
    assert message.startswith(f"client load: --metrics-url http://127.0.0.1:{port}/metrics: "), message
    assert "\n" not in message, message


def test_load_without_server_is_one_line_exit_1(capsys) -> None:
    """`load` asks the server first (GetModelInfo and a probe call: load_sizing.py): with
    nobody there, that is the one line every client command gives, exit 1."""
    target = f"127.0.0.1:{_closed_port()}"
    flags = ["--target", target, "--streams", "1", "--seconds", "0.5", "--warmup", "0", "--chunks", "1"]
    assert client_main(["load", *flags]) == 1
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and f"no server listening at {target}" in lines[0], captured.err
    assert captured.out == "", captured.out


# --- the CPU self-check ------------------------------------------------------------------


def test_cpu_self_check_covers_every_plan_with_few_chunks(folded_model) -> None:
    engine = CpuEngine(folded_model, plan_sizes=(1, 2, 32))
    assert check_sizes(engine) == {1: 1, 2: 2, 32: 3}, check_sizes(engine)
    ran: list[tuple[int, list[str]]] = []
    original = engine.run_batch

    def recording(fbank: np.ndarray, masks: np.ndarray):
        run = original(fbank, masks)
        ran.append((fbank.shape[0], run.plans))
        return run

    engine.run_batch = recording  # type: ignore[method-assign]
    parity = check_engine(engine, folded_model)
    assert sorted(parity) == [1, 2, 32], parity
    plans = {plan.split("/")[0] for _, plans in ran for plan in plans}
    assert plans == {"b1", "b2", "b32"}, ran
    # each plan once (CPU_SELF_CHECK_RUNS), on the fewest chunks, not 2 * (1 + 2 + 32): a
    # middle plan of 2 keeps it at 6 chunk runs (plans 1,4,32 checked the same on 8)
    assert sum(chunks for chunks, _ in ran) == 1 + 2 + 3, ran


# --- SIGTERM -----------------------------------------------------------------------------


def test_sigterm_during_warm_up_exits_without_waiting_for_it(weights_path) -> None:
    server = start_server(weights_path, wait_serving=False)
    server.process.send_signal(signal.SIGTERM)
    code = server.wait(60)
    log = server.log()
    assert code == 0, log
    assert "stopping during warm-up" in log, log
    assert "self-check passed" not in log and "SERVING speakerd" not in log, log
    assert "Traceback" not in log, log


def test_sigterm_with_work_in_flight_ends_within_the_drain_time(weights_path) -> None:
    server = start_server(weights_path, "--plans", "1,32", "--drain-seconds", str(DRAIN_S))
    rng = np.random.default_rng(0)
    fbank = rng.standard_normal((32, FRAMES, MEL_BINS)).astype(np.float32)
    masks = np.ones((32, MAX_SPEAKERS, TRUNK_FRAMES), np.float32)
    outcomes: list[str] = []
    lock = threading.Lock()

    def call() -> None:
        with SpeakerClient(server.target, timeout_s=300, retry=NO_RETRY) as client:
            try:
                client.embed(fbank, masks)
                outcome = "OK"
            except grpc.RpcError as error:
                outcome = error.code().name
        with lock:
            outcomes.append(outcome)

    taken = scrape(server).get(TAKEN, 0)
    callers = [threading.Thread(target=call) for _ in range(HEAVY_CALLS)]
    for caller in callers:
        caller.start()

    def in_flight() -> bool:
        now = scrape(server)
        return now.get("speakerd_inflight_requests{}", 0) >= HEAVY_CALLS and now.get(TAKEN, 0) > taken

    wait_until(in_flight, "every call at the server and its first batch begun", server, timeout_s=WAIT_S)
    started = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    code = server.wait(120)
    elapsed = time.monotonic() - started
    for caller in callers:
        caller.join(60)
    assert code == 0, server.log()
    assert elapsed < DRAIN_S + EXIT_SLACK_S, (
        f"exit took {elapsed:.1f} s with --drain-seconds {DRAIN_S} (bound {DRAIN_S + EXIT_SLACK_S} s); "
        f"the work in flight was ~{HEAVY_CALLS * 6.5:.0f} s:\n{server.log()}"
    )
    assert outcomes and set(outcomes) <= {"OK", "UNAVAILABLE"} and "UNAVAILABLE" in outcomes, outcomes
    assert "Traceback" not in server.log(), server.log()
    # one line tells the operator what the drain gave up
    drain_lines = [line for line in server.lines if " drain: " in line]
    print(drain_lines)
    assert len(drain_lines) == 1 and "abandoned" in drain_lines[0], drain_lines
    assert "batches still running in the engine, not waited for" in drain_lines[0], drain_lines


def test_failed_warm_up_exits_1_without_draining(tmp_path: Path) -> None:
    """A warm-up that fails (here: the default model cannot be made, its cache is a file) is
    exit code 1, and the log does not speak of draining a server that never served."""
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    done = serve("--engine", "cpu", env={**os.environ, "SPEAKERD_CACHE": str(blocker / "cache")})
    assert done.returncode == 1, (done.returncode, done.stderr[-3000:])
    assert "start-up failed" in done.stderr and "never served" in done.stderr, done.stderr[-3000:]
    assert "draining" not in done.stderr, done.stderr[-3000:]

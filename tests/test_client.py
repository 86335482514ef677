"""The client package as a user drives it: `python -m speakerd.client` commands against a real server.

Health is the container probe, so its exit code is the contract: 0 only when SERVING, 1
when unreachable. `embed` round-trips an .npz; `info` prints GetModelInfo; `load` prints
one JSON object with throughput, latency percentiles, errors and the batch fill from
/metrics.
"""

from __future__ import annotations

import json
import random
import socket
from pathlib import Path

import numpy as np
import pytest

from speakerd.client.cli import main
from speakerd.client.client import RetryPolicy
from speakerd.client.loadgen_window import Window
from speakerd.engine.cpu import CpuEngine
from speakerd.model.architecture import EMBEDDING_DIM
from speakerd.model.numerics import Math
from tests.serving import ServerProcess


@pytest.fixture(scope="module")
def server(shared_server: ServerProcess) -> ServerProcess:
    return shared_server


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_commands_default_to_the_servers_address(capsys) -> None:
    """--target is optional: the server's default 127.0.0.1:50051 (nothing listens there in
    tests, or something else does: either way the one-line error names that target)."""
    code = main(["health", "--timeout", "1"])
    captured = capsys.readouterr()
    assert code == 0 or "127.0.0.1:50051" in captured.err, (code, captured.err)


def test_health_exit_codes(server: ServerProcess, capsys) -> None:
    assert main(["health", "--target", server.target]) == 0
    assert capsys.readouterr().out.strip() == "SERVING"
    assert main(["health", "--target", f"127.0.0.1:{_closed_port()}", "--timeout", "1"]) == 1
    assert "UNREACHABLE" in capsys.readouterr().err


def test_info_prints_the_served_model(server: ServerProcess, folded_model, capsys) -> None:
    assert main(["info", "--target", server.target]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["model_id"] == folded_model.model_id and info["engine"] == "cpu-onnxruntime"
    assert info["plan_sizes"] == [1, 8] and info["precision"] == "fp32"


def test_embed_npz_round_trip(
    server: ServerProcess, reference_cases, folded_model, tmp_path: Path, capsys
) -> None:
    case = reference_cases[3]  # empty_mask_b1: one empty row must be flagged
    source, target = tmp_path / "in.npz", tmp_path / "out.npz"
    np.savez(source, fbank=case.fbank, masks=case.masks)
    assert main(["embed", "--target", server.target, "--input", str(source), "--output", str(target)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["shape"] == [1, 3, EMBEDDING_DIM] and summary["empty_rows"] == 1
    expected = CpuEngine(folded_model, Math.FP32, (1,)).embed(case.fbank, case.masks)
    with np.load(target) as result:
        assert np.array_equal(result["embeddings"], expected.embeddings)
        assert result["empty"].tolist() == [[False, True, False]]


@pytest.mark.slow
def test_load_generator_reports_json(server: ServerProcess, capsys) -> None:
    """Two streams of one-chunk calls for the shortest window (`load` lengthens it to three
    calls' time of all its streams): 3 streams of 2-chunk calls ran three times as long for
    the same report."""
    chunks = 1
    flags = ["--target", server.target, "--streams", "2", "--seconds", "1", "--warmup", "0",
             "--chunks", str(chunks), "--metrics-url", server.metrics_url]  # fmt: skip
    assert main(["load", *flags]) == 0
    report = json.loads(capsys.readouterr().out)
    print(report)
    assert report["requests_ok"] >= 1 and report["errors"] == {} and report["chunks_per_s"] > 0
    assert report["ok"] is True and report["failed_calls"] == 0, report
    # the JSON agrees with itself: rounding chunks/s to 2 decimals broke this at low rates
    rate = report["requests_ok"] * chunks / report["seconds"]
    assert report["chunks_per_s"] == pytest.approx(rate, rel=1e-4), (report["chunks_per_s"], rate)
    assert report["latency_p50_ms"] <= report["latency_p90_ms"] <= report["latency_p99_ms"]
    assert 0 < report["batch_fill_mean"] <= 1 and report["batch_size_mean_chunks"] >= 1
    # one engine in process, no receivers: no per-device or per-receiver series
    assert report["device_batches"] == {} and report["receiver_calls"] == {}, report


def test_load_counts_the_calls_begun_in_its_window() -> None:
    """`client load --warmup 1 --seconds 10` started at t=100: calls begun in [101, 111)
    count; those begun in the warm-up or at the window's end do not."""
    window = Window.after(100.0, 1.0, 10.0)
    assert (window.start, window.end) == (101.0, 111.0)
    begun = (100.0, 100.99, 101.0, 110.99, 111.0)
    assert [window.counts(t) for t in begun] == [False, False, True, True, False]


def test_retry_backoff_is_full_jitter_capped() -> None:
    policy = RetryPolicy(attempts=6, initial_backoff_s=0.05, max_backoff_s=0.3)
    rng = random.Random(1)
    for attempt in range(6):
        ceiling = min(0.3, 0.05 * 2**attempt)
        pauses = [policy.backoff(attempt, rng) for _ in range(200)]
        assert all(0 <= p <= ceiling for p in pauses), (attempt, max(pauses), ceiling)
        assert max(pauses) > 0.8 * ceiling, f"attempt {attempt}: jitter never nears {ceiling}"

"""Serve configuration: flags, SPEAKERD_* environment variables, and their checks.

Precedence is flag > environment > default. A bad value from either source stops the
server before it starts, with a message naming the variable or flag and what it takes
(config.UsageError: `serve` prints it as one line and exits 2).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from speakerd.model.numerics import Math
from speakerd.serving.server import config


def parse(argv: list[str]) -> config.ServeConfig:
    parser = argparse.ArgumentParser()
    config.configure(parser)
    return config.from_args(parser.parse_args(argv))


def test_defaults_environment_and_flag_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("SPEAKERD_PORT", "SPEAKERD_MATH", "SPEAKERD_PLANS", "SPEAKERD_LOG_LEVEL"):
        monkeypatch.delenv(name, raising=False)
    defaults = parse([])
    assert (defaults.host, defaults.port, defaults.plans, defaults.math) == (
        "127.0.0.1",
        50051,
        (1, 32),
        Math.FP32,
    )
    monkeypatch.setenv("SPEAKERD_PORT", "6000")
    monkeypatch.setenv("SPEAKERD_MATH", "tf32")
    monkeypatch.setenv("SPEAKERD_PLANS", "1,8")
    monkeypatch.setenv("SPEAKERD_LOG_LEVEL", "debug")
    from_env = parse([])
    assert (from_env.port, from_env.math, from_env.plans, from_env.log_level) == (
        6000,
        Math.TF32,
        (1, 8),
        "DEBUG",
    )
    assert parse(["--port", "7000", "--math", "fp32"]).port == 7000


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("SPEAKERD_ENGINE", "bogus", "SPEAKERD_ENGINE='bogus': expected one of auto, cpu, gpu"),
        ("SPEAKERD_MATH", "fp64", "SPEAKERD_MATH='fp64': expected one of fp32, tf32, fp16"),
        ("SPEAKERD_LOG_LEVEL", "loud", "SPEAKERD_LOG_LEVEL='loud': expected one of"),
    ],
)
def test_bad_environment_choices_are_named(monkeypatch: pytest.MonkeyPatch, variable, value, message) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(config.UsageError, match=message):
        parse([])


def test_queue_must_hold_one_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPEAKERD_QUEUE_CHUNKS", raising=False)
    with pytest.raises(config.UsageError, match="--queue-chunks 8 must hold one full batch of 32 chunks"):
        parse(["--queue-chunks", "8", "--plans", "1,32"])


@pytest.mark.parametrize("plans", ["1,64", "33"])
def test_plans_beyond_one_batch_are_refused(plans: str) -> None:
    """A batch holds at most 32 chunks: a larger plan is a usage error, not a silent plan."""
    with pytest.raises(argparse.ArgumentTypeError, match=f"exceeds {config.MAX_PLAN_SIZE}"):
        config.parse_plans(plans)
    assert config.parse_plans("1,8,32") == (1, 8, 32)


def test_plans_from_the_environment_are_checked_too(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setenv("SPEAKERD_PLANS", "1,64")
    with pytest.raises(SystemExit) as raised:
        parse([])
    assert raised.value.code == 2 and "64 exceeds 32" in capsys.readouterr().err


def test_tls_and_token_flags(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("SPEAKERD_TLS_CERT", "SPEAKERD_TLS_KEY", "SPEAKERD_TLS_CLIENT_CA", "SPEAKERD_AUTH_TOKENS"):
        monkeypatch.delenv(name, raising=False)
    plain = parse([])
    assert (plain.tls_cert, plain.tls_key, plain.tls_client_ca, plain.auth_tokens) == (None,) * 4
    cert, key, ca, tokens = (tmp_path / name for name in ("tls.crt", "tls.key", "ca.crt", "tokens"))
    for path in (cert, key, ca, tokens):
        path.write_text("x\n")
    monkeypatch.setenv("SPEAKERD_TLS_CERT", str(cert))
    monkeypatch.setenv("SPEAKERD_TLS_KEY", str(key))
    monkeypatch.setenv("SPEAKERD_AUTH_TOKENS", str(tokens))
    settings = parse(["--tls-client-ca", str(ca)])
    assert (settings.tls_cert, settings.tls_key, settings.tls_client_ca, settings.auth_tokens) == (
        cert,
        key,
        ca,
        tokens,
    )
    with pytest.raises(config.UsageError, match="--tls-cert and --tls-key go together"):
        parse(["--tls-key", ""])
    monkeypatch.delenv("SPEAKERD_TLS_CERT")
    monkeypatch.delenv("SPEAKERD_TLS_KEY")
    with pytest.raises(config.UsageError, match="--tls-client-ca needs --tls-cert and --tls-key"):
        parse(["--tls-client-ca", str(ca)])
    with pytest.raises(
        config.UsageError, match=r"--auth-tokens .*missing: no such file \[SPEAKERD_AUTH_TOKENS\]"
    ):
        parse(["--auth-tokens", str(tmp_path / "missing")])


def test_cpu_threads_flag_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """0 (every core this process may run on) unless SPEAKERD_CPU_THREADS or --cpu-threads
    says otherwise (the flag wins); a negative count is refused naming the flag."""
    monkeypatch.delenv("SPEAKERD_CPU_THREADS", raising=False)
    assert parse([]).cpu_threads == 0
    monkeypatch.setenv("SPEAKERD_CPU_THREADS", "3")
    assert parse([]).cpu_threads == 3
    assert parse(["--cpu-threads", "1"]).cpu_threads == 1
    monkeypatch.delenv("SPEAKERD_CPU_THREADS")
    with pytest.raises(SystemExit):
        parse(["--cpu-threads", "-1"])


def test_devices_flag_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset: one engine in this process (as before --devices); `all` or indices otherwise,
    from the flag or SPEAKERD_DEVICES (the flag wins)."""
    monkeypatch.delenv("SPEAKERD_DEVICES", raising=False)
    assert parse([]).devices is None
    assert parse(["--devices", "1, 0"]).devices == config.DeviceRequest("1, 0", (0, 1))
    monkeypatch.setenv("SPEAKERD_DEVICES", "all")
    every = parse([]).devices
    assert every is not None and every.indices is None
    assert every.resolve(4, "GPUs") == (0, 1, 2, 3)
    assert parse(["--devices", "3"]).devices == config.DeviceRequest("3", (3,))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("0,x", "expected all or comma-separated device indices like 0,1"),
        ("-1", "expected all or comma-separated device indices like 0,1"),
        ("0,1,1", "device 1 listed twice"),
        (",", "expected all or comma-separated device indices"),
    ],
)
def test_garbled_devices_are_refused(text: str, message: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        config.parse_devices(text)


def test_garbled_devices_from_the_environment_stop_the_server(
    monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    monkeypatch.setenv("SPEAKERD_DEVICES", "first")
    with pytest.raises(SystemExit) as raised:
        parse([])
    assert raised.value.code == 2 and "devices 'first': expected all or" in capsys.readouterr().err


def test_a_device_that_does_not_exist_is_one_line_naming_it() -> None:
    request = config.parse_devices("0,2")
    assert request is not None
    assert request.resolve(3, "GPUs") == (0, 2)
    with pytest.raises(config.UsageError) as raised:
        request.resolve(2, "GPUs")
    assert str(raised.value) == (
        "--devices 0,2 [SPEAKERD_DEVICES]: device 2 does not exist; this machine has 2 GPUs "
        "(indices 0..1), or use --devices all"
    )
    every = config.parse_devices("all")
    assert every is not None
    with pytest.raises(
        config.UsageError, match=r"--devices all \[SPEAKERD_DEVICES\]: this machine has no GPUs"
    ):
        every.resolve(0, "GPUs")

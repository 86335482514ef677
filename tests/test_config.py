"""Serve configuration: flags, SPEAKERD_* environment variables, and their checks.

Precedence is flag > environment > default. A bad value from either source stops the
server before it starts, with a message naming the variable or flag and what it takes.
"""

from __future__ import annotations

import argparse

import pytest

from speakerd.model.numerics import Math
from speakerd.serving import config


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
    with pytest.raises(SystemExit, match=message):
        parse([])


def test_queue_must_hold_one_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPEAKERD_QUEUE_CHUNKS", raising=False)
    with pytest.raises(SystemExit, match="--queue-chunks 8 must hold one full batch of 32 chunks"):
        parse(["--queue-chunks", "8", "--plans", "1,32"])

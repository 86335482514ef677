"""The client's voiceprint commands (speakerd/client/voiceprints.py): a flag or file that
cannot be used is one line and exit 2, before any call; the calls themselves are exercised
against a real server in tests/test_voiceprints.py."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pytest

from speakerd.client.cli import main
from speakerd.client.voiceprints import parse_segments

#: Nothing listens here: a command that got as far as calling would fail with exit 1.
NOWHERE = "127.0.0.1:9"
#: The flags with which every command that takes a recording reads it (recording.add_audio_flags).
AUDIO_FLAGS = {"--audio", "--sample-rate", "--step"}


def one_line_usage_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main([*argv, "--target", NOWHERE]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_enroll_needs_audio(capsys: pytest.CaptureFixture[str]) -> None:
    err = one_line_usage_error(capsys, ["enroll", "--speaker-id", "alice"])
    assert "give --audio FILE" in err


def test_a_column_needs_masks_and_must_exist(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    import soundfile

    audio = tmp_path / "a.wav"
    soundfile.write(audio, np.zeros(16000, np.int16), 16000)
    masks = tmp_path / "m.npy"
    np.save(masks, np.ones((1, 3, 589), np.uint8))
    enroll = ["enroll", "--speaker-id", "a", "--audio", str(audio)]
    assert "--column picks a speaker of --masks" in one_line_usage_error(capsys, [*enroll, "--column", "0"])
    with_masks = [*enroll, "--masks", str(masks)]
    assert "--column 3: expected 0..2" in one_line_usage_error(capsys, [*with_masks, "--column", "3"])
    assert "has 3 speakers: pick one with --column" in one_line_usage_error(capsys, with_masks)


def test_segments_parse_or_name_the_flag() -> None:
    assert parse_segments("0-3.5, 7-9") == [(0.0, 3.5), (7.0, 9.0)]
    with pytest.raises(ValueError, match="--segments '0-3-4'"):
        parse_segments("0-3-4")


def test_an_unreachable_server_is_one_line_and_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["voiceprints", "list", "--target", NOWHERE, "--timeout", "2"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"no server listening at {NOWHERE}" in err, err


def audio_commands() -> dict[str, set[str]]:
    """Every client command that takes --audio, by its words, with its flags."""
    from speakerd.client.cli import build_parser

    found: dict[str, set[str]] = {}

    def walk(parser: argparse.ArgumentParser, words: str) -> None:
        flags = {option for action in parser._actions for option in action.option_strings}
        if "--audio" in flags:
            found[words] = flags
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, f"{words} {name}".strip())

    walk(build_parser(), "")
    return found


def test_every_command_that_takes_audio_takes_the_same_audio_flags() -> None:
    commands = audio_commands()
    assert set(commands) == {"diarize", "embed", "enroll", "identify", "voiceprints verify"}, sorted(commands)
    for words, flags in commands.items():
        missing = sorted(AUDIO_FLAGS - flags)
        assert not missing, f"{words} takes --audio but not {missing}"


@pytest.mark.parametrize(
    "command",
    [["enroll", "--speaker-id", "a"], ["identify"], ["voiceprints", "verify", "0" * 32]],
    ids=lambda command: " ".join(command[:2]),
)
def test_a_npy_recording_with_its_sample_rate(
    command: list[str], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A .npy recording is read with --sample-rate, as by embed (before, these commands
    refused the flag their own error asked for); without it, the error names a flag they take."""
    audio = tmp_path / "recording.npy"
    np.save(audio, np.zeros(16000, np.float32))
    err = one_line_usage_error(capsys, [*command, "--audio", str(audio)])
    assert "needs --sample-rate HZ" in err, err
    argv = [*command, "--audio", str(audio), "--sample-rate", "16000", "--target", NOWHERE, "--timeout", "2"]
    assert main(argv) == 1  # the file was read and the call made: nothing listens there
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"no server listening at {NOWHERE}" in err, err

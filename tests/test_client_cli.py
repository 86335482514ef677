"""The client's command line as users meet it (speakerd/client/cli.py, outcome.py,
progress.py, options.py): its name and help, what a failed call says happened and what to
do, progress on stderr, --retries, and Diarize's fallback for a server without progress.

Calls against a real server (the turns table, --json, the notes) are tests/test_diarize.py's.
"""

from __future__ import annotations

import argparse
import io
from concurrent import futures

import grpc
import numpy as np
import pytest

from speakerd.client import progress as progress_module
from speakerd.client.cli import build_parser, main
from speakerd.client.diarize import DiarizationClient
from speakerd.client.files import UsageError
from speakerd.client.options import retry_policy
from speakerd.client.outcome import explain
from speakerd.client.progress import Progress, ProgressLine, describe
from speakerd.v1 import speakerd_pb2 as pb

TARGET = "127.0.0.1:9"


class Failed(grpc.RpcError):
    """A failed call's error as gRPC raises it: a code and its details."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


@pytest.mark.parametrize(
    ("code", "details", "says"),
    [
        (grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses; last error: UNKNOWN: "
         "ipv4:127.0.0.1:9: Failed to connect to remote host: Connection refused",
         f"no server listening at {TARGET} (failed to connect"),
        (grpc.StatusCode.UNAVAILABLE, "DNS resolution failed for nohost:50051",
         "no server listening at"),
        (grpc.StatusCode.UNAVAILABLE, "the server is draining; retry elsewhere",
         f"the server at {TARGET} is shutting down and did not take the call; retry (--retries N)"),
        (grpc.StatusCode.UNAVAILABLE, "Socket closed",
         f"the connection to {TARGET} was lost during the call after 12.5 s (Socket closed): the server "
         "shut down or restarted and the call was not completed"),
        (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded",
         "the deadline passed after 12.5 s and the call was not completed (Deadline Exceeded); give a "
         "longer --timeout"),
        (grpc.StatusCode.UNAVAILABLE, "the engine is still warming up",
         f"the server at {TARGET} is starting (the engine is still warming up); retry in a few seconds"),
        (grpc.StatusCode.UNAVAILABLE, "something else",
         f"{TARGET} answered UNAVAILABLE (something else); the call was not completed: retry it"),
        (grpc.StatusCode.INVALID_ARGUMENT, "uri: expected no whitespace",
         f"{TARGET} answered INVALID_ARGUMENT (uri: expected no whitespace)"),
    ],
    ids=["refused", "dns", "draining", "lost", "deadline", "warming-up", "unavailable", "answered"],
)  # fmt: skip
def test_a_failed_call_says_what_happened_and_what_to_do(code, details, says) -> None:
    line = explain(Failed(code, details), TARGET, 12.5)
    assert says in line, line


def test_the_command_line_is_speakerd_client_and_lists_every_command(capsys) -> None:
    parser = build_parser()
    assert parser.format_usage().startswith("usage: speakerd-client "), parser.format_usage()
    text = parser.format_help()
    for command in (
        "embed",
        "info",
        "health",
        "diarize",
        "load",
        "verify",
        "enroll",
        "identify",
        "voiceprints",
    ):
        assert f"    {command}" in text, f"{command} missing from:\n{text}"
    with pytest.raises(SystemExit) as stopped:
        main(["diarize", "--target", TARGET])
    assert stopped.value.code == 2
    assert "the following arguments are required: --audio" in capsys.readouterr().err
    assert (
        "[-h] --audio AUDIO" in build_parser()._subparsers._group_actions[0].choices["diarize"].format_usage()
    )


def test_an_unreachable_server_names_the_command(capsys, tmp_path) -> None:
    audio = tmp_path / "a.npy"
    np.save(audio, np.zeros(16000, np.float32))
    argv = ["diarize", "--audio", str(audio), "--sample-rate", "16000", "--target", TARGET, "--timeout", "5"]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(
        f"speakerd-client diarize: no server listening at {TARGET}"
    )


def test_retries_are_asked_for() -> None:
    assert retry_policy(argparse.Namespace()).attempts == 1  # a command without the flag
    assert retry_policy(argparse.Namespace(retries=0)).attempts == 1
    assert retry_policy(argparse.Namespace(retries=3)).attempts == 4
    with pytest.raises(UsageError, match="--retries -1: expected 0 or more"):
        retry_policy(argparse.Namespace(retries=-1))
    args = build_parser().parse_args(["diarize", "--audio", "a.wav", "--retries", "2"])
    assert args.retries == 2
    assert not hasattr(build_parser().parse_args(["load"]), "retries")  # a load counts every failure


class Stream(io.StringIO):
    def __init__(self, terminal: bool) -> None:
        super().__init__()
        self.terminal = terminal

    def isatty(self) -> bool:
        return self.terminal


def test_progress_is_shown_after_a_few_seconds_and_sparingly_when_piped(monkeypatch) -> None:
    clock = [100.0]
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: clock[0])
    piped = Stream(terminal=False)
    line = ProgressLine("diarize", stream=piped)
    line.update(Progress("embedding", 32, 3591, 0.5))
    assert piped.getvalue() == "", "a short call shows nothing"
    clock[0] += progress_module.SHOW_AFTER_S
    line.update(Progress("embedding", 1234, 3591, 3.0))
    clock[0] += 1.0
    line.update(Progress("embedding", 2000, 3591, 4.0))  # within LINE_EVERY_S: not written
    clock[0] += progress_module.LINE_EVERY_S
    line.update(Progress("clustering", 3591, 3591, 14.0))
    line.close()
    assert piped.getvalue().splitlines() == [
        "diarize: 1,234 of 3,591 windows segmented and embedded (34%), 3.0 s",
        "diarize: clustering 3,591 windows, 14.0 s",
    ], piped.getvalue()
    terminal = Stream(terminal=True)
    line = ProgressLine("diarize", stream=terminal)
    clock[0] += progress_module.SHOW_AFTER_S
    line.update(Progress("embedding", 10, 0, 3.2))
    line.update(Progress("embedding", 20, 0, 3.4))
    line.close()
    assert terminal.getvalue() == (
        "\r\x1b[Kdiarize: 10 windows segmented and embedded, 3.2 s"
        "\r\x1b[Kdiarize: 20 windows segmented and embedded, 3.4 s\r\x1b[K"
    ), repr(terminal.getvalue())
    quiet = Stream(terminal=False)
    ProgressLine("diarize", enabled=False, stream=quiet).update(Progress("embedding", 1, 2, 9.0))
    assert quiet.getvalue() == "" and describe(Progress("embedding", 5, 0, 1.0)).startswith("5 windows")


def test_a_server_without_progress_is_asked_with_diarize() -> None:
    """A server of the Diarization service before DiarizeWithProgress answers it
    UNIMPLEMENTED; the client then sends the recording with Diarize, once, and keeps to it."""
    calls: list[str] = []

    def diarize(requests, context):  # the older server's whole service: Diarize only
        calls.append("Diarize")
        header = next(requests).header
        audio = b"".join(message.audio for message in requests)
        assert header.recording.sample_rate == 16000 and len(audio) == 2 * 16000
        return pb.DiarizeResponse(windows=1, model_id="older", request_id="r")

    server = grpc.server(futures.ThreadPoolExecutor(2))
    handler = grpc.stream_unary_rpc_method_handler(
        diarize, request_deserializer=pb.DiarizeRequest.FromString,
        response_serializer=pb.DiarizeResponse.SerializeToString,
    )  # fmt: skip
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("speakerd.v1.Diarization", {"Diarize": handler}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        seen: list[Progress] = []
        with DiarizationClient(f"127.0.0.1:{port}", timeout_s=30) as client:
            for _ in range(2):
                result = client.diarize(np.zeros(16000, np.int16), 16000, progress=seen.append)
                assert result.windows == 1 and result.model_id == "older"
        assert calls == ["Diarize", "Diarize"] and seen == []
    finally:
        server.stop(None)

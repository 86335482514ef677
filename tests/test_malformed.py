"""Bytes that are no protobuf message, sent to every method of a real CPU server.

Each is answered INVALID_ARGUMENT with a message naming the message type (and, in a
stream, the message's position), a `google.rpc.BadRequest` detail naming the same, one
WARNING line in the server's log (no traceback, no ERROR), and one count of
`speakerd_requests_rejected_total{reason="invalid_argument"}`; the server then answers a
good call. Before, EmbedRecording answered such bytes INTERNAL with a traceback and
GetModelInfo UNKNOWN with an internal exception's name. The voiceprint methods are held to
the same.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import numpy as np
import pytest

from speakerd.serving.api.service import SERVICE_NAME
from speakerd.serving.voiceprints.service import SERVICE_NAME as VOICEPRINTS
from speakerd.v1 import speakerd_pb2 as pb
from speakerd.v1.tensors import to_tensor
from tests.serving import ServerProcess, scrape, start_server
from tests.test_bad_inputs import _good, field_violations

GARBAGE = b"\xff\xff\xff\xff"
INVALID = "speakerd_requests_rejected_total{reason=invalid_argument}"
#: How long the server's log line may take to reach the test's pump thread.
LOG_SEEN_S = 10.0
CALL_TIMEOUT_S = 60.0


def _header() -> bytes:
    header = pb.RecordingHeader(sample_rate=16_000, channels=1, encoding=pb.AUDIO_ENCODING_PCM_S16LE)
    return pb.EmbedRecordingRequest(header=header).SerializeToString()


def _masks_cut_short() -> bytes:
    masks = pb.RecordingMasks(windows=1, masks=to_tensor(np.ones((1, 3, 589), np.float32)))
    return pb.EmbedRecordingRequest(masks=masks).SerializeToString()[:-100]


@dataclass(frozen=True)
class Case:
    method: str
    stream: bool
    messages: tuple[bytes, ...]
    field: str  # the BadRequest field violation's field
    names: str  # what the message must say: the message type and its position
    service: str = SERVICE_NAME


CASES = {
    "GetModelInfo garbage": Case(
        "GetModelInfo", False, (GARBAGE,), "GetModelInfoRequest", "speakerd.v1.GetModelInfoRequest"
    ),
    "EmbedRecording garbage first message": Case(
        "EmbedRecording",
        True,
        (GARBAGE,),
        "EmbedRecordingRequest",
        "message 0 of the stream (4 bytes): not a valid speakerd.v1.EmbedRecordingRequest",
    ),
    "EmbedRecording garbage after a valid header": Case(
        "EmbedRecording",
        True,
        (_header(), GARBAGE),
        "EmbedRecordingRequest",
        "message 1 of the stream (4 bytes): not a valid speakerd.v1.EmbedRecordingRequest",
    ),
    "EmbedRecording masks message cut short": Case(
        "EmbedRecording",
        True,
        (_header(), _masks_cut_short()),
        "EmbedRecordingRequest",
        "message 1 of the stream",
    ),
    "EmbedChunks garbage": Case("EmbedChunks", False, (GARBAGE,), "request", "request: "),
    "EmbedChunksStream garbage after a good request": Case(
        "EmbedChunksStream", True, (_good().SerializeToString(), GARBAGE), "request", "request 1 "
    ),
    "Enroll garbage first message": Case(
        "Enroll", True, (GARBAGE,), "EnrollRequest",
        "message 0 of the stream (4 bytes): not a valid speakerd.v1.EnrollRequest", VOICEPRINTS,
    ),
    "Identify garbage first message": Case(
        "Identify", True, (GARBAGE,), "IdentifyRequest",
        "message 0 of the stream (4 bytes): not a valid speakerd.v1.IdentifyRequest", VOICEPRINTS,
    ),
    "DeleteVoiceprint garbage": Case(
        "DeleteVoiceprint", False, (GARBAGE,), "DeleteVoiceprintRequest",
        "not a valid speakerd.v1.DeleteVoiceprintRequest", VOICEPRINTS,
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def server(weights_path) -> Iterator[ServerProcess]:
    running = start_server(weights_path, "--plans", "1,8")
    yield running
    assert running.terminate() == 0, running.log()


@pytest.fixture(scope="module")
def channel(server: ServerProcess) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(server.target) as opened:
        yield opened


def _send(channel: grpc.Channel, case: Case) -> grpc.RpcError:
    """Send the case's bytes as they are (no serializer); the error the call ended with."""
    path = f"/{case.service}/{case.method}"
    try:
        if case.stream and case.service == VOICEPRINTS:  # client streams, one answer
            channel.stream_unary(path)(iter(case.messages), timeout=CALL_TIMEOUT_S)
        elif case.stream:
            for _ in channel.stream_stream(path)(iter(case.messages), timeout=CALL_TIMEOUT_S):
                pass
        else:
            channel.unary_unary(path)(case.messages[0], timeout=CALL_TIMEOUT_S)
    except grpc.RpcError as error:
        return error
    raise AssertionError(f"{case.method}: the call succeeded")


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_undecodable_bytes_are_named_logged_and_counted(
    server: ServerProcess, channel: grpc.Channel, name: str
) -> None:
    case = CASES[name]
    before_count, before_lines = scrape(server).get(INVALID, 0.0), len(server.lines)
    error = _send(channel, case)
    details = error.details() or ""
    print(f"{name:<48} {error.code().name:<18} {details[:160]}")
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, f"{name}: {error.code().name} {details}"
    assert case.names in details, f"{name}: {details!r} does not say {case.names!r}"
    violations = field_violations(error)
    assert [field for field, _ in violations] == [case.field], f"{name}: violations {violations}"
    assert details.endswith(violations[0][1]), f"{name}: message and detail differ"

    deadline = time.monotonic() + LOG_SEEN_S
    while not any(" WARNING " in line for line in server.lines[before_lines:]):
        assert time.monotonic() < deadline, f"{name}: no WARNING line: {server.lines[before_lines:]}"
        time.sleep(0.05)
    time.sleep(0.5)  # a second line, were there one, would follow at once
    new = server.lines[before_lines:]
    warnings = [line for line in new if " WARNING " in line]
    assert len(warnings) == 1 and case.method in warnings[0], f"{name}: {new}"
    assert not any(" ERROR " in line or "Traceback" in line for line in new), f"{name}: {new}"
    assert scrape(server).get(INVALID, 0.0) == before_count + 1, f"{name}: not counted once"


def test_the_server_still_answers(server: ServerProcess, channel: grpc.Channel) -> None:
    for case in CASES.values():
        _send(channel, case)
    with server.client() as client:
        assert client.model_info(timeout_s=CALL_TIMEOUT_S).embedding_dim == 256

"""request_wire.parse_request reads EmbedRequest bytes exactly as protobuf's own parser does,
without copying the tensors: every case is checked against `EmbedRequest.FromString`."""

from __future__ import annotations

import numpy as np
import pytest
from google.protobuf.message import DecodeError

from speakerd.serving.api.request_ids import MAX_REQUEST_ID_BYTES
from speakerd.serving.api.wire import MAX_FIELDS, MAX_GROUP_DEPTH, WireError, WireRequest, parse_request
from speakerd.v1 import speakerd_pb2 as pb
from speakerd.v1.tensors import from_tensor, to_tensor


def _request(seed: int, chunks: int = 2, request_id: str = "") -> pb.EmbedRequest:
    random = np.random.default_rng(seed)
    return pb.EmbedRequest(
        fbank=to_tensor(random.standard_normal((chunks, 998, 80), dtype=np.float32)),
        masks=to_tensor((random.random((chunks, 3, 589)) > 0.5).astype(np.uint8)),
        request_id=request_id,
    )


def _same(wire: WireRequest, message: pb.EmbedRequest) -> None:
    """Every field the service reads equals protobuf's parse of the same bytes."""
    assert wire.features == message.WhichOneof("features")
    assert wire.request_id == message.request_id
    for name in ("fbank", "waveform", "masks"):
        ours, theirs = wire.tensor(name), getattr(message, name)
        if not message.HasField(name):
            assert ours is None, f"{name}: set here, unset in protobuf"
            continue
        assert ours is not None, f"{name}: unset here, set in protobuf"
        assert (ours.dtype, list(ours.shape), bytes(ours.data)) == (
            theirs.dtype,
            list(theirs.shape),
            theirs.data,
        )


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (lengths here stay below 128: one varint byte)."""
    assert len(payload) < 128
    return bytes([number << 3 | 2, len(payload)]) + payload


CASES = {
    "fbank and masks": _request(0).SerializeToString(),
    "with request id": _request(1, 1, "req-é-7").SerializeToString(),
    "waveform": pb.EmbedRequest(
        waveform=to_tensor(np.zeros((1, 160000), np.float32)), masks=to_tensor(np.ones((1, 2, 9), np.float32))
    ).SerializeToString(),
    "empty message": b"",
    # two serialized messages back to back merge: masks merged, the later oneof member wins
    "fbank then waveform": _request(2).SerializeToString()
    + pb.EmbedRequest(waveform=to_tensor(np.ones((1, 4), np.float32))).SerializeToString(),
    "waveform then fbank then fbank": pb.EmbedRequest(
        waveform=to_tensor(np.ones((1, 4), np.float32))
    ).SerializeToString()
    + _request(3, 1).SerializeToString()
    + pb.EmbedRequest(fbank=pb.Tensor(shape=[7])).SerializeToString(),
    "unpacked shape": _field(3, b"\x08\x03" + b"\x10\x02\x10\x03\x10\x05" + b"\x1a\x00"),
    "group skipped": b"\x2b\x08\x01\x33\x34\x2c" + _request(8, 1).SerializeToString(),  # 5 { 1: 1, 6 {} }
    "negative dim": pb.EmbedRequest(masks=pb.Tensor(dtype=1, shape=[-1, 3], data=b"")).SerializeToString(),
    "unknown fields": _request(4, 1).SerializeToString()
    + b"\x28\x96\x01"  # field 5 varint
    + b"\x31"
    + bytes(8)  # field 6 fixed64
    + b"\x3d"
    + bytes(4)  # field 7 fixed32
    + _field(9, b"skipped"),
    "known number, wrong wire type": b"\x18\x05" + _request(5, 1).SerializeToString(),  # masks as varint
    "unknown enum dtype": pb.EmbedRequest(masks=pb.Tensor(dtype=9, shape=[1])).SerializeToString(),
    # field 5 as a group, nested as deep as protobuf allows
    "groups nested 100 deep": b"\x2b" * MAX_GROUP_DEPTH + b"\x2c" * MAX_GROUP_DEPTH,
}


@pytest.mark.parametrize("name", list(CASES))
def test_parse_matches_protobuf(name: str) -> None:
    raw = CASES[name]
    _same(parse_request(raw), pb.EmbedRequest.FromString(raw))


def test_tensors_are_views_of_the_request_bytes() -> None:
    """The point of the module: a 2-chunk fbank (640 KB) is decoded in place."""
    raw = _request(6).SerializeToString()
    wire = parse_request(raw)
    fbank = from_tensor(wire.fbank, "fbank")
    start = np.frombuffer(raw, np.uint8).ctypes.data
    assert start <= fbank.ctypes.data and fbank.ctypes.data + fbank.nbytes <= start + len(raw), (
        "fbank was copied"
    )
    assert np.array_equal(fbank, from_tensor(pb.EmbedRequest.FromString(raw).fbank, "fbank"))
    assert not fbank.flags.writeable


MALFORMED = {
    "truncated masks": (_request(7, 1).SerializeToString()[:-10], "masks"),
    "truncated varint": (b"\x0a\xff", "request"),
    "over-long varint": (b"\x0a" + b"\xff" * 11, "request"),
    "unclosed group": (b"\x0b\x08\x01", "request"),
    "group closed by another": (b"\x0b\x14", "request"),
    "end group alone": (b"\x0c", "request"),
    "field number 0": (b"\x02\x00", "request"),
    "fixed64 cut short": (b"\x31\x00\x00", "request"),
    "bad UTF-8 request id": (_field(4, b"\xc3\x28"), "request_id"),
    "truncated inside fbank": (_field(1, b"\x1a\x05ab"), "fbank"),
    "packed shape cut short": (_field(3, b"\x12\x01\xff"), "masks.shape"),
    "groups nested 101 deep": (b"\x2b" * (MAX_GROUP_DEPTH + 1) + b"\x2c" * (MAX_GROUP_DEPTH + 1), "request"),
    # deep enough to exhaust Python's recursion (1,000 frames) in a recursive skipper
    "groups nested 5000 deep": (b"\x2b" * 5000 + b"\x2c" * 5000, "request"),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_bytes_are_rejected_like_protobuf(name: str) -> None:
    raw, field = MALFORMED[name]
    with pytest.raises(DecodeError):
        pb.EmbedRequest.FromString(raw)
    with pytest.raises(WireError) as raised:
        parse_request(raw)
    print(f"{name:<24} {raised.value}")
    assert raised.value.field == field, f"{name}: {raised.value} names {raised.value.field}, expected {field}"


# --- bounds protobuf does not have: refused where protobuf would accept ------------------

BOUNDED = {
    # 4 MiB of two-byte unknown fields: 2 Mi fields, seconds of pure Python without the bound
    "4 MiB of tiny fields": (b"\x28\x00" * (2 * 1024 * 1024), "request", f"more than {MAX_FIELDS} fields"),
    "5-dimension shape": (
        pb.EmbedRequest(masks=pb.Tensor(dtype=1, shape=[1, 1, 1, 1, 1])).SerializeToString(),
        "masks.shape",
        "more than 4 dimensions",
    ),
    "packed shape of 1 Mi dims": (
        pb.EmbedRequest(fbank=pb.Tensor(shape=[1] * (1 << 20))).SerializeToString(),
        "fbank.shape",
        "more than 4 dimensions",
    ),
    "long request_id": (
        pb.EmbedRequest(request_id="x" * (MAX_REQUEST_ID_BYTES + 1)).SerializeToString(),
        "request_id",
        f"{MAX_REQUEST_ID_BYTES + 1} bytes, expected at most 128 characters",
    ),
}


@pytest.mark.parametrize("name", list(BOUNDED))
def test_work_per_request_is_bounded(name: str) -> None:
    """Every one parses with protobuf; here each stops early with WireError naming the field,
    so parse time is bounded by MAX_FIELDS, not by the message's size."""
    raw, field, message = BOUNDED[name]
    pb.EmbedRequest.FromString(raw)
    with pytest.raises(WireError) as raised:
        parse_request(raw)
    print(f"{name:<26} {raised.value}")
    assert raised.value.field == field, f"{name}: {raised.value} names {raised.value.field}, expected {field}"
    assert message in raised.value.message, f"{name}: {raised.value.message!r} lacks {message!r}"


def test_tiny_fields_stop_at_the_field_bound() -> None:
    """The tiny-field flood is refused at the field past MAX_FIELDS: within the first few KB
    of the 4 MiB, whatever follows."""
    raw = b"\x28\x00" * (2 * 1024 * 1024)
    with pytest.raises(WireError, match=rf"by byte {2 * MAX_FIELDS} of {len(raw)}"):
        parse_request(raw)

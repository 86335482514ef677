"""EmbedRequest read straight from its wire bytes, tensor payloads as views (no copy).

Why not `EmbedRequest.FromString`: on the H200 the service delivered 56-67% of the
engine's b32 throughput with the GIL held 72% of the time, mostly in copies of the
payload. The generated parser copies a 10 MB fbank into the message, and reading
`tensor.data` copies it out again, both under the GIL (and the parse ran on the event
loop). Here the gRPC handler takes the raw bytes (`request_deserializer=None`) and this
module walks the protobuf wire format of the three small messages involved, keeping each
tensor's `data` as a memoryview into those bytes, so NumPy decodes them in place and the
one remaining copy (into pinned staging) runs with the GIL released.

Parsing follows the protobuf rules for proto3 (speakerd.proto): fields in any order, the
last value of a scalar wins, a message field seen twice is merged, `shape` packed or not,
setting one member of the `features` oneof clears the other, unknown fields (and known
numbers with an unexpected wire type) are skipped, strings must be UTF-8. Malformed
bytes raise WireError with the byte offset, answered as INVALID_ARGUMENT.

Bounded work: the parse is pure Python, so its time grows with the number of fields, not
bytes. A real request has about 25 fields (and tensors are single fields however large),
so more than MAX_FIELDS fields is refused at the field past the limit, whatever the
message's size: 4 MiB of two-byte fields would otherwise hold a thread for seconds. Groups
are skipped without recursion, nested at most MAX_GROUP_DEPTH deep (protobuf's own limit),
a shape holds at most MAX_DIMS dimensions and a request_id at most MAX_REQUEST_ID_BYTES.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from speakerd.serving.api.request_ids import MAX_REQUEST_ID_BYTES, MAX_REQUEST_ID_CHARS
from speakerd.v1.tensors import MAX_DIMS

#: Protobuf wire types (encoding.md in the protobuf docs).
VARINT, FIXED64, LENGTH_DELIMITED, START_GROUP, END_GROUP, FIXED32 = 0, 1, 2, 3, 4, 5
#: A varint is at most 10 bytes (64 bits, 7 per byte).
MAX_VARINT_BYTES = 10
#: Fields (and packed shape entries) parsed at most per request: a real one has ~25; a
#: thousand parse in about a millisecond and leave room for merged messages and the unknown
#: fields of newer clients.
MAX_FIELDS = 1000
#: Nesting of (unknown, skipped) groups: protobuf's default recursion limit.
MAX_GROUP_DEPTH = 100
#: Field numbers of speakerd.v1.Tensor and speakerd.v1.EmbedRequest.
TENSOR_DTYPE, TENSOR_SHAPE, TENSOR_DATA = 1, 2, 3
REQUEST_FBANK, REQUEST_WAVEFORM, REQUEST_MASKS, REQUEST_ID = 1, 2, 3, 4
#: The `features` oneof: field number -> member name.
FEATURES = {REQUEST_FBANK: "fbank", REQUEST_WAVEFORM: "waveform"}
#: EmbedRequest field number -> the name errors use.
REQUEST_FIELDS = {**FEATURES, REQUEST_MASKS: "masks", REQUEST_ID: "request_id"}


class WireError(ValueError):
    """Bytes that are not a valid EmbedRequest; `field` names where parsing stopped."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass
class WireTensor:
    """speakerd.v1.Tensor with `data` a view into the request bytes (what from_tensor reads)."""

    dtype: int = 0
    shape: list[int] = field(default_factory=list)
    data: memoryview = field(default_factory=lambda: memoryview(b""))


@dataclass
class WireRequest:
    """speakerd.v1.EmbedRequest as parsed here; `features` is the set oneof member or None."""

    features: str | None = None
    fbank: WireTensor | None = None
    waveform: WireTensor | None = None
    masks: WireTensor | None = None
    request_id: str = ""

    def tensor(self, name: str) -> WireTensor | None:
        return {"fbank": self.fbank, "waveform": self.waveform, "masks": self.masks}[name]


class _Parser:
    """Walks one request's bytes, counting fields against MAX_FIELDS."""

    def __init__(self, view: memoryview) -> None:
        self.view = view
        self.fields_left = MAX_FIELDS

    def count(self, at: int, where: str) -> None:
        self.fields_left -= 1
        if self.fields_left < 0:
            raise WireError(
                where,
                f"more than {MAX_FIELDS} fields by byte {at} of {len(self.view)}; a request has about 25",
            )

    def varint(self, at: int, end: int, where: str) -> tuple[int, int]:
        """(unsigned value, next offset) of the varint at `at`."""
        view, value, shift = self.view, 0, 0
        for offset in range(at, min(end, at + MAX_VARINT_BYTES)):
            byte = view[offset]
            value |= (byte & 0x7F) << shift
            if byte < 0x80:
                return value & 0xFFFFFFFFFFFFFFFF, offset + 1
            shift += 7
        raise WireError(where, f"truncated or over-long varint at byte {at}")

    def field_at(self, at: int, end: int, where: str, names: dict[int, str] | None = None):
        """(field number, wire type, value, offset after it) of the field at `at`. The value
        is an int for VARINT, a (start, end) pair for LENGTH_DELIMITED, None for skipped
        fixed-width values and groups. Errors name the field by `names` when known, else
        `where`."""
        self.count(at, where)
        key, at = self.varint(at, end, where)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise WireError(where, f"field number 0 at byte {at}")
        if wire == VARINT:
            value, at = self.varint(at, end, where)
            return number, wire, value, at
        if wire == LENGTH_DELIMITED:
            length, at = self.varint(at, end, where)
            if length > end - at:
                name = (names or {}).get(number, where)
                raise WireError(name, f"{length} bytes from byte {at} run past the message's end ({end})")
            return number, wire, (at, at + length), at + length
        if wire in (FIXED64, FIXED32):
            return number, wire, None, self.fixed(wire, at, end, where)
        if wire == START_GROUP:  # not proto3, but a valid unknown field: skipped, as protobuf does
            return number, wire, None, self.skip_group(number, at, end, where)
        raise WireError(where, f"wire type {wire} for field {number} at byte {at}")

    def fixed(self, wire: int, at: int, end: int, where: str) -> int:
        at += 8 if wire == FIXED64 else 4
        if at > end:
            raise WireError(where, f"truncated fixed-width field ending at byte {at}")
        return at

    def skip_group(self, number: int, at: int, end: int, where: str) -> int:
        """Offset after the END_GROUP closing group `number` (opened just before `at`);
        nested groups on an explicit stack, so no input can exhaust Python's recursion."""
        open_groups = [number]
        while at < end:
            self.count(at, where)
            key, after = self.varint(at, end, where)
            inner, wire = key >> 3, key & 7
            if inner == 0:
                raise WireError(where, f"field number 0 at byte {after}")
            if wire == END_GROUP:
                if inner != open_groups[-1]:
                    raise WireError(where, f"group {open_groups[-1]} closed as {inner} at byte {at}")
                open_groups.pop()
                if not open_groups:
                    return after
                at = after
            elif wire == START_GROUP:
                if len(open_groups) == MAX_GROUP_DEPTH:
                    raise WireError(where, f"groups nested deeper than {MAX_GROUP_DEPTH} at byte {at}")
                open_groups.append(inner)
                at = after
            elif wire == VARINT:
                at = self.varint(after, end, where)[1]
            elif wire == LENGTH_DELIMITED:
                length, at = self.varint(after, end, where)
                if length > end - at:
                    raise WireError(
                        where, f"{length} bytes from byte {at} run past the message's end ({end})"
                    )
                at += length
            elif wire in (FIXED64, FIXED32):
                at = self.fixed(wire, after, end, where)
            else:
                raise WireError(where, f"wire type {wire} for field {inner} at byte {after}")
        raise WireError(where, f"group {open_groups[-1]} is not closed before byte {end}")

    def fields(self, start: int, end: int, where: str, names: dict[int, str] | None = None):
        """Yield (field number, wire type, value) of each field in view[start:end]."""
        at = start
        while at < end:
            number, wire, value, at = self.field_at(at, end, where, names)
            yield number, wire, value

    def merge_tensor(self, span: tuple[int, int], tensor: WireTensor, where: str) -> None:
        """Merge the Tensor encoded in view[span] into `tensor` (protobuf merge semantics)."""
        for number, wire, value in self.fields(*span, where):
            if number == TENSOR_DTYPE and wire == VARINT:
                tensor.dtype = _signed64(value)
            elif number == TENSOR_SHAPE and wire == VARINT:
                self.add_dim(tensor, value, span[0], where)
            elif number == TENSOR_SHAPE and wire == LENGTH_DELIMITED:
                at, end = value
                while at < end:
                    self.count(at, f"{where}.shape")
                    dim, at = self.varint(at, end, f"{where}.shape")
                    self.add_dim(tensor, dim, at, where)
            elif number == TENSOR_DATA and wire == LENGTH_DELIMITED:
                tensor.data = self.view[value[0] : value[1]]

    @staticmethod
    def add_dim(tensor: WireTensor, dim: int, at: int, where: str) -> None:
        if len(tensor.shape) == MAX_DIMS:
            raise WireError(f"{where}.shape", f"more than {MAX_DIMS} dimensions at byte {at}")
        tensor.shape.append(_signed64(dim))


def _signed64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def parse_request(raw: bytes | memoryview) -> WireRequest:
    """An EmbedRequest from its serialized bytes; WireError when they are malformed."""
    view = memoryview(raw).cast("B") if not isinstance(raw, bytes) else memoryview(raw)
    parser = _Parser(view)
    request = WireRequest()
    for number, wire, value in parser.fields(0, len(view), "request", REQUEST_FIELDS):
        if wire != LENGTH_DELIMITED:
            continue  # every EmbedRequest field is length-delimited: anything else is unknown
        if number in FEATURES:
            name = FEATURES[number]
            if request.features != name:  # setting a oneof member clears the other
                request.fbank = request.waveform = None
                request.features = name
                setattr(request, name, WireTensor())
            parser.merge_tensor(value, request.tensor(name), name)  # type: ignore[arg-type]
        elif number == REQUEST_MASKS:
            if request.masks is None:
                request.masks = WireTensor()
            parser.merge_tensor(value, request.masks, "masks")
        elif number == REQUEST_ID:
            if value[1] - value[0] > MAX_REQUEST_ID_BYTES:
                raise WireError(
                    "request_id",
                    f"{value[1] - value[0]} bytes, expected at most {MAX_REQUEST_ID_CHARS} characters",
                )
            try:
                request.request_id = str(view[value[0] : value[1]], "utf-8")
            except UnicodeDecodeError as error:
                raise WireError("request_id", f"not UTF-8 ({error.reason} at byte {error.start})") from None
    return request

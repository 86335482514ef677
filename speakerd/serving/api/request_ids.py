"""Request ids: what a client may send as one, and how one is made when it sends none.

An id is echoed in responses, error messages and the server's log lines, so it must be
short and printable: a newline in it would forge a log line of its own, and an id of
kilobytes would push an error's trailer past gRPC's metadata limit (the client would then
see RESOURCE_EXHAUSTED, a code it retries, instead of the real error).
"""

from __future__ import annotations

import uuid

#: Longest accepted id, in characters: a UUID is 36, a trace id 32; room for a prefix.
MAX_REQUEST_ID_CHARS = 128
#: Bytes of UTF-8 that can hold MAX_REQUEST_ID_CHARS characters (4 bytes each at most):
#: the wire parser refuses longer fields before decoding them.
MAX_REQUEST_ID_BYTES = 4 * MAX_REQUEST_ID_CHARS
#: Characters of a refused id shown (escaped) in the server's log.
LOGGED_CHARS = 40


class RequestIdError(ValueError):
    """A request id that cannot be used; `field` is where it came from."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def check_request_id(value: str, field: str) -> str:
    """`value` when it is a usable id (empty means none given); RequestIdError otherwise."""
    if len(value) > MAX_REQUEST_ID_CHARS:
        raise RequestIdError(field, f"{len(value)} characters, expected at most {MAX_REQUEST_ID_CHARS}")
    if not value.isprintable():
        at = next(i for i, char in enumerate(value) if not char.isprintable())
        raise RequestIdError(
            field, f"control or separator character {value[at]!a} at {at}, expected printable text"
        )
    return value


def fresh_request_id() -> str:
    """A new id for a request that brought none: 16 hex digits."""
    return uuid.uuid4().hex[:16]


def loggable(value: str) -> str:
    """A refused id as it may appear in a log line: escaped (one line) and cut short."""
    return ascii(value[:LOGGED_CHARS]) + ("..." if len(value) > LOGGED_CHARS else "")

"""A byte budget for requests being decoded, so concurrent large messages cannot take the
server's memory without bound.

gRPC hands a handler the whole serialized message; from then until its tensors are
validated the service holds those bytes (and NumPy may hold a float32 copy of a float16
fbank). The budget is taken before parsing and given back once decoding ends: a message
that does not fit is answered RESOURCE_EXHAUSTED at once (the client retries with backoff)
instead of waiting in memory for a decode thread. Bytes still being received by gRPC are
bounded by the server's message size and concurrent-stream limits, not here.
"""

from __future__ import annotations


class ByteBudget:
    """Bytes held by calls being decoded; used on the event loop thread only (no lock)."""

    def __init__(self, limit_bytes: int) -> None:
        if limit_bytes < 1:
            raise ValueError(f"byte budget {limit_bytes}, expected at least 1")
        self.limit_bytes = limit_bytes
        self.used_bytes = 0

    def take(self, size: int) -> bool:
        """Reserve `size` bytes; False (nothing reserved) when they would pass the limit."""
        if self.used_bytes + size > self.limit_bytes:
            return False
        self.used_bytes += size
        return True

    def give(self, size: int) -> None:
        """Return bytes reserved by a successful `take`."""
        if size > self.used_bytes:
            raise ValueError(f"giving back {size} bytes, only {self.used_bytes} are taken")
        self.used_bytes -= size

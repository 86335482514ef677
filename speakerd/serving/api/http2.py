"""HTTP/2 settings every gRPC listener of the server uses (its own and each receiver's)."""

from __future__ import annotations


def stream_options(max_concurrent_streams: int) -> list[tuple[str, int]]:
    """The HTTP/2 server options of every listener (the server's and each receiver's).

    `grpc.http.overload_protection` off: with it on (gRPC's default), the core counts a
    stream against MAX_CONCURRENT_STREAMS until its server-side call is freed, which is
    after the handler ends, while the client counts it until it has the answer or its
    deadline passes. A client keeping 32 calls in flight whose deadlines pass while they
    wait in the queue is then over the server's count, and its next calls are refused with
    RST_STREAM REFUSED_STREAM (code 7), which clients see as UNAVAILABLE: 3-20% of fast
    calls on a healthy server. Off, the server counts streams open on the wire, as the
    client does. A handler still ending after its stream closed holds no received bytes
    the budget does not count."""
    return [
        ("grpc.max_concurrent_streams", max_concurrent_streams),
        ("grpc.http.overload_protection", 0),
    ]

"""A client command's outcome: its exit code, and each failure as one line on stderr.

Its own module, below the command line: `python -m speakerd.client.verify` runs one
command with the same outcomes as `speakerd-client verify` without importing cli.py, which
imports every command's module (verify.py among them), so neither imports the other.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import grpc

#: Exit codes: the server failed the call (or was not there); the command line was unusable.
CALL_FAILED_EXIT = 1
USAGE_EXIT = 2


def describe(error: grpc.RpcError) -> str:
    """'UNAVAILABLE (failed to connect ...)': the code and the server's or gRPC's detail."""
    code = error.code() if callable(getattr(error, "code", None)) else None
    details = error.details() if callable(getattr(error, "details", None)) else str(error)
    return f"{code.name if code is not None else 'an error'} ({' '.join(str(details).split())})"


#: gRPC's words for a connection that was never made (no process listening, a name that does
#: not resolve, a host that does not answer): nothing reached a server.
NOT_CONNECTED = (
    "failed to connect", "connection refused", "dns resolution failed", "name resolution",
    "no route to host", "connection timed out", "deadline exceeded while connecting",
)  # fmt: skip
#: The server's own words when it refuses a call because it is shutting down (api/calls.py)
#: or not ready yet (api/recording.py, serve.py).
DRAINING = "the server is draining"
WARMING_UP = "still warming up"
#: gRPC's words for a connection that broke while a call was on it.
LOST = ("socket closed", "connection reset", "broken pipe", "goaway", "stream removed", "end of stream")


def explain(error: grpc.RpcError, target: str, elapsed_s: float) -> str:
    """What happened to a failed call and what to do, in words: no server at `target`; the
    server shutting down (before or during the call); the deadline passed after `elapsed_s`;
    else what the server answered (its code and message)."""
    code = error.code() if callable(getattr(error, "code", None)) else None
    details = " ".join(str(error.details() if callable(getattr(error, "details", None)) else error).split())
    lowered = details.lower()
    if code == grpc.StatusCode.UNAVAILABLE and any(words in lowered for words in NOT_CONNECTED):
        return (f"no server listening at {target} ({details}); start one (speakerd serve) or give "
                "--target HOST:PORT")  # fmt: skip
    if code == grpc.StatusCode.UNAVAILABLE and DRAINING in lowered:
        return (f"the server at {target} is shutting down and did not take the call; retry "
                "(--retries N) or use another server")  # fmt: skip
    if code == grpc.StatusCode.UNAVAILABLE and WARMING_UP in lowered:
        return (f"the server at {target} is starting ({details}); retry in a few seconds (--retries N), "
                "or wait for it: speakerd-client health --wait 600")  # fmt: skip
    if code == grpc.StatusCode.UNAVAILABLE and any(words in lowered for words in LOST):
        return (f"the connection to {target} was lost during the call after {elapsed_s:.1f} s ({details}): "
                "the server shut down or restarted and the call was not completed; run it again "
                "(--retries N retries it)")  # fmt: skip
    if code == grpc.StatusCode.UNAVAILABLE:
        return f"{target} answered {describe(error)}; the call was not completed: retry it (--retries N)"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return (f"the deadline passed after {elapsed_s:.1f} s and the call was not completed ({details}); "
                "give a longer --timeout")  # fmt: skip
    return f"{target} answered {describe(error)}"


def run_command(name: str, command: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Run `command`: 0 done, 1 a call failed (or the server was not there), 2 a flag or file
    that cannot be used; each failure is one stderr line starting with `name`."""
    started = time.monotonic()
    try:
        return int(command(args))
    except grpc.RpcError as error:
        print(f"{name}: {explain(error, args.target, time.monotonic() - started)}", file=sys.stderr)
        return CALL_FAILED_EXIT
    except (ValueError, OSError) as error:  # UsageError, and the TLS and token files' errors
        print(f"{name}: error: {' '.join(str(error).split())}", file=sys.stderr)
        return USAGE_EXIT

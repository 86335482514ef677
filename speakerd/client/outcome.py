"""A client command's outcome: its exit code, and each failure as one line on stderr.

Its own module, below the command line: `python -m speakerd.client.verify` runs one
command with the same outcomes as `speakerd-client verify` without importing cli.py, which
imports every command's module (verify.py among them), so neither imports the other.
"""

from __future__ import annotations

import argparse
import sys
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


def run_command(name: str, command: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Run `command`: 0 done, 1 a call failed (or the server was not there), 2 a flag or file
    that cannot be used; each failure is one stderr line starting with `name`."""
    try:
        return int(command(args))
    except grpc.RpcError as error:
        print(f"{name}: {args.target} answered {describe(error)}", file=sys.stderr)
        return CALL_FAILED_EXIT
    except (ValueError, OSError) as error:  # UsageError, and the TLS and token files' errors
        print(f"{name}: error: {' '.join(str(error).split())}", file=sys.stderr)
        return USAGE_EXIT

"""The connection flags every `python -m speakerd.client` command shares, and the client they make.

`--target` defaults to $SPEAKERD_TARGET, else the server's own default address, so on one
machine `client info` needs no flags (and a shell that sets SPEAKERD_TARGET once, such as
the README's test, runs the README's commands against another server unchanged). TLS and
tokens mirror the server's flags: `--tls-ca` (trust these roots; TLS on), `--tls-cert` +
`--tls-key` (a client certificate, for a server with --tls-client-ca), `--token-file FILE`
or the SPEAKERD_TOKEN variable (for --auth-tokens).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from speakerd.client.client import DEFAULT_TARGET, RetryPolicy, Security
from speakerd.client.files import UsageError

TOKEN_ENV = "SPEAKERD_TOKEN"
TARGET_ENV = "SPEAKERD_TARGET"


def add_connection_flags(
    parser: argparse.ArgumentParser,
    timeout_s: float | None,
    timeout_help: str = "deadline in seconds a call",
    retries: bool = True,
) -> None:
    """The flags; `timeout_s` None leaves --timeout to the command (`load` sizes it);
    `retries`: the command takes --retries (`load` counts every failure instead)."""
    target = os.environ.get(TARGET_ENV) or DEFAULT_TARGET
    parser.add_argument(
        "--target", default=target, help=f"HOST:PORT (default ${TARGET_ENV}, else {DEFAULT_TARGET})"
    )
    parser.add_argument("--timeout", type=float, default=timeout_s, help=timeout_help)
    parser.add_argument("--tls-ca", type=Path, default=None, help="PEM roots to trust: connect with TLS")
    parser.add_argument("--tls-cert", type=Path, default=None, help="PEM client certificate (mutual TLS)")
    parser.add_argument("--tls-key", type=Path, default=None, help="PEM key of --tls-cert")
    if retries:
        parser.add_argument(
            "--retries", type=int, default=0,
            help="send a call again up to N times, with backoff, when the server was unreachable, shut "
            "down during it or was full (UNAVAILABLE, RESOURCE_EXHAUSTED); default 0: one attempt",
        )  # fmt: skip
    parser.add_argument(
        "--token-file",
        type=Path,
        default=None,
        help=f"file whose first line is a bearer token (else ${TOKEN_ENV})",
    )


def read_token(path: Path | None) -> str | None:
    """The token of --token-file (its first line that is not blank or a # comment), else
    $SPEAKERD_TOKEN, else None. ValueError naming the flag when the file gives none."""
    if path is None:
        return os.environ.get(TOKEN_ENV) or None
    try:
        lines = [line.strip() for line in path.read_text().splitlines()]
    except OSError as error:
        raise ValueError(f"--token-file {path}: cannot read it ({error.strerror})") from error
    token = next((line for line in lines if line and not line.startswith("#")), None)
    if token is None:
        raise ValueError(f"--token-file {path}: holds no token (expected one on its first line)")
    return token


def security(args: argparse.Namespace) -> Security:
    """The Security of the parsed flags; ValueError naming the file when one is unusable."""
    return Security.from_files(**_security_kwargs(args))  # type: ignore[arg-type]


def retry_policy(args: argparse.Namespace) -> RetryPolicy:
    """One attempt, or 1 + --retries with the client's backoff; UsageError below 0."""
    retries = getattr(args, "retries", 0)
    if retries < 0:
        raise UsageError(f"--retries {retries}: expected 0 or more")
    return RetryPolicy(attempts=1 + retries)


def client_kwargs(args: argparse.Namespace) -> dict[str, object]:
    """Keyword arguments of SpeakerClient / AsyncSpeakerClient from the parsed flags (the
    retry policy too: a command line makes one attempt unless --retries asks for more); a TLS
    file that is not there is a UsageError naming its flag."""
    return {**_security_kwargs(args), "retry": retry_policy(args)}


def _security_kwargs(args: argparse.Namespace) -> dict[str, object]:
    """The TLS files and the token of the parsed flags, checked."""
    for flag, path in (("--tls-ca", args.tls_ca), ("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key)):
        if path is not None and not Path(path).is_file():
            raise UsageError(f"{flag} {path}: no such file (expected a PEM file)")
    return {
        "tls_ca": args.tls_ca,
        "tls_cert": args.tls_cert,
        "tls_key": args.tls_key,
        "token": read_token(args.token_file),
    }

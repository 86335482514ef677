"""`speakerd-client` (`python -m speakerd.client`): the client's command line.

Every command takes --target (default: $SPEAKERD_TARGET, else the server's default address
127.0.0.1:50051) and the TLS and token flags of speakerd/client/options.py. A server that
does not answer, or answers with an error, is one line on stderr naming the target and the
gRPC code, exit 1; a flag or file that cannot be used is one line naming it and what was
expected (files.py), exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys

import grpc
import numpy as np
from google.protobuf.json_format import MessageToDict

from speakerd.client import diarize, files, loadgen, recording, verify, voiceprints
from speakerd.client.client import SpeakerClient
from speakerd.client.files import UsageError
from speakerd.client.options import add_connection_flags, client_kwargs
from speakerd.client.outcome import CALL_FAILED_EXIT, describe, run_command


def _embed(args: argparse.Namespace) -> int:
    if args.audio:  # a whole recording over EmbedRecording
        with SpeakerClient(args.target, timeout_s=args.timeout, **client_kwargs(args)) as client:
            return recording.run(args, client)
    if not args.input:
        raise UsageError("embed: give --input FILE.npz, or --audio FILE with --masks FILE.npy or --segment")
    output = files.writable("--output", args.output)
    kind, chunks, masks = files.read_chunks(args.input)
    with SpeakerClient(args.target, timeout_s=args.timeout, **client_kwargs(args)) as client:
        embed = client.embed if kind == "fbank" else client.embed_waveform
        result = embed(chunks, masks)
    np.savez(output, embeddings=result.embeddings, empty=result.empty, active_frames=result.active_frames)
    summary = {"output": args.output, "shape": list(result.embeddings.shape), "model_id": result.model_id,
               "precision": result.precision, "empty_rows": int(result.empty.sum())}  # fmt: skip
    print(json.dumps(summary))
    return 0


def _diarize(args: argparse.Namespace) -> int:
    with diarize.DiarizationClient(args.target, timeout_s=args.timeout, **client_kwargs(args)) as client:
        return diarize.run(args, client)


def _info(args: argparse.Namespace) -> int:
    with SpeakerClient(args.target, timeout_s=args.timeout, **client_kwargs(args)) as client:
        print(json.dumps(MessageToDict(client.model_info(), preserving_proto_field_name=True), indent=2))
    return 0


def _health(args: argparse.Namespace) -> int:
    """Exit 0 only when SERVING (a probe command for containers)."""
    with SpeakerClient(args.target, **client_kwargs(args)) as client:
        try:
            if args.wait > 0:
                client.wait_serving(args.wait, args.service)
                status = "SERVING"
            else:
                status = client.health(args.service, timeout_s=args.timeout)
        except grpc.RpcError as error:
            print(f"UNREACHABLE: {args.target} answered {describe(error)}", file=sys.stderr)
            return CALL_FAILED_EXIT
        except TimeoutError as error:
            print(f"UNREACHABLE: {args.target}: {error}", file=sys.stderr)
            return CALL_FAILED_EXIT
    print(status)
    return 0 if status == "SERVING" else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="speakerd-client",
        description="speakerd's client: embeddings, diarizations and voiceprints from a speakerd server",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    embed = sub.add_parser("embed", help="embed an .npz holding fbank or waveform, and masks")
    embed.add_argument("--input", help=".npz holding fbank or waveform, and masks")
    recording.configure(embed)
    embed.add_argument("--output", required=True)
    embed.set_defaults(func=_embed)
    info = sub.add_parser("info", help="print GetModelInfo as JSON")
    info.set_defaults(func=_info)
    health = sub.add_parser("health", help="exit 0 when the server is SERVING")
    health.add_argument("--service", default="")
    health.add_argument("--wait", type=float, default=0.0, help="poll up to this many seconds")
    health.set_defaults(func=_health)
    diarize_command = sub.add_parser("diarize", help="who spoke when in a recording (and by name: --names)")
    diarize.configure(diarize_command)
    diarize_command.set_defaults(func=_diarize)
    add_connection_flags(
        diarize_command, timeout_s=3600.0, timeout_help="deadline in seconds for the recording"
    )
    for command in (embed, info, health):
        add_connection_flags(command, timeout_s=60.0)
    load = sub.add_parser("load", help="load generator: JSON with chunks/s, latency, errors, batch fill")
    loadgen.configure(load)
    load.set_defaults(func=loadgen.run)
    check = sub.add_parser("verify", help="parity (docs/parity.md) of a server against reference cases")
    verify.configure(check)
    check.set_defaults(func=verify.run)
    voiceprints.configure(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command. Its outcome is its exit code: 0 done, 1 a call failed (or the server
    was not there), 2 a flag or file that cannot be used; each failure is one stderr line."""
    args = build_parser().parse_args(argv)
    return run_command(f"speakerd-client {args.command}", args.func, args)

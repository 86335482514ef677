"""`python -m speakerd.client.verify --target HOST:PORT --references DIR`: docs/parity.md parity over gRPC.

Sends every reference case to a running server, compares the embeddings with the ONNX
Runtime CPU reference rows and the empty flags with the masks, prints a table and exits 1
when any case misses the bound of the precision the server reports.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
from safetensors import SafetensorError

from speakerd.client.client import SpeakerClient
from speakerd.client.files import UsageError
from speakerd.client.options import add_connection_flags, client_kwargs
from speakerd.client.outcome import run_command
from speakerd.model.architecture import EMBEDDING_DIM, MAX_SPEAKERS
from speakerd.model.cases import ReferenceCase, load_cases
from speakerd.model.numerics import BOUNDS, Math, active_frames, compare


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--references", required=True, help="directory of reference .safetensors cases")
    add_connection_flags(parser, timeout_s=300.0)


def read_cases(directory: str) -> list[ReferenceCase]:
    """The reference cases of --references; UsageError naming the directory or file otherwise."""
    try:
        cases = load_cases(directory)
    except FileNotFoundError as error:
        raise UsageError(f"--references {directory}: {error}") from None
    except (SafetensorError, KeyError, ValueError) as error:
        raise UsageError(f"--references {directory}: a case file is not a reference case ({error}; "
                         "write them with `speakerd make-references --out DIR`)") from None  # fmt: skip
    if not cases:
        raise UsageError(f"--references {directory}: no reference cases (speakerd make-references --out DIR)")
    return cases


def run(args: argparse.Namespace) -> int:
    cases = read_cases(args.references)
    failed = 0
    with SpeakerClient(args.target, timeout_s=args.timeout, **client_kwargs(args)) as client:
        precision = Math(client.model_info().precision)
        bound = BOUNDS[precision]
        print(f"{'case':<18} {'rows':>5} {'min cosine':>11} {'max abs':>10} {'bound':>22} flags  ok")
        for case in cases:
            result = client.embed(case.fbank, case.masks, request_id=f"verify-{case.name}")
            expected = case.output.reshape(case.chunks, MAX_SPEAKERS, EMBEDDING_DIM)
            parity = compare(result.embeddings, expected)
            flags_ok = bool(np.array_equal(result.empty, active_frames(case.masks) == 0))
            ok = parity.within(bound) and flags_ok and result.precision == precision
            failed += not ok
            print(
                f"{case.name:<18} {parity.rows:>5} {parity.min_cosine:>11.7f} {parity.max_abs:>10.3g} "
                f"{f'>={bound.min_cosine} <{bound.max_relative_abs}':>22} {'ok' if flags_ok else 'BAD':>5}  "
                f"{'PASS' if ok else 'FAIL'}"
            )
    print(f"{precision}: {len(cases) - failed}/{len(cases)} cases within the parity bounds (docs/parity.md)")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    """`python -m speakerd.client.verify`: `speakerd-client verify`, with the same one-line
    failures and exit codes (outcome.py)."""
    parser = argparse.ArgumentParser(
        prog="python -m speakerd.client.verify", description=__doc__.splitlines()[0]
    )
    configure(parser)
    return run_command("speakerd-client verify", run, parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

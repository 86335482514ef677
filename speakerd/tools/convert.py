"""`speakerd convert pytorch_model.bin --out model.safetensors`: pyannote checkpoint -> safetensors.

No torch: the checkpoint is read by speakerd.model.torch_pickle (NumPy, a closed list of
pickle names) and converted by speakerd.model.checkpoint, the same code `--model` runs on a
checkpoint it finds; this command writes the result where the user says. `--segmentation`
converts pyannote/segmentation-3.0's checkpoint instead of the embedding model's (the code
`--segmentation-model` runs). A bad file is one line saying what is wrong, exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from speakerd.model.checkpoint import EMBEDDING, convert
from speakerd.model.segmentation.weights import NETWORK as SEGMENTATION
from speakerd.model.torch_pickle import CheckpointError
from speakerd.model.weights import WeightsError, file_sha256

#: A file the user named that cannot be converted is a usage error (argparse's code).
USAGE_EXIT = 2


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", type=Path, help="pyannote pytorch_model.bin (or any torch state dict)")
    parser.add_argument("--out", type=Path, required=True, help="safetensors file to write")
    parser.add_argument(
        "--segmentation",
        action="store_true",
        help="the checkpoint is pyannote/segmentation-3.0's (PyanNet), not the embedding model's",
    )


def run(args: argparse.Namespace) -> int:
    network = SEGMENTATION if args.segmentation else EMBEDDING
    try:
        convert(args.checkpoint, args.out, network)
    except FileNotFoundError as error:
        print(f"convert: {error.filename or args.checkpoint}: no such file", file=sys.stderr)
        return USAGE_EXIT
    except CheckpointError as error:
        print(f"convert: {error}", file=sys.stderr)
        return USAGE_EXIT
    except WeightsError as error:
        print(f"convert: {args.checkpoint}: not pyannote's {network.name}: {error}", file=sys.stderr)
        return USAGE_EXIT
    except OSError as error:
        print(f"convert: cannot write {args.out} ({error.strerror or error})", file=sys.stderr)
        return USAGE_EXIT
    print(f"wrote {args.out}")
    print(f"model id {file_sha256(args.out)}")
    return 0

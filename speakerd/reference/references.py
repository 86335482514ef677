"""Reference cases (docs/model.md): ONNX Runtime CPU outputs every engine is judged against.

`python -m speakerd make-references --out DIR [--weights FILE]` writes one safetensors file
per case: `input/fbank` [n, 998, 80], `input/masks` [n, 3, 589], `tensor/<tap>` for every
tap of docs/model.md in b1 cases, and `tensor/output` [n * 3, 256] in all of them.

The inputs, the reader and the writer live in `speakerd.model.cases`; this module runs ONNX Runtime on
them and writes the files (`make-references`). A full set is about 930 MB: every b1 case
keeps every tap of the trunk.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from speakerd.model.cases import (
    B1_CASES,
    BATCH_CASE,
    CASE_NAMES,
    FILE_SUFFIX,
    case_inputs,
    load_case,
    mixed_rows,
    save_case,
)
from speakerd.model.source import ModelError, add_model_flag, resolve_model
from speakerd.model.weights import load_model
from speakerd.onnx.runtime import OnnxReference


def make_references(out_dir: str | Path, weights_path: str | Path | None = None) -> list[Path]:
    """Run ORT CPU (one thread) on every case and write `<out_dir>/<case>.safetensors`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = load_model(resolve_model(weights_path).path)
    with_taps = OnnxReference(model, taps=True)
    output_only = OnnxReference(model, taps=False)
    rows = mixed_rows()
    paths = []
    for name in CASE_NAMES:
        fbank_in, masks_in = case_inputs(name)
        reference = with_taps if name in B1_CASES else output_only
        metadata = {
            "case": name,
            "model_id": model.model_id,
            "producer": "speakerd make-references (onnxruntime CPU, 1 thread, sequential)",
        }
        if name == BATCH_CASE:
            metadata["b1_case_rows"] = json.dumps(rows, sort_keys=True)
        path = out / f"{name}{FILE_SUFFIX}"
        save_case(path, fbank_in, masks_in, reference.run(fbank_in, masks_in), metadata)
        paths.append(path)
    return paths


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, required=True, help="directory to write the case files into")
    add_model_flag(parser)


#: A --model that cannot be had is a usage error (argparse's code).
USAGE_EXIT = 2
#: What a full set takes on disk (every b1 case keeps every tap): said before writing it.
REFERENCE_SET_MB = 930


def run(args: argparse.Namespace) -> int:
    size = f"about {REFERENCE_SET_MB} MB"
    print(f"writing {len(CASE_NAMES)} reference cases, {size}, to {args.out}", flush=True)
    started = time.perf_counter()
    try:
        weights = resolve_model(args.model).path
    except ModelError as error:
        print(f"make-references: {error}", file=sys.stderr)
        return USAGE_EXIT
    paths = make_references(args.out, weights)
    elapsed = time.perf_counter() - started
    print(f"{'case':<18} {'chunks':>6} {'taps':>5} {'min |row|':>10} {'max |row|':>10}")
    for path in paths:
        case = load_case(path)
        norms = np.linalg.norm(case.output, axis=1)
        print(
            f"{case.name:<18} {case.chunks:>6} {len(case.taps):>5} {norms.min():>10.4f} {norms.max():>10.4f}"
        )
    print(f"wrote {len(paths)} cases to {args.out} in {elapsed:.1f} s")
    return 0

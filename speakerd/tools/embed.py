"""`python -m speakerd embed --input IN.npz --output OUT.npz`: embed chunks offline, no server needed.

IN.npz holds `masks` [n, s, F] (float32, or uint8 0/1) and either `fbank` [n, 998, 80]
(float32/float16) or `waveform` [n, 160000] float32 in [-1, 1], whose fbank is computed here
exactly as pyannote does (speakerd.model.fbank). OUT.npz gets `embeddings` [n, s, 256] float32,
`empty` [n, s] bool (the mask had no weight: the row is seg_1.bias, not a speaker),
`active_frames` [n, s] int32, `fbank` when it was computed from `waveform`, and the
`model_id` and `math` that produced it. The same engines as the service run it, so an
offline result equals the served one.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from speakerd.engine.base import EmbedResult
from speakerd.engine.factory import ENGINE_KINDS
from speakerd.model.fbank import fbank as compute_fbank
from speakerd.model.inputs import InputError, check_fbank, check_masks, check_waveform
from speakerd.model.numerics import Math
from speakerd.model.source import ModelError, add_model_flag, resolve_model
from speakerd.model.weights import WeightsError, load_model

INPUT_ARRAYS = ("masks", "fbank", "waveform")
#: Exit codes: bad input (the caller's to fix) differs from a failure to load weights or run.
EXIT_BAD_INPUT = 2
EXIT_FAILURE = 1


@dataclass(frozen=True)
class OfflineInputs:
    fbank: np.ndarray  # [n, 998, 80] float32
    masks: np.ndarray  # [n, s, F] float32
    fbank_computed: bool  # True when it came from `waveform`


def read_inputs(path: str | Path) -> OfflineInputs:
    """Read and validate IN.npz; InputError names the array, its shape and the expected shape."""
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {name: archive[name] for name in archive.files}
    except FileNotFoundError:
        raise InputError("input", f"no file at {path}") from None
    except (ValueError, OSError, zipfile.BadZipFile) as error:
        raise InputError("input", f"{path} is not a readable .npz of plain arrays ({error})") from error
    unexpected = sorted(set(arrays) - set(INPUT_ARRAYS))
    if unexpected:
        raise InputError(unexpected[0], f"unexpected array; IN.npz holds {', '.join(INPUT_ARRAYS)}")
    if "masks" not in arrays:
        raise InputError("masks", "missing; expected [n, s, F] float32 speaker masks")
    if ("fbank" in arrays) == ("waveform" in arrays):
        raise InputError("fbank", "give exactly one of `fbank` [n, 998, 80] or `waveform` [n, 160000]")
    if "waveform" in arrays:
        waveform = check_waveform(arrays["waveform"])
        masks = check_masks(arrays["masks"], waveform.shape[0])
        return OfflineInputs(compute_fbank(waveform), masks, fbank_computed=True)
    fbank = check_fbank(arrays["fbank"])
    return OfflineInputs(fbank, check_masks(arrays["masks"], fbank.shape[0]), fbank_computed=False)


def write_outputs(path: str | Path, result: EmbedResult, model_id: str, inputs: OfflineInputs) -> None:
    """Write OUT.npz atomically (a temporary file renamed into place): never a half-written file."""
    arrays: dict[str, np.ndarray] = {
        "embeddings": result.embeddings.astype(np.float32, copy=False),
        "empty": result.empty,
        "active_frames": result.active_frames.astype(np.int32, copy=False),
        "model_id": np.array(model_id),
        "math": np.array(str(result.math)),
    }
    if inputs.fbank_computed:
        arrays["fbank"] = inputs.fbank
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=target.parent, prefix=target.name + ".", suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as stream:
            np.savez(stream, **arrays)
        os.replace(temporary, target)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


def configure(parser: argparse.ArgumentParser) -> None:
    add_model_flag(parser)
    parser.add_argument("--input", type=Path, required=True, help="IN.npz with masks and fbank or waveform")
    parser.add_argument("--output", type=Path, required=True, help="OUT.npz to write")
    parser.add_argument(
        "--engine", choices=ENGINE_KINDS, default="auto", help="auto = GPU when usable, else CPU"
    )
    parser.add_argument("--math", choices=[m.value for m in Math], default=Math.FP32.value)


def run(args: argparse.Namespace) -> int:
    try:
        inputs = read_inputs(args.input)
    except InputError as error:
        print(f"embed: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    # imported only now: bad input is reported without loading an engine (or CuPy)
    from speakerd.engine.factory import create_engine

    try:
        resolved = resolve_model(args.model)
    except ModelError as error:
        print(f"embed: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        model = load_model(resolved.path)
        engine = create_engine(kind=args.engine, model=model, math=Math(args.math))
    except (FileNotFoundError, WeightsError, ValueError, RuntimeError) as error:
        print(f"embed: {error}", file=sys.stderr)
        return EXIT_FAILURE
    try:
        result = engine.embed(inputs.fbank, inputs.masks)
    finally:
        engine.close()
    write_outputs(args.output, result, model.model_id, inputs)
    n, s = result.embeddings.shape[:2]
    print(
        f"embedded {n} chunks x {s} speakers with {engine.name} ({result.math}); "
        f"{int(result.empty.sum())} empty rows; model id {model.model_id}; wrote {args.output}"
    )
    return 0

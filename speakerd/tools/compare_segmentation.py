"""`python -m speakerd.tools.compare_segmentation`: speakerd's hard segmentation against
pyannote's, cell by cell, on real speech; JSON lines.

The acceptance check for any segmentation math: pyannote's diarization reads only the hard
multilabel segmentation (the most likely powerset class per frame, as `Powerset.to_multilabel`),
so a math that moves log-probabilities but never a hard cell leaves every turn where it was.
The reference is PyanNet as pyannote writes it (scripts/anchors/torch_segmentation.py) in FP32
with TF32 off, in pyannote's batches of 32, on the recording's windows as pyannote slides
them (10 s every 1 s, the last one zero-padded). Each engine math segments the same windows
in the server's groups (engine/factory.GPU_SEGMENTATION_WINDOWS on a GPU).

One line per (recording, engine math): cells (window x frame x speaker) and frames whose hard
value differs from pyannote's; of those frames, the ties (pyannote's own top-2 log-probability
margin below `--tie-margin`: FP32 rounding alone decides them, so any two FP32 forwards may
split them); the largest log-probability difference; `ok` when no frame differs outside a
tie. Recordings: the speech file itself and, with `--seconds`, the file tiled to that length
(bench_diarize's hour).

  python -m speakerd.tools.compare_segmentation --audio sample.wav --seconds 3600 --maths fp32,fast
  python -m speakerd.tools.compare_segmentation --audio sample.wav --maths cpu --device cpu  # no GPU
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from speakerd.client.files import read_audio
from speakerd.model.fbank import chunk_starts
from speakerd.model.recording import Encoding, decode_pcm
from speakerd.model.segmentation.architecture import WINDOW_SAMPLES
from speakerd.model.segmentation.powerset import to_multilabel
from speakerd.tools.bench_diarize import tiled

ROOT = Path(__file__).resolve().parents[2]
SAMPLE_RATE = 16000
STEP = SAMPLE_RATE  # pyannote's 1 s step
#: pyannote's segmentation batch size (`segmentation_batch_size`), the reference's batches
TORCH_BATCH = 32
#: a frame whose top-2 log-probabilities are closer than this is a tie (tests/test_gpu_segmentation.py)
TIE_MARGIN = 1e-4
#: engine maths: "cpu" is the NumPy segmenter (engine/cpu_segmenter.py), the others the GPU's
CPU = "cpu"


@dataclass(frozen=True)
class Comparison:
    """One engine math's hard segmentation against the reference's, on one recording."""

    cells: int
    cells_differ: int
    frames_differ: int
    frames_differ_at_ties: int
    ties: int
    max_abs_logp: float | None

    @property
    def ok(self) -> bool:
        return self.frames_differ == self.frames_differ_at_ties


def compare(
    reference_logp: np.ndarray, multilabel: np.ndarray, logp: np.ndarray | None, tie_margin: float
) -> Comparison:
    """`multilabel` [k, 589, 3] (and its log-probabilities, when the engine gives them) against
    the reference's log-probabilities [k, 589, 7]."""
    expected = to_multilabel(reference_logp).astype(np.uint8)
    got = np.asarray(multilabel, dtype=np.uint8)
    assert got.shape == expected.shape, f"multilabel {got.shape}, reference {expected.shape}"
    top2 = np.sort(reference_logp, axis=-1)[..., -2:]
    tie = (top2[..., 1] - top2[..., 0]) < tie_margin
    differ = got != expected
    frames = differ.any(axis=-1)
    return Comparison(
        cells=int(differ.size),
        cells_differ=int(differ.sum()),
        frames_differ=int(frames.sum()),
        frames_differ_at_ties=int((frames & tie).sum()),
        ties=int(tie.sum()),
        max_abs_logp=None if logp is None else float(np.abs(logp - reference_logp).max()),
    )


def recordings(audio: Path, seconds: list[float]) -> Iterator[tuple[str, np.ndarray]]:
    """(name, 16 kHz mono float32 samples): the file, then the file tiled to each length."""
    raw, rate = read_audio(audio)
    if rate != SAMPLE_RATE or raw.shape[1] != 1:
        raise SystemExit(f"--audio {audio}: {rate} Hz, {raw.shape[1]} channel(s); expected 16 kHz mono")
    encoding = Encoding.S16 if raw.dtype == np.int16 else Encoding.F32

    def decoded(pcm: np.ndarray) -> np.ndarray:  # as the server decodes what a client sends
        return decode_pcm(np.ascontiguousarray(pcm, dtype=encoding.value).tobytes(), encoding, 1)[:, 0]

    yield audio.name, decoded(raw)
    for length in seconds:
        yield f"{audio.name} tiled to {length:g} s", decoded(tiled(raw, rate, length))


def reference_log_probs(model, samples: np.ndarray, starts: np.ndarray, device: str) -> np.ndarray:
    """pyannote's PyanNet on the windows at `starts`, batches of TORCH_BATCH: [k, 589, 7]."""
    import torch
    from torch_segmentation import windows  # scripts/anchors, on sys.path (main)

    out = []
    with torch.inference_mode():
        for i in range(0, starts.shape[0], TORCH_BATCH):
            batch = torch.from_numpy(windows(samples, starts[i : i + TORCH_BATCH], WINDOW_SAMPLES)).to(device)
            out.append(model(batch).float().cpu().numpy())
    return np.concatenate(out)


def engine_outputs(
    segmenter, samples: np.ndarray, starts: np.ndarray
) -> tuple[np.ndarray, np.ndarray | None]:
    """(multilabel, log-probabilities or None) of `segmenter` over the windows, in its groups,
    each group's samples cut as the server's SegmentingSource hands them out."""
    labels, logps = [], []
    for i in range(0, starts.shape[0], segmenter.max_windows):
        group = starts[i : i + segmenter.max_windows]
        cut = samples[group[0] : group[-1] + WINDOW_SAMPLES]
        if hasattr(segmenter, "multilabel_log_probs"):  # the GPU segmenter: both from one forward
            multilabel, logp = segmenter.multilabel_log_probs(cut, group - group[0])
            logps.append(logp)
        else:
            multilabel = segmenter.segment(cut, group - group[0]).multilabel
        labels.append(multilabel)
    return np.concatenate(labels), (np.concatenate(logps) if logps else None)


def make_segmenter(math: str, state: dict[str, np.ndarray]):
    """The segmenter the server builds for `math` on the checkpoint's weights."""
    if math == CPU:
        from speakerd.engine.cpu_segmenter import CpuSegmenter
        from speakerd.model.segmentation.weights import prepare

        return CpuSegmenter(prepare(state, "compare"))
    from speakerd.engine.factory import GPU_SEGMENTATION_WINDOWS
    from speakerd.engine.gpu.segmentation.engine import GpuSegmenter

    return GpuSegmenter(state, "compare", max_windows=GPU_SEGMENTATION_WINDOWS, math=math)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m speakerd.tools.compare_segmentation", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--audio", required=True, help="16 kHz mono speech (pyannote.audio's sample.wav)")
    ap.add_argument("--ckpt", default=str(ROOT / ".cache/pyannote/segmentation-3.0/pytorch_model.bin"))
    ap.add_argument(
        "--seconds", default="", help="comma-separated lengths to tile the file to, besides the file itself"
    )
    ap.add_argument("--maths", default="fp32,fast", help=f"engine maths: fp32, fast (GPU) or {CPU} (NumPy)")
    ap.add_argument("--device", default="cuda", help="the reference's torch device")
    ap.add_argument("--tie-margin", type=float, default=TIE_MARGIN)
    args = ap.parse_args(argv)
    import torch

    sys.path.insert(0, str(ROOT / "scripts/anchors"))
    from torch_segmentation import PyanNet, load_state_dict

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    state = load_state_dict(args.ckpt)
    model = PyanNet(state).to(args.device).eval()
    segmenters = {math: make_segmenter(math, state) for math in args.maths.split(",")}
    lengths = [float(v) for v in args.seconds.split(",") if v]
    every_ok = True
    for name, samples in recordings(Path(args.audio), lengths):
        starts = chunk_starts(samples.shape[0], WINDOW_SAMPLES, STEP).astype(np.int64)
        reference = reference_log_probs(model, samples, starts, args.device)
        for math, segmenter in segmenters.items():
            multilabel, logp = engine_outputs(segmenter, samples, starts)
            result = compare(reference, multilabel, logp, args.tie_margin)
            every_ok &= result.ok
            line = {"recording": name, "windows": int(starts.shape[0]), "engine": segmenter.name,
                    "math": math, **result.__dict__, "ok": result.ok}  # fmt: skip
            print(json.dumps(line), flush=True)
    for segmenter in segmenters.values():
        segmenter.close()
    return 0 if every_ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""speakrs 0.7.0 on the same GPU and the same hour: the `diarize` suite's whole-diarization
anchor (`--speakrs DIR`).

speakrs (PyPI `speakrs`, Rust with its own CUDA kernels; segmentation-3.0, WeSpeaker
ResNet34, its own clustering) is the fastest published pyannote-style diarizer. DIR holds what
its offline recipe makes (the project's anchors, `speakrs/README.md` there): the speakrs wheel
(`speakrs-*.whl`), its model directory (`models/`, from `make_model_dir.py`) and `hour.py`,
which tiles a speech clip into an hour, warms speakrs up and times `Pipeline.diarize_samples`.
Here hour.py gets the suite's own hour as its clip (the speech clip tiled as bench_diarize
tiles it, written as 16 kHz PCM16), so speakrs diarizes the audio speakerd diarizes, with
the seeded gain (one factor, within +-3 dB) and the 1e-3 noise hour.py adds to any clip. Both
modes are timed: CUDA (windows every 1 s, as speakerd's) and CUDAFast (every 2 s).
"""

from __future__ import annotations

import tempfile
import wave
from pathlib import Path
from typing import Any

import numpy as np

from speakerd.tools.bench_diarize import tiled
from speakerd.tools.suite.record import anchor, figure
from speakerd.tools.suite.run import Context, json_lines, shown

#: hour.py's modes and what each is, as the records name them.
MODES = {
    "cuda": "speakrs 0.7.0 CUDA (1 s step, its own clustering), same GPU and hour, median of 3",
    "cudafast": "speakrs 0.7.0 CUDAFast (2 s step, its own clustering), same GPU and hour, median of 3",
}
#: Seconds one mode may take: its load, a warm-up minute and three hours at 1-4 s each.
MODE_LIMIT_S = 150
SAMPLE_RATE = 16_000


def hour_wav(speech: Path, seconds: float, out: Path) -> Path:
    """`speech` (16 kHz mono PCM16) tiled to `seconds` by bench_diarize.tiled, written as
    16 kHz mono PCM16 to `out`."""
    with wave.open(str(speech)) as clip:
        if (clip.getframerate(), clip.getnchannels(), clip.getsampwidth()) != (SAMPLE_RATE, 1, 2):
            raise ValueError(f"{speech}: speakrs' hour.py takes 16 kHz mono PCM16")
        samples = np.frombuffer(clip.readframes(clip.getnframes()), "<i2")
    hour_samples = tiled(samples[:, None], SAMPLE_RATE, seconds)[:, 0]
    with wave.open(str(out), "wb") as hour:
        hour.setnchannels(1)
        hour.setsampwidth(2)
        hour.setframerate(SAMPLE_RATE)
        hour.writeframes(hour_samples.astype("<i2").tobytes())
    return out


def cuda_library_path() -> str:
    """The CUDA libraries' folders of this Python's `nvidia` packages (cuDNN, cuBLAS, ...),
    for speakrs' fallbacks that dlopen them, joined for LD_LIBRARY_PATH; "" without them."""
    try:
        import nvidia
    except ImportError:
        return ""
    return ":".join(str(lib) for root in nvidia.__path__ for lib in sorted(Path(root).glob("*/lib")))


def speakrs_hours(ctx: Context, speech: Path, seconds: float) -> dict[str, dict[str, Any]]:
    """Each mode's hour.py line, by mode, recorded as a record of its own; {} (and a skip
    line) without --speakrs or with an incomplete DIR."""
    directory = ctx.options.speakrs
    if not directory:
        ctx.skip("speakrs", "no --speakrs DIR (speakrs' wheel, models/ and hour.py)")
        return {}
    directory = Path(directory)
    wheels = sorted(directory.glob("speakrs-*.whl"))
    script, models = directory / "hour.py", directory / "models"
    if not wheels or not script.is_file() or not models.is_dir():
        ctx.skip("speakrs", f"{directory} lacks speakrs-*.whl, hour.py or models/")
        return {}
    site = Path(tempfile.mkdtemp(prefix="speakrs-"))
    install = ctx.python(
        "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(site), str(wheels[-1])
    )
    ctx.run("speakrs-install", install, 120)
    wav = hour_wav(speech, seconds, site / "hour.wav")
    env = {"PYTHONPATH": str(site), "LD_LIBRARY_PATH": cuda_library_path()}
    lines = {}
    for mode, name in MODES.items():
        argv = ctx.python(str(script), "--model-dir", str(models), "--mode", mode, "--wav", str(wav),
                          "--seconds", f"{seconds:g}", "--runs", "3")  # fmt: skip
        done = ctx.run(f"speakrs-{mode}", argv, MODE_LIMIT_S, env=env, check=False)
        line = (
            json_lines(done.stdout)[-1] if json_lines(done.stdout) else {"error": f"exit {done.returncode}"}
        )
        ok = done.returncode == 0 and "error" not in line
        value = line.get("median_s", 0.0) if ok else 0.0
        ctx.record(name, shown(argv), figure(value, "s", "lower"), detail=line, ok=ok)
        if ok:
            lines[mode] = {**line, "_command": shown(argv)}
    return lines


def speakrs_anchors(lines: dict[str, dict[str, Any]], of: dict[str, Any]) -> list[dict[str, Any]]:
    """The anchors of speakerd's hour figure `of` that speakrs' lines give."""
    return [
        anchor(MODES[mode], line["median_s"], "s", "lower", of, line["_command"])
        for mode, line in lines.items()
    ]

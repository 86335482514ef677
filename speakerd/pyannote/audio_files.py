"""Audio files for a pipeline that cannot decode them: read with soundfile (libsndfile).

pyannote.audio 4 decodes a file path with torchcodec only; where torchcodec does not load
(no FFmpeg libraries, or a build for another torch: the CPU machines this project tests on),
`pipeline("meeting.wav")` fails with "torchcodec is not available" and only an in-memory
`{"waveform", "sample_rate"}` dict works. `use_server` then wraps the pipeline's `apply` (an
instance attribute, as it does `get_embeddings`): a file given by path is read with
soundfile, which the client already depends on (any file libsndfile reads: WAV, FLAC, OGG,
MP3, ...), into the in-memory form pyannote's own `preload=True` gives. Where torchcodec
works, pyannote's decoding is left alone. (pyannote's lazy `preprocessors` cannot do this:
they replace a waveform given in memory too, comparing tensors with `!=`, which raises.)
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from pathlib import Path
from typing import Any

import numpy as np
import soundfile
import torch
from pyannote.audio.core import io as pyannote_io


def pyannote_decodes_files() -> bool:
    """Whether pyannote.audio's own decoder (torchcodec) loaded in this process."""
    return getattr(pyannote_io, "AudioDecoder", None) is not None


def read_into(file: MutableMapping[str, Any]) -> None:
    """A file given by path gets its samples as pyannote's Audio gives them: "waveform"
    float32 (channel, time) in [-1, 1] and "sample_rate". Files in memory, and streams,
    are left as they are."""
    audio = file.get("audio") if "waveform" not in file else None
    if not isinstance(audio, (str, Path)):
        return
    samples, rate = soundfile.read(str(audio), dtype="float32", always_2d=True)
    file["waveform"] = torch.from_numpy(np.ascontiguousarray(samples.T))
    file["sample_rate"] = int(rate)


class FileReadingApply:
    """The `apply` use_server gives a pipeline that cannot decode files: read_into, then the
    pipeline's own `apply`."""

    def __init__(self, pipeline: Any) -> None:
        self.pipeline = pipeline
        self.apply: Callable[..., Any] = type(pipeline).apply.__get__(pipeline)

    def __call__(self, file: MutableMapping[str, Any], *args: Any, **kwargs: Any) -> Any:
        read_into(file)
        return self.apply(file, *args, **kwargs)


def add_file_reader(pipeline: Any) -> bool:
    """Wrap `pipeline.apply` with FileReadingApply when pyannote cannot decode files; True when it did."""
    if pyannote_decodes_files() or isinstance(pipeline.__dict__.get("apply"), FileReadingApply):
        return False
    pipeline.apply = FileReadingApply(pipeline)
    return True


def remove_file_reader(pipeline: Any) -> None:
    """Undo add_file_reader (ServerEmbeddings.detach)."""
    if isinstance(pipeline.__dict__.get("apply"), FileReadingApply):
        del pipeline.__dict__["apply"]

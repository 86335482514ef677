"""The client side of `EmbedRecording`: samples in memory -> a stream of small messages,
the streamed answers -> one `[n, s, 256]` array with its flags and window start times.

Messages stay near PIECE_BYTES (4 MiB) so that no message approaches gRPC's size limit and
the server can work while the rest is in flight: the header (with the frame count, so the
server checks the masks' window count before any engine work), the masks in pieces of
whole windows (6 MB an hour as uint8), then PCM pieces cut on frame boundaries. Masks
first: the server embeds each window as soon as its audio is in, so the embeddings follow
the upload instead of waiting for its end. With `segment=True` there are no masks: the
server segments the recording itself and answers each window's segmentation with its rows.
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import AsyncIterable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from speakerd.client.files import UsageError, read_audio, read_masks, writable
from speakerd.v1 import speakerd_pb2 as pb
from speakerd.v1.tensors import from_tensor, to_tensor

#: Bytes of PCM or masks per message: small next to the 64 MiB message limit, large enough
#: that per-message overhead is small (an hour of 16 kHz s16 is 28 messages). Measured on the
#: H200 through the FP16 server: an hour of 48 kHz stereo took 934 ms in 1 MiB pieces and
#: 781 ms in 4 MiB ones (16 kHz mono: 838 and 720 ms).
PIECE_BYTES = 4 << 20
#: pyannote's Inference step for the pipeline's segmentation: a window every second.
DEFAULT_STEP_S = 1.0

Metadata = tuple[tuple[str, str], ...]


@dataclass
class RecordingEmbeddings:
    """A recording's embeddings in window order, with what served them."""

    embeddings: np.ndarray  # [n, s, 256] float32
    empty: np.ndarray  # [n, s] bool: no mask weight; the row is the model's bias alone
    active_frames: np.ndarray  # [n, s] int32: trunk frames (of 125) with non-zero weight
    starts: np.ndarray  # [n] float64 seconds
    model_id: str
    precision: str
    request_id: str = ""
    plans: list[str] = field(default_factory=list)
    fp16_fallbacks: int = 0
    #: [n, 589, 3] uint8: the server's segmentation (pyannote's get_segmentations, hard
    #: multilabel) when the call asked for it (`segment=True`), else None
    segmentation: np.ndarray | None = None
    segmentation_model_id: str = ""


def _pcm(samples: np.ndarray) -> tuple[np.ndarray, int]:
    """[N] or [N, C] int16 or float -> (little-endian [N, C] array, wire encoding)."""
    samples = np.asarray(samples)
    if samples.ndim == 1:
        samples = samples[:, None]
    if samples.ndim != 2 or samples.shape[0] < 1:
        raise ValueError(f"samples: shape {samples.shape}, expected [N] or [N, channels] with N >= 1")
    if samples.dtype == np.int16:
        return np.ascontiguousarray(samples, dtype="<i2"), pb.AUDIO_ENCODING_PCM_S16LE
    if samples.dtype.kind == "f":
        return np.ascontiguousarray(samples, dtype="<f4"), pb.AUDIO_ENCODING_PCM_F32LE
    raise ValueError(f"samples: dtype {samples.dtype}, expected int16 or float32")


def recording_requests(
    samples: np.ndarray,
    sample_rate: int,
    masks: np.ndarray | None,
    exclude_overlap: bool = False,
    step_s: float = DEFAULT_STEP_S,
    request_id: str = "",
    piece_bytes: int = PIECE_BYTES,
    masks_first: bool = True,
) -> Iterator[pb.EmbedRecordingRequest]:
    """The messages of one call: samples [N] or [N, C] (int16 or float32 in [-1, 1]) at
    `sample_rate`, masks [n, s, F] (float32 or uint8) for the recording's n windows, or None:
    the server segments the recording (`header.segment`) and no masks are sent.
    `masks_first=False` sends them after the audio (what the embeddings' overlap with the
    upload is measured against: `client load --masks-after-audio`)."""
    pcm, encoding = _pcm(samples)
    segment = masks is None
    masks = np.zeros((0, 1, 1), np.uint8) if masks is None else np.asarray(masks)
    if masks.dtype != np.uint8 and np.all((masks == 0) | (masks == 1)):
        # binarized masks (what pyannote's pipeline passes) are exact as uint8: a quarter of
        # float32's bytes, so an hour's masks add 6 MB instead of 25 MB to 115 MB of PCM
        masks = masks.astype(np.uint8)
    yield pb.EmbedRecordingRequest(
        header=pb.RecordingHeader(
            sample_rate=sample_rate,
            channels=pcm.shape[1],
            encoding=encoding,
            step_s=step_s,
            exclude_overlap=exclude_overlap,
            request_id=request_id,
            frames=pcm.shape[0],
            segment=segment,
        )
    )
    windows = int(masks.shape[0])
    rows_per_piece = max(1, piece_bytes // max(1, masks[:1].nbytes))
    rows = (
        pb.EmbedRecordingRequest(
            masks=pb.RecordingMasks(windows=windows, masks=to_tensor(masks[at : at + rows_per_piece]))
        )
        for at in range(0, windows if segment else max(windows, 1), rows_per_piece)
    )
    frames_per_piece = max(1, piece_bytes // (pcm.itemsize * pcm.shape[1]))
    audio = (
        pb.EmbedRecordingRequest(audio=pcm[at : at + frames_per_piece].tobytes())
        for at in range(0, pcm.shape[0], frames_per_piece)
    )
    yield from (itertools.chain(rows, audio) if masks_first else itertools.chain(audio, rows))


def collect(received: Iterable[pb.EmbedRecordingResponse]) -> RecordingEmbeddings:
    """Responses in window order -> one RecordingEmbeddings; ValueError if windows are missing."""
    responses = list(received)
    if not responses:
        raise ValueError("no responses: the call returned no windows")
    expected = 0
    for response in responses:
        if response.first_window != expected:
            raise ValueError(f"response for window {response.first_window}, expected window {expected}")
        expected += len(response.starts)
    if expected != responses[-1].windows:
        raise ValueError(f"{expected} windows answered of {responses[-1].windows}")
    embeddings = np.concatenate([from_tensor(r.embeddings, "embeddings") for r in responses]).astype(
        np.float32
    )
    rows = embeddings.shape[:2]
    last = responses[-1]
    segmented = [r for r in responses if r.HasField("segmentation")]
    if segmented and len(segmented) != len(responses):
        raise ValueError(f"{len(segmented)} of {len(responses)} responses carry a segmentation")
    segmentation = (
        np.concatenate([from_tensor(r.segmentation, "segmentation") for r in responses])
        if segmented
        else None
    )
    return RecordingEmbeddings(
        embeddings=embeddings,
        empty=np.array([e for r in responses for e in r.empty], dtype=bool).reshape(rows),
        active_frames=np.array([a for r in responses for a in r.active_frames], dtype=np.int32).reshape(rows),
        starts=np.array([s for r in responses for s in r.starts], dtype=np.float64),
        model_id=last.model_id,
        precision=last.precision,
        request_id=last.request_id,
        plans=sorted({p for r in responses for p in r.plans}),
        fp16_fallbacks=sum(r.fp16_fallbacks for r in responses),
        segmentation=segmentation,
        segmentation_model_id=last.segmentation_model_id,
    )


def embed_recording(
    stub: Any, requests: Iterator[pb.EmbedRecordingRequest], timeout_s: float, metadata: Metadata
) -> RecordingEmbeddings:
    """Blocking call on a SpeakerEmbeddingStub; the reassembled RecordingEmbeddings."""
    return collect(stub.EmbedRecording(requests, timeout=timeout_s, metadata=metadata))


async def embed_recording_async(
    stub: Any, requests: Iterator[pb.EmbedRecordingRequest], timeout_s: float, metadata: Metadata
) -> RecordingEmbeddings:
    """The same on a grpc.aio channel's SpeakerEmbeddingStub."""
    call = stub.EmbedRecording(_aiter(requests), timeout=timeout_s, metadata=metadata)
    return collect([response async for response in call])


async def _aiter(items: Iterable[pb.EmbedRecordingRequest]) -> AsyncIterable[pb.EmbedRecordingRequest]:
    for item in items:
        yield item


def add_audio_flags(parser: argparse.ArgumentParser, required: bool = False) -> None:
    """`--audio`, `--sample-rate` and `--step`: how every command that takes a recording
    (embed, enroll, identify, voiceprints verify, diarize) reads it, so that a file one
    accepts, and the advice its errors give, hold for all of them. `required`: the command
    takes nothing else (diarize), so its usage shows --audio as required."""
    parser.add_argument(
        "--audio",
        required=required,
        help="a whole recording: WAV, FLAC or any file libsndfile reads, or .npy with --sample-rate",
    )
    parser.add_argument("--sample-rate", type=int, help="with --audio FILE.npy: its sample rate in Hz")
    parser.add_argument("--step", type=float, default=DEFAULT_STEP_S, help="window step in seconds")


def read_recording(args: argparse.Namespace) -> tuple[np.ndarray, int]:
    """(samples, rate) of the audio flags; UsageError naming the flag and file otherwise."""
    return read_audio(args.audio, args.sample_rate)


def configure(embed: argparse.ArgumentParser) -> None:
    """`client embed --audio FILE --masks FILE.npy`: the recording form of the embed command."""
    add_audio_flags(embed)
    embed.add_argument("--masks", help="with --audio: .npy [n, s, F] masks of the recording's n windows")
    embed.add_argument(
        "--segment",
        action="store_true",
        help="with --audio, instead of --masks: the server segments the recording (its segmentation "
        "model, pyannote's get_segmentations) and the output holds the segmentation [n, 589, 3] too",
    )
    embed.add_argument("--exclude-overlap", action="store_true", help="pyannote's embedding_exclude_overlap")


def run(args: argparse.Namespace, client: Any) -> int:
    """Embed `args.audio` under `args.masks` with `client` (a SpeakerClient); write `args.output`.
    Every file is checked before the call (files.py: one line naming it, exit 2)."""
    if bool(args.masks) == bool(args.segment):
        raise UsageError(
            "embed --audio needs --masks FILE.npy ([n, s, F] for the recording's n windows) or --segment "
            "(the server finds them), one of the two"
        )
    output = writable("--output", args.output)
    samples, rate = read_recording(args)
    masks = read_masks(args.masks) if args.masks else None
    result = client.embed_recording(samples, rate, masks, args.exclude_overlap, args.step)
    arrays = {"embeddings": result.embeddings, "empty": result.empty,
              "active_frames": result.active_frames, "starts": result.starts}  # fmt: skip
    if result.segmentation is not None:
        arrays["segmentation"] = result.segmentation
    np.savez(output, **arrays)
    summary = {"output": args.output, "shape": list(result.embeddings.shape), "model_id": result.model_id,
               "precision": result.precision, "empty_rows": int(result.empty.sum())}  # fmt: skip
    if result.segmentation is not None:
        summary["segmentation_model_id"] = result.segmentation_model_id
    print(json.dumps(summary))
    return 0

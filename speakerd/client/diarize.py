"""The client of `speakerd.v1.Diarization` (docs/diarization.md): a recording in, who spoke
when (and by name) out; and the command line's `diarize`.

A recording travels as EmbedRecording's does (the header, then PCM in 4 MiB pieces); the
server segments, embeds, clusters and answers once. The call is retried on UNAVAILABLE and
RESOURCE_EXHAUSTED by sending it again whole (its answer is a pure function of the audio),
like `SpeakerClient.embed_recording`.
"""

from __future__ import annotations

import argparse
import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from speakerd.client import recording
from speakerd.client.client import SpeakerClient
from speakerd.client.files import UsageError, writable
from speakerd.v1 import speakerd_pb2 as pb
from speakerd.v1 import speakerd_pb2_grpc as pb_grpc
from speakerd.v1.tensors import from_tensor

#: Clustering.method's values: speaker-diarization-3.1's clustering and community-1's.
AGGLOMERATIVE = "agglomerative"
VBX = "vbx"
CLUSTERINGS = (AGGLOMERATIVE, VBX)


@dataclass(frozen=True)
class Turn:
    """A speaker's turn: [start_s, end_s) seconds from the recording's start."""

    start_s: float
    end_s: float
    label: str


@dataclass(frozen=True)
class Speaker:
    label: str  # the name with `names` when a voiceprint matched, else the cluster's label
    cluster: str  # pyannote's label, SPEAKER_nn
    centroid: np.ndarray  # [256] float32
    speech_s: float
    speaker_id: str = ""  # the matched voiceprint's speaker ("" when none matched)
    voiceprint_id: str = ""
    score: float = 0.0


@dataclass(frozen=True)
class Diarization:
    """What Diarize answered: pyannote's speaker_diarization and exclusive_speaker_diarization
    as turns, the speakers, the RTTM text, and which models made it."""

    turns: list[Turn]
    exclusive_turns: list[Turn]
    speakers: list[Speaker]
    rttm: str
    windows: int
    model_id: str
    segmentation_model_id: str
    request_id: str = ""
    labels: list[str] = field(default_factory=list)
    #: the PLDA VBx clustered in (GetModelInfo's plda.plda_id); "" for the agglomerative clustering
    plda_id: str = ""


def parse(response: pb.DiarizeResponse) -> Diarization:
    def turns(items: Any) -> list[Turn]:
        return [Turn(t.start_s, t.end_s, t.label) for t in items]

    speakers = [
        Speaker(s.label, s.cluster, from_tensor(s.centroid, "centroid").astype(np.float32), s.speech_s,
                s.speaker_id, s.voiceprint_id, s.score)
        for s in response.speakers
    ]  # fmt: skip
    return Diarization(
        turns(response.turns), turns(response.exclusive_turns), speakers, response.rttm, response.windows,
        response.model_id, response.segmentation_model_id, response.request_id, [s.label for s in speakers],
        response.plda_id,
    )  # fmt: skip


def diarize_requests(
    samples: np.ndarray,
    sample_rate: int,
    header: pb.DiarizeHeader,
    step_s: float,
    exclude_overlap: bool,
    piece_bytes: int = recording.PIECE_BYTES,
) -> Iterator[pb.DiarizeRequest]:
    """The call's messages: `header` with the recording's format (from the samples), then
    the audio, cut as EmbedRecording's is."""
    for message in recording.recording_requests(
        samples, sample_rate, None, exclude_overlap, step_s, piece_bytes=piece_bytes
    ):
        if message.WhichOneof("part") == "header":
            full = pb.DiarizeHeader()
            full.CopyFrom(header)
            full.recording.CopyFrom(message.header)
            yield pb.DiarizeRequest(header=full)
        else:
            yield pb.DiarizeRequest(audio=message.audio)


class DiarizationClient(SpeakerClient):
    """SpeakerClient with Diarize, on the same channel."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._diarization = pb_grpc.DiarizationStub(self._channel)

    def diarize(
        self,
        samples: np.ndarray,
        sample_rate: int,
        *,
        num_speakers: int | None = None,
        min_speakers: int | None = None,
        max_speakers: int | None = None,
        names: bool = False,
        threshold: float | None = None,
        exclude_overlap: bool = False,
        clustering: str = AGGLOMERATIVE,
        clustering_threshold: float | None = None,
        min_cluster_size: int | None = None,
        fa: float | None = None,
        fb: float | None = None,
        step_s: float = recording.DEFAULT_STEP_S,
        uri: str = "",
        timeout_s: float | None = None,
    ) -> Diarization:
        """Who speaks when in a recording [N] or [N, C] (int16 or float32) at `sample_rate`:
        pyannote's SpeakerDiarization on the server; with `names`, speakers matching the
        caller's voiceprints are labelled with their speaker_id.

        clustering: "agglomerative" (speaker-diarization-3.1's, with `clustering_threshold`,
        a cosine distance, and `min_cluster_size`) or "vbx" (speaker-diarization-community-1's,
        on a server started with --plda, with `clustering_threshold`, its AHC cut, and VBx's
        `fa` and `fb`); a parameter left None is the pipeline's own. The server checks them
        (INVALID_ARGUMENT naming the field; vbx without a PLDA is FAILED_PRECONDITION)."""
        header = pb.DiarizeHeader(
            num_speakers=num_speakers or 0, min_speakers=min_speakers or 0, max_speakers=max_speakers or 0,
            names=names, uri=uri,
        )  # fmt: skip
        header.clustering.method = clustering
        if threshold is not None:
            header.threshold = threshold
        if clustering_threshold is not None:
            header.clustering.threshold = clustering_threshold
        if min_cluster_size is not None:
            header.clustering.min_cluster_size = min_cluster_size
        if fa is not None:
            header.clustering.fa = fa
        if fb is not None:
            header.clustering.fb = fb
        request_id = uuid.uuid4().hex[:16]

        def attempt(_: None, timeout: float, metadata: recording.Metadata) -> Diarization:
            messages = diarize_requests(samples, sample_rate, header, step_s, exclude_overlap)
            return parse(self._diarization.Diarize(messages, timeout=timeout, metadata=metadata))

        return self._call(attempt, None, timeout_s, request_id)


# --- the command line -----------------------------------------------------------------------


def configure(parser: argparse.ArgumentParser) -> None:
    """`speakerd-client diarize --audio FILE [--rttm OUT] [--names] [--num-speakers N] ...`."""
    recording.add_audio_flags(parser)
    parser.add_argument("--rttm", help="also write the turns here as RTTM")
    parser.add_argument("--names", action="store_true", help="label speakers with your enrolled voiceprints")
    parser.add_argument("--threshold", type=float, help="cosine for a name (default: the server's)")
    parser.add_argument("--num-speakers", type=int, help="the number of speakers, when known")
    parser.add_argument("--min-speakers", type=int, help="at least this many speakers")
    parser.add_argument("--max-speakers", type=int, help="at most this many speakers")
    parser.add_argument("--exclude-overlap", action="store_true", help="pyannote's embedding_exclude_overlap")
    parser.add_argument(
        "--clustering", choices=CLUSTERINGS, default=AGGLOMERATIVE,
        help="agglomerative (the default, pyannote/speaker-diarization-3.1's) or vbx (community-1's; "
        "the server needs --plda)",
    )  # fmt: skip
    parser.add_argument(
        "--clustering-threshold", type=float,
        help="agglomerative: the cosine distance clusters merge under (3.1's 0.7046); vbx: the distance "
        "its AHC start is cut at (community-1's 0.6)",
    )  # fmt: skip
    for flag, default in (("fa", "0.07"), ("fb", "0.8")):
        vbx_help = f"with --clustering vbx: VBx's {flag.capitalize()} (community-1's {default})"
        parser.add_argument(f"--{flag}", type=float, help=vbx_help)
    parser.add_argument(
        "--uri", default="", help="the recording's name in the RTTM (default: the file's stem)"
    )


def run(args: argparse.Namespace, client: DiarizationClient) -> int:
    """Diarize `args.audio`; print a JSON summary (speakers, turns), write `--rttm`."""
    from pathlib import Path

    rttm = writable("--rttm", args.rttm) if args.rttm else None
    if not args.audio:
        raise UsageError("diarize needs --audio FILE (a recording)")
    samples, rate = recording.read_recording(args)
    for flag in ("num_speakers", "min_speakers", "max_speakers"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UsageError(f"--{flag.replace('_', '-')} {value}: expected 1 or more")
    for flag in ("fa", "fb"):
        if getattr(args, flag) is not None and args.clustering != VBX:
            raise UsageError(f"--{flag} is VBx's: give it with --clustering {VBX}")
    result = client.diarize(
        samples, rate, num_speakers=args.num_speakers, min_speakers=args.min_speakers,
        max_speakers=args.max_speakers, names=args.names, threshold=args.threshold,
        exclude_overlap=args.exclude_overlap, clustering=args.clustering,
        clustering_threshold=args.clustering_threshold, fa=args.fa, fb=args.fb, step_s=args.step,
        uri=args.uri or Path(args.audio).stem,
    )  # fmt: skip
    if rttm is not None:
        Path(rttm).write_text(result.rttm)
    summary = {
        "speakers": [
            {
                "label": s.label,
                "speech_s": round(s.speech_s, 2),
                **({"speaker_id": s.speaker_id} if s.speaker_id else {}),
            }
            for s in result.speakers
        ],
        "turns": len(result.turns),
        "windows": result.windows,
        "clustering": args.clustering,
        **({"plda_id": result.plda_id} if result.plda_id else {}),
        **({"rttm": args.rttm} if args.rttm else {}),
    }
    print(json.dumps(summary))
    return 0

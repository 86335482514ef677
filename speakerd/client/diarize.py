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
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np

from speakerd.client import recording
from speakerd.client.client import SpeakerClient
from speakerd.client.files import UsageError, writable
from speakerd.client.progress import Progress, ProgressLine
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
        #: False once the server answered DiarizeWithProgress UNIMPLEMENTED (an older speakerd)
        self._progress_served = True

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
        progress: Callable[[Progress], None] | None = None,
    ) -> Diarization:
        """Who speaks when in a recording [N] or [N, C] (int16 or float32) at `sample_rate`:
        pyannote's SpeakerDiarization on the server; with `names`, speakers matching the
        caller's voiceprints are labelled with their speaker_id.

        clustering: "agglomerative" (speaker-diarization-3.1's, with `clustering_threshold`,
        a cosine distance, and `min_cluster_size`) or "vbx" (speaker-diarization-community-1's,
        on a server started with --plda, with `clustering_threshold`, its AHC cut, and VBx's
        `fa` and `fb`); a parameter left None is the pipeline's own. The server checks them
        (INVALID_ARGUMENT naming the field; vbx without a PLDA is FAILED_PRECONDITION).

        progress: called with each Progress the server sends while it works
        (DiarizeWithProgress); a server without that method (UNIMPLEMENTED) is asked with
        Diarize instead, and `progress` is not called."""
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
            if progress is not None and self._progress_served:
                try:
                    return self._with_progress(messages, timeout, metadata, progress)
                except grpc.RpcError as error:
                    if error.code() != grpc.StatusCode.UNIMPLEMENTED:
                        raise
                    self._progress_served = False  # an older server: Diarize alone, from now on
                messages = diarize_requests(samples, sample_rate, header, step_s, exclude_overlap)
            return parse(self._diarization.Diarize(messages, timeout=timeout, metadata=metadata))

        return self._call(attempt, None, timeout_s, request_id)

    def _with_progress(
        self,
        messages: Iterator[pb.DiarizeRequest],
        timeout: float,
        metadata: recording.Metadata,
        progress: Callable[[Progress], None],
    ) -> Diarization:
        events = self._diarization.DiarizeWithProgress(messages, timeout=timeout, metadata=metadata)
        for event in events:
            if event.HasField("result"):
                return parse(event.result)
            step = event.progress
            progress(Progress(step.stage, int(step.windows_done), int(step.windows), step.elapsed_s))
        raise RuntimeError("DiarizeWithProgress ended without a result")


# --- the command line -----------------------------------------------------------------------


def configure(parser: argparse.ArgumentParser) -> None:
    """`speakerd-client diarize --audio FILE [--rttm OUT] [--json] [--names] [--num-speakers N] ...`."""
    recording.add_audio_flags(parser, required=True)
    parser.add_argument("--rttm", help="also write the turns here as RTTM")
    parser.add_argument(
        "--json", action="store_true", help="print JSON (every turn, the speakers) instead of the table"
    )
    parser.add_argument(
        "--no-progress", action="store_true", help="no progress on stderr (shown after a few seconds)"
    )
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
        "--uri", default="",
        help="the recording's name in the RTTM (default: the file's stem, each run of whitespace an _)",
    )  # fmt: skip


def run(args: argparse.Namespace, client: DiarizationClient) -> int:
    """Diarize `args.audio`: the turns as a table (or `--json`), progress on stderr while it
    works, `--rttm` written; a note on stderr when the server's models are synthetic."""
    from pathlib import Path

    rttm = writable("--rttm", args.rttm) if args.rttm else None
    samples, rate = recording.read_recording(args)
    for flag in ("num_speakers", "min_speakers", "max_speakers"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UsageError(f"--{flag.replace('_', '-')} {value}: expected 1 or more")
    for flag in ("fa", "fb"):
        if getattr(args, flag) is not None and args.clustering != VBX:
            raise UsageError(f"--{flag} is VBx's: give it with --clustering {VBX}")
    shown = ProgressLine("diarize", enabled=not args.no_progress)
    try:
        result = client.diarize(
            samples, rate, num_speakers=args.num_speakers, min_speakers=args.min_speakers,
            max_speakers=args.max_speakers, names=args.names, threshold=args.threshold,
            exclude_overlap=args.exclude_overlap, clustering=args.clustering,
            clustering_threshold=args.clustering_threshold, fa=args.fa, fb=args.fb, step_s=args.step,
            uri=args.uri or "_".join(Path(args.audio).stem.split()), progress=shown.update,
        )  # fmt: skip
    finally:
        shown.close()
    if rttm is not None:
        Path(rttm).write_text(result.rttm)
    audio_s = samples.shape[0] / rate
    if args.json:
        print(json.dumps(as_json(result, args, audio_s)))
    else:
        print(table(result, args.names, audio_s, args.rttm))
    synthetic = synthetic_models(client)
    if synthetic:
        print(f"diarize: note: the server's {synthetic} synthetic (random weights for trying the service): "
              "these turns and speakers mean nothing; serve real weights (README, Real weights)",
              file=sys.stderr)  # fmt: skip
    return 0


#: Seconds of audio in one segmentation window: a recording shorter than this is one window,
#: padded with silence, as pyannote pads it.
WINDOW_S = 10.0


def why_none(audio_s: float) -> str:
    """Why a recording may have no speaker: what the user can check."""
    why = "the segmentation found no speech above its threshold"
    if audio_s < WINDOW_S:
        why += f" (the recording is shorter than one {WINDOW_S:g} s window)"
    return why


def table(result: Diarization, names: bool, audio_s: float, rttm: str | None) -> str:
    """Who spoke when, one turn a line (start, end, speaker; with `names` the speaker's best
    voiceprint score), then a summary line."""
    scores = {s.label: s.score for s in result.speakers}
    width = max([len("speaker"), *(len(t.label) for t in result.turns)])
    lines = []
    if result.turns:
        lines.append(f"{'start':>9} {'end':>9}  {'speaker':<{width}}" + ("  score" if names else ""))
        for turn in result.turns:
            line = f"{turn.start_s:9.3f} {turn.end_s:9.3f}  {turn.label:<{width}}"
            if names and turn.label in scores:
                line += f"  {scores[turn.label]:.3f}"
            lines.append(line.rstrip())
    if result.speakers:
        spoken = ", ".join(f"{s.label} {s.speech_s:.1f} s" for s in result.speakers)
        summary = (f"{len(result.speakers)} speakers ({spoken}), {len(result.turns)} turns, "
                   f"{result.windows} windows, {audio_s:.1f} s of audio")  # fmt: skip
    else:
        found = f"no speaker found in {audio_s:.1f} s of audio ({result.windows} windows)"
        summary = f"{found}: {why_none(audio_s)}"
    if rttm:
        summary += f"; RTTM in {rttm}"
    return "\n".join([*lines, summary])


def as_json(result: Diarization, args: argparse.Namespace, audio_s: float) -> dict[str, Any]:
    """Every turn and speaker, the recording's windows and seconds, how it was clustered."""
    speakers = []
    for s in result.speakers:
        speaker: dict[str, Any] = {"label": s.label, "cluster": s.cluster, "speech_s": round(s.speech_s, 3)}
        if args.names:
            speaker.update(score=round(s.score, 6), speaker_id=s.speaker_id)
        speakers.append(speaker)
    found = {
        "turns": [
            {"start": round(t.start_s, 3), "end": round(t.end_s, 3), "speaker": t.label} for t in result.turns
        ],
        "speakers": speakers,
        "windows": result.windows,
        "audio_s": round(audio_s, 3),
        "clustering": args.clustering,
        **({"plda_id": result.plda_id} if result.plda_id else {}),
        **({"rttm": args.rttm} if args.rttm else {}),
    }
    if not result.speakers:
        found["why"] = why_none(audio_s)
    return found


def synthetic_models(client: SpeakerClient) -> str:
    """Which of the server's models are the built-in synthetic ones ("" when none, or when
    GetModelInfo does not answer: the note is a courtesy, never a failure)."""
    try:
        info = client.model_info()
    except grpc.RpcError:
        return ""
    which = [name for name, source in (("embedding model", info.source),
             ("segmentation model", info.segmentation.source)) if source.synthetic]  # fmt: skip
    return " and ".join(which) + (" are" if len(which) > 1 else " is") if which else ""

"""The client of `speakerd.v1.Voiceprints` (docs/voiceprints.md): enroll speakers from a
recording, identify or verify them, list and delete voiceprints; and the command line's
`enroll`, `identify` and `voiceprints list|delete|verify` commands.

A recording travels as EmbedRecording's does (header, masks, then PCM in 4 MiB pieces).
Without masks the server takes `segments` of speech, or (`segment=True`) the speech its own
segmentation finds, or the whole audio. Every call is
retried on UNAVAILABLE (a replica draining, a database down: the server wrote nothing) by
sending it again whole, like `SpeakerClient.embed_recording`.
"""

from __future__ import annotations

import argparse
import json
import sys
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import grpc
import numpy as np
from google.protobuf.json_format import MessageToDict

from speakerd.client import recording
from speakerd.client.client import SpeakerClient
from speakerd.client.files import read_masks
from speakerd.client.options import add_connection_flags, client_kwargs
from speakerd.client.outcome import CALL_FAILED_EXIT
from speakerd.v1 import speakerd_pb2 as pb
from speakerd.v1 import speakerd_pb2_grpc as pb_grpc
from speakerd.v1.tensors import to_tensor

R = TypeVar("R")


class VoiceprintClient(SpeakerClient):
    """SpeakerClient with the Voiceprints methods, on the same channel."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._voiceprints = pb_grpc.VoiceprintsStub(self._channel)

    def _stream(self, method: str, messages: Any, timeout_s: float | None) -> Any:
        """Call client-streaming `method` with the messages `messages()` makes (again on a retry)."""
        request_id = uuid.uuid4().hex[:16]
        stub = getattr(self._voiceprints, method)

        def attempt(_: None, timeout: float, metadata: recording.Metadata) -> Any:
            return stub(messages(), timeout=timeout, metadata=metadata)

        return self._call(attempt, None, timeout_s, request_id)

    def enroll(
        self,
        speaker_id: str,
        samples: np.ndarray,
        sample_rate: int,
        masks: np.ndarray | None = None,
        segments: Sequence[tuple[float, float]] = (),
        replace: bool = False,
        step_s: float = recording.DEFAULT_STEP_S,
        timeout_s: float | None = None,
        segment: bool = False,
    ) -> pb.EnrollResponse:
        """Enroll `speaker_id` from a recording [N] or [N, C] of them: masks [n, 1, F] of its
        windows, or speech `segments` in seconds, or (`segment`) the frames where the server's
        segmentation hears one speaker, or (none of these) the whole audio."""

        check_speech(masks, segments, segment)

        def messages() -> Iterator[pb.EnrollRequest]:
            parts = speech_parts(samples, sample_rate, masks, segments, step_s, segment)
            return _requests(
                pb.EnrollRequest,
                parts,
                lambda speech: pb.EnrollHeader(speaker_id=speaker_id, speech=speech, replace=replace),
            )

        return self._stream("Enroll", messages, timeout_s)

    def identify(
        self,
        embeddings: np.ndarray | None = None,
        samples: np.ndarray | None = None,
        sample_rate: int = 0,
        masks: np.ndarray | None = None,
        segments: Sequence[tuple[float, float]] = (),
        top_k: int = 1,
        threshold: float | None = None,
        step_s: float = recording.DEFAULT_STEP_S,
        timeout_s: float | None = None,
        segment: bool = False,
    ) -> pb.IdentifyResponse:
        """The best voiceprints for each row of `embeddings` [m, 256], or for each speaker
        (mask column) of a recording."""

        check_speech(masks, segments, segment)

        def messages() -> Iterator[pb.IdentifyRequest]:
            parts = _query(embeddings, samples, sample_rate, masks, segments, step_s, segment)
            return _requests(
                pb.IdentifyRequest,
                parts,
                lambda speech: pb.IdentifyHeader(speech=speech, top_k=top_k, threshold=threshold),
            )

        return self._stream("Identify", messages, timeout_s)

    def verify(
        self,
        voiceprint_id: str,
        embedding: np.ndarray | None = None,
        samples: np.ndarray | None = None,
        sample_rate: int = 0,
        masks: np.ndarray | None = None,
        segments: Sequence[tuple[float, float]] = (),
        threshold: float | None = None,
        step_s: float = recording.DEFAULT_STEP_S,
        timeout_s: float | None = None,
        segment: bool = False,
    ) -> pb.VerifyResponse:
        """Score one voiceprint against an embedding [256] / [1, 256] or a recording of one speaker."""
        rows = None if embedding is None else np.asarray(embedding, np.float32).reshape(1, -1)

        check_speech(masks, segments, segment)

        def messages() -> Iterator[pb.VerifyRequest]:
            parts = _query(rows, samples, sample_rate, masks, segments, step_s, segment)
            return _requests(
                pb.VerifyRequest,
                parts,
                lambda speech: pb.VerifyHeader(
                    voiceprint_id=voiceprint_id, speech=speech, threshold=threshold
                ),
            )

        return self._stream("Verify", messages, timeout_s)

    def list_voiceprints(self, timeout_s: float | None = None) -> list[pb.Voiceprint]:
        response = self._call(self._voiceprints.ListVoiceprints, pb.ListVoiceprintsRequest(), timeout_s,
                              uuid.uuid4().hex[:16])  # fmt: skip
        return list(response.voiceprints)

    def delete_voiceprint(
        self, voiceprint_id: str, timeout_s: float | None = None
    ) -> pb.DeleteVoiceprintResponse:
        request = pb.DeleteVoiceprintRequest(voiceprint_id=voiceprint_id)
        return self._call(self._voiceprints.DeleteVoiceprint, request, timeout_s, uuid.uuid4().hex[:16])


def check_speech(masks: np.ndarray | None, segments: Sequence[tuple[float, float]], segment: bool) -> None:
    """ValueError before any call when the speech is given twice (a generator's error would
    only surface inside gRPC's request iterator, as UNKNOWN)."""
    if segment and (masks is not None or segments):
        raise ValueError("segment: the server finds the speech itself; give no masks or segments with it")


def speech_parts(
    samples: np.ndarray,
    sample_rate: int,
    masks: np.ndarray | None,
    segments: Sequence[tuple[float, float]],
    step_s: float,
    segment: bool = False,
) -> Iterator[tuple[str, Any]]:
    """("header", SpeechHeader) then ("masks", RecordingMasks) and ("audio", bytes) parts of a
    recording, cut as EmbedRecording's messages are (recording.recording_requests). Without
    masks only the audio travels: the server builds the masks from the segments (or the
    whole audio), or with `segment` finds the speech itself."""
    messages = recording.recording_requests(samples, sample_rate, masks, step_s=step_s)
    spans = [pb.SpeechSegment(start_s=start, end_s=end) for start, end in segments]
    for message in messages:
        part = message.WhichOneof("part")
        if part == "header":
            message.header.segment = segment
            yield "header", pb.SpeechHeader(recording=message.header, segments=spans)
        else:
            yield part, getattr(message, part)


def _requests(
    kind: Callable[..., R], parts: Iterator[tuple[str, Any]], header: Callable[[pb.SpeechHeader], object]
) -> Iterator[R]:
    """A call's messages of type `kind`: the speech header wrapped in the method's own header
    (`header`), then the recording's parts (audio, masks) as they are."""
    for part, value in parts:
        yield kind(header=header(value)) if part == "header" else kind(**{part: value})


def _query(
    embeddings: np.ndarray | None,
    samples: np.ndarray | None,
    sample_rate: int,
    masks: np.ndarray | None,
    segments: Sequence[tuple[float, float]],
    step_s: float,
    segment: bool = False,
) -> Iterator[tuple[str, Any]]:
    if (embeddings is None) == (samples is None):
        raise ValueError("give embeddings, or samples (with sample_rate, and masks or segments)")
    if embeddings is not None:
        yield "header", pb.SpeechHeader(embeddings=to_tensor(np.asarray(embeddings, np.float32)))
        return
    assert samples is not None
    yield from speech_parts(samples, sample_rate, masks, segments, step_s, segment)


# --- the command line -----------------------------------------------------------------------


def parse_segments(text: str) -> list[tuple[float, float]]:
    """'0-3.5,7-9.25' -> [(0, 3.5), (7, 9.25)]; ValueError naming the flag otherwise."""
    try:
        spans = [tuple(float(x) for x in item.split("-")) for item in text.split(",") if item.strip()]
        if all(len(span) == 2 for span in spans):
            return [(span[0], span[1]) for span in spans]
    except ValueError:
        pass
    raise ValueError(f"--segments {text!r}: expected START-END seconds, comma-separated (e.g. 0-3.5,7-9)")


def _speech_flags(parser: argparse.ArgumentParser, column_help: str) -> None:
    recording.add_audio_flags(parser)  # the same --audio, --sample-rate and --step as embed
    parser.add_argument("--masks", help=".npy [n, s, F] masks of the recording's n windows (segmentation)")
    parser.add_argument("--column", type=int, help=column_help)
    parser.add_argument(
        "--segments", type=parse_segments, default=[], help="without --masks: speech, e.g. 0-3.5,7-9"
    )
    parser.add_argument(
        "--segment",
        action="store_true",
        help="without --masks or --segments: the server's segmentation finds the speech (the frames "
        "where exactly one speaker talks)",
    )


def _speech(args: argparse.Namespace, one_speaker: bool) -> dict[str, Any]:
    """The recording keyword arguments of the client's methods from the flags."""
    if not args.audio:
        raise ValueError("give --audio FILE (with --masks FILE.npy, --segments, or neither for all of it)")
    samples, rate = recording.read_recording(args)
    masks = None
    if args.masks:
        masks = read_masks(args.masks)
        if args.column is not None:
            if not 0 <= args.column < masks.shape[1]:
                raise ValueError(f"--column {args.column}: expected 0..{masks.shape[1] - 1}")
            masks = masks[:, args.column : args.column + 1]
        elif one_speaker and masks.shape[1] != 1:
            raise ValueError(f"--masks {args.masks} has {masks.shape[1]} speakers: pick one with --column")
    elif args.column is not None:
        raise ValueError("--column picks a speaker of --masks: give --masks too")
    if args.segment and (args.masks or args.segments):
        raise ValueError(
            "--segment: the server finds the speech itself; give no --masks or --segments with it"
        )
    return {
        "samples": samples,
        "sample_rate": rate,
        "masks": masks,
        "segments": args.segments,
        "step_s": args.step,
        "segment": args.segment,
    }


def _print(message: Any) -> None:
    print(
        json.dumps(
            MessageToDict(
                message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
            )
        )
    )


def _enroll(args: argparse.Namespace) -> int:
    speech = _speech(args, one_speaker=True)
    with VoiceprintClient(args.target, timeout_s=args.timeout, **client_kwargs(args)) as client:
        try:
            _print(client.enroll(args.speaker_id, replace=args.replace, **speech))
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.ALREADY_EXISTS:
                raise
            message = " ".join(str(error.details()).split()).replace("set replace", "add --replace")
            print(f"speakerd-client enroll: {message}", file=sys.stderr)
            return CALL_FAILED_EXIT
    return 0


def _identify(args: argparse.Namespace) -> int:
    query: dict[str, Any] = (
        {"embeddings": np.load(args.embeddings)} if args.embeddings else _speech(args, False)
    )
    with VoiceprintClient(args.target, timeout_s=args.timeout, **client_kwargs(args)) as client:
        _print(client.identify(top_k=args.top_k, threshold=args.threshold, **query))
    return 0


def _verify(args: argparse.Namespace) -> int:
    query: dict[str, Any] = (
        {"embedding": np.load(args.embeddings)} if args.embeddings else _speech(args, True)
    )
    with VoiceprintClient(args.target, timeout_s=args.timeout, **client_kwargs(args)) as client:
        _print(client.verify(args.voiceprint_id, threshold=args.threshold, **query))
    return 0


def _list(args: argparse.Namespace) -> int:
    with VoiceprintClient(args.target, timeout_s=args.timeout, **client_kwargs(args)) as client:
        _print(pb.ListVoiceprintsResponse(voiceprints=client.list_voiceprints()))
    return 0


def _delete(args: argparse.Namespace) -> int:
    with VoiceprintClient(args.target, timeout_s=args.timeout, **client_kwargs(args)) as client:
        _print(client.delete_voiceprint(args.voiceprint_id))
    return 0


#: A recording's upload and embedding on the CPU engine take seconds to minutes.
TIMEOUT_S = 300.0


def configure(sub: Any) -> None:
    """Add `enroll`, `identify` and `voiceprints list|delete|verify` to the client's subcommands."""
    enroll = sub.add_parser("enroll", help="enroll a speaker from a recording: prints the voiceprint as JSON")
    enroll.add_argument("--speaker-id", required=True, help="your name for the speaker")
    enroll.add_argument("--replace", action="store_true", help="replace the speaker's voiceprint if enrolled")
    _speech_flags(enroll, "with --masks: the speaker's column (0-based)")
    enroll.set_defaults(func=_enroll)
    identify = sub.add_parser(
        "identify", help="the enrolled speakers of a recording's mask columns, or of embeddings"
    )
    _speech_flags(identify, "with --masks: only this column")
    identify.add_argument("--embeddings", help="instead of --audio: .npy [m, 256] rows to identify")
    identify.add_argument("--top-k", type=int, default=1, help="matches per row")
    identify.add_argument(
        "--threshold", type=float, help="cosine under which a row is unknown (server default)"
    )
    identify.set_defaults(func=_identify)
    group = sub.add_parser("voiceprints", help="list, delete or verify enrolled voiceprints")
    actions = group.add_subparsers(dest="action", required=True)
    listing = actions.add_parser("list", help="this token's voiceprints as JSON")
    listing.set_defaults(func=_list)
    delete = actions.add_parser("delete", help="erase a voiceprint for good")
    delete.add_argument("voiceprint_id")
    delete.set_defaults(func=_delete)
    verify = actions.add_parser("verify", help="score a recording of one speaker against a voiceprint")
    verify.add_argument("voiceprint_id")
    _speech_flags(verify, "with --masks: the speaker's column (0-based)")
    verify.add_argument("--embeddings", help="instead of --audio: .npy [256] or [1, 256]")
    verify.add_argument("--threshold", type=float, help="cosine at or above which it is accepted")
    verify.set_defaults(func=_verify)
    for command in (enroll, identify, listing, delete, verify):
        add_connection_flags(command, timeout_s=TIMEOUT_S)

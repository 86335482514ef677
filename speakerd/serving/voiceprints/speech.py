"""The speech an Enroll, Identify or Verify call brings -> one pooled unit row per speaker.

A call's stream is a SpeechHeader (`recording` or `embeddings`), then, for a recording,
audio pieces and masks messages as EmbedRecording takes them. The recording goes through
EmbedRecording's own path (RecordingService.windows: the same decoding, resampling, fbank
and batcher), and each mask column's window embeddings are pooled into one row
(speakerd.model.voiceprint). Masks are the caller's; or, with `recording.segment`, the
frames where the server's segmentation hears exactly one speaker; or built at the end of the
audio from `segments` (or the whole audio when there are none), so that no masks must be
computed to enroll a clean recording of one speaker.

While the audio passes, its peak is measured: silent audio (SILENCE_PEAK) is refused
whatever the masks say. Nothing here logs audio or vectors.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import numpy as np

from speakerd.model.architecture import EMBEDDING_DIM, SAMPLE_RATE
from speakerd.model.inputs import InputError
from speakerd.model.recording import step_samples, window_count
from speakerd.model.resample import output_length
from speakerd.model.voiceprint import (
    SILENCE_PEAK,
    check_segments,
    normalize,
    pool,
    segment_masks,
    single_speaker_speech,
    speech_seconds,
)
from speakerd.serving.api.recording import DEFAULT_STEP_S, ENCODINGS, RecordingService
from speakerd.v1 import speakerd_pb2 as pb
from speakerd.v1.tensors import TensorError, from_tensor, to_tensor


@dataclass(frozen=True)
class Speech:
    """One row per query speaker: unit vectors, or None for a column without enough speech."""

    rows: list[np.ndarray | None]  # [D] float32 unit vectors
    speech_s: list[float]  # per row; 0 for embeddings
    windows: list[int]
    quality: list[float]
    model_id: str


async def collect(
    header: pb.SpeechHeader,
    rest: AsyncIterator[tuple[str, object]],
    recordings: RecordingService,
    context: grpc.aio.ServicerContext,
    max_columns: int,
    model_id: str,
) -> Speech:
    """`rest`: the call's remaining (part name, value) pairs. `max_columns`: mask columns
    (speakers) the method takes, 1 for Enroll and Verify."""
    kind = header.WhichOneof("query")
    if kind == "embeddings":
        async for part, _ in rest:
            raise InputError(part, "not with speech.embeddings: send a recording, or embeddings alone")
        return _embedded(header.embeddings, max_columns, model_id)
    if kind != "recording":
        raise InputError(
            "speech", "set speech.recording (then audio and masks) or speech.embeddings [m, 256]"
        )
    segments = [(s.start_s, s.end_s) for s in header.segments]
    check_segments(segments)
    segmenting = header.recording.segment
    if segmenting and segments:
        raise InputError(
            "speech.segments", "not with speech.recording.segment: the server finds the speech itself"
        )
    feed = _Feed(header.recording, segments, rest)
    rows: list[np.ndarray] = []
    active: list[np.ndarray] = []
    found: list[np.ndarray] = []  # with segment: the masks the server's segmentation gave
    served_by = model_id
    masks_of = single_speaker_speech if segmenting else None
    async for response in recordings.windows(feed.messages(), context, masks_of):
        rows.append(from_tensor(response.embeddings, "embeddings").astype(np.float32))
        active.append(np.asarray(response.active_frames, np.int32).reshape(rows[-1].shape[:2]))
        served_by = response.model_id or served_by
        if segmenting:
            found.append(single_speaker_speech(from_tensor(response.segmentation, "segmentation")))
    masks = np.concatenate(found).astype(np.float32) if segmenting else feed.masks()
    columns = masks.shape[1]
    if columns > max_columns:
        raise InputError("masks.masks", f"{columns} speakers, expected [n, {max_columns}, F]")
    embeddings, counts = np.concatenate(rows), np.concatenate(active)
    duration = feed.samples_16k / SAMPLE_RATE
    step_s = feed.step / SAMPLE_RATE
    speech = Speech([], [], [], [], served_by)
    for column in range(columns):
        pooled = pool(embeddings[:, column], counts[:, column])
        speech.rows.append(None if pooled is None else pooled.vector)
        speech.windows.append(0 if pooled is None else pooled.windows)
        speech.quality.append(0.0 if pooled is None else pooled.quality)
        seconds = speech_seconds(masks[:, column], step_s, duration) if pooled is not None else 0.0
        speech.speech_s.append(seconds)
    return speech


def _embedded(tensor: pb.Tensor, max_rows: int, model_id: str) -> Speech:
    try:
        rows = from_tensor(tensor, "speech.embeddings")
    except TensorError as error:
        raise InputError(error.field, error.message) from error
    if rows.ndim != 2 or rows.shape[1] != EMBEDDING_DIM or not 1 <= rows.shape[0] <= max_rows:
        expected = "[1, 256]" if max_rows == 1 else f"[m, {EMBEDDING_DIM}] with 1 <= m <= {max_rows}"
        raise InputError("speech.embeddings", f"shape {list(rows.shape)}, expected {expected}")
    unit = normalize(rows, "speech.embeddings")
    return Speech(list(unit), [0.0] * len(unit), [0] * len(unit), [0.0] * len(unit), model_id)


class _Feed:
    """Turns the call's parts into EmbedRecording messages, measuring the audio on the way
    and keeping the masks (given, or built from the segments at the end)."""

    def __init__(
        self,
        header: pb.RecordingHeader,
        segments: list[tuple[float, float]],
        rest: AsyncIterator[tuple[str, object]],
    ) -> None:
        self.header = header
        self.segments = segments
        self.rest = rest
        self.step = step_samples(header.step_s or DEFAULT_STEP_S, "speech.recording.step_s")
        encoding = ENCODINGS.get(header.encoding)
        self.dtype = np.dtype(encoding.value) if encoding is not None else None
        self.frames = 0
        self.peak = 0.0
        self._carry = b""  # bytes of an incomplete sample: pieces may split anywhere
        self._given: list[np.ndarray] = []
        self._built: np.ndarray | None = None
        self.samples_16k = 0

    async def messages(self) -> AsyncIterator[pb.EmbedRecordingRequest]:
        yield pb.EmbedRecordingRequest(header=self.header)
        async for part, value in self.rest:
            if part == "audio":
                assert isinstance(value, bytes)
                self._measure(value)
                yield pb.EmbedRecordingRequest(audio=value)
            elif part == "masks":
                assert isinstance(value, pb.RecordingMasks)
                if self.segments:
                    raise InputError("masks", "not with speech.segments: send masks or segments, not both")
                if value.HasField("masks"):
                    self._given.append(np.array(from_tensor(value.masks, "masks.masks")))
                yield pb.EmbedRecordingRequest(masks=value)
            else:
                raise InputError("header", "sent twice; one header, then audio pieces and masks")
        self._finish()
        if not self._given and not self.header.segment:
            windows = window_count(self.samples_16k, self.step)
            whole = [(0.0, self.samples_16k / SAMPLE_RATE)]
            self._built = segment_masks(self.segments or whole, windows, self.step / SAMPLE_RATE)
            yield pb.EmbedRecordingRequest(
                masks=pb.RecordingMasks(windows=windows, masks=to_tensor(self._built))
            )

    def _measure(self, piece: bytes) -> None:
        if self.dtype is None:
            return  # the recording path refuses the header's encoding
        data = self._carry + piece
        usable = len(data) - len(data) % self.dtype.itemsize
        self._carry = data[usable:]
        samples = np.frombuffer(data[:usable], self.dtype)
        if samples.size:
            scale = 32768.0 if self.dtype.kind == "i" else 1.0
            self.peak = max(self.peak, float(np.abs(samples.astype(np.float32)).max()) / scale)
        self.frames += samples.size // max(1, self.header.channels)

    def _finish(self) -> None:
        if self.frames == 0:
            raise InputError("audio", "no audio received; expected a recording with speech")
        if self.peak < SILENCE_PEAK:
            db = 20 * np.log10(max(self.peak, 1e-10))
            raise InputError(
                "audio",
                f"silent: peak {db:.0f} dBFS, expected speech above {20 * np.log10(SILENCE_PEAK):.0f} dBFS",
            )
        rate = self.header.sample_rate
        self.samples_16k = output_length(self.frames, rate, SAMPLE_RATE) if rate > 0 else 0

    def masks(self) -> np.ndarray:
        """[n, s, F] float32: the masks the windows were embedded under."""
        if self._built is not None:
            return self._built.astype(np.float32)
        return np.concatenate(self._given).astype(np.float32)

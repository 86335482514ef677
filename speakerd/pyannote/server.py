"""`use_server(pipeline, target)`: a pyannote.audio `SpeakerDiarization` pipeline whose
embedding step (and, with `segmentation=True`, its segmentation step too) runs on a speakerd
server.

pyannote.audio 4.0.7's `SpeakerDiarization.get_embeddings` crops every (window, local
speaker) pair out of the file and runs the whole ResNet34 on each, inactive speakers included:
three trunks per 10 s window, each on a fresh fbank. Here the file's audio goes to the
server once, with the pipeline's binarized segmentations as masks, through `EmbedRecording`;
the server computes each window's trunk once, pools it under the masks as pyannote does
(`embedding_exclude_overlap` included) and the rows come back as the array pyannote's
`get_embeddings` returns: [windows, local speakers, 256] float32, window-major. Everything
else in the pipeline (segmentation, clustering, reconstruction) runs unchanged.

Before the pipeline is handed back, a probe checks that the server's model is the
pipeline's: the same 10 s of audio and masks embedded by the pipeline's own embedding model
and by the server must agree within the parity bound of the server's arithmetic
(docs/parity.md), else `ModelMismatchError`. Failures never fall back silently: an
unreachable or draining server is retried by the client, then `ServerUnavailableError` names
the target; `local_fallback=True` is the explicit way to compute the embeddings with
pyannote's own model instead (with a `SpeakerdFallbackWarning` each time). Where pyannote
cannot decode a file path itself (no torchcodec), the pipeline reads files with soundfile
(audio_files.py), so `pipeline("meeting.wav")` works as pyannote documents it.

With `segmentation=True` the pipeline's `get_segmentations` is the server's too: one
`EmbedRecording` call per file with `header.segment` returns both the segmentation pyannote's
`Inference` would give ([windows, 589, 3] hard multilabel, the same sliding windows) and the
embeddings pooled under it; `get_segmentations` hands the first to the pipeline and keeps
the second for the `get_embeddings` that follows on the same segmentation. The client then
runs no model at all: `speakerd.pyannote.remote_pipeline` builds such a pipeline without
loading any weights. When the pipeline holds weights of its own, `use_server` checks the
server's segmentation against its segmentation model on a probe window too.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import torch
from pyannote.audio import Audio
from pyannote.audio.models.embedding import WeSpeakerResNet34
from pyannote.audio.pipelines import SpeakerDiarization
from pyannote.audio.pipelines.speaker_verification import PyannoteAudioPretrainedSpeakerEmbedding
from pyannote.core import SlidingWindow, SlidingWindowFeature

from speakerd.client import RetryPolicy, SpeakerClient
from speakerd.client.recording import RecordingEmbeddings
from speakerd.model.architecture import CHUNK_SAMPLES, EMBEDDING_DIM, MAX_SPEAKERS, SAMPLE_RATE
from speakerd.model.audio import speaker_masks, synthetic_recording
from speakerd.model.numerics import BOUNDS, Math, Parity, compare
from speakerd.model.recording import MIN_NUM_SAMPLES
from speakerd.pyannote.audio_files import add_file_reader, remove_file_reader

#: One recording is one call, so its deadline must cover the whole file: an hour of audio
#: takes about a second on a GPU server but roughly 40 minutes on the CPU engine (2 cores).
#: A deadline still exists so that a hung server fails the pipeline instead of blocking it.
DEFAULT_TIMEOUT_S = 3600.0
#: The window pyannote's segmentation-3.0 slides and the server embeds (10 s).
WINDOW_S = CHUNK_SAMPLES / SAMPLE_RATE
#: Seed of the probe recording: any fixed value; it makes the probe the same on every run.
PROBE_SEED = 17
#: Codes after which the server is "not there" (down, draining, overloaded or too slow),
#: as opposed to a request it refuses: only these may fall back to the local model.
UNAVAILABLE_CODES = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED}
)
#: int16 full scale: pyannote's decoders give 16-bit PCM as int16 / 32768.
INT16_SCALE = 32768.0
#: Share of the probe's (frame, speaker) cells in which the server's segmentation may differ
#: from the pipeline's own model before the models count as different: 0 for the same
#: weights in FP32 (a cell flips only where two powerset classes tie to rounding); another
#: model differs in a large share of them.
SEGMENTATION_MISMATCH_SHARE = 0.01


class SpeakerdError(RuntimeError):
    """Base of the errors speakerd.pyannote raises."""


class ServerUnavailableError(SpeakerdError):
    """The server could not be reached, was draining or overloaded, after the client's retries."""


class ModelMismatchError(SpeakerdError):
    """The server's embeddings are not the pipeline's embedding model's."""


class ServerRequestError(SpeakerdError):
    """The server refused the request (the message names the field and what it expected)."""


class SpeakerdFallbackWarning(UserWarning):
    """Embeddings were computed by pyannote's own model because the server was unavailable."""


@dataclass
class CallStats:
    """What the last `get_embeddings` did: for logs and the benchmark."""

    windows: int = 0
    speakers: int = 0
    audio_bytes: int = 0  # PCM sent (the masks add windows * speakers * frames bytes)
    mask_bytes: int = 0
    seconds: float = 0.0
    model_id: str = ""
    precision: str = ""
    fallback: bool = False
    #: [windows, speakers] rows whose mask had no weight (the row is seg_1.bias); None after
    #: a fallback, which does not know them
    empty: np.ndarray | None = None


def _describe(pipeline: SpeakerDiarization) -> str:
    """The pipeline's embedding model, for messages: its class and how it was given."""
    model = getattr(getattr(pipeline, "_embedding", None), "model_", None)
    given = getattr(pipeline, "embedding", None)
    origin = given if isinstance(given, str | dict | Path) else "a model object"
    return f"{type(model).__name__} ({origin})"


def check_pipeline(pipeline: Any) -> None:
    """TypeError unless `pipeline` is a SpeakerDiarization whose embedding model speakerd
    serves: pyannote's WeSpeakerResNet34 run by `PyannoteAudioPretrainedSpeakerEmbedding`
    (the hub's community-1 and 3.1 pipelines). Other embeddings (pyannote's ONNX WeSpeaker
    wrapper, SpeechBrain, NeMo) pool differently and are not served."""
    if not isinstance(pipeline, SpeakerDiarization):
        raise TypeError(
            f"pipeline: a {type(pipeline).__name__}, expected pyannote.audio.pipelines.SpeakerDiarization"
        )
    embedding = getattr(pipeline, "_embedding", None)
    if not isinstance(embedding, PyannoteAudioPretrainedSpeakerEmbedding) or not isinstance(
        embedding.model_, WeSpeakerResNet34
    ):
        found = type(getattr(embedding, "model_", embedding)).__name__
        raise TypeError(
            f"pipeline._embedding: {found}, expected pyannote's WeSpeakerResNet34 (the embedding model "
            "speakerd serves, as in pyannote/speaker-diarization-community-1)"
        )


def file_samples(file: Mapping[str, Any]) -> tuple[np.ndarray, int]:
    """The file's samples [N, C] at their own rate, as pyannote decodes them (its `Audio`,
    with the file's `channel` selection), as int16 when that is exact (16-bit sources: half
    the bytes of float32 on the wire), else float32. The server downmixes and resamples."""
    waveform, sample_rate = Audio()(file)
    samples = np.ascontiguousarray(waveform.numpy(force=True).T, dtype=np.float32)
    scaled = samples * np.float32(INT16_SCALE)
    as_int16 = np.clip(scaled, -INT16_SCALE, INT16_SCALE - 1).astype(np.int16)
    if np.array_equal(as_int16, scaled):
        return as_int16, int(sample_rate)
    peak = float(np.max(np.abs(samples))) if samples.size else 0.0
    if not math.isfinite(peak) or peak > 1.0:
        raise ValueError(
            f"{file.get('uri', 'file')}: samples up to |{peak:.6g}|; speakerd takes finite samples in "
            "[-1, 1], the range decoded audio has"
        )
    return samples, int(sample_rate)


def chunking(segmentations: SlidingWindowFeature) -> float:
    """The window step in seconds of the pipeline's segmentation windows; ValueError unless
    they are windows speakerd cuts too (10 s from t = 0, a step of whole 10 ms frames)."""
    window = segmentations.sliding_window
    if window.start != 0.0 or not math.isclose(window.duration, WINDOW_S, abs_tol=1e-9):
        raise ValueError(
            f"binary_segmentations.sliding_window: start {window.start} s, duration {window.duration} s; "
            f"expected start 0 and duration {WINDOW_S:g} s (the segmentation-3.0 windows speakerd embeds)"
        )
    return float(window.step)


class ServerEmbeddings:
    """The `get_embeddings` that `use_server` puts on a pipeline (see module doc).

    Called as pyannote calls its own: `(file, binary_segmentations, exclude_overlap, hook)`."""

    def __init__(
        self,
        pipeline: SpeakerDiarization,
        client: SpeakerClient,
        target: str,
        local_fallback: bool = False,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        segmentation: bool = False,
        verify: bool = True,
    ) -> None:
        check_pipeline(pipeline)
        if segmentation:
            check_segmentation(pipeline)
        self.pipeline = pipeline
        self.client = client
        self.target = target
        self.local_fallback = local_fallback
        self.timeout_s = timeout_s
        self.segmentation = segmentation
        #: False: the pipeline's models hold no weights of their own (remote_pipeline), so the
        #: server's are taken as they are
        self.verify_models = verify
        self.verified: Parity | None = None
        self.last = CallStats()
        #: the last server segmentation handed to the pipeline, with the exclude_overlap it
        #: was embedded with and the call's result, for the get_embeddings that follows
        self._kept: tuple[SlidingWindowFeature, bool, RecordingEmbeddings] | None = None

    # -- the model check ----------------------------------------------------------------

    def verify_segmentation(self) -> float:
        """Segment the probe here and on the server; ModelMismatchError unless at most
        SEGMENTATION_MISMATCH_SHARE of its (frame, speaker) cells differ. Returns the share."""
        recording = synthetic_recording(WINDOW_S, seed=PROBE_SEED)
        pcm = np.round(recording.samples * INT16_SCALE).astype(np.int16)
        served = self._embed(pcm, SAMPLE_RATE, None, exclude_overlap=False, step_s=1.0)
        assert served.segmentation is not None, "the server answered header.segment without a segmentation"
        model = self.pipeline._segmentation.model
        waveform = torch.from_numpy(pcm.astype(np.float32) / np.float32(INT16_SCALE))[None, None]
        with torch.inference_mode():
            log_probs = model(waveform.to(model.device))
        local = self.pipeline._segmentation.conversion(log_probs).cpu().numpy()
        share = float(np.mean(local != served.segmentation))
        if share > SEGMENTATION_MISMATCH_SHARE:
            raise ModelMismatchError(
                f"speakerd at {self.target} segments with model {served.segmentation_model_id[:16]}, whose "
                f"segmentation differs from the pipeline's segmentation model in {share:.1%} of the probe's "
                f"frames (expected at most {SEGMENTATION_MISMATCH_SHARE:.0%}). Serve the pipeline's weights "
                "(serve --segmentation-model) or give the pipeline the server's."
            )
        return share

    def verify(self) -> Parity:
        """Embed the probe here and on the server; ModelMismatchError unless they agree within
        the parity bound of the server's arithmetic. Returns the measured parity."""
        recording = synthetic_recording(WINDOW_S, seed=PROBE_SEED)
        pcm = np.round(recording.samples * INT16_SCALE).astype(np.int16)  # exact on the wire
        masks = speaker_masks(recording, np.zeros(1, dtype=np.int64))  # [1, 3, 589]
        served = self._embed(pcm, SAMPLE_RATE, masks, exclude_overlap=False, step_s=1.0)
        waveform = torch.from_numpy(pcm.astype(np.float32) / np.float32(INT16_SCALE))
        local = self.pipeline._embedding(waveform.expand(MAX_SPEAKERS, 1, -1), torch.from_numpy(masks[0]))
        parity = compare(served.embeddings[0], local)
        bound = BOUNDS[Math(served.precision)]
        if not parity.within(bound):
            raise ModelMismatchError(
                f"speakerd at {self.target} serves model {served.model_id[:16]} ({served.precision}), "
                f"whose embeddings differ from the pipeline's embedding model {_describe(self.pipeline)}: "
                f"probe min cosine {parity.min_cosine:.6f}, max |diff| / max |local| "
                f"{parity.max_relative_abs:.2e} (expected cosine >= {bound.min_cosine} and < "
                f"{bound.max_relative_abs:g} for {served.precision}). Serve the pipeline's weights "
                "(python -m speakerd convert) or give the pipeline the server's."
            )
        self.verified = parity
        return parity

    # -- pyannote's get_embeddings ------------------------------------------------------

    def __call__(
        self,
        file: Mapping[str, Any],
        binary_segmentations: SlidingWindowFeature,
        exclude_overlap: bool = False,
        hook: Callable[..., Any] | None = None,
    ) -> np.ndarray:
        pipeline = self.pipeline
        if pipeline.training:  # pyannote reuses a trial's embeddings while tuning: so do we
            cache = file.get("training_cache/embeddings", {})
            if "embeddings" in cache and (
                pipeline._segmentation.model.specifications.powerset
                or cache["segmentation.threshold"] == pipeline.segmentation.threshold
            ):
                return cache["embeddings"]
        try:
            embeddings = self._served(file, binary_segmentations, exclude_overlap, hook)
        except ServerUnavailableError as error:
            if not self.local_fallback:
                raise
            warnings.warn(
                f"{error}; computing this file's embeddings with pyannote's own model (local_fallback=True)",
                SpeakerdFallbackWarning,
                stacklevel=2,
            )
            started = time.perf_counter()
            embeddings = type(pipeline).get_embeddings(
                pipeline, file, binary_segmentations, exclude_overlap=exclude_overlap, hook=hook
            )
            self.last = CallStats(*embeddings.shape[:2], seconds=time.perf_counter() - started, fallback=True)
            return embeddings  # pyannote's own method already filled the training cache
        if pipeline.training:
            entry = {"embeddings": embeddings}
            if not pipeline._segmentation.model.specifications.powerset:
                entry["segmentation.threshold"] = pipeline.segmentation.threshold
            file["training_cache/embeddings"] = entry  # type: ignore[index]
        return embeddings

    def _served(
        self,
        file: Mapping[str, Any],
        segmentations: SlidingWindowFeature,
        exclude_overlap: bool,
        hook: Callable[..., Any] | None,
    ) -> np.ndarray:
        windows, frames, speakers = segmentations.data.shape
        # pyannote's progress unit: batches of embedding_batch_size (window, speaker) pairs
        batch = max(1, int(self.pipeline.embedding_batch_size))
        total = math.ceil(windows * speakers / batch)
        kept, self._kept = self._kept, None
        if kept is not None and kept[0] is segmentations and kept[1] == exclude_overlap:
            if hook is not None:  # computed with the segmentation, in the same call
                hook("embeddings", None, total=total, completed=total)
            return self._checked(kept[2].embeddings, windows, speakers)
        started = time.perf_counter()
        step_s = chunking(segmentations)
        if (
            exclude_overlap
            and self.verify_models
            and self.pipeline._embedding.min_num_samples != MIN_NUM_SAMPLES
        ):
            raise ValueError(
                f"pipeline._embedding.min_num_samples: {self.pipeline._embedding.min_num_samples}, expected "
                f"{MIN_NUM_SAMPLES} (the shortest input speakerd's exclude_overlap rule assumes)"
            )
        if self.verified is None and self.verify_models:  # not reached by use_server (local_fallback)
            self.verify()
        masks = np.nan_to_num(np.transpose(segmentations.data, (0, 2, 1)), nan=0.0).astype(np.float32)
        samples, sample_rate = file_samples(file)
        if hook is not None:
            hook("embeddings", None, total=total, completed=0)

        def progress(answered: int, _: int) -> None:
            if hook is not None:
                hook(
                    "embeddings",
                    None,
                    total=total,
                    completed=min(total, math.ceil(answered * speakers / batch)),
                )

        result = self._embed(samples, sample_rate, masks, exclude_overlap, step_s, progress)
        self.last = CallStats(
            windows, speakers, samples.nbytes, windows * speakers * frames,
            time.perf_counter() - started, result.model_id, result.precision, empty=result.empty,
        )  # fmt: skip
        return self._checked(result.embeddings, windows, speakers)

    def _checked(self, embeddings: np.ndarray, windows: int, speakers: int) -> np.ndarray:
        if embeddings.shape != (windows, speakers, EMBEDDING_DIM):
            raise SpeakerdError(
                f"speakerd at {self.target} answered {list(embeddings.shape)} for "
                f"{[windows, speakers, EMBEDDING_DIM]} (windows, local speakers, dimension)"
            )
        return embeddings

    # -- pyannote's get_segmentations (segmentation=True) ----------------------------------

    def segmentations(
        self, file: Mapping[str, Any], hook: Callable[..., Any] | None = None
    ) -> SlidingWindowFeature:
        """The file's segmentation as pyannote's `get_segmentations` returns it, from one
        server call that computes the embeddings under it too (kept for get_embeddings)."""
        pipeline = self.pipeline
        if pipeline.training and pipeline.CACHED_SEGMENTATION in file:
            return file[pipeline.CACHED_SEGMENTATION]
        started = time.perf_counter()
        step_s = float(pipeline.segmentation_step) * WINDOW_S
        samples, sample_rate = file_samples(file)
        exclude_overlap = bool(pipeline.embedding_exclude_overlap)
        if hook is not None:
            hook("segmentation", None, total=1, completed=0)
        try:
            result = self._embed(samples, sample_rate, None, exclude_overlap, step_s)
        except ServerUnavailableError as error:
            if not self.local_fallback:
                raise
            warnings.warn(
                f"{error}; segmenting this file with pyannote's own model (local_fallback=True)",
                SpeakerdFallbackWarning,
                stacklevel=2,
            )
            return type(pipeline).get_segmentations(pipeline, file, hook=hook)
        if result.segmentation is None:
            raise SpeakerdError(f"speakerd at {self.target} answered header.segment without a segmentation")
        feature = SlidingWindowFeature(
            result.segmentation.astype(np.float32), SlidingWindow(start=0.0, duration=WINDOW_S, step=step_s)
        )
        self._kept = (feature, exclude_overlap, result)
        windows, _, speakers = result.segmentation.shape
        self.last = CallStats(
            windows, speakers, samples.nbytes, 0, time.perf_counter() - started, result.model_id,
            result.precision, empty=result.empty,
        )  # fmt: skip
        if hook is not None:
            hook("segmentation", None, total=1, completed=1)
        if pipeline.training:
            file[pipeline.CACHED_SEGMENTATION] = feature  # type: ignore[index]
        return feature

    def _embed(
        self,
        samples: np.ndarray,
        sample_rate: int,
        masks: np.ndarray | None,
        exclude_overlap: bool,
        step_s: float,
        progress: Callable[[int, int], None] | None = None,
    ) -> RecordingEmbeddings:
        """One EmbedRecording call; gRPC failures become this module's errors, naming the target."""
        try:
            return self.client.embed_recording(
                samples, sample_rate, masks, exclude_overlap=exclude_overlap, step_s=step_s,
                timeout_s=self.timeout_s, progress=progress,
            )  # fmt: skip
        except grpc.RpcError as error:
            code, details = error.code(), error.details()
            if code in UNAVAILABLE_CODES:
                raise ServerUnavailableError(
                    f"speakerd at {self.target}: {code.name} after {self.client.retry.attempts} attempts "
                    f"({details})"
                ) from error
            raise ServerRequestError(f"speakerd at {self.target}: {code.name}: {details}") from error

    def detach(self) -> None:
        """Give the pipeline its own get_embeddings back and close the channel."""
        if self.pipeline.__dict__.get("get_embeddings") is self:
            del self.pipeline.__dict__["get_embeddings"]
        if self.pipeline.__dict__.get("get_segmentations") == self.segmentations:
            del self.pipeline.__dict__["get_segmentations"]
        remove_file_reader(self.pipeline)
        self.client.close()


def check_segmentation(pipeline: SpeakerDiarization) -> None:
    """TypeError unless the pipeline's segmentation is one speakerd serves: a powerset model
    of 3 speakers, at most 2 at once, over 10 s windows (pyannote/segmentation-3.0), slid by
    a step of whole 10 ms frames."""
    specifications = pipeline._segmentation.model.specifications
    shape = (specifications.powerset, len(specifications.classes), specifications.powerset_max_classes)
    if shape != (True, MAX_SPEAKERS, 2) or not math.isclose(specifications.duration, WINDOW_S):
        raise TypeError(
            f"pipeline._segmentation.model: powerset {shape[0]}, {shape[1]} speakers, at most {shape[2]} at "
            f"once over {specifications.duration} s windows; expected segmentation-3.0's powerset of "
            f"{MAX_SPEAKERS} speakers, at most 2 at once, over {WINDOW_S:g} s windows"
        )
    step = float(pipeline.segmentation_step) * WINDOW_S
    if not math.isclose(step * 100, round(step * 100), abs_tol=1e-6) or not 0 < step <= WINDOW_S:
        raise TypeError(f"pipeline.segmentation_step: {pipeline.segmentation_step}, expected a step of whole "
                        f"10 ms frames in (0, {WINDOW_S:g}] s")  # fmt: skip


def use_server(
    pipeline: SpeakerDiarization,
    target: str,
    *,
    segmentation: bool = False,
    verify: bool = True,
    local_fallback: bool = False,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    retry: RetryPolicy | None = None,
    tls_ca: str | Path | None = None,
    tls_cert: str | Path | None = None,
    tls_key: str | Path | None = None,
    token: str | None = None,
) -> SpeakerDiarization:
    """Make `pipeline` compute its embeddings on the speakerd server at `target` (in place;
    the same pipeline is returned). Checks the server's model first (ModelMismatchError).

    `segmentation=True`: its segmentation too, in the same call per file (the server's
    segmentation model; checked against the pipeline's on a probe window). `verify=False`
    skips both checks: for a pipeline whose models hold no weights (remote_pipeline).
    `local_fallback` then has nothing to fall back to and must stay False.

    An unreachable server raises ServerUnavailableError here and in every later call, unless
    `local_fallback`: then a warning, and each file is embedded by the server when it answers
    (after the model check) and by pyannote's own model when it does not. `timeout_s` is
    one recording's deadline; `retry`, `tls_*` and `token` are SpeakerClient's options."""
    check_pipeline(pipeline)  # before a channel opens: a wrong pipeline is a TypeError, no more
    if segmentation:
        check_segmentation(pipeline)
    if local_fallback and not verify:
        raise ValueError("local_fallback needs the pipeline's own weights: not with verify=False")
    client = SpeakerClient(
        target, timeout_s=timeout_s, retry=retry or RetryPolicy(),
        tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key, token=token,
    )  # fmt: skip
    embeddings = ServerEmbeddings(pipeline, client, target, local_fallback, timeout_s, segmentation, verify)
    try:
        if verify:
            embeddings.verify()
            if segmentation:
                embeddings.verify_segmentation()
    except ServerUnavailableError as error:
        if not local_fallback:
            client.close()
            raise
        warnings.warn(
            f"{error}; the model check waits for the first file the server answers (local_fallback=True)",
            SpeakerdFallbackWarning,
            stacklevel=2,
        )
    except BaseException:
        client.close()
        raise
    pipeline.get_embeddings = embeddings  # the instance attribute shadows the method
    if segmentation:
        pipeline.get_segmentations = embeddings.segmentations
    add_file_reader(pipeline)  # pipeline("meeting.wav") where pyannote cannot decode files
    return pipeline

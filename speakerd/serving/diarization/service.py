"""The `speakerd.v1.Diarization` gRPC service: `Diarize`, who spoke when, and by name.

One call: the header (the recording's format and pyannote's options), then the audio. The
recording goes through EmbedRecording's own path with `segment` (the same decoding,
windows, admission, deadlines and errors): the server's segmentation and the embeddings
under it, window by window. Then, on a thread, pyannote's SpeakerDiarization after its
embeddings (speakerd.model.diarization: speaker count, clustering, reconstruction, turns),
and with `names` each speaker's centroid looked up among the caller's voiceprints
(Identify's search and threshold). The clustering is speaker-diarization-3.1's
agglomerative one, or with `clustering.method` vbx community-1's VBx in the PLDA the server
was started with (`--plda`; without one, vbx is FAILED_PRECONDITION). Bad options are
INVALID_ARGUMENT naming the field; a recording without speech is no turns, not an error.

`DiarizeWithProgress` is the same call answering a stream: DiarizeProgress messages while
it works (the windows segmented and embedded so far, then the clustering's start), then the
result. `Diarize` stays as it was, so older clients keep working; the client library falls
back to it where a server has no DiarizeWithProgress (UNIMPLEMENTED).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import grpc
import numpy as np

from speakerd.model.architecture import EMBEDDING_DIM, MASK_FRAMES, MAX_SPEAKERS
from speakerd.model.diarization import (
    COMMUNITY_1,
    SPEAKER_DIARIZATION_3_1,
    AgglomerativeParameters,
    Diarization,
    Plda,
    Turn,
    VBxParameters,
    clean_speakers,
    diarize,
    rttm_field,
    to_rttm,
    working_bytes,
)
from speakerd.model.diarization.linkage import HOST, Linker
from speakerd.model.inputs import InputError
from speakerd.model.recording import SAMPLE_RATE, step_samples, window_count
from speakerd.model.resample import output_length
from speakerd.model.source import ResolvedPlda
from speakerd.model.voiceprint import check_threshold, normalize
from speakerd.serving.api.calls import CALL_REQUEST_ID, header_and_parts, served
from speakerd.serving.api.errors import Rejection
from speakerd.serving.api.recording import (
    DEFAULT_STEP_S,
    Host,
    RecordingService,
    metadata_request_id,
    reserve,
)
from speakerd.serving.api.request_ids import check_request_id
from speakerd.serving.memory.recording_budget import RecordingBudget, Reservation
from speakerd.serving.voiceprints.service import DEFAULT_THRESHOLD, VoiceprintService
from speakerd.serving.voiceprints.tenants import tenant_of
from speakerd.v1 import speakerd_pb2 as pb
from speakerd.v1.tensors import from_tensor, to_tensor

log = logging.getLogger(__name__)
#: DiarizeProgress's stages, and the least time between two of its "embedding" messages: a
#: few a second keep a progress line moving and cost nothing beside a window batch's work.
EMBEDDING_STAGE, CLUSTERING_STAGE = "embedding", "clustering"
PROGRESS_INTERVAL_S = 0.25
#: The service's name on the wire (speakerd.proto).
SERVICE_NAME = "speakerd.v1.Diarization"
#: Threads clustering recordings at once: an hour's 3,591 windows x 3 speakers cluster in
#: well under a second of NumPy and SciPy, so two keep a busy server's calls moving.
CLUSTER_THREADS = 2
#: Speakers a call may ask for: pyannote bounds nothing, but more clusters than an hour's
#: windows x 3 local speakers cannot be formed.
MAX_SPEAKERS_ASKED = 1000
DEFAULT_URI = "recording"
#: Longest `uri` taken: a file name's length on common file systems.
MAX_URI_CHARS = 255
#: What a call keeps of each window until its clustering ends: the segmentation row (uint8
#: [589, 3]) and the embeddings (float32 [3, 256]); 4,839 bytes, 52 MB for 3 h.
KEPT_ROW_BYTES = MASK_FRAMES * MAX_SPEAKERS + MAX_SPEAKERS * EMBEDDING_DIM * 4
#: Clustering.method's values: pyannote's AgglomerativeClustering (also "") and VBxClustering.
AGGLOMERATIVE = "agglomerative"
VBX = "vbx"
#: Clustering.threshold's range for both methods: a distance between unit embeddings
#: (cosine distance for the agglomerative clustering, Euclidean for VBx's AHC), at most 2.
MAX_CLUSTER_DISTANCE = 2.0


class DiarizationService:
    """Diarize over `recordings` (the recording path), naming speakers from `voiceprints`
    (None with `--voiceprints off`), clustering with VBx in `plda` when asked (None without
    `--plda`).

    Memory: a call keeps each window's segmentation and embeddings (KEPT_ROW_BYTES), reserved
    with its recording in the recording budget. Once the audio is embedded, it reserves what
    the clustering will hold (model.diarization.working_bytes: the linkage's 8 n^2 bytes for n
    clean pairs, and its per-window arrays) with what it keeps, in `clustering_budget`
    (`--clustering-memory-mb`), waiting in arrival order up to its deadline while still
    holding its recording's reservation (so what it keeps is always counted; no deadlock: a
    call holding clustering room never waits for anything), then gives the recording's back.
    VBx resizes that room once its AHC cut gives s initial clusters (its updates hold 112 n s
    bytes): it shrinks, or grows where the budget has the bytes free now, or else gives the
    room back and waits in line for the whole of it, holding nothing meanwhile. A recording
    whose clustering needs more than the whole budget is INVALID_ARGUMENT naming `recording`."""

    def __init__(
        self,
        host: Host,
        recordings: RecordingService,
        voiceprints: VoiceprintService | None,
        authenticated: bool,
        clustering_budget: RecordingBudget,
        plda: tuple[ResolvedPlda, Plda] | None = None,
    ) -> None:
        self.host = host
        self.recordings = recordings
        self.voiceprints = voiceprints
        self.authenticated = authenticated
        self.clustering_budget = clustering_budget
        self.plda = plda
        #: the centroid linkage's implementation: the server sets the engine's once it is built
        self.linker: Linker = HOST
        self._pool = ThreadPoolExecutor(CLUSTER_THREADS, thread_name_prefix="diarize")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def Diarize(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext):
        return await served(
            self.host, "Diarize", context, lambda tenant: self._diarize(tenant, requests, context),
            lambda c: tenant_of(c.invocation_metadata(), self.authenticated),
        )  # fmt: skip

    async def DiarizeWithProgress(
        self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.DiarizeEvent]:
        """Diarize, with DiarizeProgress messages while it works (PROGRESS_INTERVAL_S apart at
        most, and one as the clustering starts) before the result."""
        events: asyncio.Queue[pb.DiarizeProgress] = asyncio.Queue()
        call = asyncio.ensure_future(
            served(
                self.host, "DiarizeWithProgress", context,
                lambda tenant: self._diarize(tenant, requests, context, events.put_nowait),
                lambda c: tenant_of(c.invocation_metadata(), self.authenticated),
            )
        )  # fmt: skip
        try:
            while not call.done():
                waiting = asyncio.ensure_future(events.get())
                await asyncio.wait({waiting, call}, return_when=asyncio.FIRST_COMPLETED)
                if waiting.done():
                    yield pb.DiarizeEvent(progress=waiting.result())
                else:
                    waiting.cancel()
            yield pb.DiarizeEvent(result=call.result())  # a rejection: the call's abort, raised here
        finally:
            call.cancel()  # the client went away: the work stops as a cancelled Diarize does

    async def _diarize(
        self,
        tenant: str,
        requests: AsyncIterator[bytes],
        context: grpc.aio.ServicerContext,
        progress: Callable[[pb.DiarizeProgress], None] | None = None,
    ) -> pb.DiarizeResponse:
        began = time.perf_counter()
        header, rest = await header_and_parts(requests, pb.DiarizeRequest)
        assert isinstance(header, pb.DiarizeHeader)
        options = diarization_options(header)
        if header.names and self.voiceprints is None:
            raise _unserved(
                "names", "false on a server without voiceprints",
                "this server keeps no voiceprints (serve --voiceprints off); diarize without names",
            )  # fmt: skip
        if options.vbx and self.plda is None:
            raise _unserved(
                "clustering.method", "agglomerative on a server without --plda",
                "vbx needs a PLDA and this server has none: start it with --plda (e.g. "
                "pyannote/speaker-diarization-community-1), or cluster with agglomerative",
            )  # fmt: skip
        used = self.plda if options.vbx else None  # (where from, the PLDA) VBx clusters in
        if not header.HasField("recording"):
            raise InputError("recording", "missing; the recording's sample rate, channels and encoding")
        check_uri(header.uri)
        if header.recording.request_id and not metadata_request_id(context):
            CALL_REQUEST_ID.set(check_request_id(header.recording.request_id, "header.recording.request_id"))
        self._refuse_early(header.recording)
        rows: tuple[list[np.ndarray], list[np.ndarray]] = ([], [])
        last, held, reported = None, [], began
        clean: tuple[list[np.ndarray], list[np.ndarray]] = ([], [])

        def report(stage: str, done: int, windows: int) -> None:
            if progress is not None:
                progress(pb.DiarizeProgress(stage=stage, windows_done=done, windows=windows,
                                            elapsed_s=round(time.perf_counter() - began, 3)))  # fmt: skip

        try:
            windows = self.recordings.windows(
                _messages(header.recording, rest), context, kept_row_bytes=KEPT_ROW_BYTES, held=held
            )
            # closed however the call ends (a cancel too), not left to the loop's finalizer
            async with contextlib.aclosing(windows):
                async for response in windows:
                    rows[0].append(from_tensor(response.segmentation, "segmentation"))
                    rows[1].append(from_tensor(response.embeddings, "embeddings"))
                    # the clean pairs the clustering will link, found as the windows come
                    # (pyannote's filter is per window): nothing of it is left for the end
                    windows_at, speakers_at = clean_speakers(rows[1][-1], rows[0][-1])
                    clean[0].append(windows_at + response.first_window)
                    clean[1].append(speakers_at)
                    last = response
                    if time.perf_counter() - reported >= PROGRESS_INTERVAL_S:
                        reported = time.perf_counter()
                        report(
                            EMBEDDING_STAGE, response.first_window + len(response.starts), response.windows
                        )
            assert last is not None, "a recording has at least one window"
            embedded = time.perf_counter()
            segmentations, embeddings = np.concatenate(rows[0]), np.concatenate(rows[1])
            del rows
            found = (np.concatenate(clean[0]), np.concatenate(clean[1]))
            pairs = len(found[0])
            room = Room(self, segmentations, embeddings, pairs, context)
            await room.reserve(0)
        except Rejection as error:
            raise within_recording(error) from error
        finally:
            for reservation in held:  # the recording's: what it keeps is in `room` now
                reservation.release()
            metrics = self.host.metrics
            self.recordings.budget.report(metrics.recordings_waiting, metrics.recording_bytes_held)
        step_s = header.recording.step_s or DEFAULT_STEP_S
        report(CLUSTERING_STAGE, len(segmentations), last.windows)

        loop = asyncio.get_running_loop()

        def initial_clusters(pairs: int, clusters: int) -> None:  # on the clustering thread
            if room.abandoned:  # the call was cancelled: stop before VBx's updates
                raise CallAbandoned("the call was cancelled during its clustering")
            asyncio.run_coroutine_threadsafe(room.reserve(clusters), loop).result()

        def cluster() -> Diarization:
            return diarize(
                segmentations, embeddings, step_s, options.num_speakers, options.min_speakers,
                options.max_speakers, clustering=options.clustering,
                plda=used[1] if used is not None else None, linker=self.linker,
                on_initial_clusters=initial_clusters, clean=found,
            )  # fmt: skip

        started = time.perf_counter()
        clustering = loop.run_in_executor(self._pool, cluster)
        try:
            # shielded: a cancelled call's clustering thread runs on to its end, and its
            # room stays reserved until then (the memory is held until the thread lets go)
            result = await asyncio.shield(clustering)
        except asyncio.CancelledError:
            room.abandoned = True

            def ended(future: asyncio.Future[Diarization]) -> None:
                room.release()  # the thread let go of the memory
                if not future.cancelled():
                    future.exception()  # retrieved: the call is gone, nobody reads the outcome

            clustering.add_done_callback(ended)
            raise
        room.release()
        self.host.metrics.clustering_seconds.observe(time.perf_counter() - started)
        speakers = [
            pb.DiarizedSpeaker(
                label=label,
                cluster=label,
                speech_s=result.speech_s[label],
                centroid=to_tensor(np.asarray(centroid, np.float32)),
            )
            for label, centroid in zip(result.labels, result.centroids, strict=True)
        ]
        names: dict[str, str] = {}
        if header.names and speakers and self.voiceprints is not None:
            names = await self._names(tenant, last.model_id, result, speakers, options.threshold)
        turns, exclusive = _named(result.turns, names), _named(result.exclusive_turns, names)
        uri = header.uri or DEFAULT_URI
        response = pb.DiarizeResponse(
            turns=_turns(turns),
            exclusive_turns=_turns(exclusive),
            speakers=speakers,
            rttm=to_rttm(_named(turns, {t.speaker: rttm_field(t.speaker) for t in turns}), uri),
            windows=last.windows,
            model_id=last.model_id,
            segmentation_model_id=last.segmentation_model_id,
            plda_id=used[0].plda_id if used is not None else "",
        )
        steps = result.seconds
        replied = time.perf_counter()
        log.info(
            "Diarize %s: %d windows, %d clean pairs, %s, %d speakers, %d turns in %.3f s: audio "
            "to embeddings %.3f s, waiting for clustering room %.3f s, clustering %.3f s (linkage "
            "%.3f s; speaker count %.3f s beside it), reconstruction %.3f s, reply %.3f s",
            CALL_REQUEST_ID.get(), last.windows, pairs, VBX if options.vbx else AGGLOMERATIVE,
            len(speakers), len(turns),
            replied - began, embedded - began, started - embedded, steps.get("clustering", 0.0),
            steps.get("linkage", 0.0), steps.get("count", 0.0), steps.get("reconstruction", 0.0),
            replied - started - steps.get("total", 0.0),
        )  # fmt: skip
        return response

    def _refuse_early(self, recording: pb.RecordingHeader) -> None:
        """INVALID_ARGUMENT at the header for a recording whose `frames` make more windows than
        the clustering budget can ever hold, even with no clean pair (its per-window arrays
        and what the call keeps of each window): refused before any work, not after it."""
        if recording.frames <= 0 or recording.sample_rate <= 0:
            return
        samples = output_length(recording.frames, recording.sample_rate, SAMPLE_RATE)  # as the recording path
        try:
            windows = window_count(samples, step_samples(recording.step_s or DEFAULT_STEP_S))
        except InputError:
            return  # the recording path names the bad step
        least = working_bytes(windows, 0) + KEPT_ROW_BYTES * windows
        limit = self.clustering_budget.limit_bytes
        if least > limit:
            raise InputError(
                "header.recording.frames",
                f"{recording.frames} frames make {windows} windows, whose clustering needs at least "
                f"{least / 2**20:.0f} MiB, more than the server's whole clustering budget "
                f"({limit / 2**20:.0f} MiB, serve --clustering-memory-mb): send a shorter recording",
            )

    def _report_clustering(self, waiting: int) -> None:
        metrics = self.host.metrics
        self.clustering_budget.report(metrics.clusterings_waiting, metrics.clustering_bytes_held, waiting)

    async def _names(
        self,
        tenant: str,
        model_id: str,
        result: Diarization,
        speakers: list[pb.DiarizedSpeaker],
        threshold: float,
    ) -> dict[str, str]:
        """Label -> name of the speakers whose centroid's best voiceprint scores `threshold`
        or more (Identify's rule); every speaker gets its best match's score."""
        assert self.voiceprints is not None
        centroids = np.asarray(result.centroids, np.float32)
        usable = [
            i for i, row in enumerate(centroids) if np.linalg.norm(row) > 0
        ]  # a count-only speaker has none
        found = await self.voiceprints.best_matches(
            tenant, model_id, normalize(centroids[usable], "centroids")
        )
        names = {}
        for index, match in zip(usable, found, strict=True):
            if match is None:
                continue
            speaker = speakers[index]
            speaker.score = match[2]
            if match[2] >= threshold:
                speaker.voiceprint_id, speaker.speaker_id = match[0], match[1]
                speaker.label = names[speaker.cluster] = match[1]
        return names


@dataclass(frozen=True)
class Options:
    """A call's speaker bounds, clustering and naming threshold, checked."""

    num_speakers: int | None
    min_speakers: int
    max_speakers: int | None
    clustering: AgglomerativeParameters | VBxParameters
    threshold: float

    @property
    def vbx(self) -> bool:
        """VBx (community-1's clustering), which needs the server's PLDA."""
        return isinstance(self.clustering, VBxParameters)


def _unserved(field: str, expected: str, why: str) -> Rejection:
    """FAILED_PRECONDITION for an option this server was not started to serve, naming it."""
    return Rejection(grpc.StatusCode.FAILED_PRECONDITION, "unserved", f"{field}: {why}", field, expected)


def _named(turns: list[Turn], names: dict[str, str]) -> list[Turn]:
    """`turns` with each speaker renamed as `names` says (unchanged where it says nothing or
    the same; the same list when nothing changes, as for pyannote's labels)."""
    if all(names.get(speaker, speaker) == speaker for speaker in names):
        return turns
    return [replace(t, speaker=names.get(t.speaker, t.speaker)) for t in turns]


def _turns(turns: list[Turn]) -> list[pb.SpeakerTurn]:
    return [pb.SpeakerTurn(start_s=t.start, end_s=t.end, label=t.speaker) for t in turns]


def diarization_options(header: pb.DiarizeHeader) -> Options:
    """The header's speaker counts and clustering, checked: INVALID_ARGUMENT naming the field."""
    for field in ("num_speakers", "min_speakers", "max_speakers"):
        value = getattr(header, field)
        if not 0 <= value <= MAX_SPEAKERS_ASKED:
            raise InputError(field, f"{value}, expected 0 (not given) to {MAX_SPEAKERS_ASKED}")
    least, most = header.min_speakers or 1, header.max_speakers or None
    if most is not None and least > most:
        raise InputError("min_speakers", f"{least} is more than max_speakers {most}")
    if header.num_speakers and (
        header.num_speakers < least or (most is not None and header.num_speakers > most)
    ):
        field = "num_speakers"
        raise InputError(
            field,
            f"{header.num_speakers} is outside min_speakers..max_speakers ({least}..{most or 'no bound'})",
        )
    parameters = clustering_parameters(header.clustering)
    threshold = check_threshold(header.threshold) if header.HasField("threshold") else DEFAULT_THRESHOLD
    return Options(header.num_speakers or None, least, most, parameters, threshold)


def clustering_parameters(clustering: pb.Clustering) -> AgglomerativeParameters | VBxParameters:
    """The header's clustering, checked: speaker-diarization-3.1's agglomerative parameters
    or community-1's VBx ones with what the call changed; INVALID_ARGUMENT naming the field.

    A parameter of the other method is refused rather than ignored (min_cluster_size with
    vbx: VBx merges no small clusters, its priors drop weak speakers instead; fa or fb with
    agglomerative), so a call never believes it tuned something that had no effect."""
    method = clustering.method or AGGLOMERATIVE
    if method not in (AGGLOMERATIVE, VBX):
        expected = f'expected "{AGGLOMERATIVE}" (or "" for it) or "{VBX}"'
        raise InputError("clustering.method", f"{clustering.method!r}, {expected}")
    threshold = clustering.threshold
    if clustering.HasField("threshold") and not 0.0 < threshold <= MAX_CLUSTER_DISTANCE:
        distance = "a cosine distance" if method == AGGLOMERATIVE else "VBx's AHC cut (a distance)"
        expected = f"expected {distance} in (0, {MAX_CLUSTER_DISTANCE:g}]"
        raise InputError("clustering.threshold", f"{threshold}, {expected}")
    if method == VBX:
        if clustering.min_cluster_size:
            raise InputError(
                "clustering.min_cluster_size",
                f"{clustering.min_cluster_size} with vbx, expected 0: the agglomerative clustering's only "
                "(VBx merges no small clusters; its Fb drops weak speakers)",
            )
        vbx = COMMUNITY_1
        for field, name in (("fa", "Fa"), ("fb", "Fb")):
            if clustering.HasField(field):
                value = getattr(clustering, field)
                if not (math.isfinite(value) and value > 0):
                    default = getattr(COMMUNITY_1, name)
                    expected = f"expected VBx's {name}, a finite number > 0 (unset: community-1's {default})"
                    raise InputError(f"clustering.{field}", f"{value}, {expected}")
                vbx = replace(vbx, **{name: value})
        if clustering.HasField("threshold"):
            vbx = replace(vbx, threshold=clustering.threshold)
        return vbx
    for field in ("fa", "fb"):
        if clustering.HasField(field):
            raise InputError(
                f"clustering.{field}", f"{getattr(clustering, field)}: VBx's only, expected unset without vbx"
            )
    if clustering.min_cluster_size < 0:
        raise InputError(
            "clustering.min_cluster_size", f"{clustering.min_cluster_size}, expected >= 1 (0: 12)"
        )
    parameters = SPEAKER_DIARIZATION_3_1
    if clustering.HasField("threshold"):
        parameters = replace(parameters, threshold=clustering.threshold)
    if clustering.min_cluster_size:
        parameters = replace(parameters, min_cluster_size=clustering.min_cluster_size)
    return parameters


class CallAbandoned(Exception):
    """Raised in a cancelled call's clustering thread, at VBx's resize, to stop its work."""


class Room:
    """A call's room in the clustering budget (DiarizationService's docstring): reserved for
    the linkage, then resized for VBx's updates once its initial clusters are known."""

    def __init__(
        self,
        service: DiarizationService,
        segmentations: np.ndarray,
        embeddings: np.ndarray,
        pairs: int,
        context: grpc.aio.ServicerContext,
    ) -> None:
        self.service = service
        self.windows = segmentations.shape[0]
        self.pairs = pairs  # clean (window, speaker) pairs: clustering.clean_speakers
        self.kept = segmentations.nbytes + embeddings.nbytes
        remaining = context.time_remaining()
        self.deadline = None if remaining is None else time.monotonic() + remaining
        self.reservation: Reservation | None = None
        #: the call was cancelled while its clustering ran: VBx stops before resizing
        self.abandoned = False

    async def reserve(self, initial_clusters: int) -> None:
        """Hold what the clustering needs with `initial_clusters` (0: before VBx's AHC cut)."""
        budget = self.service.clustering_budget
        need = working_bytes(self.windows, self.pairs, initial_clusters) + self.kept
        held = self.reservation
        if held is not None and need <= held.nbytes:
            held.shrink(held.nbytes - need)
        elif held is None or not held.grow(need - held.nbytes):
            if held is not None:
                held.release()  # wait holding nothing: no call holding room waits for more
            self.reservation = None

            def too_large() -> InputError:
                clusters = f" in {initial_clusters} initial clusters" if initial_clusters else ""
                return InputError(
                    "recording",
                    f"{self.windows} windows with {self.pairs} clean speaker pairs{clusters} need "
                    f"{need / 2**20:.0f} MiB to cluster, more than the server's whole clustering budget "
                    f"({budget.limit_bytes / 2**20:.0f} MiB, serve --clustering-memory-mb): send a shorter "
                    "recording",
                )

            report = self.service._report_clustering
            self.reservation = await reserve(budget, need, self.deadline, too_large, "clusterings",
                                             "clustering", report)  # fmt: skip
        self.service._report_clustering(0)

    def release(self) -> None:
        if self.reservation is not None:
            self.reservation.release()
        self.service._report_clustering(0)


def check_uri(uri: str) -> None:
    """`uri` names the recording in the RTTM, whose fields are space-separated: no whitespace
    or control character (a tab or newline would forge lines), and not too long to log."""
    if len(uri) > MAX_URI_CHARS or any(c.isspace() or not c.isprintable() for c in uri):
        raise InputError(
            "uri", f"{uri[:40]!r}: expected at most {MAX_URI_CHARS} printable characters without "
            "whitespace (RTTM fields are space-separated), e.g. team_meeting",
        )  # fmt: skip


def within_recording(error: Rejection) -> Rejection:
    """The recording path's rejection with its `header.` field named where Diarize has it,
    `header.recording.` (DiarizeHeader.recording is EmbedRecording's header)."""
    if not error.field.startswith("header."):
        return error
    field = "header.recording." + error.field.removeprefix("header.")
    moved = Rejection(error.code, error.reason, f"{field}{error.message.removeprefix(error.field)}", field,
                      error.expected)  # fmt: skip
    moved.malformed = error.malformed
    return moved


async def _messages(
    recording: pb.RecordingHeader, rest: AsyncIterator[tuple[str, object]]
) -> AsyncIterator[pb.EmbedRecordingRequest]:
    """The call as EmbedRecording messages: its recording header with `segment`, then its audio."""
    header = pb.RecordingHeader()
    header.CopyFrom(recording)
    header.segment = True
    yield pb.EmbedRecordingRequest(header=header)
    async for part, value in rest:
        if part != "audio":
            raise InputError(part, "Diarize takes the header, then audio pieces only")
        assert isinstance(value, bytes)
        yield pb.EmbedRecordingRequest(audio=value)


def register(service: DiarizationService, server: grpc.aio.Server) -> None:
    """Add `service` as the generated add_DiarizationServicer_to_server would, except that
    requests arrive as raw bytes, decoded by the method (api/errors.decode_message says why)."""
    handlers = {
        "Diarize": grpc.stream_unary_rpc_method_handler(
            service.Diarize, response_serializer=pb.DiarizeResponse.SerializeToString
        ),
        "DiarizeWithProgress": grpc.stream_stream_rpc_method_handler(
            service.DiarizeWithProgress, response_serializer=pb.DiarizeEvent.SerializeToString
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)

"""The `speakerd.v1.Voiceprints` gRPC service: Enroll, Identify, Verify, ListVoiceprints,
DeleteVoiceprint (docs/voiceprints.md).

Every call works in its caller's tenant (tenants.py): another tenant's voiceprint id is
answered exactly as an unknown one (NOT_FOUND). Writes go to the store first, then to this
server's index (other servers' indexes through the store's notifications), so a voiceprint
that can be found is one that is stored. Logs name the method, the tenant's voiceprint ids
and codes, never a speaker id, a vector or audio.

Codes: INVALID_ARGUMENT naming the field (with a BadRequest detail) for bad input, too
little speech and silent audio; NOT_FOUND for an unknown voiceprint id; ALREADY_EXISTS for
a speaker id enrolled before without `replace`; FAILED_PRECONDITION for a voiceprint made
by other weights; UNAVAILABLE when the store cannot be reached (retry: nothing was written),
while the engine warms up, and while draining.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import grpc
import numpy as np
from google.protobuf.message import Message

from speakerd.model.inputs import InputError
from speakerd.model.voiceprint import MIN_ENROLL_SPEECH_S, MIN_QUERY_SPEECH_S, check_threshold
from speakerd.serving.api.calls import header_and_parts, served
from speakerd.serving.api.errors import Rejection, decode_message
from speakerd.serving.api.recording import Host, RecordingService
from speakerd.serving.voiceprints.index import VoiceprintIndex
from speakerd.serving.voiceprints.records import DuplicateSpeaker, StoreUnavailable, VoiceprintRecord
from speakerd.serving.voiceprints.speech import Speech, collect
from speakerd.serving.voiceprints.store import Change, VoiceprintStore, open_store
from speakerd.serving.voiceprints.tenants import tenant_of
from speakerd.v1 import speakerd_pb2 as pb
from speakerd.v1 import speakerd_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
T = TypeVar("T")
M = TypeVar("M", bound=Message)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Voiceprints"].full_name
#: Cosine at or above which Identify names a speaker and Verify accepts, when the caller
#: sets no threshold: halfway between unrelated vectors (0) and the same voice (1). Not
#: calibrated on real speakers (docs/voiceprints.md): callers should calibrate on their data.
DEFAULT_THRESHOLD = 0.5
MAX_TOP_K = 100
#: Query rows of one Identify call: 1,000 centroids or windows x 100,000 voiceprints is a
#: 400 MB score matrix at most 10 times over; larger batches are the client's to split.
MAX_QUERY_ROWS = 10_000
MAX_SPEAKER_ID_CHARS = 128
#: Threads running store transactions (blocking I/O) and searches (NumPy releases the GIL).
STORE_THREADS = 2


class VoiceprintService(pb_grpc.VoiceprintsServicer):
    """Voiceprints of `spec`'s store (store.open_store), searched in this server's index."""

    def __init__(self, host: Host, recordings: RecordingService, spec: str, data_dir: Path,
                 authenticated: bool) -> None:  # fmt: skip
        self.host = host
        self.recordings = recordings
        self.spec = spec
        self.data_dir = data_dir
        self.authenticated = authenticated
        self.index = VoiceprintIndex()
        self.store: VoiceprintStore | None = None
        self._pool = ThreadPoolExecutor(STORE_THREADS, thread_name_prefix="voiceprints")
        self._opening = asyncio.Lock()

    # --- the store -----------------------------------------------------------------------

    def open(self) -> None:
        """Open the store and load the index (blocking); StoreUnavailable when it cannot
        be reached: calls then try again, so a database that comes up later is used."""
        store = open_store(self.spec, self.data_dir)
        try:
            self.index.reset(store.all())
            store.watch(self._changed, self._reload)
        except BaseException:
            store.close()
            raise
        self.store = store
        log.info("voiceprints: %d in %s", len(self.index), store.description)

    def _changed(self, change: Change) -> None:
        """Another server wrote (the listener's thread)."""
        kind, voiceprint_id = change
        store = self.store
        if kind == "delete" or store is None:
            self.index.remove(voiceprint_id)
            return
        record = store.get_any(voiceprint_id)
        if record is not None:
            self.index.add(record)

    def _reload(self) -> None:
        if self.store is not None:
            self.index.reset(self.store.all())

    async def _store(self) -> VoiceprintStore:
        if self.store is None:
            async with self._opening:
                if self.store is None:
                    await self._blocking(self.open)
        assert self.store is not None
        return self.store

    async def _blocking(self, work: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, work)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.store is not None:
            self.store.close()

    # --- calls ---------------------------------------------------------------------------

    async def Enroll(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext):
        async def work(tenant: str) -> pb.EnrollResponse:
            header, rest = await header_and_parts(requests, pb.EnrollRequest)
            speaker_id = _speaker_id(header.speaker_id)
            if header.speech.WhichOneof("query") != "recording":
                raise InputError(
                    "speech.recording", "Enroll takes a recording of the speaker (then audio, masks)"
                )
            model_id = self._model_id()
            speech = await collect(header.speech, rest, self.recordings, context, 1, model_id)
            seconds = speech.speech_s[0]
            vector = speech.rows[0]
            if vector is None or seconds < MIN_ENROLL_SPEECH_S:
                raise InputError("speech", f"{seconds:.2f} s of speech under the masks, expected at "
                                           f"least {MIN_ENROLL_SPEECH_S:g} s to enroll")  # fmt: skip
            record = VoiceprintRecord.new(tenant, speaker_id, speech.model_id, vector, seconds,
                                          speech.quality[0], speech.windows[0])  # fmt: skip
            store = await self._store()
            replaced = await self._blocking(lambda: store.put(record, header.replace))
            if replaced:
                self.index.remove(replaced)
            self.index.add(record)
            log.info(
                "Enroll: voiceprint %s%s", record.voiceprint_id, f" replaced {replaced}" if replaced else ""
            )
            return pb.EnrollResponse(voiceprint=_message(record), replaced_voiceprint_id=replaced)

        return await self._served("Enroll", context, work)

    async def Identify(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext):
        async def work(tenant: str) -> pb.IdentifyResponse:
            header, rest = await header_and_parts(requests, pb.IdentifyRequest)
            top_k = header.top_k or 1
            if not 1 <= top_k <= MAX_TOP_K:
                raise InputError("top_k", f"{header.top_k}, expected 1..{MAX_TOP_K} (0: 1)")
            threshold = _threshold(header)
            speech = await collect(
                header.speech, rest, self.recordings, context, MAX_QUERY_ROWS, self._model_id()
            )
            await self._store()  # the index is loaded
            usable = [i for i, row in enumerate(speech.rows) if row is not None and _enough(speech, i)]
            queries = np.stack([speech.rows[i] for i in usable]) if usable else np.zeros((0, 1), np.float32)
            found = await self._blocking(lambda: self.index.search(tenant, speech.model_id, queries, top_k))
            rows = [pb.Identification(unknown=True, speech_s=s) for s in speech.speech_s]
            for place, i in enumerate(usable):
                row = rows[i]
                for voiceprint_id, speaker, score in zip(found.ids[place], found.speakers[place],
                                                         found.scores[place], strict=True):  # fmt: skip
                    row.matches.add(voiceprint_id=voiceprint_id, speaker_id=speaker, score=float(score))
                if row.matches and row.matches[0].score >= threshold:
                    row.unknown, row.speaker_id = False, row.matches[0].speaker_id
            return pb.IdentifyResponse(rows=rows, threshold=threshold, model_id=speech.model_id,
                                       other_model_voiceprints=found.other_model)  # fmt: skip

        return await self._served("Identify", context, work)

    async def Verify(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext):
        async def work(tenant: str) -> pb.VerifyResponse:
            header, rest = await header_and_parts(requests, pb.VerifyRequest)
            threshold = _threshold(header)
            store = await self._store()
            record = await self._blocking(lambda: store.get(tenant, header.voiceprint_id))
            if record is None:
                raise _not_found(header.voiceprint_id)
            model_id = self._model_id()
            if record.model_id != model_id:
                raise Rejection(
                    grpc.StatusCode.FAILED_PRECONDITION, "other_model",
                    f"voiceprint_id: made by model {record.model_id[:12]}, this server runs {model_id[:12]}: "
                    "re-enroll the speaker on a server with these weights, or ask one with those",
                    "voiceprint_id", "a voiceprint of this server's model",
                )  # fmt: skip
            speech = await collect(header.speech, rest, self.recordings, context, 1, model_id)
            query = speech.rows[0]
            if query is None or not _enough(speech, 0):
                raise InputError("speech", f"{speech.speech_s[0]:.2f} s of speech under the masks, expected "
                                           f"at least {MIN_QUERY_SPEECH_S:g} s")  # fmt: skip
            score = float(np.clip(query @ record.vector, -1.0, 1.0))  # a cosine (index.py's search)
            return pb.VerifyResponse(score=score, accepted=score >= threshold, threshold=threshold,
                                     speaker_id=record.speaker_id, speech_s=speech.speech_s[0])  # fmt: skip

        return await self._served("Verify", context, work)

    async def ListVoiceprints(self, raw: bytes, context: grpc.aio.ServicerContext):
        async def work(tenant: str) -> pb.ListVoiceprintsResponse:
            decode_message(pb.ListVoiceprintsRequest, raw)  # no fields yet; undecodable bytes are refused
            store = await self._store()
            records = await self._blocking(lambda: store.list(tenant))
            return pb.ListVoiceprintsResponse(voiceprints=[_message(r) for r in records])

        return await self._served("ListVoiceprints", context, work)

    async def DeleteVoiceprint(self, raw: bytes, context: grpc.aio.ServicerContext):
        async def work(tenant: str) -> pb.DeleteVoiceprintResponse:
            request = decode_message(pb.DeleteVoiceprintRequest, raw)
            store = await self._store()
            record = await self._blocking(lambda: store.delete(tenant, request.voiceprint_id))
            if record is None:
                raise _not_found(request.voiceprint_id)
            self.index.remove(record.voiceprint_id)
            log.info("DeleteVoiceprint: voiceprint %s erased", record.voiceprint_id)
            return pb.DeleteVoiceprintResponse(
                voiceprint_id=record.voiceprint_id, speaker_id=record.speaker_id
            )

        return await self._served("DeleteVoiceprint", context, work)

    async def best_matches(
        self, tenant: str, model_id: str, rows: np.ndarray
    ) -> list[tuple[str, str, float] | None]:
        """Each unit row's best voiceprint of the tenant made by `model_id`: (voiceprint id,
        speaker id, cosine), or None when the tenant has none (Diarize's names)."""
        await self._store()  # the index is loaded
        found = await self._blocking(lambda: self.index.search(tenant, model_id, rows, 1))
        return [
            (ids[0], speakers[0], float(scores[0])) if ids else None
            for ids, speakers, scores in zip(found.ids, found.speakers, found.scores, strict=True)
        ]

    # --- one call ------------------------------------------------------------------------

    def _model_id(self) -> str:
        engine = self.host.engine
        if engine is None:
            raise Rejection(grpc.StatusCode.UNAVAILABLE, "not_ready", "the engine is still warming up")
        return engine.model_id

    async def _served(
        self, method: str, context: grpc.aio.ServicerContext, work: Callable[[str], Awaitable[T]]
    ) -> T:
        """Run `work(tenant)` as one call (api/calls.served): every failure becomes its code
        (module doc), never UNKNOWN."""
        return await served(
            self.host,
            method,
            context,
            work,
            lambda c: tenant_of(c.invocation_metadata(), self.authenticated),
            _rejection,
        )


def _speaker_id(speaker_id: str) -> str:
    if not 1 <= len(speaker_id) <= MAX_SPEAKER_ID_CHARS or not speaker_id.isprintable():
        raise InputError("speaker_id", f"expected 1..{MAX_SPEAKER_ID_CHARS} printable characters")
    return speaker_id


def _threshold(header: pb.IdentifyHeader | pb.VerifyHeader) -> float:
    return check_threshold(header.threshold) if header.HasField("threshold") else DEFAULT_THRESHOLD


def _enough(speech: Speech, row: int) -> bool:
    """Embeddings rows (speech_s 0, windows 0) always; recording columns with enough speech."""
    return speech.windows[row] == 0 or speech.speech_s[row] >= MIN_QUERY_SPEECH_S


def _not_found(voiceprint_id: str) -> Rejection:
    """The same answer for an unknown id and another tenant's: nothing tells them apart."""
    shown = voiceprint_id[:64] if voiceprint_id.isprintable() else repr(voiceprint_id[:64])
    return Rejection(
        grpc.StatusCode.NOT_FOUND,
        "not_found",
        f"voiceprint_id: no voiceprint {shown} in your namespace",
        "voiceprint_id",
        "the id of one of your voiceprints (ListVoiceprints)",
    )


def _rejection(error: Exception) -> Rejection | None:
    """The voiceprint methods' own failures as Rejections (None: not one of them)."""
    if isinstance(error, DuplicateSpeaker):
        return Rejection(
            grpc.StatusCode.ALREADY_EXISTS, "already_exists",
            f"speaker_id: already enrolled as voiceprint {error.voiceprint_id}; set replace to replace it",
            "speaker_id", "a speaker id not enrolled yet, or replace = true",
        )  # fmt: skip
    if isinstance(error, StoreUnavailable):
        return Rejection(grpc.StatusCode.UNAVAILABLE, "store_unavailable",
                         f"voiceprint store unavailable ({error}); nothing was written, retry")  # fmt: skip
    return None


def _message(record: VoiceprintRecord) -> pb.Voiceprint:
    return pb.Voiceprint(voiceprint_id=record.voiceprint_id, speaker_id=record.speaker_id,
                         speech_s=record.speech_s, quality=record.quality, windows=record.windows,
                         model_id=record.model_id, created_unix_ms=record.created_ms)  # fmt: skip


#: The service's name on the wire (speakerd.proto).
SERVICE_NAME = "speakerd.v1.Voiceprints"


def register(service: VoiceprintService, server: grpc.aio.Server) -> None:
    """Add `service` to `server` as the generated add_VoiceprintsServicer_to_server would,
    except that every method gets its requests as raw bytes, decoded by the method
    (api/errors.decode_message): gRPC would answer a request deserializer's failure itself,
    as UNKNOWN or INTERNAL, without the BadRequest detail, log line and metric."""
    stream = grpc.stream_unary_rpc_method_handler
    unary = grpc.unary_unary_rpc_method_handler
    handlers = {
        "Enroll": stream(service.Enroll, response_serializer=pb.EnrollResponse.SerializeToString),
        "Identify": stream(service.Identify, response_serializer=pb.IdentifyResponse.SerializeToString),
        "Verify": stream(service.Verify, response_serializer=pb.VerifyResponse.SerializeToString),
        "ListVoiceprints": unary(
            service.ListVoiceprints, response_serializer=pb.ListVoiceprintsResponse.SerializeToString
        ),
        "DeleteVoiceprint": unary(
            service.DeleteVoiceprint, response_serializer=pb.DeleteVoiceprintResponse.SerializeToString
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)

"""Thin sync and asyncio clients of `speakerd.v1.SpeakerEmbedding`: NumPy in, NumPy out.

Security (optional, matching the server's flags): `tls_ca` (PEM roots to trust; TLS on),
`tls_cert` + `tls_key` (a client certificate, for a server with --tls-client-ca), and
`token` (sent as `authorization: Bearer <token>` on every call, for --auth-tokens).

Retries: UNAVAILABLE (a draining or restarting replica) and RESOURCE_EXHAUSTED (a full
queue) are retried with exponential backoff and full jitter, within the call's overall
deadline, so a fleet of clients does not retry in lockstep. Every other code is final.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from speakerd.client import recording
from speakerd.v1 import speakerd_pb2 as pb
from speakerd.v1 import speakerd_pb2_grpc as pb_grpc
from speakerd.v1.tensors import from_tensor, to_tensor

#: The server's default address (`speakerd serve` listens on 127.0.0.1:50051 unless told
#: otherwise; the client cannot import the server's config, a test checks they agree).
DEFAULT_TARGET = "127.0.0.1:50051"
AUTHORIZATION_KEY = "authorization"
#: Same limit as the server's default (--max-message-mb 64): room for 32-chunk requests.
DEFAULT_MAX_MESSAGE_MB = 64
#: A b32 request on the CPU engine takes ~20 s; on a GPU ~10 ms. Callers set their own.
DEFAULT_TIMEOUT_S = 60.0
RETRY_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED})
REQUEST_ID_KEY = "x-request-id"


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with full jitter: attempt k waits uniform(0, min(cap, base * 2^k))."""

    attempts: int = 5
    initial_backoff_s: float = 0.05
    max_backoff_s: float = 2.0
    multiplier: float = 2.0
    codes: frozenset[grpc.StatusCode] = RETRY_CODES

    def backoff(self, attempt: int, rng: random.Random) -> float:
        return rng.uniform(0.0, min(self.max_backoff_s, self.initial_backoff_s * self.multiplier**attempt))


NO_RETRY = RetryPolicy(attempts=1)


@dataclass
class Embeddings:
    """One response: embeddings [n, s, 256] with per-row flags and what served them."""

    embeddings: np.ndarray  # [n, s, 256] float32
    empty: np.ndarray  # [n, s] bool: the mask had no weight; the row is the model's bias alone
    active_frames: np.ndarray  # [n, s] int32: trunk frames (of 125) with non-zero weight
    model_id: str
    precision: str
    plans: list[str] = field(default_factory=list)
    request_id: str = ""
    fp16_fallbacks: int = 0


def build_request(
    masks: np.ndarray,
    fbank: np.ndarray | None = None,
    waveform: np.ndarray | None = None,
    request_id: str = "",
) -> pb.EmbedRequest:
    """fbank [n, 998, 80] (float32/float16) or waveform [n, 160000], masks [n, s, F] (float32/uint8)."""
    if (fbank is None) == (waveform is None):
        raise ValueError("give exactly one of fbank or waveform")
    request = pb.EmbedRequest(masks=to_tensor(masks), request_id=request_id)
    if fbank is not None:
        request.fbank.CopyFrom(to_tensor(fbank))
    else:
        request.waveform.CopyFrom(to_tensor(np.asarray(waveform, dtype=np.float32)))
    return request


def parse_response(response: pb.EmbedResponse) -> Embeddings:
    embeddings = np.array(from_tensor(response.embeddings, "embeddings"), dtype=np.float32)
    rows = embeddings.shape[:2]
    return Embeddings(
        embeddings=embeddings,
        empty=np.array(response.empty, dtype=bool).reshape(rows),
        active_frames=np.array(response.active_frames, dtype=np.int32).reshape(rows),
        model_id=response.model_id,
        precision=response.precision,
        plans=list(response.plans),
        request_id=response.request_id,
        fp16_fallbacks=response.fp16_fallbacks,
    )


def channel_options(max_message_mb: int) -> list[tuple[str, int]]:
    size = max_message_mb * 1024 * 1024
    return [("grpc.max_receive_message_length", size), ("grpc.max_send_message_length", size)]


@dataclass(frozen=True)
class Security:
    """How a client reaches a server: TLS roots, a client certificate (mTLS), a bearer token.
    All empty: plaintext, no token (a loopback or in-cluster server)."""

    tls_ca: bytes | None = None
    tls_cert: bytes | None = None
    tls_key: bytes | None = None
    token: str | None = None

    @classmethod
    def from_files(
        cls,
        tls_ca: str | Path | None = None,
        tls_cert: str | Path | None = None,
        tls_key: str | Path | None = None,
        token: str | None = None,
    ) -> Security:
        """Read the PEM files (ValueError naming the argument when one cannot be read)."""
        if (tls_cert is None) != (tls_key is None):
            raise ValueError("tls_cert and tls_key go together: give both for mutual TLS, or neither")
        return cls(_read(tls_ca, "tls_ca"), _read(tls_cert, "tls_cert"), _read(tls_key, "tls_key"),
                   token.strip() if token else None)  # fmt: skip

    @property
    def tls(self) -> bool:
        return self.tls_ca is not None or self.tls_cert is not None

    def credentials(self) -> grpc.ChannelCredentials:
        """TLS channel credentials; without tls_ca the system's roots are trusted."""
        return grpc.ssl_channel_credentials(self.tls_ca, self.tls_key, self.tls_cert)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The bearer token as call metadata: sent on plaintext channels too, since gRPC's
        call credentials refuse a channel without TLS and the server may be on loopback."""
        return () if not self.token else ((AUTHORIZATION_KEY, f"Bearer {self.token}"),)


def _read(path: str | Path | None, name: str) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as error:
        raise ValueError(f"{name} {path}: cannot read it ({error.strerror})") from error


def make_channel(target: str, options: list[tuple[str, int]], security: Security, aio: bool):
    """A blocking or grpc.aio channel to `target`, with TLS when `security` asks for it."""
    if security.tls:
        make = grpc.aio.secure_channel if aio else grpc.secure_channel
        return make(target, security.credentials(), options=options)
    return (grpc.aio.insecure_channel if aio else grpc.insecure_channel)(target, options=options)


def health_name(status: int) -> str:
    return health_pb2.HealthCheckResponse.ServingStatus.Name(status)


class _ClientCore:
    """What the blocking and asyncio clients share: channel, stubs, deadline and retry rule."""

    #: grpc.aio channel (AsyncSpeakerClient) or a blocking one (SpeakerClient)
    _AIO: ClassVar[bool] = False

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        retry: RetryPolicy = RetryPolicy(),
        max_message_mb: int = DEFAULT_MAX_MESSAGE_MB,
        seed: int | None = None,
        tls_ca: str | Path | None = None,
        tls_cert: str | Path | None = None,
        tls_key: str | Path | None = None,
        token: str | None = None,
    ) -> None:
        """`tls_ca`: PEM roots (TLS on); `tls_cert` + `tls_key`: a client certificate (mTLS);
        `token`: a bearer token for a server started with --auth-tokens."""
        self.timeout_s = timeout_s
        self.retry = retry
        self.security = Security.from_files(tls_ca, tls_cert, tls_key, token)
        self._rng = random.Random(seed)
        self._channel = make_channel(target, channel_options(max_message_mb), self.security, aio=self._AIO)
        self._stub = pb_grpc.SpeakerEmbeddingStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def _metadata(self, request_id: str = "") -> tuple[tuple[str, str], ...]:
        ids = ((REQUEST_ID_KEY, request_id),) if request_id else ()
        return ids + self.security.metadata()

    def _deadline(self, timeout_s: float | None) -> float:
        return time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)

    def _retry_pause(self, attempt: int, code: grpc.StatusCode, deadline: float) -> float | None:
        """Seconds to wait before the next attempt, or None when this failure is final."""
        pause = self.retry.backoff(attempt, self._rng)
        final = attempt + 1 == self.retry.attempts or code not in self.retry.codes
        return None if final or time.monotonic() + pause >= deadline else pause


class SpeakerClient(_ClientCore):
    """Blocking client; one channel, safe to share between threads."""

    def __enter__(self) -> SpeakerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def _call(self, method: Callable[..., object], request: object, timeout_s: float | None, request_id: str):
        deadline = self._deadline(timeout_s)
        for attempt in range(self.retry.attempts):
            try:
                return method(
                    request,
                    timeout=max(0.0, deadline - time.monotonic()),
                    metadata=self._metadata(request_id),
                )
            except grpc.RpcError as error:
                pause = self._retry_pause(attempt, error.code(), deadline)
                if pause is None:
                    raise
                time.sleep(pause)
        raise AssertionError("unreachable: the last attempt raises or returns")

    def embed(
        self,
        fbank: np.ndarray,
        masks: np.ndarray,
        timeout_s: float | None = None,
        request_id: str | None = None,
    ) -> Embeddings:
        """Embed n chunks of fbank [n, 998, 80] under masks [n, s, F] -> [n, s, 256]."""
        request_id = request_id or uuid.uuid4().hex[:16]
        request = build_request(masks, fbank=fbank, request_id=request_id)
        return parse_response(self._call(self._stub.EmbedChunks, request, timeout_s, request_id))

    def embed_waveform(
        self,
        waveform: np.ndarray,
        masks: np.ndarray,
        timeout_s: float | None = None,
        request_id: str | None = None,
    ) -> Embeddings:
        """Embed n chunks of 16 kHz audio [n, 160000] in [-1, 1]; the server computes the fbank."""
        request_id = request_id or uuid.uuid4().hex[:16]
        request = build_request(masks, waveform=waveform, request_id=request_id)
        return parse_response(self._call(self._stub.EmbedChunks, request, timeout_s, request_id))

    def embed_stream(
        self, items: Iterable[tuple[np.ndarray, np.ndarray]], timeout_s: float | None = None
    ) -> Iterator[Embeddings]:
        """(fbank, masks) pairs over one EmbedChunksStream call, answered in order (no retries)."""
        requests = (build_request(masks, fbank=fbank) for fbank, masks in items)
        timeout = self.timeout_s if timeout_s is None else timeout_s
        for response in self._stub.EmbedChunksStream(requests, timeout=timeout, metadata=self._metadata()):
            yield parse_response(response)

    def embed_recording(
        self,
        samples: np.ndarray,
        sample_rate: int,
        masks: np.ndarray | None,
        exclude_overlap: bool = False,
        step_s: float = recording.DEFAULT_STEP_S,
        timeout_s: float | None = None,
        request_id: str | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> recording.RecordingEmbeddings:
        """A whole recording [N] or [N, C] (int16 or float32) with masks [n, s, F] of its n
        windows, embedded as pyannote's pipeline does (speakerd.client.recording). `masks`
        None: the server segments the recording itself, and the result carries its
        `segmentation` [n, 589, 3] (pyannote's get_segmentations) beside the embeddings
        [n, 3, 256] pooled under it.

        UNAVAILABLE and RESOURCE_EXHAUSTED are retried like the unary calls, by sending the
        whole recording again: its rows are a pure function of the inputs, so a repeat after
        a replica drained mid-call is safe. `progress(windows_answered, windows)` is called
        as each batch of rows arrives (a retry starts again from 0)."""
        request_id = request_id or uuid.uuid4().hex[:16]

        def attempt(_: None, timeout: float, metadata: recording.Metadata) -> recording.RecordingEmbeddings:
            requests = recording.recording_requests(
                samples, sample_rate, masks, exclude_overlap, step_s, request_id
            )
            responses = self._stub.EmbedRecording(requests, timeout=timeout, metadata=metadata)
            return recording.collect(_reporting(responses, progress))

        return self._call(attempt, None, timeout_s, request_id)

    def model_info(self, timeout_s: float | None = None) -> pb.ModelInfo:
        return self._call(self._stub.GetModelInfo, pb.GetModelInfoRequest(), timeout_s, uuid.uuid4().hex[:16])

    def health(self, service: str = "", timeout_s: float = 5.0) -> str:
        """SERVING, NOT_SERVING, SERVICE_UNKNOWN or UNKNOWN; raises grpc.RpcError if unreachable."""
        response = self._health.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        return health_name(response.status)

    def wait_serving(self, timeout_s: float, service: str = "") -> None:
        """Poll health until SERVING; TimeoutError with the last status otherwise."""
        deadline, status = time.monotonic() + timeout_s, "UNREACHABLE"
        while time.monotonic() < deadline:
            try:
                status = self.health(service, timeout_s=min(2.0, max(0.1, deadline - time.monotonic())))
            except grpc.RpcError as error:
                status = f"UNREACHABLE ({error.code().name})"
            if status == "SERVING":
                return
            time.sleep(0.1)
        raise TimeoutError(f"not SERVING after {timeout_s:.0f} s; last status {status}")


def _reporting(
    responses: Iterable[pb.EmbedRecordingResponse], progress: Callable[[int, int], None] | None
) -> Iterator[pb.EmbedRecordingResponse]:
    """The responses unchanged, calling `progress(windows answered, windows)` after each."""
    for response in responses:
        if progress is not None:
            progress(response.first_window + len(response.starts), response.windows)
        yield response


class AsyncSpeakerClient(_ClientCore):
    """asyncio client on grpc.aio; create and use it inside one event loop."""

    _AIO = True

    async def __aenter__(self) -> AsyncSpeakerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def _call(
        self, method: Callable[..., object], request: object, timeout_s: float | None, request_id: str
    ):
        deadline = self._deadline(timeout_s)
        for attempt in range(self.retry.attempts):
            try:
                remaining = max(0.0, deadline - time.monotonic())
                return await method(request, timeout=remaining, metadata=self._metadata(request_id))  # type: ignore[misc]
            except grpc.aio.AioRpcError as error:
                pause = self._retry_pause(attempt, error.code(), deadline)
                if pause is None:
                    raise
                await asyncio.sleep(pause)
        raise AssertionError("unreachable: the last attempt raises or returns")

    async def embed(
        self,
        fbank: np.ndarray,
        masks: np.ndarray,
        timeout_s: float | None = None,
        request_id: str | None = None,
    ) -> Embeddings:
        request_id = request_id or uuid.uuid4().hex[:16]
        request = build_request(masks, fbank=fbank, request_id=request_id)
        return parse_response(await self._call(self._stub.EmbedChunks, request, timeout_s, request_id))

    async def embed_request(
        self, request: pb.EmbedRequest, timeout_s: float | None = None
    ) -> pb.EmbedResponse:
        """A prebuilt request (the load generator reuses one), the raw response back."""
        request_id = request.request_id or uuid.uuid4().hex[:16]
        return await self._call(self._stub.EmbedChunks, request, timeout_s, request_id)

    def stream(self, requests: AsyncIterator[pb.EmbedRequest], timeout_s: float | None = None):
        """The raw EmbedChunksStream call: iterate it for responses in request order."""
        return self._stub.EmbedChunksStream(
            requests, timeout=self.timeout_s if timeout_s is None else timeout_s, metadata=self._metadata()
        )

    async def embed_recording(
        self,
        samples: np.ndarray,
        sample_rate: int,
        masks: np.ndarray | None,
        exclude_overlap: bool = False,
        step_s: float = recording.DEFAULT_STEP_S,
        timeout_s: float | None = None,
        request_id: str | None = None,
        piece_bytes: int = recording.PIECE_BYTES,
        masks_first: bool = True,
    ) -> recording.RecordingEmbeddings:
        """SpeakerClient.embed_recording on asyncio; `piece_bytes` and `masks_first` as in
        recording.recording_requests (the load generator compares them)."""
        request_id = request_id or uuid.uuid4().hex[:16]
        requests = recording.recording_requests(
            samples, sample_rate, masks, exclude_overlap, step_s, request_id, piece_bytes, masks_first
        )
        timeout = self.timeout_s if timeout_s is None else timeout_s
        return await recording.embed_recording_async(
            self._stub, requests, timeout, self._metadata(request_id)
        )

    async def model_info(self, timeout_s: float | None = None) -> pb.ModelInfo:
        return await self._call(
            self._stub.GetModelInfo, pb.GetModelInfoRequest(), timeout_s, uuid.uuid4().hex[:16]
        )

    async def health(self, service: str = "", timeout_s: float = 5.0) -> str:
        response = await self._health.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        return health_name(response.status)

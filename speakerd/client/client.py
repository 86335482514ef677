"""Thin sync and asyncio clients of `speakerd.v1.SpeakerEmbedding`: NumPy in, NumPy out.

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

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from speakerd.v1 import speakerd_pb2 as pb
from speakerd.v1 import speakerd_pb2_grpc as pb_grpc
from speakerd.v1.tensors import from_tensor, to_tensor

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


def _metadata(request_id: str) -> tuple[tuple[str, str], ...]:
    return ((REQUEST_ID_KEY, request_id),)


def health_name(status: int) -> str:
    return health_pb2.HealthCheckResponse.ServingStatus.Name(status)


class _ClientCore:
    """What the blocking and asyncio clients share: channel, stubs, deadline and retry rule."""

    def __init__(
        self,
        channel: grpc.Channel | grpc.aio.Channel,
        timeout_s: float,
        retry: RetryPolicy,
        seed: int | None,
    ) -> None:
        self.timeout_s = timeout_s
        self.retry = retry
        self._rng = random.Random(seed)
        self._channel = channel
        self._stub = pb_grpc.SpeakerEmbeddingStub(channel)
        self._health = health_pb2_grpc.HealthStub(channel)

    def _deadline(self, timeout_s: float | None) -> float:
        return time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)

    def _retry_pause(self, attempt: int, code: grpc.StatusCode, deadline: float) -> float | None:
        """Seconds to wait before the next attempt, or None when this failure is final."""
        pause = self.retry.backoff(attempt, self._rng)
        final = attempt + 1 == self.retry.attempts or code not in self.retry.codes
        return None if final or time.monotonic() + pause >= deadline else pause


class SpeakerClient(_ClientCore):
    """Blocking client; one channel, safe to share between threads."""

    def __init__(
        self,
        target: str,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        retry: RetryPolicy = RetryPolicy(),
        max_message_mb: int = DEFAULT_MAX_MESSAGE_MB,
        seed: int | None = None,
    ) -> None:
        channel = grpc.insecure_channel(target, options=channel_options(max_message_mb))
        super().__init__(channel, timeout_s, retry, seed)

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
                    request, timeout=max(0.0, deadline - time.monotonic()), metadata=_metadata(request_id)
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
        for response in self._stub.EmbedChunksStream(requests, timeout=timeout):
            yield parse_response(response)

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


class AsyncSpeakerClient(_ClientCore):
    """asyncio client on grpc.aio; create and use it inside one event loop."""

    def __init__(
        self,
        target: str,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        retry: RetryPolicy = RetryPolicy(),
        max_message_mb: int = DEFAULT_MAX_MESSAGE_MB,
        seed: int | None = None,
    ) -> None:
        channel = grpc.aio.insecure_channel(target, options=channel_options(max_message_mb))
        super().__init__(channel, timeout_s, retry, seed)

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
                return await method(request, timeout=remaining, metadata=_metadata(request_id))  # type: ignore[misc]
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
            requests, timeout=self.timeout_s if timeout_s is None else timeout_s
        )

    async def model_info(self, timeout_s: float | None = None) -> pb.ModelInfo:
        return await self._call(
            self._stub.GetModelInfo, pb.GetModelInfoRequest(), timeout_s, uuid.uuid4().hex[:16]
        )

    async def health(self, service: str = "", timeout_s: float = 5.0) -> str:
        response = await self._health.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        return health_name(response.status)

"""Settings of `serve`: every flag also read from a `SPEAKERD_<NAME>` environment variable.

A flag given on the command line wins over the environment, which wins over the default,
so a container image sets its defaults by environment and an operator can still override
one flag by hand. Values are parsed and checked here, once, so the server never starts
half-configured.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from speakerd.engine.factory import ENGINE_KINDS
from speakerd.model.numerics import Math
from speakerd.model.source import MODEL_ENV, MODEL_HELP, PLDA_HELP, env_model
from speakerd.serving.memory.recording_budget import (
    DEFAULT_CLUSTERING_MEMORY_MB,
    DEFAULT_RECORDING_MEMORY_MB,
    DEFAULT_RECORDING_QUEUE,
)

ENV_PREFIX = "SPEAKERD_"
#: Loopback by default: exposing the port is a deliberate act (the container sets SPEAKERD_HOST).
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 50051
DEFAULT_METRICS_PORT = 9100
#: The plans every engine preallocates: single-chunk latency and the b32 throughput plan (docs/service.md).
DEFAULT_PLANS = "1,32"
#: The service contract packs at most 32 chunks into one batch: the GPU plans, their graphs
#: and the batcher's cost model are sized and measured for that, so a larger plan is refused.
MAX_PLAN_SIZE = 32
#: How long the batcher holds a partial batch for more chunks: a b32 FP16 batch costs 4.8 ms
#: of GPU time on an H200, so waiting under half that costs a lone
#: request less than one batch of latency and lets concurrent requests share a batch.
DEFAULT_MAX_DELAY_MS = 2.0
#: Queued chunks before RESOURCE_EXHAUSTED: 16 full b32 batches, about 80 ms of FP16 work on
#: an H200 (4.8 ms a batch), so a rejected client retries long before a queued request would
#: time out.
DEFAULT_QUEUE_CHUNKS = 512
#: Time to finish in-flight requests after SIGTERM; below Kubernetes' default 30 s grace period.
DEFAULT_DRAIN_SECONDS = 25.0
#: A 32-chunk request is 10.2 MB of float32 fbank or 20.5 MB of waveform: 64 MB leaves room
#: for masks and for a client packing up to ~96 fbank chunks into one call.
DEFAULT_MAX_MESSAGE_MB = 64
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
#: Who may run the trunk's convolutions on the GPU: "auto" times our tensor-core kernel
#: against cuDNN per convolution; "cudnn" never runs ours (an operator's escape hatch);
#: "blocks" is auto plus one kernel per layer1 BasicBlock (both convolutions, the hidden
#: activation kept on chip) where it beats the two (FP16; not the default until measured
#: on a GPU: docs/performance.md).
CONV_KERNELS = ("auto", "cudnn", "blocks")
#: --linkage: Diarize's centroid linkage compiled (distances on the GPU engine's device, else
#: the host's cores) or SciPy's own, the reference; both give SciPy's bits
#: (model/diarization/linkage.py), so scipy is for checking a server against it. Its
#: IMPLEMENTATIONS, spelled out: importing that package imports SciPy, and the flags load
#: without it (tests/test_linkage.py checks the two agree).
LINKAGES = ("compiled", "scipy")
#: --segmentation-math: the GPU segmenter's maths (engine/gpu/segmentation/engine.py's MATHS):
#: fp32, strict FP32 GEMMs beside the sinc convolution in double; fast, the GEMMs on 3xTF32
#: tensor cores and the sinc convolution in float32. The CPU segmenter has fp32 only.
#: `python -m speakerd.tools.compare_segmentation` compares either's hard segmentation with
#: pyannote's, cell by cell.
SEGMENTATION_MATHS = ("fp32", "fast")
#: `--devices` value for every device of the engine's kind on this machine.
ALL_DEVICES = "all"
#: Most `--receivers`: each is a process with its own shared-memory slots; past a few per
#: GPU they only add memory (docs/service.md: 4 took an H200's FP16 server past 90% of its
#: engine).
MAX_RECEIVERS = 32
#: The server's files (the SQLite voiceprint store): the XDG data directory of its user.
DEFAULT_DATA_DIR = "~/.local/share/speakerd"
#: Log lines of the server and of its receiver processes.


#: The exit code of a UsageError: argparse's usage-error code.
USAGE_EXIT = 2


class UsageError(ValueError):
    """A flag or SPEAKERD_* value the server cannot start with. `serve` prints it as one line
    naming the flag and what it takes, and exits USAGE_EXIT."""


@dataclass(frozen=True)
class DeviceRequest:
    """What `--devices` asked for: every device (`indices` None, from `all`) or these device
    indices, ascending and unique. Which exist is known only once the engine kind is (the
    GPU count, or the CPU engine's worker slots): `resolve` checks them then."""

    text: str
    indices: tuple[int, ...] | None

    def resolve(self, available: int, unit: str) -> tuple[int, ...]:
        """The device indices to serve on, given `available` devices of the engine's kind
        (`unit` names them for the message, e.g. "GPUs"); UsageError for one that does not
        exist or when there is none."""
        flag = f"--devices {self.text} [{env_name('devices')}]"
        if available < 1:
            raise UsageError(f"{flag}: this machine has no {unit}; serve without --devices")
        if self.indices is None:
            return tuple(range(available))
        missing = [index for index in self.indices if index >= available]
        if missing:
            raise UsageError(
                f"{flag}: device {missing[0]} does not exist; this machine has {available} {unit} "
                f"(indices 0..{available - 1}), or use --devices {ALL_DEVICES}"
            )
        return self.indices


@dataclass(frozen=True)
class ServeConfig:
    host: str
    port: int
    metrics_port: int
    engine: str
    #: --model as given: a Hugging Face repo id, a local path, or None for the default model
    model: str | None
    math: Math
    plans: tuple[int, ...]
    max_delay_ms: float
    queue_chunks: int
    drain_seconds: float
    max_message_mb: int
    log_level: str
    conv_kernels: str = "auto"
    #: --linkage: how Diarize computes the clustering's centroid linkage (LINKAGES)
    linkage: str = "compiled"
    #: --segmentation-model as given (EmbedRecording's header.segment): a Hugging Face repo id,
    #: a local path, or None for the synthetic default segmentation model
    segmentation_model: str | None = None
    #: --segmentation-math: the GPU segmenter's maths (SEGMENTATION_MATHS)
    segmentation_math: str = "fp32"
    #: --plda as given (Diarize's VBx clustering): a Hugging Face repo id whose plda/ folder
    #: holds the PLDA, a local directory, or None: no PLDA, and VBx is unavailable
    plda: str | None = None
    #: bytes of recordings in progress at once, and calls that may wait for room in them
    recording_memory_mb: int = DEFAULT_RECORDING_MEMORY_MB
    recording_queue: int = DEFAULT_RECORDING_QUEUE
    clustering_memory_mb: int = DEFAULT_CLUSTERING_MEMORY_MB
    #: PEM files: server certificate chain and key (TLS), and the CA that client certificates
    #: must chain to (mutual TLS). All None: plaintext gRPC.
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None
    #: Bearer tokens, one per line; None: no token needed.
    auth_tokens: Path | None = None
    #: One engine per listed device, each in its own worker process; None: one engine in
    #: this process (the default, as before --devices existed).
    devices: DeviceRequest | None = None
    #: Processes that receive gRPC calls on the port and hand them over through shared
    #: memory (receiver_link.py); 0: this process receives them itself.
    receivers: int = 0
    #: The CPU engine's threads (ONNX Runtime intra-op); 0: every core this process may run
    #: on. With --devices, each CPU worker's (0: the cores split between the workers).
    cpu_threads: int = 0
    #: Where the server keeps its files (the SQLite voiceprint store).
    data_dir: Path = Path.home() / ".local" / "share" / "speakerd"  # DEFAULT_DATA_DIR, expanded
    #: Voiceprint store: "sqlite" (a file in data_dir), a postgresql:// URL, or "off".
    voiceprints: str = "sqlite"

    @property
    def max_message_bytes(self) -> int:
        return self.max_message_mb * 1024 * 1024


def parse_plans(text: str) -> tuple[int, ...]:
    """'1,32' -> (1, 32): ascending, unique, positive batch sizes."""
    try:
        sizes = sorted({int(piece) for piece in text.split(",") if piece.strip()})
    except ValueError as error:
        message = f"plans {text!r}: expected comma-separated batch sizes like 1,32"
        raise argparse.ArgumentTypeError(message) from error
    if not sizes or sizes[0] < 1:
        raise argparse.ArgumentTypeError(f"plans {text!r}: expected positive batch sizes like 1,32")
    if sizes[-1] > MAX_PLAN_SIZE:
        raise argparse.ArgumentTypeError(
            f"plans {text!r}: batch size {sizes[-1]} exceeds {MAX_PLAN_SIZE}, the most chunks one "
            f"batch holds; use sizes in 1..{MAX_PLAN_SIZE} like 1,32"
        )
    return tuple(sizes)


def parse_devices(text: str) -> DeviceRequest | None:
    """'' -> None (one engine in process), 'all' -> every device, '0,1' -> those indices."""
    text = str(text).strip()
    if not text:
        return None
    if text.lower() == ALL_DEVICES:
        return DeviceRequest(ALL_DEVICES, None)
    expected = f"expected {ALL_DEVICES} or comma-separated device indices like 0,1"
    pieces = [piece.strip() for piece in text.split(",")]
    if not all(piece.isdigit() for piece in pieces):
        raise argparse.ArgumentTypeError(f"devices {text!r}: {expected}")
    indices = [int(piece) for piece in pieces]
    repeated = sorted({index for index in indices if indices.count(index) > 1})
    if repeated:
        raise argparse.ArgumentTypeError(
            f"devices {text!r}: device {repeated[0]} listed twice; each device runs one engine"
        )
    return DeviceRequest(text, tuple(sorted(indices)))


def _number(text: str, kind: type[int] | type[float], expected: str) -> int | float:
    """`text` as a number; ArgumentTypeError saying what was expected (argparse's own message
    would name the parsing function: "invalid _port value")."""
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected {expected}") from None


def _port(text: str) -> int:
    port = int(_number(text, int, "a port number 0..65535 (0 picks a free port)"))
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port {port}: expected 0..65535 (0 picks a free port)")
    return port


def _receivers(text: str) -> int:
    value = int(_number(text, int, f"a number of receiver processes, 0 to {MAX_RECEIVERS}"))
    if not 0 <= value <= MAX_RECEIVERS:
        raise argparse.ArgumentTypeError(
            f"{value}: expected 0 (this process receives calls) to {MAX_RECEIVERS} receiver processes"
        )
    return value


def _non_negative_float(text: str) -> float:
    value = float(_number(text, float, "a number >= 0"))
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value}: expected a value >= 0")
    return value


def _positive_int(text: str) -> int:
    value = int(_number(text, int, "an integer >= 1"))
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: expected an integer >= 1")
    return value


def _non_negative_int(text: str) -> int:
    value = int(_number(text, int, "an integer >= 0"))
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value}: expected an integer >= 0")
    return value


def env_default(name: str, default: object) -> object:
    """The default of flag --name: SPEAKERD_NAME when set (argparse applies `type` to strings)."""
    return os.environ.get(env_name(name), default)


def configure(parser: argparse.ArgumentParser) -> None:
    """Add serve's flags; each help line names its environment variable."""

    def add(name: str, default: object, help_text: str, **kwargs: object) -> None:
        env = env_name(name)
        if env in os.environ and callable(kwargs.get("type")):
            kwargs["type"] = _naming_env(kwargs["type"], env, os.environ[env])  # type: ignore[arg-type]
        parser.add_argument(f"--{name}", default=env_default(name, default), help=f"{help_text} [{env}]",
                            **kwargs)  # fmt: skip

    add("host", DEFAULT_HOST, "address to listen on (gRPC and metrics)")
    add("port", DEFAULT_PORT, "gRPC port (0 picks a free one)", type=_port)
    add("metrics-port", DEFAULT_METRICS_PORT, "Prometheus /metrics port (0 picks a free one)", type=_port)
    add("engine", "auto", "engine: auto (GPU when usable), cpu or gpu", choices=ENGINE_KINDS)
    # --weights is the same flag under its older name, SPEAKERD_WEIGHTS the same variable
    parser.add_argument(
        "--model", "--weights", dest="model", default=env_model(), help=f"{MODEL_HELP} [{MODEL_ENV}]"
    )
    add(
        "segmentation-model",
        None,
        "the segmentation model EmbedRecording's header.segment runs: Hugging Face repo id "
        "(org/name[@revision], e.g. pyannote/segmentation-3.0: its pytorch_model.bin) or a local "
        ".safetensors, .bin or .ckpt file or directory (default: the synthetic segmentation model, made "
        "on first use in $SPEAKERD_CACHE)",
    )
    add(
        "segmentation-math",
        "fp32",
        "the GPU segmenter's maths: fp32 (strict FP32 GEMMs, the sinc convolution in double) or fast "
        "(the GEMMs on 3xTF32 tensor cores, the sinc convolution in float32); the CPU segmenter has "
        "fp32 only",
        choices=SEGMENTATION_MATHS,
    )
    add("plda", None, PLDA_HELP)
    add(
        "recording-memory-mb",
        DEFAULT_RECORDING_MEMORY_MB,
        "MiB that recording calls in progress may hold at once (frames and mask rows, reserved when a "
        "call starts); a call that does not fit waits for room up to its deadline",
        type=_positive_int,
    )
    add(
        "clustering-memory-mb",
        DEFAULT_CLUSTERING_MEMORY_MB,
        "MiB that Diarize calls clustering at once may hold (the linkage's 8 n^2 bytes for n clean speaker "
        "pairs, and what each keeps per window); a call that does not fit waits for room up to its deadline",
        type=_positive_int,
    )
    add(
        "recording-queue",
        DEFAULT_RECORDING_QUEUE,
        "recording calls that may wait for room; one more is RESOURCE_EXHAUSTED at once",
        type=_non_negative_int,
    )
    add("math", Math.FP32.value, "trunk arithmetic", choices=[m.value for m in Math])
    add("plans", DEFAULT_PLANS, f"batch sizes to preallocate, each 1..{MAX_PLAN_SIZE}", type=parse_plans)
    add("max-delay-ms", DEFAULT_MAX_DELAY_MS, "longest wait for a batch to fill", type=_non_negative_float)
    add("queue-chunks", DEFAULT_QUEUE_CHUNKS, "queued chunks before RESOURCE_EXHAUSTED", type=_positive_int)
    add(
        "drain-seconds",
        DEFAULT_DRAIN_SECONDS,
        "after SIGTERM, time for calls in progress; the rest get UNAVAILABLE",
        type=_non_negative_float,
    )
    add("max-message-mb", DEFAULT_MAX_MESSAGE_MB, "largest gRPC message in MiB", type=_positive_int)
    add("log-level", "INFO", "log level", choices=LOG_LEVELS, type=str.upper)
    kernels = (
        "GPU convolutions: auto (ours where faster), cudnn, blocks (auto + one-kernel layer1 blocks, trial)"
    )
    add("conv-kernels", "auto", kernels, choices=CONV_KERNELS)
    add(
        "linkage",
        "compiled",
        "Diarize's centroid linkage: compiled (SciPy's bits: on the GPU engine's device, else "
        "on the host's cores) or scipy (SciPy itself, the reference, for checking)",
        choices=LINKAGES,
    )
    # optional transport security; the metrics port stays plain HTTP (scraped inside the cluster)
    add("tls-cert", None, "PEM certificate chain: serve gRPC over TLS (reloaded when the file changes)")
    add("tls-key", None, "PEM private key of --tls-cert (reloaded when the file changes)")
    add("tls-client-ca", None, "PEM CA bundle: require client certificates signed by it (mutual TLS)")
    add("auth-tokens", None, "file of bearer tokens, one a line: calls must send one (health stays open)")
    add(
        "devices",
        None,
        f"one engine per device, each in a worker process: {ALL_DEVICES} or indices like 0,1 "
        "(off: one engine in this process)",
        type=parse_devices,
    )
    add(
        "receivers",
        0,
        "processes that receive gRPC calls on the port and hand 32-chunk requests to this one "
        "through shared memory (0: this process receives them)",
        type=_receivers,
    )
    add(
        "cpu-threads",
        0,
        "threads of the CPU engine (ONNX Runtime's intra-op pool; with --devices, of each CPU worker); "
        "0: every core this process may run on, which a container's CPU quota does not narrow",
        type=_non_negative_int,
    )
    add("data-dir", DEFAULT_DATA_DIR, "directory of the server's files: the SQLite voiceprint store")
    add(
        "voiceprints",
        "sqlite",
        "voiceprint store: sqlite (a file in --data-dir), a postgresql:// URL (a fleet), or off",
    )


def _voiceprints(args: argparse.Namespace) -> str:
    value = str(args.voiceprints)
    if value in ("sqlite", "off") or value.startswith(("postgresql://", "postgres://")):
        return value
    raise UsageError(
        f"--voiceprints: expected sqlite, off or a postgresql:// URL [{env_name('voiceprints')}]"
    )


def _naming_env(parse: Callable[[str], object], env: str, raw: str) -> Callable[[str], object]:
    """`parse`, whose error names the variable when the bad value is the one it set: argparse
    parses an environment default like a flag and would name only the flag."""

    def parse_naming_env(text: str) -> object:
        try:
            return parse(text)
        except (argparse.ArgumentTypeError, ValueError) as error:
            if text != raw:
                raise
            reason = str(error).removeprefix(f"{raw!r}: ")
            raise argparse.ArgumentTypeError(f"{env}={raw!r}: {reason}") from None

    return parse_naming_env


def env_name(flag: str) -> str:
    """--max-delay-ms -> SPEAKERD_MAX_DELAY_MS."""
    return ENV_PREFIX + flag.upper().replace("-", "_")


def _check_choice(args: argparse.Namespace, flag: str, choices: tuple[str, ...] | list[str]) -> None:
    """argparse checks the choices of a flag given on the command line, never of a default:
    a value that came from the environment is checked here instead."""
    value = getattr(args, flag.replace("-", "_"))
    if value not in choices:
        raw = os.environ.get(env_name(flag), value)
        raise UsageError(f"{env_name(flag)}={raw!r}: expected one of {', '.join(map(str, choices))}")


def _readable_file(args: argparse.Namespace, flag: str) -> Path | None:
    """The path of a file flag, checked to be a readable file now rather than at first use."""
    value = getattr(args, flag.replace("-", "_"))
    if value is None or str(value) == "":
        return None
    path = Path(value).expanduser()
    if not path.is_file():
        raise UsageError(f"--{flag} {value}: no such file [{env_name(flag)}]")
    try:
        path.read_bytes()
    except OSError as error:
        raise UsageError(f"--{flag} {value}: cannot read it ({error.strerror}) [{env_name(flag)}]") from error
    return path


def from_args(args: argparse.Namespace) -> ServeConfig:
    """Validate the combination of flags (each flag alone was checked by its type); UsageError
    naming the flag (or its SPEAKERD_* variable) otherwise."""
    _check_choice(args, "engine", ENGINE_KINDS)
    _check_choice(args, "math", [m.value for m in Math])
    _check_choice(args, "log-level", LOG_LEVELS)
    _check_choice(args, "conv-kernels", CONV_KERNELS)
    _check_choice(args, "linkage", LINKAGES)
    _check_choice(args, "segmentation-math", SEGMENTATION_MATHS)
    try:
        plans = args.plans if isinstance(args.plans, tuple) else parse_plans(str(args.plans))
    except argparse.ArgumentTypeError as error:
        raise UsageError(f"--plans: {error} [{env_name('plans')}]") from error
    if args.queue_chunks < plans[-1]:
        raise UsageError(f"--queue-chunks {args.queue_chunks} must hold one full batch of {plans[-1]} chunks")
    tls_cert, tls_key = _readable_file(args, "tls-cert"), _readable_file(args, "tls-key")
    tls_client_ca = _readable_file(args, "tls-client-ca")
    if (tls_cert is None) != (tls_key is None):
        raise UsageError("--tls-cert and --tls-key go together: give both for TLS, or neither")
    if tls_client_ca is not None and tls_cert is None:
        raise UsageError("--tls-client-ca needs --tls-cert and --tls-key: mutual TLS is TLS first")
    try:  # argparse applies the type to a default string too; a DeviceRequest passes through
        devices = parse_devices(args.devices) if isinstance(args.devices, str) else args.devices
    except argparse.ArgumentTypeError as error:
        raise UsageError(f"--devices: {error} [{env_name('devices')}]") from error
    return ServeConfig(
        host=args.host,
        port=int(args.port),
        metrics_port=int(args.metrics_port),
        engine=args.engine,
        model=args.model or None,
        segmentation_model=args.segmentation_model or None,
        segmentation_math=args.segmentation_math,
        plda=args.plda or None,
        recording_memory_mb=int(args.recording_memory_mb),
        recording_queue=int(args.recording_queue),
        clustering_memory_mb=int(args.clustering_memory_mb),
        math=Math(args.math),
        plans=plans,
        max_delay_ms=float(args.max_delay_ms),
        queue_chunks=int(args.queue_chunks),
        drain_seconds=float(args.drain_seconds),
        max_message_mb=int(args.max_message_mb),
        log_level=args.log_level,
        conv_kernels=args.conv_kernels,
        linkage=args.linkage,
        tls_cert=tls_cert,
        tls_key=tls_key,
        tls_client_ca=tls_client_ca,
        auth_tokens=_readable_file(args, "auth-tokens"),
        devices=devices,
        receivers=int(args.receivers),
        cpu_threads=int(args.cpu_threads),
        data_dir=Path(args.data_dir).expanduser(),
        voiceprints=_voiceprints(args),
    )

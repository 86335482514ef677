"""ONNX Runtime CPU on the project's ONNX export: the deterministic FP32 reference of docs/model.md.

One intra-op and one inter-op thread with sequential execution make every reduction run
in one fixed order, so the same inputs give the same bits on every run; that is what
lets the reference files be byte-identical across regenerations. The session is cached
per (model id, taps): building and optimising the graph costs more than a b1 run.
"""

from __future__ import annotations

import threading

import numpy as np
import onnxruntime as ort

from speakerd.model.weights import FoldedModel
from speakerd.onnx.export import build_onnx

#: ORT_ENABLE_ALL: the fusions (Conv+Relu, Conv+Add) are deterministic and keep the
#: reference fast enough to regenerate every case in CI.
GRAPH_OPTIMIZATION = ort.GraphOptimizationLevel.ORT_ENABLE_ALL

_SESSIONS: dict[tuple[str, bool, int], ort.InferenceSession] = {}
_SESSIONS_LOCK = threading.Lock()


#: ONNX Runtime's intra-op threads busy-wait for the next operator by default. A CPU server
#: shares its cores with its own decoding, segmentation and gRPC threads, and often with
#: other processes; spinning threads take those cores for nothing. Measured on 2 cores, the
#: CPU engine's 8-chunk batches: alone 3.94 chunks/s spinning, 3.99 not; two engines at once
#: 1.70 + 1.69 spinning, 1.93 + 1.92 not (13.6% more). The bits are the same either way.
ALLOW_SPINNING = "0"


def session_options(threads: int) -> ort.SessionOptions:
    """CPU session options: `threads` intra-op threads that sleep when idle (ALLOW_SPINNING),
    one inter-op thread, sequential."""
    options = ort.SessionOptions()
    options.add_session_config_entry("session.intra_op.allow_spinning", ALLOW_SPINNING)
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = GRAPH_OPTIMIZATION
    options.log_severity_level = 3  # warnings and up only: ORT's info lines are not ours to print
    return options


def cpu_session(model: FoldedModel, taps: bool, threads: int = 1) -> ort.InferenceSession:
    """The cached CPU session of `model`'s ONNX graph (with or without tap outputs)."""
    key = (model.model_id, taps, threads)
    with _SESSIONS_LOCK:
        session = _SESSIONS.get(key)
        if session is None:
            serialized = build_onnx(model, taps=taps).SerializeToString()
            session = ort.InferenceSession(
                serialized, session_options(threads), providers=["CPUExecutionProvider"]
            )
            _SESSIONS[key] = session
    return session


class OnnxReference:
    """ORT CPU, one thread, sequential: `.run(fbank, masks)` -> {tap: float32 array}."""

    def __init__(self, model: FoldedModel, taps: bool = True) -> None:
        self.model = model
        self.taps = taps
        self.session = cpu_session(model, taps, threads=1)
        self.output_names = [output.name for output in self.session.get_outputs()]

    def run(self, fbank: np.ndarray, masks: np.ndarray) -> dict[str, np.ndarray]:
        """fbank [n, 998, 80] and masks [n, 3, F] float32 -> every output by name."""
        feeds = {
            "fbank": np.ascontiguousarray(fbank, dtype=np.float32),
            "masks": np.ascontiguousarray(masks, dtype=np.float32),
        }
        values = self.session.run(self.output_names, feeds)
        return dict(zip(self.output_names, values, strict=True))

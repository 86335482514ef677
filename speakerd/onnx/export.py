"""The multi-mask WeSpeaker ResNet34 as an ONNX graph, built from folded weights without torch.

ONNX Runtime CPU runs this graph to produce the reference outputs every engine is judged
against (docs/model.md) and to serve on machines without a GPU. Building it node by node from
`speakerd.model.architecture` (instead of tracing pyannote's torch module) keeps the graph, the
NumPy float64 forward and the GPU plans walking the same tables, and keeps torch out of
the service.

Graph layout:
- inputs `fbank` [n, 998, 80] float32 and `masks` [n, 3, F] float32, F dynamic;
- the trunk runs NCHW with H = 80 mel bins and W = 998 frames (fbank transposed, as
  pyannote's `x.permute(0, 2, 1).unsqueeze(1)`), convs carry the folded BatchNorm bias;
- every trunk tap is a graph output in NCHW [n, C, H, W] (`architecture.tap_shape`), the
  value named exactly as the tap, so a tap is addressable by name in any ONNX tool;
- masks are resized onto the 125 trunk frames in-graph: index = floor(t * F / 125) in
  int64 (Range, Mul, Div: integer Div floors for non-negative operands), then Gather;
- pooling is pyannote's weighted StatsPool, operation for operation (docs/model.md), then the
  `seg_1` Gemm: `pooled` [n*3, 5120] and `output` [n*3, 256], row = chunk * 3 + speaker.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from speakerd.model.architecture import (
    BLOCKS,
    EMBEDDING_DIM,
    FRAMES,
    MAX_SPEAKERS,
    MEL_BINS,
    POOL_FEATURES,
    POOL_V1_EPS,
    POOL_VAR_EPS,
    STATS_DIM,
    TAP_NAMES,
    TRUNK_FRAMES,
    tap_shape,
)
from speakerd.model.weights import FoldedConv, FoldedModel

#: Opset 17 has every operator used here with axes as inputs (ReduceSum since 13) and is
#: supported by every onnxruntime release this project allows (>= 1.18).
OPSET = 17
#: IR version 8 is what opset 17 shipped with; newer IR versions would lock out older runtimes.
IR_VERSION = 8
#: Symbolic batch dimension names shown by ONNX tools.
BATCH_DIM = "n"
MASK_FRAMES_DIM = "F"
ROWS_DIM = "rows"


class _GraphBuilder:
    """Collects nodes and initializers; `value` names are unique by construction."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []

    def const(self, name: str, array: np.ndarray) -> str:
        # np.asarray keeps 0-d scalars 0-d (np.ascontiguousarray would make them 1-d), and
        # Range needs true scalars.
        self.initializers.append(numpy_helper.from_array(np.asarray(array, order="C"), name))
        return name

    def node(self, op: str, inputs: list[str], output: str, **attrs: object) -> str:
        self.nodes.append(helper.make_node(op, inputs, [output], name=output, **attrs))
        return output

    def conv(self, x: str, folded: FoldedConv, output: str) -> str:
        spec = folded.spec
        weight = self.const(f"{spec.name}.weight", folded.weight.astype(np.float32))
        bias = self.const(f"{spec.name}.bias", folded.bias.astype(np.float32))
        return self.node(
            "Conv",
            [x, weight, bias],
            output,
            kernel_shape=[spec.kernel, spec.kernel],
            strides=[spec.stride, spec.stride],
            pads=[spec.pad] * 4,
        )


def _trunk(graph: _GraphBuilder, model: FoldedModel, x: str) -> str:
    """Stem and the 16 BasicBlocks; returns the layer4 output value [n, 256, 10, 125]."""
    x = graph.node("Relu", [graph.conv(x, model.stem, "stem.conv")], "stem")
    for spec, block in zip(BLOCKS, model.blocks, strict=True):
        hidden = graph.node("Relu", [graph.conv(x, block.conv1, f"{spec.prefix}.conv1")], spec.hidden_tap)
        branch = graph.conv(hidden, block.conv2, f"{spec.prefix}.conv2")
        shortcut = x
        if block.shortcut is not None:
            assert spec.shortcut_tap is not None, spec.prefix
            shortcut = graph.conv(x, block.shortcut, spec.shortcut_tap)
        summed = graph.node("Add", [branch, shortcut], f"{spec.prefix}.sum")
        x = graph.node("Relu", [summed], spec.out_tap)
    return x


def _resized_masks(graph: _GraphBuilder, masks: str) -> str:
    """[n, 3, F] -> [n, 3, 125]: w[t] = mask[floor(t * F / 125)], exact in int64."""
    shape = graph.node("Shape", [masks], "masks.shape")
    frames = graph.node(
        "Gather", [shape, graph.const("masks.frames_axis", np.array([2], np.int64))], "masks.frames"
    )
    steps = graph.node(
        "Range",
        [
            graph.const("pool.t_start", np.array(0, np.int64)),
            graph.const("pool.t_stop", np.array(TRUNK_FRAMES, np.int64)),
            graph.const("pool.t_step", np.array(1, np.int64)),
        ],
        "pool.t",
    )
    scaled = graph.node("Mul", [steps, frames], "pool.t_times_F")
    index = graph.node(
        "Div", [scaled, graph.const("pool.trunk_frames", np.array(TRUNK_FRAMES, np.int64))], "pool.index"
    )
    return graph.node("Gather", [masks, index], "pool.weights", axis=2)


def _stats_pool(graph: _GraphBuilder, trunk: str, weights: str) -> str:
    """pyannote StatsPool per speaker: [n, 256, 10, 125] and [n, 3, 125] -> [n*3, 5120]."""
    flat = graph.node(
        "Reshape",
        [trunk, graph.const("pool.flat_shape", np.array([0, POOL_FEATURES, TRUNK_FRAMES], np.int64))],
        "pool.x",
    )  # [n, 2560, 125], row = channel * 10 + mel
    speaker_axis = graph.const("pool.speaker_axis", np.array([1], np.int64))
    feature_axis = graph.const("pool.feature_axis", np.array([2], np.int64))
    x = graph.node("Unsqueeze", [flat, speaker_axis], "pool.x4")
    w = graph.node("Unsqueeze", [weights, feature_axis], "pool.w4")
    last = graph.const("pool.time_axis", np.array([-1], np.int64))
    # x [n, 1, 2560, 125], w [n, 3, 1, 125]; every reduction below is over time (axis -1).
    v1 = graph.node(
        "Add",
        [
            graph.node("ReduceSum", [w, last], "pool.sum_w", keepdims=1),
            graph.const("pool.v1_eps", np.array(POOL_V1_EPS, np.float32)),
        ],
        "pool.v1",
    )  # [n, 3, 1, 1]
    weighted = graph.node("Mul", [x, w], "pool.wx")
    mean = graph.node(
        "Div", [graph.node("ReduceSum", [weighted, last], "pool.sum_wx", keepdims=1), v1], "pool.mean"
    )  # [n, 3, 2560, 1]
    centred = graph.node("Sub", [x, mean], "pool.dx")
    dx2 = graph.node("Mul", [centred, centred], "pool.dx2")
    v2 = graph.node("ReduceSum", [graph.node("Mul", [w, w], "pool.w2"), last], "pool.v2", keepdims=1)
    denominator = graph.node(
        "Add",
        [
            graph.node("Sub", [v1, graph.node("Div", [v2, v1], "pool.v2_over_v1")], "pool.v1_minus"),
            graph.const("pool.var_eps", np.array(POOL_VAR_EPS, np.float32)),
        ],
        "pool.denominator",
    )
    numerator = graph.node(
        "ReduceSum", [graph.node("Mul", [dx2, w], "pool.w_dx2"), last], "pool.sum_w_dx2", keepdims=1
    )
    std = graph.node("Sqrt", [graph.node("Div", [numerator, denominator], "pool.var")], "pool.std")
    stats = graph.node("Concat", [mean, std], "pool.stats", axis=2)  # [n, 3, 5120, 1]: means first
    return graph.node(
        "Reshape", [stats, graph.const("pool.rows_shape", np.array([-1, STATS_DIM], np.int64))], "pooled"
    )


def _tap_value_info(name: str) -> onnx.ValueInfoProto:
    """Output declaration of a tap, with `n` / `rows` symbolic and the rest fixed."""
    shape: list[int | str] = list(tap_shape(name, 1))
    shape[0] = ROWS_DIM if name in ("pooled", "output") else BATCH_DIM
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def build_onnx(model: FoldedModel, taps: bool = True) -> onnx.ModelProto:
    """The multi-mask model; with `taps` every TAP_NAMES entry is an output, else only `output`.

    Serving uses `taps=False`: the runtime may then fuse and free intermediates. The
    arithmetic of the two variants is the same graph, so their outputs agree to float32
    rounding of whatever fusions the runtime applies.
    """
    graph = _GraphBuilder()
    image = graph.node(
        "Unsqueeze",
        [
            graph.node("Transpose", ["fbank"], "fbank.mel_major", perm=[0, 2, 1]),
            graph.const("fbank.channel_axis", np.array([1], np.int64)),
        ],
        "fbank.nchw",
    )  # [n, 1, 80, 998]
    trunk = _trunk(graph, model, image)
    pooled = _stats_pool(graph, trunk, _resized_masks(graph, "masks"))
    graph.node(
        "Gemm",
        [
            pooled,
            graph.const("resnet.seg_1.weight", model.seg_weight.astype(np.float32)),
            graph.const("resnet.seg_1.bias", model.seg_bias.astype(np.float32)),
        ],
        "output",
        transB=1,
    )
    outputs = [_tap_value_info(name) for name in (TAP_NAMES if taps else ("output",))]
    inputs = [
        helper.make_tensor_value_info("fbank", TensorProto.FLOAT, [BATCH_DIM, FRAMES, MEL_BINS]),
        helper.make_tensor_value_info("masks", TensorProto.FLOAT, [BATCH_DIM, MAX_SPEAKERS, MASK_FRAMES_DIM]),
    ]
    proto = helper.make_graph(
        graph.nodes, "wespeaker_resnet34_multimask", inputs, outputs, initializer=graph.initializers
    )
    onnx_model = helper.make_model(
        proto,
        producer_name="speakerd",
        opset_imports=[helper.make_opsetid("", OPSET)],
        doc_string=f"WeSpeaker ResNet34 multi-mask, model id {model.model_id}",
    )
    onnx_model.ir_version = IR_VERSION
    assert model.seg_weight.shape[0] == EMBEDDING_DIM, model.seg_weight.shape
    return onnx_model

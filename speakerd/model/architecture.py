"""The WeSpeaker ResNet34 multi-mask network as data: shapes, state-dict keys and taps.

Every other module (weights, ONNX export, NumPy reference, GPU plans) walks these
tables instead of re-deriving the network, so a shape or tap name is defined once.
Semantics follow pyannote.audio 4.0.7 `WeSpeakerResNet34` (see docs/model.md).
"""

from __future__ import annotations

from dataclasses import dataclass

SAMPLE_RATE = 16_000
#: 10 s chunks, as pyannote's segmentation-3.0 windows them.
CHUNK_SAMPLES = 160_000
#: Kaldi fbank with 25 ms frames, 10 ms shift and snip_edges on 160,000 samples.
FRAMES = 998
MEL_BINS = 80
#: pyannote segmentation-3.0 emits 589 frames per 10 s chunk.
MASK_FRAMES = 589
#: pyannote's local speakers per chunk.
MAX_SPEAKERS = 3
EMBEDDING_DIM = 256
#: layer4 output is 256 channels x 10 mel rows x 125 frames.
TRUNK_CHANNELS = 256
TRUNK_MELS = 10
TRUNK_FRAMES = 125
POOL_FEATURES = TRUNK_CHANNELS * TRUNK_MELS  # 2560 rows of the pooled matrix
STATS_DIM = 2 * POOL_FEATURES  # mean and std: 5120
#: BatchNorm eval epsilon of torch.nn.BatchNorm2d, folded into conv weight and bias.
BN_EPS = 1e-5
#: (channels, blocks, first-block stride) of layer1..layer4.
STAGES: tuple[tuple[int, int, int], ...] = ((32, 3, 1), (64, 4, 2), (128, 6, 2), (256, 3, 2))
STEM_CHANNELS = 32


def conv_out(size: int, kernel: int, stride: int) -> int:
    """Output length of a 'same'-padded (pad = kernel // 2) convolution."""
    pad = kernel // 2
    return (size + 2 * pad - kernel) // stride + 1


@dataclass(frozen=True)
class ConvSpec:
    """One convolution of the trunk with its BatchNorm, in NCHW terms."""

    name: str  # state-dict prefix of the conv weight, e.g. "resnet.layer2.0.conv1"
    bn: str  # state-dict prefix of its BatchNorm, e.g. "resnet.layer2.0.bn1"
    cin: int
    cout: int
    kernel: int
    stride: int
    h_in: int
    w_in: int

    @property
    def pad(self) -> int:
        return self.kernel // 2

    @property
    def h_out(self) -> int:
        return conv_out(self.h_in, self.kernel, self.stride)

    @property
    def w_out(self) -> int:
        return conv_out(self.w_in, self.kernel, self.stride)

    @property
    def flops_per_chunk(self) -> int:
        """Multiply-adds times two, for TFLOP/s reports."""
        return 2 * self.h_out * self.w_out * self.cout * self.cin * self.kernel * self.kernel


@dataclass(frozen=True)
class BlockSpec:
    """A BasicBlock: conv1-bn1-relu, conv2-bn2, + shortcut, relu."""

    layer: int  # 1..4
    index: int  # block index inside the layer
    conv1: ConvSpec
    conv2: ConvSpec
    shortcut: ConvSpec | None  # conv1x1 stride 2 + BN on the first block of layers 2-4

    @property
    def prefix(self) -> str:
        return f"layer{self.layer}.{self.index}"

    @property
    def hidden_tap(self) -> str:
        return f"{self.prefix}.hidden"

    @property
    def out_tap(self) -> str:
        return f"{self.prefix}.out"

    @property
    def shortcut_tap(self) -> str | None:
        return f"{self.prefix}.shortcut" if self.shortcut is not None else None


def _build() -> tuple[ConvSpec, tuple[BlockSpec, ...]]:
    stem = ConvSpec("resnet.conv1", "resnet.bn1", 1, STEM_CHANNELS, 3, 1, MEL_BINS, FRAMES)
    blocks = []
    cin, h, w = STEM_CHANNELS, MEL_BINS, FRAMES
    for layer, (cout, count, first_stride) in enumerate(STAGES, start=1):
        for index in range(count):
            stride = first_stride if index == 0 else 1
            base = f"resnet.layer{layer}.{index}"
            conv1 = ConvSpec(f"{base}.conv1", f"{base}.bn1", cin, cout, 3, stride, h, w)
            conv2 = ConvSpec(f"{base}.conv2", f"{base}.bn2", cout, cout, 3, 1, conv1.h_out, conv1.w_out)
            shortcut = None
            if stride != 1 or cin != cout:
                shortcut = ConvSpec(f"{base}.shortcut.0", f"{base}.shortcut.1", cin, cout, 1, stride, h, w)
            blocks.append(BlockSpec(layer, index, conv1, conv2, shortcut))
            cin, h, w = cout, conv1.h_out, conv1.w_out
    assert (cin, h, w) == (TRUNK_CHANNELS, TRUNK_MELS, TRUNK_FRAMES), (
        f"trunk output {cin}x{h}x{w}, expected {TRUNK_CHANNELS}x{TRUNK_MELS}x{TRUNK_FRAMES}"
    )
    return stem, tuple(blocks)


STEM, BLOCKS = _build()
CONVS: tuple[ConvSpec, ...] = (
    STEM,
    *(conv for block in BLOCKS for conv in (block.conv1, block.conv2, block.shortcut) if conv is not None),
)
#: 45.23 GFLOP per chunk (docs/performance.md), the denominator of every TFLOP/s figure.
TRUNK_FLOPS_PER_CHUNK = sum(conv.flops_per_chunk for conv in CONVS)
SEG_WEIGHT = "resnet.seg_1.weight"
SEG_BIAS = "resnet.seg_1.bias"
BN_FIELDS = ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")


def _taps() -> tuple[str, ...]:
    names = ["stem"]
    for block in BLOCKS:
        names.append(block.hidden_tap)
        if block.shortcut_tap is not None:
            names.append(block.shortcut_tap)
        names.append(block.out_tap)
    names += ["pooled", "output"]
    return tuple(names)


#: The 38 taps of docs/model.md in forward order (a shortcut is computed before its block's out).
TAP_NAMES = _taps()
assert len(TAP_NAMES) == 38, f"{len(TAP_NAMES)} taps, docs/model.md defines 38"


def tap_shape(name: str, chunks: int) -> tuple[int, ...]:
    """Shape of a tap for `chunks` chunks: NCHW for trunk taps, rows x features after."""
    rows = chunks * MAX_SPEAKERS
    if name == "pooled":
        return (rows, STATS_DIM)
    if name == "output":
        return (rows, EMBEDDING_DIM)
    if name == "stem":
        return (chunks, STEM.cout, STEM.h_out, STEM.w_out)
    for block in BLOCKS:
        if name in (block.hidden_tap, block.out_tap):
            return (chunks, block.conv1.cout, block.conv1.h_out, block.conv1.w_out)
        if name == block.shortcut_tap:
            assert block.shortcut is not None
            return (chunks, block.shortcut.cout, block.shortcut.h_out, block.shortcut.w_out)
    raise KeyError(f"unknown tap {name!r}; taps are {', '.join(TAP_NAMES)}")


def state_dict_shapes() -> dict[str, tuple[int, ...]]:
    """Every key of pyannote's WeSpeakerResNet34 state dict with its shape."""
    shapes: dict[str, tuple[int, ...]] = {}
    for conv in CONVS:
        shapes[f"{conv.name}.weight"] = (conv.cout, conv.cin, conv.kernel, conv.kernel)
        for field in BN_FIELDS:
            shapes[f"{conv.bn}.{field}"] = () if field == "num_batches_tracked" else (conv.cout,)
    shapes[SEG_WEIGHT] = (EMBEDDING_DIM, STATS_DIM)
    shapes[SEG_BIAS] = (EMBEDDING_DIM,)
    return shapes


#: StatsPool's epsilons, from pyannote.audio 4.0.7 `StatsPool._pool`.
POOL_V1_EPS = 1e-8
POOL_VAR_EPS = 1e-8

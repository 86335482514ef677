"""pyannote/segmentation-3.0's PyanNet as data: sizes, layer order, state-dict keys and frame timing.

Every other module of this package (filter bank, weights, forward, synthetic model) reads
these tables instead of re-deriving the network, so a size or a key is defined once. The
values are pyannote.audio 4.0.7's `PyanNet` built with segmentation-3.0's hyper-parameters
(`sincnet: {stride: 10}`, `lstm: {hidden_size: 128, num_layers: 4, bidirectional: true,
monolithic: true}`, `linear: {hidden_size: 128, num_layers: 2}`, the powerset of 3 speakers
with at most 2 at once), checked against the real checkpoint's keys and shapes by
tests/test_segmentation_convert.py.

The forward, as `PyanNet.forward` and `SincNet.forward` write it:

    waveform [1, 160000] -> InstanceNorm1d(1, affine)                       (wav_norm1d)
    -> ParamSincFB(80 filters, kernel 251, stride 10) -> abs                 (conv1d.0)
    -> MaxPool1d(3) -> InstanceNorm1d(80, affine) -> leaky_relu              [80, 5325]
    -> Conv1d(80, 60, 5) -> MaxPool1d(3) -> InstanceNorm1d(60) -> leaky_relu [60, 1773]
    -> Conv1d(60, 60, 5) -> MaxPool1d(3) -> InstanceNorm1d(60) -> leaky_relu [60, 589]
    -> LSTM(60, 128, 4 layers, bidirectional, batch_first)                   [589, 256]
    -> Linear(256, 128) -> leaky_relu -> Linear(128, 128) -> leaky_relu
    -> Linear(128, 7) -> log_softmax                                         [589, 7]
"""

from __future__ import annotations

from speakerd.model.architecture import CHUNK_SAMPLES, MASK_FRAMES, MAX_SPEAKERS, SAMPLE_RATE

#: One window is pyannote's 10 s chunk (the embedding model's chunk too).
WINDOW_SAMPLES = CHUNK_SAMPLES
#: Output frames per window; the embedding model's masks have this many frames.
OUTPUT_FRAMES = MASK_FRAMES
#: Local speakers per window, and at most this many of them active in one frame.
SPEAKERS = MAX_SPEAKERS
MAX_SET_SIZE = 2
#: Powerset classes: {}, three singles, three pairs.
CLASSES = 7

#: SincNet's learned filter bank (asteroid_filterbanks' ParamSincFB): 80 filters, 40 cosine
#: (even) then 40 sine (odd) ones, each defined by a low cut-off and a band width.
SINC_FILTERS = 80
SINC_BANDS = SINC_FILTERS // 2
SINC_KERNEL = 251
SINC_HALF = SINC_KERNEL // 2  # 125 taps left of the centre (`window_` and `n_` have this length)
SINC_STRIDE = 10
#: ParamSincFB's min_low_hz and min_band_hz as SincNet sets them.
MIN_LOW_HZ = 50.0
MIN_BAND_HZ = 50.0
#: Every MaxPool1d of SincNet: kernel 3, stride 3.
POOL = 3
#: The two Conv1d after the filter bank: 80 -> 60 -> 60 channels, kernel 5, stride 1.
CONV_CHANNELS = 60
CONV_KERNEL = 5
#: torch.nn.InstanceNorm1d's default eps (SincNet passes none); F.leaky_relu's default slope.
NORM_EPS = 1e-5
LEAKY_SLOPE = 0.01

LSTM_LAYERS = 4
LSTM_HIDDEN = 128
#: torch.nn.LSTM's gates, in the order of the rows of weight_ih / weight_hh: input, forget,
#: cell (tanh), output.
LSTM_GATES = ("i", "f", "g", "o")
LSTM_GATE_ROWS = len(LSTM_GATES) * LSTM_HIDDEN  # 512
#: State-dict suffixes of the two directions, forward first (its half comes first in the output).
LSTM_DIRECTIONS = ("", "_reverse")
LSTM_OUTPUT = LSTM_HIDDEN * len(LSTM_DIRECTIONS)  # 256
LINEAR_HIDDEN = 128
LINEAR_LAYERS = 2

#: (kernel, stride) of the frame-reducing layers in order: filter bank, pool, conv, pool, conv,
#: pool, as SincNet.num_frames / receptive_field_size list them (no padding, no dilation).
FRAME_LAYERS: tuple[tuple[int, int], ...] = (
    (SINC_KERNEL, SINC_STRIDE),
    (POOL, POOL),
    (CONV_KERNEL, 1),
    (POOL, POOL),
    (CONV_KERNEL, 1),
    (POOL, POOL),
)


def num_frames(samples: int) -> int:
    """Frames out of `samples` input samples (pyannote's `multi_conv_num_frames`)."""
    frames = samples
    for kernel, stride in FRAME_LAYERS:
        frames = 1 + (frames - kernel) // stride
    return frames


def receptive_field_size(frames: int = 1) -> int:
    """Input samples that `frames` consecutive output frames see (`multi_conv_receptive_field_size`)."""
    size = frames
    for kernel, stride in reversed(FRAME_LAYERS):
        size = kernel + (size - 1) * stride
    return size


def receptive_field_center(frame: int = 0) -> int:
    """The input sample at the centre of output frame `frame` (`multi_conv_receptive_field_center`)."""
    center = frame
    for kernel, stride in reversed(FRAME_LAYERS):
        center = center * stride + (kernel - 1) // 2
    return center


#: Frames after each stage of one window: filter bank 15975, then 5325, 5321, 1773, 1769, 589.
SINC_FRAMES = 1 + (WINDOW_SAMPLES - SINC_KERNEL) // SINC_STRIDE
POOLED_SINC_FRAMES = SINC_FRAMES // POOL
CONV1_FRAMES = POOLED_SINC_FRAMES - CONV_KERNEL + 1
POOLED_CONV1_FRAMES = CONV1_FRAMES // POOL
CONV2_FRAMES = POOLED_CONV1_FRAMES - CONV_KERNEL + 1
assert CONV2_FRAMES // POOL == num_frames(WINDOW_SAMPLES) == OUTPUT_FRAMES, (
    f"{num_frames(WINDOW_SAMPLES)} frames per window, pyannote's segmentation-3.0 gives {OUTPUT_FRAMES}"
)

#: Output frame timing, pyannote's `Model.receptive_field` (a SlidingWindow in seconds): one
#: frame advances 270 samples (10 x 3 x 3 x 3) and sees 991, centred on its sample 495, so
#: the window starts at 0 s: step 0.016875 s, duration 0.0619375 s.
FRAME_STEP_SAMPLES = receptive_field_size(2) - receptive_field_size(1)
FRAME_FIELD_SAMPLES = receptive_field_size(1)
FRAME_CENTER_SAMPLES = receptive_field_center(0)
FRAME_STEP_S = FRAME_STEP_SAMPLES / SAMPLE_RATE
FRAME_DURATION_S = FRAME_FIELD_SAMPLES / SAMPLE_RATE
FRAME_START_S = (FRAME_CENTER_SAMPLES - (FRAME_FIELD_SAMPLES - 1) / 2) / SAMPLE_RATE
assert (FRAME_STEP_SAMPLES, FRAME_FIELD_SAMPLES, FRAME_CENTER_SAMPLES) == (270, 991, 495), (
    f"frame step {FRAME_STEP_SAMPLES}, field {FRAME_FIELD_SAMPLES}, centre {FRAME_CENTER_SAMPLES} samples"
)

# State-dict keys, pyannote's own (PyanNet's attributes).
WAV_NORM = "sincnet.wav_norm1d"
FILTERBANK = "sincnet.conv1d.0.filterbank"
LOW_HZ = f"{FILTERBANK}.low_hz_"
BAND_HZ = f"{FILTERBANK}.band_hz_"
#: ParamSincFB's buffers: the left half of a Hamming window and 2 pi t / sample_rate for
#: t = -125..-1 (saved with the weights, read from them rather than recomputed).
SINC_WINDOW = f"{FILTERBANK}.window_"
SINC_TIME = f"{FILTERBANK}.n_"
CONVS = ("sincnet.conv1d.1", "sincnet.conv1d.2")
NORMS = ("sincnet.norm1d.0", "sincnet.norm1d.1", "sincnet.norm1d.2")
LINEARS = tuple(f"linear.{index}" for index in range(LINEAR_LAYERS))
CLASSIFIER = "classifier"


def lstm_key(kind: str, layer: int, direction: str) -> str:
    """`lstm.{weight,bias}_{ih,hh}_l{layer}{direction}`, e.g. kind "weight_ih"."""
    return f"lstm.{kind}_l{layer}{direction}"


def lstm_input_size(layer: int) -> int:
    """60 features into the first layer, both directions' 128 into each later one."""
    return CONV_CHANNELS if layer == 0 else LSTM_OUTPUT


def state_dict_shapes() -> dict[str, tuple[int, ...]]:
    """Every key of pyannote's PyanNet state dict for segmentation-3.0, with its shape, in
    the module order torch saves them."""
    shapes: dict[str, tuple[int, ...]] = {
        f"{WAV_NORM}.weight": (1,),
        f"{WAV_NORM}.bias": (1,),
        LOW_HZ: (SINC_BANDS, 1),
        BAND_HZ: (SINC_BANDS, 1),
        SINC_WINDOW: (SINC_HALF,),
        SINC_TIME: (1, SINC_HALF),
    }
    for name, cin in zip(CONVS, (SINC_FILTERS, CONV_CHANNELS), strict=True):
        shapes[f"{name}.weight"] = (CONV_CHANNELS, cin, CONV_KERNEL)
        shapes[f"{name}.bias"] = (CONV_CHANNELS,)
    for name, channels in zip(NORMS, (SINC_FILTERS, CONV_CHANNELS, CONV_CHANNELS), strict=True):
        shapes[f"{name}.weight"] = (channels,)
        shapes[f"{name}.bias"] = (channels,)
    for layer in range(LSTM_LAYERS):
        for direction in LSTM_DIRECTIONS:
            shapes[lstm_key("weight_ih", layer, direction)] = (LSTM_GATE_ROWS, lstm_input_size(layer))
            shapes[lstm_key("weight_hh", layer, direction)] = (LSTM_GATE_ROWS, LSTM_HIDDEN)
            shapes[lstm_key("bias_ih", layer, direction)] = (LSTM_GATE_ROWS,)
            shapes[lstm_key("bias_hh", layer, direction)] = (LSTM_GATE_ROWS,)
    features = LSTM_OUTPUT
    for name in LINEARS:
        shapes[f"{name}.weight"] = (LINEAR_HIDDEN, features)
        shapes[f"{name}.bias"] = (LINEAR_HIDDEN,)
        features = LINEAR_HIDDEN
    shapes[f"{CLASSIFIER}.weight"] = (CLASSES, LINEAR_HIDDEN)
    shapes[f"{CLASSIFIER}.bias"] = (CLASSES,)
    return shapes

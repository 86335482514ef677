"""segmentation-3.0's forward in NumPy float32: 10 s windows -> [589, 7] powerset log-probabilities.

The math is pyannote.audio 4.0.7's `PyanNet.forward` (architecture.py draws it); the
arithmetic is arranged for two CPU cores, on two observations:

- The waveform's instance norm is an affine map per window (y = a x + c with a = gamma /
  std, c = beta - a mean), and the first convolution is linear, so conv(y) = a conv(x) +
  c sum(w). Windows overlap 9 s in 10, so the sinc convolution of a group of consecutive
  windows runs once over their samples (window k's frames are the global frames
  start_k / 10 + j, the starts being multiples of the stride) and each window takes its
  frames with its own a and c: 10x less work than per window at the default 1 s step.
  `log_probs` (per window, straight) is the yardstick `recording_log_probs` is tested against.
- The LSTM runs all windows of a group at once, both directions in one batched matmul per
  step, after one matmul per layer for every input projection.

Parity with pyannote's own forward on the real checkpoint: tests/test_segmentation_model.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from speakerd.model.segmentation import sincnet
from speakerd.model.segmentation.architecture import (
    CLASSIFIER,
    CONV_KERNEL,
    CONVS,
    LEAKY_SLOPE,
    LINEARS,
    LSTM_DIRECTIONS,
    LSTM_HIDDEN,
    LSTM_LAYERS,
    NORM_EPS,
    NORMS,
    OUTPUT_FRAMES,
    POOL,
    SINC_KERNEL,
    SINC_STRIDE,
    WAV_NORM,
    WINDOW_SAMPLES,
    lstm_key,
)

F32 = np.float32
#: Windows whose convolutions run at once: bounds the im2col copies (a conv1d.1 input of
#: one window is 5321 x 400 float32, 8.5 MB).
CONV_WINDOWS = 8


@dataclass(frozen=True)
class Network:
    """The checkpoint's arrays arranged for the forward (once, when the weights load)."""

    wav_norm: tuple[float, float]  # gamma, beta of the waveform's instance norm
    filters: np.ndarray  # [251, 80]: the sinc kernels, column per filter
    filter_sums: np.ndarray  # [80]
    convs: tuple[tuple[np.ndarray, np.ndarray], ...]  # ([K * C_in, C_out] tap-major, bias [C_out])
    norms: tuple[tuple[np.ndarray, np.ndarray], ...]  # (gamma [C], beta [C])
    lstm: tuple[tuple[np.ndarray, np.ndarray, np.ndarray], ...]  # per layer: W_ih^T [2, in, 512], W_hh^T [2, 128, 512], b [2, 512]
    linears: tuple[tuple[np.ndarray, np.ndarray], ...]  # (W^T, b), the classifier last

    @classmethod
    def from_state(cls, state: dict[str, np.ndarray]) -> Network:
        def f32(key: str) -> np.ndarray:
            return np.ascontiguousarray(state[key], dtype=F32)

        bank = sincnet.filters(state)[:, 0, :]  # [80, 251]
        convs = []
        for key in CONVS:
            weight = f32(f"{key}.weight")  # [C_out, C_in, K]
            # tap-major columns: row k * C_in + c of the im2col of a [T, C] signal
            convs.append((np.ascontiguousarray(weight.transpose(2, 1, 0).reshape(-1, weight.shape[0])), f32(f"{key}.bias")))
        lstm = []
        for layer in range(LSTM_LAYERS):
            w_ih = np.stack([f32(lstm_key("weight_ih", layer, d)).T for d in LSTM_DIRECTIONS])
            w_hh = np.stack([f32(lstm_key("weight_hh", layer, d)).T for d in LSTM_DIRECTIONS])
            bias = np.stack([f32(lstm_key("bias_ih", layer, d)) + f32(lstm_key("bias_hh", layer, d)) for d in LSTM_DIRECTIONS])
            lstm.append((np.ascontiguousarray(w_ih), np.ascontiguousarray(w_hh), bias))
        linears = [(np.ascontiguousarray(f32(f"{key}.weight").T), f32(f"{key}.bias")) for key in (*LINEARS, CLASSIFIER)]
        return cls(
            wav_norm=(float(f32(f"{WAV_NORM}.weight")[0]), float(f32(f"{WAV_NORM}.bias")[0])),
            filters=np.ascontiguousarray(bank.T),
            filter_sums=bank.sum(axis=1, dtype=F32),
            convs=tuple(convs),
            norms=tuple((f32(f"{key}.weight"), f32(f"{key}.bias")) for key in NORMS),
            lstm=tuple(lstm),
            linears=tuple(linears),
        )


def _leaky(x: np.ndarray) -> np.ndarray:
    return np.where(x >= 0, x, x * F32(LEAKY_SLOPE))


def _instance_norm(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray) -> np.ndarray:
    """[B, T, C] normalised over T per (window, channel), biased variance, torch's eps, and
    torch's rounding: ((x - mean) * invstd) * gamma + beta in float32."""
    mean = x.mean(axis=1, keepdims=True, dtype=np.float64)
    var = ((x - mean) ** 2).mean(axis=1, keepdims=True)
    invstd = (1.0 / np.sqrt(var + NORM_EPS)).astype(F32)
    return ((x - mean.astype(F32)) * invstd) * gamma + beta


def _pool(x: np.ndarray) -> np.ndarray:
    """MaxPool1d(3, 3) over T of [B, T, C] (the last T % 3 frames dropped)."""
    frames = x.shape[1] // POOL
    return x[:, : frames * POOL].reshape(x.shape[0], frames, POOL, x.shape[2]).max(axis=2)


def _conv(x: np.ndarray, weight: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """Conv1d (stride 1, no padding) of [B, T, C_in] -> [B, T - K + 1, C_out]."""
    batch, frames, channels = x.shape
    out = np.empty((batch, frames - CONV_KERNEL + 1, weight.shape[1]), F32)
    for start in range(0, batch, CONV_WINDOWS):
        part = x[start : start + CONV_WINDOWS]
        taps = np.lib.stride_tricks.sliding_window_view(part, CONV_KERNEL, axis=1)  # [b, T', C, K]
        columns = np.ascontiguousarray(taps.transpose(0, 1, 3, 2)).reshape(part.shape[0], -1, CONV_KERNEL * channels)
        out[start : start + CONV_WINDOWS] = columns @ weight + bias
    return out


def _sinc_frames(samples: np.ndarray, filters: np.ndarray) -> np.ndarray:
    """The sinc convolution (stride 10) of 1-D `samples` -> [frames, 80]."""
    taps = np.lib.stride_tricks.sliding_window_view(samples, SINC_KERNEL)[::SINC_STRIDE]
    return np.ascontiguousarray(taps) @ filters


def _sigmoid(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return F32(1) / (F32(1) + np.exp(-x))


def _lstm(x: np.ndarray, net: Network) -> np.ndarray:
    """Four bidirectional layers over [B, 589, 60] -> [B, 589, 256] (forward half first)."""
    batch, frames, _ = x.shape
    hidden = LSTM_HIDDEN
    for w_ih, w_hh, bias in net.lstm:
        # every step's input projections at once: [2, B, T, 512]
        projected = np.stack([x @ w_ih[d] + bias[d] for d in range(2)])
        out = np.empty((batch, frames, 2 * hidden), F32)
        h = np.zeros((2, batch, hidden), F32)
        c = np.zeros((2, batch, hidden), F32)
        for step in range(frames):
            back = frames - 1 - step  # the reverse direction's frame
            gates = np.matmul(h, w_hh)  # [2, B, 512]
            gates[0] += projected[0, :, step]
            gates[1] += projected[1, :, back]
            i = _sigmoid(gates[..., :hidden])
            f = _sigmoid(gates[..., hidden : 2 * hidden])
            g = np.tanh(gates[..., 2 * hidden : 3 * hidden])
            o = _sigmoid(gates[..., 3 * hidden :])
            c = f * c + i * g
            h = o * np.tanh(c)
            out[:, step, :hidden] = h[0]
            out[:, back, hidden:] = h[1]
        x = out
    return x


def _head(x: np.ndarray, net: Network) -> np.ndarray:
    """The two linear layers, the classifier and log_softmax: [B, 589, 256] -> [B, 589, 7]."""
    for weight, bias in net.linears[:-1]:
        x = _leaky(x @ weight + bias)
    weight, bias = net.linears[-1]
    scores = x @ weight + bias
    shifted = scores - scores.max(axis=-1, keepdims=True)
    return (shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))).astype(F32)


def _after_sinc(sinc: np.ndarray, net: Network) -> np.ndarray:
    """SincNet after its first convolution, then the LSTM and the head: [B, 15975, 80] -> [B, 589, 7]."""
    x = np.abs(sinc)
    for index in range(3):
        if index:
            x = _conv(x, *net.convs[index - 1])
        x = _leaky(_instance_norm(_pool(x), *net.norms[index]))
    assert x.shape[1] == OUTPUT_FRAMES, f"{x.shape[1]} frames after SincNet, expected {OUTPUT_FRAMES}"
    return _head(_lstm(x, net), net)


def _normalised(windows: np.ndarray, net: Network) -> np.ndarray:
    """The waveform instance norm, rounded as torch rounds it: ((x - mean) * invstd) * gamma + beta
    in float32 (a rounding of the samples here moves the log-probabilities by ~1e-5)."""
    mean = windows.mean(axis=1, keepdims=True, dtype=np.float64).astype(F32)
    var = windows.var(axis=1, keepdims=True, dtype=np.float64)
    invstd = (1.0 / np.sqrt(var + NORM_EPS)).astype(F32)
    gamma, beta = net.wav_norm
    return ((windows - mean) * invstd) * F32(gamma) + F32(beta)


def log_probs(network: Network, windows: np.ndarray) -> np.ndarray:
    """[B, 160000] float32 windows -> [B, 589, 7] log-probabilities."""
    windows = np.asarray(windows, dtype=F32)
    assert windows.ndim == 2 and windows.shape[1] == WINDOW_SAMPLES, windows.shape
    normalised = _normalised(windows, network)
    sinc = np.stack([_sinc_frames(window, network.filters) for window in normalised])
    return _after_sinc(sinc, network)


def recording_log_probs(network: Network, samples: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Windows starting at `starts` (sample offsets into `samples`, ascending; a window past
    the end zero-padded, as pyannote pads the last one) -> [B, 589, 7]."""
    samples = np.asarray(samples, dtype=F32)
    windows = np.zeros((len(starts), WINDOW_SAMPLES), F32)
    for row, start in enumerate(np.asarray(starts, dtype=np.int64)):
        part = samples[start : start + WINDOW_SAMPLES]
        windows[row, : part.shape[0]] = part
    return log_probs(network, windows)

"""PyanNet's head in NumPy float32: the 4-layer bidirectional LSTM, two linear layers, the classifier.

Over a group of windows at once, time-major ([frames, windows, features]): per layer and
direction, the input projections of every frame in one matmul, then per time step one
[windows, 128] x [128, 512] matmul and one `exp` for all four gates (weights.py stores them
negated and the cell gate doubled: sigmoid(x) = 1 / (1 + exp(-x)), tanh(x) = 2 / (1 +
exp(-2 x)) - 1), in torch's gate order and cell arithmetic: c = f c + i g, h = o tanh(c).
The two directions of a layer run on two workers.
"""

from __future__ import annotations

from functools import partial

import numpy as np

from speakerd.model.segmentation.architecture import CLASSES, LSTM_HIDDEN
from speakerd.model.segmentation.layers import leaky_relu
from speakerd.model.segmentation.weights import SIGMOID_GATES, LstmLayer, SegmentationModel
from speakerd.model.segmentation.workers import spread

F32 = np.float32


def direction(layer: LstmLayer, x: np.ndarray, out: np.ndarray, reverse: int) -> None:
    """One direction of one layer over [frames, windows, in]; its hidden states are written
    into `out` [frames, windows, 128] (a view of the layer's output). reverse = 1 reads the
    frames backwards."""
    frames, windows, _ = x.shape
    gates = layer.hidden_weight.shape[2]
    columns = slice(reverse * gates, (reverse + 1) * gates)
    projected = (x.reshape(frames * windows, -1) @ layer.input_weight[:, columns]).reshape(
        frames, windows, gates
    )
    projected += layer.bias[columns]
    hidden_weight = layer.hidden_weight[reverse]
    z = np.empty((windows, gates), dtype=F32)
    cell = np.zeros((windows, LSTM_HIDDEN), dtype=F32)
    product = np.empty_like(cell)
    sigmoid = SIGMOID_GATES * LSTM_HIDDEN
    input_gate, forget_gate = z[:, :LSTM_HIDDEN], z[:, LSTM_HIDDEN : 2 * LSTM_HIDDEN]
    output_gate, cell_gate = z[:, 2 * LSTM_HIDDEN : sigmoid], z[:, sigmoid:]
    previous = -1
    for time_index in range(frames - 1, -1, -1) if reverse else range(frames):
        if previous < 0:
            z[...] = projected[time_index]
        else:
            np.matmul(out[previous], hidden_weight, out=z)
            z += projected[time_index]
        # z holds -x for the sigmoid gates and -2 x for the cell gate: one exp for all four
        np.exp(z, out=z)
        z += F32(1)
        np.reciprocal(z, out=z)
        cell_gate *= F32(2)
        cell_gate -= F32(1)
        cell *= forget_gate
        np.multiply(input_gate, cell_gate, out=product)
        cell += product
        np.tanh(cell, out=product)
        np.multiply(product, output_gate, out=out[time_index])
        previous = time_index


def lstm(model: SegmentationModel, x: np.ndarray) -> np.ndarray:
    """[frames, windows, 60] -> [frames, windows, 256], forward direction's half first."""
    for layer in model.lstm:
        frames, windows, _ = x.shape
        out = np.empty((frames, windows, 2, LSTM_HIDDEN), dtype=F32)
        spread(partial(direction, layer, x), (out[:, :, 0], out[:, :, 1]), (0, 1))
        x = out.reshape(frames, windows, 2 * LSTM_HIDDEN)
    return x


def head(model: SegmentationModel, features: np.ndarray) -> np.ndarray:
    """SincNet's output for a group [windows, 589, 60] -> log-probabilities [windows, 589, 7]."""
    x = lstm(model, np.ascontiguousarray(np.transpose(features, (1, 0, 2))))
    frames, windows, _ = x.shape
    x = x.reshape(frames * windows, -1)
    for linear in model.linears:
        x = leaky_relu(x @ linear.weight + linear.bias)
    scores = x @ model.classifier.weight + model.classifier.bias
    shifted = scores - scores.max(axis=1, keepdims=True)
    shifted -= np.log(np.exp(shifted).sum(axis=1, keepdims=True))  # log_softmax
    return np.ascontiguousarray(np.transpose(shifted.reshape(frames, windows, CLASSES), (1, 0, 2)))

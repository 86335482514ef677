"""PyTorch anchor for the segmentation engine: PyanNet (pyannote/segmentation-3.0) as
pyannote.audio writes it (SincNet: InstanceNorm1d, sinc conv stride 10, abs, MaxPool1d(3),
InstanceNorm1d, leaky_relu; 2 x Conv1d(5); 4-layer biLSTM (cuDNN); 2 linears; classifier;
log_softmax), built from the checkpoint's state dict without pyannote or asteroid (the
device image has neither): the sinc filters come from speakerd.model.segmentation.sincnet
(ParamSincFB.filters()'s arithmetic in NumPy). Used as the parity reference
(tests/test_gpu_segmentation.py: FP32, and in float64 via .double() as the truth the FP32
forwards are measured against) and as the speed yardstick (speakerd/tools/bench_segmentation.py):
pyannote's Inference batch size 32, plus larger batches.
"""

from __future__ import annotations

import pickle
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from speakerd.model.segmentation import sincnet


class _Stub:
    def __init__(self, *a, **k):
        pass

    def __setstate__(self, state):
        self.__dict__["state"] = state


class _Unpickler(pickle.Unpickler):
    """Unpickles a Lightning checkpoint whose hyper-parameters reference pyannote classes."""

    def find_class(self, module, name):
        if module.startswith("pyannote") or module.startswith("pytorch_lightning"):
            return _Stub
        return super().find_class(module, name)


class _PickleModule:
    Unpickler = _Unpickler
    load = pickle.load


def load_state_dict(path: str) -> dict[str, np.ndarray]:
    ck = torch.load(path, map_location="cpu", weights_only=False, pickle_module=_PickleModule)
    sd = ck.get("state_dict", ck)
    return {k: v.detach().cpu().numpy() for k, v in sd.items()}


class PyanNet(nn.Module):
    def __init__(self, state: dict[str, np.ndarray], sinc_filters: np.ndarray | None = None):
        super().__init__()
        if sinc_filters is None:
            sinc_filters = sincnet.filters(state)
        self.wav_norm1d = nn.InstanceNorm1d(1, affine=True)
        self.register_buffer("sinc", torch.from_numpy(np.asarray(sinc_filters, np.float32)).view(80, 1, 251))
        self.conv1d = nn.ModuleList([nn.Conv1d(80, 60, 5, stride=1), nn.Conv1d(60, 60, 5, stride=1)])
        self.pool1d = nn.ModuleList([nn.MaxPool1d(3, stride=3, padding=0, dilation=1) for _ in range(3)])
        self.norm1d = nn.ModuleList([nn.InstanceNorm1d(80, affine=True), nn.InstanceNorm1d(60, affine=True),
                                     nn.InstanceNorm1d(60, affine=True)])  # fmt: skip
        self.lstm = nn.LSTM(60, 128, num_layers=4, bidirectional=True, batch_first=True, dropout=0.0)
        self.linear = nn.ModuleList([nn.Linear(256, 128), nn.Linear(128, 128)])
        self.classifier = nn.Linear(128, 7)
        self.activation = nn.LogSoftmax(dim=-1)
        own = {}
        for k, v in state.items():
            if k.startswith("sincnet.conv1d.0."):  # the filter bank's parameters and buffers
                continue
            k2 = k.replace("sincnet.conv1d.1.", "conv1d.0.").replace("sincnet.conv1d.2.", "conv1d.1.")
            own[k2.replace("sincnet.", "")] = torch.from_numpy(np.asarray(v))
        missing, unexpected = self.load_state_dict(own, strict=False)
        assert not unexpected and set(missing) <= {"sinc"}, (missing, unexpected)

    def sincnet(self, waveforms):
        outputs = self.wav_norm1d(waveforms)
        convs = [lambda x: F.conv1d(x, self.sinc, stride=10), self.conv1d[0], self.conv1d[1]]
        for c, (conv1d, pool1d, norm1d) in enumerate(zip(convs, self.pool1d, self.norm1d, strict=True)):
            outputs = conv1d(outputs)
            if c == 0:
                outputs = torch.abs(outputs)
            outputs = F.leaky_relu(norm1d(pool1d(outputs)))
        return outputs

    def forward(self, waveforms):  # (batch, 1, 160000) -> (batch, 589, 7)
        outputs = self.sincnet(waveforms)
        outputs, _ = self.lstm(outputs.transpose(1, 2))
        for linear in self.linear:
            outputs = F.leaky_relu(linear(outputs))
        return self.activation(self.classifier(outputs))


def windows(samples: np.ndarray, starts: np.ndarray, size: int = 160000) -> np.ndarray:
    """[k, 1, size] windows, zero-padded past the end as pyannote pads the last one."""
    out = np.zeros((len(starts), 1, size), np.float32)
    for i, s in enumerate(starts):
        seg = samples[s : s + size]
        out[i, 0, : len(seg)] = seg
    return out


def hour_seconds(model: PyanNet, batch: int, n_windows: int = 3591, reps: int = 2) -> float:
    """Seconds to run `n_windows` windows (already on the GPU; the audio upload excluded) in
    batches of `batch`, as pyannote's Inference loop does (FP32, cuDNN LSTM)."""
    x = torch.randn(batch, 1, 160000, device="cuda") * 0.1
    n_batches = -(-n_windows // batch)
    best = float("inf")
    with torch.inference_mode():
        model(x)
        torch.cuda.synchronize()
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(n_batches):
                model(x)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
    return best

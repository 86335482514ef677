"""PyanNet (pyannote/segmentation-3.0) on the GPU: many 10 s windows per call.

`GpuSegmenter` (engine.py) implements `engine.segmenter.Segmenter`: math "fp32" (strict FP32
GEMMs) or "fast" (3xTF32 GEMMs), and sinc "window" (each window's samples rounded as torch
rounds them), "shared32" or "shared64" (one sinc convolution shared by a group's windows, in
float or double); `weights.py` turns pyannote's state dict into the layouts the kernels read
(kernels/segmentation.cu); `blas.py` holds the strict-FP32 and TF32 cuBLAS handles.
"""

from speakerd.engine.gpu.segmentation.engine import MATHS, GpuSegmenter

__all__ = ["MATHS", "GpuSegmenter"]

"""PyanNet (pyannote/segmentation-3.0) on the GPU: many 10 s windows per call.

`GpuSegmenter` (engine.py) implements `engine.segmenter.Segmenter` with two maths, "fp32"
(parity with torch) and "fast" (one sinc convolution shared by a group's windows, 3xTF32
GEMMs); `weights.py` turns pyannote's state dict into the layouts the kernels read
(kernels/segmentation.cu); `blas.py` holds the strict-FP32 and TF32 cuBLAS handles.
"""

from speakerd.engine.gpu.segmentation.engine import MATHS, GpuSegmenter

__all__ = ["MATHS", "GpuSegmenter"]

"""Engines: the same `Engine` interface over ONNX Runtime (CPU) and CuPy/cuDNN (GPU)."""

"""The model as an ONNX graph (export) and ONNX Runtime sessions over it (runtime)."""

"""The model itself, in NumPy: architecture, weights, fbank, input checks, numerics, cases.

Everything the thin client shares with the server lives here, so nothing in it may import
onnx, onnxruntime or CuPy.
"""

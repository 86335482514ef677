"""Reference cases written by ONNX Runtime, and the start-up self-check against them."""

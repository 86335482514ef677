"""speakerd: WeSpeaker ResNet34 multi-mask speaker embeddings as a GPU gRPC service.

Sub-packages import only downward (checked by import-linter in `make test`):
v1 -> model -> onnx -> engine -> reference -> serving -> tools; `client` imports only `v1`
and `model`, so `pip install speakerd` (no extras) is a thin client.
"""

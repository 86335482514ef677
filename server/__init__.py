"""speakerd server: WeSpeaker ResNet34 multi-mask speaker embeddings over gRPC."""

__version__ = "0.1.0"

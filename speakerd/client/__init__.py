"""speakerd client: thin sync/async gRPC clients, CLI, parity verification.

`from speakerd.client import SpeakerClient` is all a caller needs; it imports only
speakerd.v1 and speakerd.model (NumPy), never the server's packages.
"""

from speakerd.client.client import AsyncSpeakerClient, RetryPolicy, SpeakerClient

__all__ = ["AsyncSpeakerClient", "RetryPolicy", "SpeakerClient"]

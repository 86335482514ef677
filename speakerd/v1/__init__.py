"""speakerd.v1: the wire contract (speakerd.proto, its generated stubs, and the Tensor codec)."""

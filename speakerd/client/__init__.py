"""speakerd client: thin sync/async gRPC clients, CLI, parity verification."""

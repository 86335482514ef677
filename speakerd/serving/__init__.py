"""The gRPC server: start-up, the servicer, request parsing, the batcher, config, metrics."""

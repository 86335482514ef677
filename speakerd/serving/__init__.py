"""The gRPC server, in rooms that import only downward (pyproject.toml's import-linter
contract; docs/architecture.md draws them): server (life cycle, settings) > voiceprints >
receivers > api (the gRPC methods) | devices > batching > access | memory | observability."""

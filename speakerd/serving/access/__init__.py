"""Who may call: TLS and mutual TLS for the gRPC port, and bearer tokens."""

"""Voiceprints (docs/voiceprints.md): enrolled speakers' vectors, stored per tenant, searched
in memory. One job per module: records (what is stored), store (the interface and how a
URL picks a backend), sqlite_store and postgres_store (the backends), index (the in-memory
search), tenants (a call's namespace), speech (a call's audio -> pooled rows), service (the
gRPC methods)."""

"""Command-line tools over the engines: bench, offline embed, checkpoint conversion."""

"""The server's memory: a byte budget for requests being decoded, and the heap between requests."""

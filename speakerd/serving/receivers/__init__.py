"""`serve --receivers N`: the receiver processes that accept calls on the server's port, and the
server's side that takes the calls they hand over."""

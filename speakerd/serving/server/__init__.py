"""The server's life cycle: `serve`'s settings (flags and SPEAKERD_* variables), the memory bound
they imply, and start-up, warm-up, serving and drain."""

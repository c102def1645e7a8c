"""Built-in storage backends, each a plugin registered exactly as a third-party one is."""

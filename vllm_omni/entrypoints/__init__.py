"""entrypoints."""

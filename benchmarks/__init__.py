"""Benchmarks (run as scripts or as modules: python -m benchmarks.diffusion.<name>)."""

"""Diffusion benchmarks: step batching, peer comparison, serving and load, profiles (docs/benchmarks.md)."""

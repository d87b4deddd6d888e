"""Diffusion benchmarks: step batching benefit, transformer forward, serving. See docs/benchmarks.md."""

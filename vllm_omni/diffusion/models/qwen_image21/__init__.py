"""Qwen-Image-2.1: a single-stream block-causal DiT with a per-request prefix KV cache."""

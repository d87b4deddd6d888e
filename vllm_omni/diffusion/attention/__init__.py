"""Attention: packed-sequence metadata and the backends that consume it."""

from vllm_omni.diffusion.attention.backends import (
    BACKENDS,
    AttentionBackend,
    FlashAttnBackend,
    SDPABackend,
    backend_class,
    get_attn_backend,
)
from vllm_omni.diffusion.attention.metadata import (
    AttentionMetadata,
    build_varlen_metadata,
)

__all__ = [
    "BACKENDS",
    "AttentionBackend",
    "AttentionMetadata",
    "FlashAttnBackend",
    "SDPABackend",
    "backend_class",
    "build_varlen_metadata",
    "get_attn_backend",
]

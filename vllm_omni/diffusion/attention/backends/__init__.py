"""Attention backends: SDPA (any device) and FLASH_ATTN (varlen, CUDA), plus selection."""

from vllm_omni.diffusion.attention.backends.base import AttentionBackend
from vllm_omni.diffusion.attention.backends.flash_attn import FlashAttnBackend
from vllm_omni.diffusion.attention.backends.registry import BACKENDS, backend_class, get_attn_backend
from vllm_omni.diffusion.attention.backends.sdpa import SDPABackend

__all__ = [
    "AttentionBackend",
    "BACKENDS",
    "FlashAttnBackend",
    "SDPABackend",
    "backend_class",
    "get_attn_backend",
]

"""Attention backends: SDPA (any device), FLASH_ATTN (FA2 varlen, CUDA), FLASH_ATTN_3 (fa3-fwd varlen,
Hopper), AUTO (per-batch choice among them), plus selection."""

from vllm_omni.diffusion.attention.backends.base import AttentionBackend
from vllm_omni.diffusion.attention.backends.fa3 import FlashAttn3Backend
from vllm_omni.diffusion.attention.backends.flash_attn import FlashAttnBackend
from vllm_omni.diffusion.attention.backends.registry import BACKENDS, backend_class, get_attn_backend
from vllm_omni.diffusion.attention.backends.sdpa import SDPABackend

__all__ = [
    "AttentionBackend",
    "BACKENDS",
    "FlashAttn3Backend",
    "FlashAttnBackend",
    "SDPABackend",
    "backend_class",
    "get_attn_backend",
]

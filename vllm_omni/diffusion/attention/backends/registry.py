"""Attention backend registry and selection.

`get_attn_backend(name, device, head_dim, for_packed, dtype)` picks once, at startup, and fails with a
message naming the alternative:

    name given        -> that backend (case-insensitive: "SDPA", "TORCH_SDPA", "FLASH_ATTN",
                         "FLASH_ATTN_3" (fa3-fwd on Hopper), "AUTO")
    name None         -> env DIFFUSION_ATTENTION_BACKEND if set (read here only when the config layer
                         passed no name; the config layer normally reads it once into
                         `OmniDiffusionConfig.attention_backend`)
    still None        -> AUTO on CUDA when a varlen kernel is importable and the dtype/head size fit
                         (per batch: one FLASH_ATTN varlen call for many short sequences,
                         per-sequence SDPA for ~1k-token ones, FLASH_ATTN_3 for long ones when the
                         fa3-fwd wheel is installed on Hopper; see auto.py), else SDPA
"""

from __future__ import annotations

import os

import torch

from vllm_omni.diffusion.attention.backends.auto import AutoAttentionBackend
from vllm_omni.diffusion.attention.backends.base import AttentionBackend
from vllm_omni.diffusion.attention.backends.fa3 import FlashAttn3Backend
from vllm_omni.diffusion.attention.backends.flash_attn import FlashAttnBackend
from vllm_omni.diffusion.attention.backends.sdpa import SDPABackend

ENV_VAR = "DIFFUSION_ATTENTION_BACKEND"

BACKENDS: dict[str, type[AttentionBackend]] = {
    "SDPA": SDPABackend,
    "TORCH_SDPA": SDPABackend,
    "FLASH_ATTN": FlashAttnBackend,
    "FLASH_ATTN_3": FlashAttn3Backend,
    "AUTO": AutoAttentionBackend,
}
"""Accepted names (upper case) -> backend class."""


def backend_class(name: str) -> type[AttentionBackend]:
    """The backend class for `name` (case-insensitive); ValueError listing the accepted names."""
    cls = BACKENDS.get(name.strip().upper())
    if cls is None:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {sorted(BACKENDS)}")
    return cls


def _default_class(device: torch.device, head_dim: int, dtype: torch.dtype | None) -> type[AttentionBackend]:
    fa = FlashAttnBackend
    if (
        fa.is_available(device)
        and fa.supports_head_size(head_dim)
        and (dtype is None or dtype in fa.supported_dtypes)
    ):
        return AutoAttentionBackend
    return SDPABackend


def get_attn_backend(
    name: str | None,
    device: torch.device | str,
    head_dim: int,
    for_packed: bool = True,
    dtype: torch.dtype | None = None,
    batch_invariant: bool = False,
) -> AttentionBackend:
    """Select and construct the attention backend.

    Args:
        name: backend name (case-insensitive) or None for env / platform default.
        device: where attention will run.
        head_dim: head size D of q/k/v.
        for_packed: the backend will see packed (varlen) batches; a backend that cannot keep packed
            sequences apart is refused.
        dtype: activation dtype if known (an explicit backend is checked against it; the default
            choice avoids kernels that cannot take it).
        batch_invariant: ask for kernels whose per-sequence result does not depend on the batch.
    Raises:
        ValueError naming the fix for unknown names, unavailable kernels, head sizes, dtypes, and
        backends without varlen support on the packed path.
    """
    device = torch.device(device)
    if name is None:
        name = os.environ.get(ENV_VAR) or None
    cls = backend_class(name) if name is not None else _default_class(device, head_dim, dtype)
    if for_packed and not cls.supports_varlen:
        raise ValueError(
            f"attention backend {cls.name} cannot keep packed sequences apart (no varlen support); "
            "use 'FLASH_ATTN' (CUDA) or 'SDPA' for the packed path"
        )
    cls.validate_available(device)
    cls.validate_head_size(head_dim)
    if dtype is not None:
        cls.validate_dtype(dtype)
    if cls is FlashAttnBackend:
        backend = FlashAttnBackend(batch_invariant=batch_invariant)
        backend.validate_batch_invariance()
        return backend
    return cls()

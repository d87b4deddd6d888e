"""FLASH_ATTN_3 backend: FlashAttention-3's varlen forward from the `fa3-fwd` wheel (Hopper only).

`pip install 'vllm-omni-step[cuda]'` (or `pip install fa3-fwd==0.0.3`) adds it; nothing requires it.
The wheel is forward-only FlashAttention-3 built on torch's stable ABI; its
`fa3_fwd_interface.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, ...)` takes flash-attn's
packed layout (q/k/v `[total_tokens, H, D]`, int32 cu_seqlens) and never splits KV unless asked
(`num_splits=1` is its default), so a sequence's result does not depend on the rest of the batch.
It reads the boundaries on the device only, so it captures in a CUDA graph and replays with new
`cu_seqlens` written into the same buffer (see worker/cuda_graphs.py).

Dense `[B, S, H, D]` calls without a key mask run as B packed sequences of S; with a mask they go
to SDPA, which applies it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import ClassVar

import torch

from vllm_omni.diffusion.attention.backends.base import AttentionBackend
from vllm_omni.diffusion.attention.backends.flash_attn import FlashAttnBackend
from vllm_omni.diffusion.attention.backends.sdpa import sdpa_dense
from vllm_omni.diffusion.attention.metadata import AttentionMetadata

HOPPER_MAJOR = 9
"""FlashAttention-3's kernels are built for compute capability 9.x (Hopper) only."""


@functools.cache
def fa3_varlen_func() -> Callable | None:
    """`fa3_fwd_interface.flash_attn_varlen_func`, or None when the wheel is not importable."""
    try:
        from fa3_fwd_interface import flash_attn_varlen_func
    except Exception:  # ImportError, or a binary built for another torch ABI
        return None
    return flash_attn_varlen_func


def _is_hopper(device: torch.device) -> bool:
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device)[0] == HOPPER_MAJOR


class FlashAttn3Backend(AttentionBackend):
    """FlashAttention-3 varlen (fa3-fwd) on Hopper GPUs; dense calls through SDPA."""

    name: ClassVar[str] = "FLASH_ATTN_3"
    supports_varlen: ClassVar[bool] = True
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = FlashAttnBackend.supported_dtypes
    supported_devices: ClassVar[tuple[str, ...]] = FlashAttnBackend.supported_devices
    min_head_size: ClassVar[int] = FlashAttnBackend.min_head_size
    max_head_size: ClassVar[int] = FlashAttnBackend.max_head_size
    head_size_multiple: ClassVar[int] = FlashAttnBackend.head_size_multiple

    def __init__(self, varlen_fn: Callable | None = None):
        """`varlen_fn`: override the kernel (tests); fa3_fwd_interface's signature."""
        self._varlen_fn = varlen_fn

    @classmethod
    def is_available(cls, device: torch.device) -> bool:
        return _is_hopper(torch.device(device)) and fa3_varlen_func() is not None

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> str:
        device = torch.device(device)
        if device.type != "cuda" or not torch.cuda.is_available():
            return f"it needs a CUDA device, got {device.type}"
        if not _is_hopper(device):
            major, minor = torch.cuda.get_device_capability(device)
            return f"FlashAttention-3 needs a Hopper GPU (sm_90), got sm_{major}{minor}"
        return "fa3_fwd_interface is not importable: pip install fa3-fwd==0.0.3 (the [cuda] extra)"

    def check_device(self, device: torch.device) -> None:
        if self._varlen_fn is None:  # an injected kernel runs wherever its author meant it to
            super().check_device(device)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        self.check_inputs(q, k, v, metadata)
        if not metadata.is_varlen:
            if metadata.attn_mask is not None:  # a key mask: SDPA applies it
                return sdpa_dense(q, k, v, metadata.attn_mask)
            return self._dense_as_varlen(q, k, v)
        return self._varlen(
            q,
            k,
            v,
            metadata.cu_seqlens_q,
            metadata.cu_seqlens_k,
            metadata.max_seqlen_q,
            metadata.max_seqlen_k,
        )

    def _varlen(self, q, k, v, cu_q, cu_k, max_q: int, max_k: int) -> torch.Tensor:
        fn = self._varlen_fn or fa3_varlen_func()
        # [total_tokens, H, D] in and out; num_splits=1: no split-KV (batch invariant)
        return fn(
            q, k, v, cu_q, cu_k, max_q, max_k,
            softmax_scale=1.0 / math.sqrt(q.shape[-1]), causal=False, num_splits=1,
        )  # fmt: skip

    def _dense_as_varlen(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Unmasked dense [B, S, H, D] as B packed sequences of S (boundaries built on the device,
        so a dense CUDA graph captures it)."""
        batch, seq_len = q.shape[:2]
        cu = torch.arange(0, (batch + 1) * seq_len, seq_len, dtype=torch.int32, device=q.device)
        rows = [t.reshape(batch * seq_len, *t.shape[2:]) for t in (q, k, v)]  # [B * S, H, D]
        return self._varlen(*rows, cu, cu, seq_len, seq_len).view(q.shape)

    def __repr__(self) -> str:
        return "FlashAttn3Backend()"

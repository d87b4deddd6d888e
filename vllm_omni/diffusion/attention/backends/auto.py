"""AUTO: per batch, the faster of one varlen call and per-sequence SDPA (CUDA).

Measured on the H200 (bf16, real-size Qwen-Image, 60 blocks; see
benchmarks/diffusion/performance_dashboard/qwen_image_step_batching.md): one varlen call
(FLASH_ATTN) wins on many short sequences (8 x 256x256 with CFG: ~10 ms of attention vs 43-75 ms
for a loop of SDPA calls), while cuDNN/flash SDPA called once per sequence wins on a few long ones
(the 23k-token 4-request CFG mix: 115 ms vs 168 ms). The choice reads only host-side lengths, so it
costs no device sync, and both paths keep sequences apart exactly.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from vllm_omni.diffusion.attention.backends.base import AttentionBackend
from vllm_omni.diffusion.attention.backends.flash_attn import FlashAttnBackend
from vllm_omni.diffusion.attention.backends.sdpa import SDPABackend
from vllm_omni.diffusion.attention.metadata import AttentionMetadata

PER_SEQUENCE_MIN_MEAN_LEN = 768
"""Packed batches whose mean sequence length reaches this run per-sequence SDPA; shorter ones
one varlen call. Between the measured points (320-token sequences: varlen; ~1.1k and longer: SDPA)."""


class AutoAttentionBackend(AttentionBackend):
    """Chooses FLASH_ATTN (varlen) or SDPA (one call per sequence) for every packed batch."""

    name: ClassVar[str] = "AUTO"
    supports_varlen: ClassVar[bool] = True
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = FlashAttnBackend.supported_dtypes
    supported_devices: ClassVar[tuple[str, ...]] = ("cuda",)
    min_head_size: ClassVar[int] = FlashAttnBackend.min_head_size
    max_head_size: ClassVar[int] = FlashAttnBackend.max_head_size
    head_size_multiple: ClassVar[int] = FlashAttnBackend.head_size_multiple

    def __init__(self):
        self.varlen = FlashAttnBackend()
        self.per_sequence = SDPABackend("per_seq")

    @classmethod
    def is_available(cls, device: torch.device) -> bool:
        return FlashAttnBackend.is_available(device)

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> str:
        return FlashAttnBackend.unavailable_reason(device)

    def choose(self, metadata: AttentionMetadata) -> AttentionBackend:
        """The backend for this call: dense batches and long sequences -> SDPA, short ones -> varlen."""
        if not metadata.is_varlen:
            return self.per_sequence
        mean_len = sum(metadata.seq_lens) / max(1, len(metadata.seq_lens))
        return self.per_sequence if mean_len >= PER_SEQUENCE_MIN_MEAN_LEN else self.varlen

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        return self.choose(metadata).forward(q, k, v, metadata)

    def __repr__(self) -> str:
        return "AutoAttentionBackend(varlen=FLASH_ATTN, per_sequence=SDPA)"

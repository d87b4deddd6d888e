"""AUTO: per batch, the fastest of FA2 varlen, per-sequence SDPA and FlashAttention-3 varlen (CUDA).

The choice reads only host-side lengths (no device sync) and every path keeps sequences apart
exactly. Thresholds: where each kernel ran fastest (bf16, 24 heads x 128, eager; TFLOP/s below;
docs/design/packed_forward.md):

    layout (sequence lengths)   FA2 varlen  SDPA per seq  FA3 varlen  ->  rule
    16 x 320                    119         14            79              mean < 768: FA2
    2 x 1088                    155         220           188             mean >= 768, total < 4096:
    2 x 1600                    242         295           282               per-sequence SDPA
    4 x 1088                    239         218           255             mean >= 768, total >= 4096:
    2 x 2100                    259         345           402               FA3 (when fa3-fwd is
    2 x 4160                    334         543           593               installed; else SDPA)
    1 x 6953                    312         578           651
    8 seqs, 4-mix with CFG      301         508           622

A dense `[B, S]` call without a key mask takes the same rule with mean = S (FA3 runs it as B
sequences of S); with a mask it stays on SDPA, which applies it.

Inside a captured CUDA graph (`metadata.for_graph`) the boundaries change between replays, so the
choice cannot depend on them: FA3 varlen when available (16 x 320 replayed: 265 TFLOP/s, FA2 207),
else FA2 varlen.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from vllm_omni.diffusion.attention.backends.base import AttentionBackend
from vllm_omni.diffusion.attention.backends.fa3 import FlashAttn3Backend
from vllm_omni.diffusion.attention.backends.flash_attn import FlashAttnBackend
from vllm_omni.diffusion.attention.backends.sdpa import SDPABackend
from vllm_omni.diffusion.attention.metadata import AttentionMetadata

PER_SEQUENCE_MIN_MEAN_LEN = 768
"""Packed batches whose mean sequence length is below this run one FA2 varlen call."""

FA3_MIN_TOTAL_TOKENS = 4096
"""Batches of longer sequences with at least this many tokens in all run FA3 varlen (if importable);
fewer, per-sequence SDPA."""


class AutoAttentionBackend(AttentionBackend):
    """Chooses FA2 varlen, per-sequence SDPA or FA3 varlen for every packed batch."""

    name: ClassVar[str] = "AUTO"
    supports_varlen: ClassVar[bool] = True
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = FlashAttnBackend.supported_dtypes
    supported_devices: ClassVar[tuple[str, ...]] = ("cuda",)
    min_head_size: ClassVar[int] = FlashAttnBackend.min_head_size
    max_head_size: ClassVar[int] = FlashAttnBackend.max_head_size
    head_size_multiple: ClassVar[int] = FlashAttnBackend.head_size_multiple

    def __init__(self, fa3: AttentionBackend | None = None, use_fa3: bool = True):
        """`fa3`: the FA3 backend to use (tests inject one); by default FA3 when importable here.
        `use_fa3=False`: never FA3 (the FA2 / SDPA choice alone, for before/after measurements)."""
        self.varlen = FlashAttnBackend()
        self.per_sequence = SDPABackend("per_seq")
        if fa3 is None and use_fa3 and torch.cuda.is_available():
            fa3 = FlashAttn3Backend() if FlashAttn3Backend.is_available(torch.device("cuda")) else None
        self.fa3 = fa3 if use_fa3 else None

    @classmethod
    def is_available(cls, device: torch.device) -> bool:
        return FlashAttnBackend.is_available(device)

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> str:
        return FlashAttnBackend.unavailable_reason(device)

    def choose(self, metadata: AttentionMetadata, dense_shape: tuple[int, int] = (0, 0)) -> AttentionBackend:
        """The backend for this call (see the module docstring); `dense_shape`: (B, S) of a dense call."""
        if not metadata.is_varlen:  # FA3 by the packed rule (mean = S) when no key mask is needed
            batch, seq_len = dense_shape
            fa3_pays = seq_len >= PER_SEQUENCE_MIN_MEAN_LEN and batch * seq_len >= FA3_MIN_TOTAL_TOKENS
            if self.fa3 is not None and metadata.attn_mask is None and fa3_pays:
                return self.fa3
            return self.per_sequence
        if metadata.for_graph:
            return self.fa3 or self.varlen
        mean_len = sum(metadata.seq_lens) / max(1, len(metadata.seq_lens))
        if mean_len < PER_SEQUENCE_MIN_MEAN_LEN:
            return self.varlen
        if sum(metadata.seq_lens) >= FA3_MIN_TOTAL_TOKENS and self.fa3 is not None:
            return self.fa3
        return self.per_sequence

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        return self.choose(metadata, tuple(q.shape[:2])).forward(q, k, v, metadata)

    def __repr__(self) -> str:
        fa3 = "FLASH_ATTN_3" if self.fa3 is not None else "none"
        return f"AutoAttentionBackend(short=FLASH_ATTN, mid=SDPA, long={fa3})"

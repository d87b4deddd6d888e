"""SDPA backend: `torch.nn.functional.scaled_dot_product_attention`, on any device.

Dense: one SDPA call with the key mask broadcast to `[B, 1, 1, S]` (what diffusers does).
Packed: two ways to keep sequences apart, chosen at construction:

    "per_seq"  one SDPA call per sequence (the reference; exact, batch invariant; on CUDA the right
               choice for a few long sequences, where SDPA's flash/cuDNN kernels beat varlen)
    "mask"     one SDPA call over the whole buffer with a block-diagonal mask built from cu_seqlens:

               cu_seqlens = [0, 2, 5]         key ->  0 1 2 3 4
                                             q 0     x x . . .
                                               1     x x . . .
                                               2     . . x x x
                                               3     . . x x x
                                               4     . . x x x

               O(total_tokens^2) memory: for tests and small batches only. Inside a CUDA graph
               (`metadata.for_graph`) the mask is built from the device `cu_seqlens`, so a replay
               with new boundaries masks them; "per_seq" (host loop bounds) is refused there.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F

from vllm_omni.diffusion.attention.backends.base import AttentionBackend
from vllm_omni.diffusion.attention.metadata import AttentionMetadata

PACKED_IMPLS = ("per_seq", "mask")


def sdpa_dense(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None
) -> torch.Tensor:
    """SDPA on `[B, S, H, D]` q/k/v with an optional bool key mask `[B, S]` (True = attend)."""
    mask = None if attn_mask is None else attn_mask[:, None, None, :]  # [B, 1, 1, S]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask,
        dropout_p=0.0,
        is_causal=False,
    )  # [B, H, S, D]
    return out.transpose(1, 2)  # [B, S, H, D]


def sdpa_packed_per_seq(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_lens: list[int],
    kv_seq_lens: list[int] | None = None,
) -> torch.Tensor:
    """Reference packed attention: one SDPA per sequence of `[total_tokens, H, D]` q and k/v
    (`kv_seq_lens`: each sequence's key/value length when it differs from its query length)."""
    out = torch.empty_like(q)
    q_start = kv_start = 0
    for n, n_kv in zip(seq_lens, kv_seq_lens or seq_lens, strict=True):
        q_end, kv_end = q_start + n, kv_start + n_kv
        # [n, H, D] -> [1, n, H, D]
        qi, ki, vi = q[None, q_start:q_end], k[None, kv_start:kv_end], v[None, kv_start:kv_end]
        out[q_start:q_end] = sdpa_dense(qi, ki, vi, None)[0]
        q_start, kv_start = q_end, kv_end
    return out


def _seq_ids(lens: list[int], device: torch.device) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens)).to(device)


def block_diagonal_mask(
    seq_lens: list[int], device: torch.device, kv_seq_lens: list[int] | None = None
) -> torch.Tensor:
    """Bool `[total_q, total_kv]`, True where query and key are in the same sequence."""
    q_ids = _seq_ids(seq_lens, device)
    kv_ids = q_ids if kv_seq_lens is None else _seq_ids(kv_seq_lens, device)
    return q_ids[:, None] == kv_ids[None, :]


def _seq_ids_from_cu(cu_seqlens: torch.Tensor, total_tokens: int) -> torch.Tensor:
    positions = torch.arange(total_tokens, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return torch.searchsorted(cu_seqlens[1:], positions, right=True)  # [T]: sequence of each token


def block_diagonal_mask_from_cu(
    cu_seqlens: torch.Tensor,
    total_tokens: int,
    cu_seqlens_k: torch.Tensor | None = None,
    total_tokens_k: int | None = None,
) -> torch.Tensor:
    """`block_diagonal_mask` from int32 `cu_seqlens [num_seqs + 1]` on the device (no host read);
    `cu_seqlens_k` / `total_tokens_k` for keys that differ from the queries."""
    q_ids = _seq_ids_from_cu(cu_seqlens, total_tokens)
    kv_ids = q_ids if cu_seqlens_k is None else _seq_ids_from_cu(cu_seqlens_k, total_tokens_k)
    return q_ids[:, None] == kv_ids[None, :]


def sdpa_packed_mask(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    metadata: AttentionMetadata,
) -> torch.Tensor:
    """Packed attention as one SDPA over `[total_tokens, H, D]` with a block-diagonal mask (from the
    device `cu_seqlens` inside a CUDA graph, else from the host lengths)."""
    cross = metadata.kv_seq_lens is not None
    if metadata.for_graph:
        cu_k = metadata.cu_seqlens_k if cross else None
        mask = block_diagonal_mask_from_cu(metadata.cu_seqlens_q, q.shape[0], cu_k, k.shape[0])
    else:
        mask = block_diagonal_mask(metadata.seq_lens, q.device, metadata.kv_seq_lens)
    mask = mask[None, None]  # [1, 1, Tq, Tk]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask
    )  # [1, H, T, D]
    return out[0].transpose(0, 1)  # [T, H, D]


class SDPABackend(AttentionBackend):
    """PyTorch SDPA; keeps packed sequences apart per sequence (reference) or by a block mask."""

    name: ClassVar[str] = "SDPA"
    supports_varlen: ClassVar[bool] = True
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32, torch.float16, torch.bfloat16)
    supported_devices: ClassVar[tuple[str, ...]] = ("cpu", "cuda", "xpu", "mps")

    def __init__(self, packed_impl: str = "per_seq"):
        if packed_impl not in PACKED_IMPLS:
            raise ValueError(f"packed_impl must be one of {PACKED_IMPLS}, got {packed_impl!r}")
        self.packed_impl = packed_impl

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        self.check_inputs(q, k, v, metadata)
        if not metadata.is_varlen:
            return sdpa_dense(q, k, v, metadata.attn_mask)
        if self.packed_impl == "mask":
            return sdpa_packed_mask(q, k, v, metadata)
        if metadata.for_graph:
            raise ValueError(
                "per-sequence SDPA cannot run inside a CUDA graph (its loop bounds are host lengths); "
                "use AUTO / FLASH_ATTN / FLASH_ATTN_3, SDPABackend('mask'), or --enforce-eager"
            )
        return sdpa_packed_per_seq(q, k, v, metadata.seq_lens, metadata.kv_seq_lens)

    def __repr__(self) -> str:
        return f"SDPABackend(packed_impl={self.packed_impl!r})"

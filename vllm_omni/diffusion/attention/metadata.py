"""Packed-sequence geometry handed from the runner to attention backends.

A packed step concatenates the real tokens of every sequence (one per image of
a request, two with CFG) into one flat buffer and describes the boundaries with
cumulative sequence lengths, in flash-attn's vocabulary::

    tokens:   | txt0 ...| img0 ......| txt0' (neg) | img0 (again) | txt1 | img1 ... |
    cu_seqlens: 0        ^             ^                          ^                 ^
                         seq 0 ends    seq 1 (negative of req 0)  seq 2 (req 1)     total

Attention over such a buffer with `cu_seqlens_q == cu_seqlens_k` keeps every
sequence to itself: no request sees another's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    """Boundaries of the packed (varlen) or dense attention call.

    Packed (`is_varlen=True`): q/k/v are `[total_tokens, num_heads, head_dim]`,
    `cu_seqlens_q` / `cu_seqlens_k` are int32 `[num_seqs + 1]` on the device,
    starting at 0 and ending at `total_tokens`; `padded_tokens` must be 0.
    Dense (`is_varlen=False`): q/k/v are `[B, S, num_heads, head_dim]` and
    `attn_mask` (bool `[B, S]`, True = real token) masks padding keys, or is None.
    """

    is_varlen: bool = False
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    padded_tokens: int = 0
    seq_lens: list[int] = field(default_factory=list)
    """Host copy of every sequence's length (no device sync needed to read it)."""
    for_graph: bool = False
    """Metadata of a captured CUDA graph: `cu_seqlens` are static buffers rewritten before every
    replay, so the boundaries differ from `seq_lens` (the capture-time layout) and `max_seqlen_q` /
    `max_seqlen_k` are the bucket's token count (an upper bound). Only kernels that read the
    boundaries on the device (varlen FA2/FA3) may run; nothing may branch on `seq_lens`."""
    attn_mask: torch.Tensor | None = None
    """Dense path only: bool [B, S], True where the key is a real token."""
    _validated_tokens: int | None = field(default=None, repr=False, compare=False)
    """`total_tokens` of the last successful `validate()`; later calls with it return at once."""

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def total_tokens(self) -> int:
        return sum(self.seq_lens)

    def validate(self, total_tokens: int | None = None) -> None:
        """Raise ValueError when the geometry is inconsistent; host-side only (no device sync, so
        it may run inside CUDA graph capture).

        Checks the tensors' dtype/shape and the host lengths. `cu_seqlens` are compared with the
        prefix sums of `seq_lens` only when they live on the host; device copies are trusted (what
        `build_varlen_metadata` makes: build a new metadata rather than editing fields). The first
        success for a token count is remembered.
        """
        if not self.is_varlen:
            return
        if self._validated_tokens is not None and total_tokens in (None, self._validated_tokens):
            return
        if self.padded_tokens != 0:
            raise ValueError(f"varlen attention needs padded_tokens == 0, got {self.padded_tokens}")
        for name in ("cu_seqlens_q", "cu_seqlens_k"):
            cu = getattr(self, name)
            if cu is None:
                raise ValueError(f"varlen attention needs {name}")
            if cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() != self.num_seqs + 1:
                raise ValueError(
                    f"{name} must be int32 [num_seqs + 1] = [{self.num_seqs + 1}], "
                    f"got {cu.dtype} {list(cu.shape)}"
                )
        if any(n < 0 for n in self.seq_lens) or (not self.for_graph and min(self.seq_lens) <= 0):
            raise ValueError(f"every packed sequence must be non-empty, got lengths {self.seq_lens}")
        expected = [0]
        for n in self.seq_lens:
            expected.append(expected[-1] + n)
        for cu in (self.cu_seqlens_q, self.cu_seqlens_k):
            if cu.device.type == "cpu" and not self.for_graph and cu.tolist() != expected:
                raise ValueError(
                    f"cu_seqlens {cu.tolist()} do not match sequence lengths {self.seq_lens} "
                    f"(expected {expected})"
                )
        longest = self.total_tokens if self.for_graph else max(self.seq_lens)
        if self.max_seqlen_q != longest or self.max_seqlen_k != longest:
            raise ValueError(
                f"max_seqlen_q/max_seqlen_k ({self.max_seqlen_q}/{self.max_seqlen_k}) must equal "
                f"{'the token count of the graph' if self.for_graph else 'the longest sequence'} ({longest})"
            )
        if total_tokens is not None and total_tokens != self.total_tokens:
            raise ValueError(f"q has {total_tokens} tokens but the sequences hold {self.total_tokens}")
        self._validated_tokens = self.total_tokens


def build_varlen_metadata(seq_lens: list[int], device: torch.device | str = "cpu") -> AttentionMetadata:
    """Varlen metadata for sequences of the given lengths (self-attention: q and kv alike)."""
    if not seq_lens:
        raise ValueError("need at least one sequence")
    cu = [0]
    for n in seq_lens:
        cu.append(cu[-1] + n)
    cu_t = torch.tensor(cu, dtype=torch.int32, device=device)
    return AttentionMetadata(
        is_varlen=True,
        cu_seqlens_q=cu_t,
        cu_seqlens_k=cu_t,
        max_seqlen_q=max(seq_lens),
        max_seqlen_k=max(seq_lens),
        padded_tokens=0,
        seq_lens=list(seq_lens),
    )

"""Packed-sequence geometry handed from the runner to attention backends.

A packed step concatenates the real tokens of every sequence (one per image of
a request, two with CFG) into one flat buffer and describes the boundaries with
cumulative sequence lengths, in flash-attn's vocabulary::

    tokens:   | txt0 ...| img0 ......| txt0' (neg) | img0 (again) | txt1 | img1 ... |
    cu_seqlens: 0        ^             ^                          ^                 ^
                         seq 0 ends    seq 1 (negative of req 0)  seq 2 (req 1)     total

Attention over such a buffer with `cu_seqlens_q == cu_seqlens_k` keeps every
sequence to itself: no request sees another's tokens.

Cross lengths (`kv_seq_lens`): a family whose keys/values hold more than its queries (Qwen-Image-2.1:
each sequence's image rows attend to its cached prefix plus those rows) packs q and k/v separately,
sequence i's queries at `cu_seqlens_q[i]:cu_seqlens_q[i+1]`, its keys/values at
`cu_seqlens_k[i]:cu_seqlens_k[i+1]`; varlen kernels take the two boundary lists as they are.
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
    """Host copy of every sequence's length (no device sync needed to read it): its queries."""
    kv_seq_lens: list[int] | None = None
    """Each sequence's key/value length when it differs from its query length (a cached prefix);
    None = `seq_lens` (self-attention)."""
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

    @property
    def seq_lens_k(self) -> list[int]:
        """Each sequence's key/value length."""
        return self.seq_lens if self.kv_seq_lens is None else self.kv_seq_lens

    @property
    def total_tokens_k(self) -> int:
        return sum(self.seq_lens_k)

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
        if len(self.seq_lens_k) != self.num_seqs:
            raise ValueError(f"kv_seq_lens has {len(self.seq_lens_k)} lengths for {self.num_seqs} sequences")
        for name in ("cu_seqlens_q", "cu_seqlens_k"):
            cu = getattr(self, name)
            if cu is None:
                raise ValueError(f"varlen attention needs {name}")
            if cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() != self.num_seqs + 1:
                raise ValueError(
                    f"{name} must be int32 [num_seqs + 1] = [{self.num_seqs + 1}], "
                    f"got {cu.dtype} {list(cu.shape)}"
                )
        for lens in (self.seq_lens, self.seq_lens_k):
            if any(n < 0 for n in lens) or (not self.for_graph and min(lens) <= 0):
                raise ValueError(f"every packed sequence must be non-empty, got lengths {lens}")
        for cu, lens in ((self.cu_seqlens_q, self.seq_lens), (self.cu_seqlens_k, self.seq_lens_k)):
            expected = [0]
            for n in lens:
                expected.append(expected[-1] + n)
            if cu.device.type == "cpu" and not self.for_graph and cu.tolist() != expected:
                raise ValueError(
                    f"cu_seqlens {cu.tolist()} do not match sequence lengths {lens} (expected {expected})"
                )
        for name, got, lens in (
            ("max_seqlen_q", self.max_seqlen_q, self.seq_lens),
            ("max_seqlen_k", self.max_seqlen_k, self.seq_lens_k),
        ):
            longest = sum(lens) if self.for_graph else max(lens)
            if got != longest:
                what = "the token count of the graph" if self.for_graph else "the longest sequence"
                raise ValueError(f"{name} ({got}) must equal {what} ({longest})")
        if total_tokens is not None and total_tokens != self.total_tokens:
            raise ValueError(f"q has {total_tokens} tokens but the sequences hold {self.total_tokens}")
        self._validated_tokens = self.total_tokens


def _cu(lens: list[int], device: torch.device | str) -> torch.Tensor:
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)


def build_varlen_metadata(
    seq_lens: list[int], device: torch.device | str = "cpu", kv_seq_lens: list[int] | None = None
) -> AttentionMetadata:
    """Varlen metadata for sequences of the given lengths: self-attention (q and kv alike), or each
    sequence's `seq_lens[i]` queries over its `kv_seq_lens[i]` keys/values."""
    if not seq_lens:
        raise ValueError("need at least one sequence")
    cu_q = _cu(seq_lens, device)
    cu_k = cu_q if kv_seq_lens is None else _cu(kv_seq_lens, device)
    return AttentionMetadata(
        is_varlen=True,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=max(seq_lens),
        max_seqlen_k=max(seq_lens if kv_seq_lens is None else kv_seq_lens),
        padded_tokens=0,
        seq_lens=list(seq_lens),
        kv_seq_lens=None if kv_seq_lens is None else list(kv_seq_lens),
    )

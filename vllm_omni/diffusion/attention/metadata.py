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

import enum
from dataclasses import dataclass, field

import torch


class SegmentKind(enum.Enum):
    """What a span of a packed sequence holds."""

    TEXT = "text"
    IMAGE = "image"
    NEGATIVE_TEXT = "negative_text"
    NEGATIVE_IMAGE = "negative_image"
    """The image tokens of a CFG request's negative sequence (same latents, own output)."""


@dataclass(frozen=True)
class AttentionSegment:
    """A span of one packed sequence: `[start, start + length)` in the joint token buffer."""

    seq_index: int
    kind: SegmentKind
    start: int
    length: int
    req_index: int = 0
    """Index of the owning request in `AttentionMetadata.req_ids`."""


@dataclass
class AttentionMetadata:
    """Boundaries of the packed (varlen) or dense attention call.

    Packed (`is_varlen=True`): q/k/v are `[total_tokens, num_heads, head_dim]`,
    `q_cu_seqlens` / `kv_cu_seqlens` are int32 `[num_seqs + 1]` on the device,
    starting at 0 and ending at `total_tokens`; `padded_tokens` must be 0.
    Dense (`is_varlen=False`): q/k/v are `[B, S, num_heads, head_dim]` and
    `attn_mask` (bool `[B, S]`, True = real token) masks padding keys, or is None.
    """

    is_varlen: bool = False
    q_cu_seqlens: torch.Tensor | None = None
    kv_cu_seqlens: torch.Tensor | None = None
    max_q_len: int = 0
    max_kv_len: int = 0
    padded_tokens: int = 0
    seq_lens: list[int] = field(default_factory=list)
    """Host copy of every sequence's length (no device sync needed to read it)."""
    req_ids: list[str] = field(default_factory=list)
    """Request order of the packed sequences (a CFG request appears once)."""
    segments: list[AttentionSegment] = field(default_factory=list)
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
        """Raise ValueError when the geometry is inconsistent.

        NOTE(attention): the first successful call reads `cu_seqlens` back to the host (a device sync
        on CUDA); it is remembered, so the per-layer calls of a forward cost nothing. Treat metadata as
        immutable once validated: build a new one rather than editing fields.
        """
        if not self.is_varlen:
            return
        if self._validated_tokens is not None and total_tokens in (None, self._validated_tokens):
            return
        if self.padded_tokens != 0:
            raise ValueError(f"varlen attention needs padded_tokens == 0, got {self.padded_tokens}")
        for name in ("q_cu_seqlens", "kv_cu_seqlens"):
            cu = getattr(self, name)
            if cu is None:
                raise ValueError(f"varlen attention needs {name}")
            if cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() != self.num_seqs + 1:
                raise ValueError(
                    f"{name} must be int32 [num_seqs + 1] = [{self.num_seqs + 1}], "
                    f"got {cu.dtype} {list(cu.shape)}"
                )
        expected = [0]
        for n in self.seq_lens:
            if n <= 0:
                raise ValueError(f"every packed sequence must be non-empty, got lengths {self.seq_lens}")
            expected.append(expected[-1] + n)
        if self.q_cu_seqlens.cpu().tolist() != expected or self.kv_cu_seqlens.cpu().tolist() != expected:
            raise ValueError(
                f"cu_seqlens {self.q_cu_seqlens.tolist()} do not match sequence lengths {self.seq_lens} "
                f"(expected {expected})"
            )
        if self.max_q_len != max(self.seq_lens) or self.max_kv_len != max(self.seq_lens):
            raise ValueError(
                f"max_q_len/max_kv_len ({self.max_q_len}/{self.max_kv_len}) must equal the longest "
                f"sequence ({max(self.seq_lens)})"
            )
        if total_tokens is not None and total_tokens != expected[-1]:
            raise ValueError(f"q has {total_tokens} tokens but cu_seqlens ends at {expected[-1]}")
        self._validated_tokens = expected[-1]


def build_varlen_metadata(
    seq_lens: list[int],
    device: torch.device | str = "cpu",
    req_ids: list[str] | None = None,
    segments: list[AttentionSegment] | None = None,
) -> AttentionMetadata:
    """Varlen metadata for sequences of the given lengths (self-attention: q and kv alike)."""
    if not seq_lens:
        raise ValueError("need at least one sequence")
    cu = [0]
    for n in seq_lens:
        cu.append(cu[-1] + n)
    cu_t = torch.tensor(cu, dtype=torch.int32, device=device)
    return AttentionMetadata(
        is_varlen=True,
        q_cu_seqlens=cu_t,
        kv_cu_seqlens=cu_t,
        max_q_len=max(seq_lens),
        max_kv_len=max(seq_lens),
        padded_tokens=0,
        seq_lens=list(seq_lens),
        req_ids=list(req_ids or []),
        segments=list(segments or []),
    )

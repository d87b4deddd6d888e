"""Sequence parallelism for the packed forward: row shards per rank, Ulysses all-to-all attention.

The packed joint buffer (see packing.py) is cut into `sp` contiguous token ranges, one per
sequence-parallel rank, balanced by token count. A cut may fall inside a sequence:

    joint       | A A A a a a a | B B b b b b b b | N N N N b b b b b b |     total_tokens 25
    sp = 2      |<------------ rank 0 ------------>|<------ rank 1 ------>|    token_bounds (0, 12, 25)
    rank 0 rows img_rows[0:9]  txt_rows[0:5];   rank 1 rows img_rows[9:16]  txt_rows[5:9]

Because every image row and every text row sits in exactly one range and rows keep their order, a
rank's rows are a contiguous slice of each flat stream, and concatenating the ranks' ranges in rank
order gives the whole joint buffer back. Everything outside attention is per row (linears, norms,
MLPs) or per sequence (modulation: each local row keeps its global sequence id), so a rank runs the
unchanged model on its slice with a *local* `PackedLayout` (`shard_layout`).

Attention is exact for every sequence although sequences are cut:

    Ulysses (`UlyssesAttention`, degree U): all-to-all q/k/v from [local tokens, H, D] to
        [all tokens of the group, H/U, D]. Rank j receives every member's range for heads slice j;
        in rank order that is the whole (group's part of the) joint buffer, so the inner backend runs
        with the *global* varlen metadata and each sequence sees all its tokens. A second all-to-all
        returns [local tokens, H, D].
    Ring (ring_attention.py): K/V ranges travel around the ring; online-softmax merge.

With both, Ulysses runs inside each ring stage: the U ranges of a Ulysses group are adjacent, so
after its all-to-all a rank holds one contiguous "super range" (U ranges) with H/U heads, and the ring
passes those super ranges (see `RingAttention`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from vllm_omni.diffusion.attention import AttentionBackend, AttentionMetadata
from vllm_omni.diffusion.distributed.parallel_state import GroupInfo
from vllm_omni.diffusion.layout import PackedLayout


@dataclass
class ShardedAttentionMetadata(AttentionMetadata):
    """What a sequence-parallel rank's attention wrapper receives: the global geometry + the cut.

    The local q/k/v are `[token_bounds[sp_rank+1] - token_bounds[sp_rank], H, D]`.
    """

    full: AttentionMetadata | None = None
    """Varlen metadata of the whole (unsharded) joint buffer."""
    token_bounds: tuple[int, ...] = ()
    """[sp_size + 1]: sp rank i holds joint tokens [token_bounds[i], token_bounds[i + 1])."""

    @property
    def seq_starts(self) -> list[int]:
        """[num_seqs + 1] host cu_seqlens of the full buffer."""
        return np.concatenate([[0], np.cumsum(self.full.seq_lens)]).tolist()


def balanced_bounds(total_tokens: int, num_shards: int) -> tuple[int, ...]:
    """[num_shards + 1] cut points splitting `total_tokens` into near-equal contiguous ranges."""
    return tuple(i * total_tokens // num_shards for i in range(num_shards + 1))


@dataclass
class SequenceShard:
    """One sequence-parallel rank's part of a packed forward."""

    layout: PackedLayout
    """Local layout: this rank's rows; per-sequence tensors (timestep) stay global."""
    img_rows: slice
    """This rank's rows of the global image stream."""
    txt_rows: slice
    img_counts: list[int]
    """[sp_size]: image rows of every sp rank (to gather the output)."""


def _joint_positions(layout: PackedLayout) -> tuple[np.ndarray, np.ndarray]:
    """Host copies of (txt_to_joint, img_to_joint), rebuilt from the specs (no device sync)."""
    txt_lens = np.array([s.num_txt_tokens for s in layout.specs], dtype=np.int64)
    img_lens = np.array([s.num_img_tokens for s in layout.specs], dtype=np.int64)
    seq_starts = np.concatenate([[0], np.cumsum(txt_lens + img_lens)])[:-1]
    txt_off, img_off = np.array(layout.txt_row_offsets[:-1]), np.array(layout.img_row_offsets[:-1])
    txt_to_joint = np.arange(layout.num_txt_rows) + np.repeat(seq_starts - txt_off, txt_lens)
    img_to_joint = np.arange(layout.num_img_rows) + np.repeat(seq_starts + txt_lens - img_off, img_lens)
    return txt_to_joint, img_to_joint


def shard_layout(layout: PackedLayout, sp_size: int, sp_rank: int) -> SequenceShard:
    """This rank's `SequenceShard` of `layout` cut by `balanced_bounds(total_tokens, sp_size)`.

    Needs `layout.total_tokens >= sp_size` (every rank gets at least one token).
    """
    if layout.total_tokens < sp_size:
        raise ValueError(
            f"a packed batch of {layout.total_tokens} tokens cannot be split over {sp_size} "
            "sequence-parallel ranks"
        )
    bounds = balanced_bounds(layout.total_tokens, sp_size)
    txt_to_joint, img_to_joint = _joint_positions(layout)
    img_cuts = np.searchsorted(img_to_joint, bounds).tolist()  # image rows before each cut
    txt_cuts = np.searchsorted(txt_to_joint, bounds).tolist()
    lo = bounds[sp_rank]
    a, b = img_cuts[sp_rank], img_cuts[sp_rank + 1]
    c, d = txt_cuts[sp_rank], txt_cuts[sp_rank + 1]

    def local_offsets(offsets: list[int], start: int, stop: int) -> list[int]:
        return (np.clip(np.array(offsets), start, stop) - start).tolist()

    local = dataclasses.replace(
        layout,
        attn=ShardedAttentionMetadata(is_varlen=True, full=layout.attn, token_bounds=bounds),
        txt_to_joint=layout.txt_to_joint[c:d] - lo,
        img_to_joint=layout.img_to_joint[a:b] - lo,
        txt_seq_ids=layout.txt_seq_ids[c:d],
        img_seq_ids=layout.img_seq_ids[a:b],
        img_rope=tuple(t[a:b] for t in layout.img_rope),
        txt_rope=tuple(t[c:d] for t in layout.txt_rope),
        img_row_offsets=local_offsets(layout.img_row_offsets, a, b),
        txt_row_offsets=local_offsets(layout.txt_row_offsets, c, d),
    )
    img_counts = np.diff(img_cuts).tolist()
    return SequenceShard(local, slice(a, b), slice(c, d), img_counts)


class UlyssesAttention(AttentionBackend):
    """DeepSpeed-Ulysses attention over a sequence-parallel group (wraps another backend).

    With `ShardedAttentionMetadata`: q/k/v `[local_tokens, H, D]` -> all-to-all -> `[group tokens,
    H/U, D]` -> inner backend (global varlen metadata, or a `RingAttention` that receives the sharded
    metadata) -> all-to-all back -> `[local_tokens, H, D]`. With any other metadata (dense, or an
    unsharded packed batch every rank holds whole) it just calls the inner backend.
    """

    name = "ULYSSES"
    supports_varlen = True

    def __init__(self, inner: AttentionBackend, group: GroupInfo, sp_offset: int = 0):
        """`sp_offset`: sp rank of this group's first member (ring_rank * ulysses_degree)."""
        self.inner = inner
        self.group = group
        self.sp_offset = sp_offset
        self.inner_takes_shards = getattr(inner, "accepts_sharded_metadata", False)
        self.supported_dtypes = inner.supported_dtypes
        self.supported_devices = inner.supported_devices

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        if not isinstance(metadata, ShardedAttentionMetadata):
            return self.inner(q, k, v, metadata)
        num_members = self.group.size
        num_tokens, num_heads, head_dim = q.shape
        if num_heads % num_members != 0:
            raise ValueError(f"ulysses_degree ({num_members}) must divide the local heads ({num_heads})")
        bounds = metadata.token_bounds[self.sp_offset : self.sp_offset + num_members + 1]
        counts = np.diff(bounds).tolist()  # tokens of every member
        if counts[self.group.rank] != num_tokens:
            raise ValueError(
                f"ulysses rank {self.group.rank} holds {num_tokens} tokens, the cut says {counts}"
            )
        heads = num_heads // num_members
        # [3, n, H, D] -> [U, 3, n, H/U, D]: block j (heads slice j) goes to member j
        send = torch.stack([q, k, v]).view(3, num_tokens, num_members, heads, head_dim)
        send = send.permute(2, 0, 1, 3, 4).reshape(num_members * 3 * num_tokens, heads, head_dim)
        recv = send.new_empty((3 * sum(counts), heads, head_dim))
        dist.all_to_all_single(
            recv, send, [3 * n for n in counts], [3 * num_tokens] * num_members, group=self.group.group
        )
        # member j's block is [3, n_j, H/U, D]; in member order the tokens are the group's range
        parts = [p.view(3, n, heads, head_dim) for p, n in zip(recv.split([3 * n for n in counts]), counts)]
        q_all, k_all, v_all = torch.cat(parts, dim=1).unbind(0)  # [group tokens, H/U, D] each
        inner_md = metadata if self.inner_takes_shards else metadata.full
        out = self.inner(q_all, k_all, v_all, inner_md).contiguous()  # [group tokens, H/U, D]
        back = out.new_empty((num_members * num_tokens, heads, head_dim))
        dist.all_to_all_single(back, out, [num_tokens] * num_members, counts, group=self.group.group)
        # [U, n, H/U, D] -> [n, U, H/U, D] -> [n, H, D]
        return back.view(num_members, num_tokens, heads, head_dim).transpose(0, 1).reshape(q.shape)

    def __repr__(self) -> str:
        return f"UlyssesAttention(degree={self.group.size}, inner={self.inner!r})"

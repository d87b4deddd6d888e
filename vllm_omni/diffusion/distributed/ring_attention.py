"""Ring attention over packed varlen sequences: K/V ranges travel around a ring, exact online softmax.

Each ring rank holds one contiguous range of the joint buffer (see sequence_parallel.py; with
Ulysses inside, a range of U adjacent shards). For R ring ranks, R stages; at stage s rank r holds
the K/V of range (r - s) mod R, sends it on to r + 1 and receives the next one from r - 1 while it
computes:

    ranges       | seq 0 ....... | seq 1 ....|... seq 2 ............ |
                 |<--- range 0 --->|<--- range 1 --->|<-- range 2 -->|
    q range 1 x kv range 0: only seq 1 overlaps both -> one block; seq 0 rows of range 0 are skipped
    q range 1 x kv range 2: seq 1 (its tail) and seq 2 overlap -> two blocks, never one mixed block

Sequences never see each other: a (q range, kv range) pair is attended sequence by sequence, over the
intersection of the sequence with each range (host arithmetic on cu_seqlens, no mask). Partial
results merge with log-sum-exp (fp32):

    lse = logaddexp(lse_a, lse_b);  out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)

which equals softmax over the union of the key blocks, so every sequence gets exactly its full
attention (up to fp32 rounding of the merge).

The per-block kernel is plain fp32 math (`attention_with_lse`, any device). NOTE(distributed): on CUDA a
flash kernel that returns the softmax LSE (flash_attn_varlen_func(return_softmax_lse=True) over all
blocks of a stage at once) would replace it; not done: no multi-GPU machine was available to test it.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from vllm_omni.diffusion.attention import AttentionBackend, AttentionMetadata
from vllm_omni.diffusion.distributed.parallel_state import GroupInfo
from vllm_omni.diffusion.distributed.sequence_parallel import ShardedAttentionMetadata

MAX_BLOCK_ROWS = 1024
"""Query rows per score block: bounds the fp32 score buffer to [H, 1024, kv_len]."""


def attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of q `[n, H, D]` over k/v `[m, H, D]` in fp32.

    Returns (out fp32 `[n, H, D]`, lse fp32 `[n, H]`), lse = log sum_j exp(scale * q.k_j).
    """
    outs, lses = [], []
    k32, v32 = k.float(), v.float()
    for start in range(0, q.shape[0], MAX_BLOCK_ROWS):
        q32 = q[start : start + MAX_BLOCK_ROWS].float()
        scores = torch.einsum("qhd,khd->hqk", q32, k32) * scale  # [H, n, m]
        lse = torch.logsumexp(scores, dim=-1)  # [H, n]
        probs = torch.exp(scores - lse[..., None])
        outs.append(torch.einsum("hqk,khd->qhd", probs, v32))
        lses.append(lse.transpose(0, 1))
    return torch.cat(outs), torch.cat(lses)


def overlapping_blocks(
    seq_starts: list[int], q_range: tuple[int, int], kv_range: tuple[int, int]
) -> list[tuple[slice, slice]]:
    """(local q rows, local kv rows) per sequence that meets both joint ranges, in sequence order."""
    blocks = []
    for seq_lo, seq_hi in zip(seq_starts[:-1], seq_starts[1:]):
        q_lo, q_hi = max(seq_lo, q_range[0]), min(seq_hi, q_range[1])
        k_lo, k_hi = max(seq_lo, kv_range[0]), min(seq_hi, kv_range[1])
        if q_lo < q_hi and k_lo < k_hi:
            blocks.append(
                (
                    slice(q_lo - q_range[0], q_hi - q_range[0]),
                    slice(k_lo - kv_range[0], k_hi - kv_range[0]),
                )
            )
    return blocks


class RingAttention(AttentionBackend):
    """Exact packed attention over a ring of sequence-parallel ranks (see the module docstring).

    `stride`: sp shards per ring range (the Ulysses degree when Ulysses runs inside). With metadata
    that is not `ShardedAttentionMetadata` (dense, or a packed batch every rank holds whole) it calls
    `fallback`.
    """

    name = "RING"
    supports_varlen = True
    accepts_sharded_metadata = True
    """Takes `ShardedAttentionMetadata` from an enclosing `UlyssesAttention`."""

    def __init__(self, group: GroupInfo, fallback: AttentionBackend, stride: int = 1):
        self.group = group
        self.fallback = fallback
        self.stride = stride
        self.supported_dtypes = fallback.supported_dtypes
        self.supported_devices = fallback.supported_devices
        self._plan_key: tuple | None = None
        self._plan: list[list[tuple[slice, slice]]] = []

    def _ranges(self, metadata: ShardedAttentionMetadata) -> list[tuple[int, int]]:
        bounds = metadata.token_bounds[:: self.stride]
        if len(bounds) != self.group.size + 1:
            raise ValueError(
                f"token_bounds {metadata.token_bounds} with stride {self.stride} do not give "
                f"{self.group.size} ring ranges"
            )
        return list(zip(bounds[:-1], bounds[1:]))

    def _blocks(self, metadata: ShardedAttentionMetadata) -> list[list[tuple[slice, slice]]]:
        """Per stage: the (q rows, kv rows) blocks; cached while the geometry is unchanged."""
        key = (tuple(metadata.full.seq_lens), metadata.token_bounds)
        if key != self._plan_key:
            ranges, num, me = self._ranges(metadata), self.group.size, self.group.rank
            starts = metadata.seq_starts
            self._plan = [
                overlapping_blocks(starts, ranges[me], ranges[(me - stage) % num]) for stage in range(num)
            ]
            self._plan_key = key
        return self._plan

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        if not isinstance(metadata, ShardedAttentionMetadata):
            return self.fallback(q, k, v, metadata)
        num, me = self.group.size, self.group.rank
        ranges = self._ranges(metadata)
        if ranges[me][1] - ranges[me][0] != q.shape[0]:
            raise ValueError(f"ring rank {me} holds {q.shape[0]} tokens, its range is {ranges[me]}")
        scale = 1.0 / math.sqrt(q.shape[-1])
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)  # [n, H, D]
        lse = torch.full(q.shape[:2], -math.inf, dtype=torch.float32, device=q.device)  # [n, H]
        kv = torch.stack([k, v]).contiguous()  # [2, n, H, D]
        send_to, recv_from = self.group.ranks[(me + 1) % num], self.group.ranks[(me - 1) % num]
        for stage, blocks in enumerate(self._blocks(metadata)):
            pending = []
            if stage < num - 1:
                src_range = ranges[(me - stage - 1) % num]
                incoming = kv.new_empty((2, src_range[1] - src_range[0], *kv.shape[2:]))
                ops = [
                    dist.P2POp(dist.isend, kv, send_to, self.group.group),
                    dist.P2POp(dist.irecv, incoming, recv_from, self.group.group),
                ]
                pending = dist.batch_isend_irecv(ops)
            for q_rows, kv_rows in blocks:
                block_out, block_lse = attention_with_lse(q[q_rows], kv[0, kv_rows], kv[1, kv_rows], scale)
                merged = torch.logaddexp(lse[q_rows], block_lse)  # [rows, H]
                out[q_rows] = (
                    out[q_rows] * torch.exp(lse[q_rows] - merged)[..., None]
                    + block_out * torch.exp(block_lse - merged)[..., None]
                )
                lse[q_rows] = merged
            for work in pending:
                work.wait()
            if stage < num - 1:
                kv = incoming
        return out.to(q.dtype)

    def __repr__(self) -> str:
        return f"RingAttention(degree={self.group.size}, stride={self.stride})"

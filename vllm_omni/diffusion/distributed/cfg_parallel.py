"""CFG parallelism: the positive and negative sequences of CFG requests run on different ranks.

With `cfg_parallel_size = 2` the packed batch's sequences are split into two sub-batches:

    specs       | a+ | a- | b+ | b- | c+ | c- |            (CFG requests: positive, then negative)
    cfg rank 0  | a+ | b+ | c+ |                           global rank 0: the positive sequences
    cfg rank 1  | a- | b- | c- |                           the negative sequences

Sequences of requests without a negative (a batch without CFG, or the positive of a request whose
negative is not in the batch) go to the cfg rank with fewer tokens so far. Each cfg rank runs its
sub-batch as an ordinary packed forward (its own `build_packed_layout` over the chosen specs: RoPE,
indices and cu_seqlens depend only on each sequence's own spec, so a sequence computes exactly what
it computes in the full batch). The image-row outputs are exchanged with one `all_gather` over the
cfg group and put back in the full batch's row order, so every rank holds every sequence's velocity
and can do each request's CFG combine itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_omni.diffusion.layout import PackedLayout, SequenceSpec, build_packed_layout


def assign_cfg_ranks(specs: tuple[SequenceSpec, ...] | list[SequenceSpec], cfg_size: int) -> list[int]:
    """The cfg rank of every sequence: negatives -> 1, positives of CFG requests -> 0, the rest to
    the rank with the fewest tokens so far (in order)."""
    if cfg_size == 1:
        return [0] * len(specs)
    if cfg_size != 2:
        raise ValueError(f"cfg_parallel_size must be 1 or 2, got {cfg_size}")
    with_negative = {s.req_id for s in specs if s.is_negative}
    ranks: list[int | None] = [None] * len(specs)
    load = [0, 0]
    for i, spec in enumerate(specs):
        if spec.is_negative or spec.req_id in with_negative:
            ranks[i] = 1 if spec.is_negative else 0
            load[ranks[i]] += spec.seq_len
    for i, spec in enumerate(specs):
        if ranks[i] is None:
            ranks[i] = 0 if load[0] <= load[1] else 1
            load[ranks[i]] += spec.seq_len
    return ranks


@dataclass
class CfgPlan:
    """One cfg rank's sub-batch of a packed forward, and how to put the outputs back together."""

    layout: PackedLayout | None
    """This rank's sub-batch layout; None when no sequence was assigned to it."""
    seq_index: torch.Tensor
    """int64 [local seqs]: this rank's sequences in the full batch (selects their timesteps)."""
    img_index: torch.Tensor
    """int64 [local img rows]: this rank's rows of the full image stream."""
    txt_index: torch.Tensor
    """int64 [local txt rows]: this rank's rows of the full text stream."""
    img_counts: list[int]
    """[cfg_size]: image rows of every cfg rank (to gather the output)."""
    gather_index: torch.Tensor
    """int64 [num_img_rows]: full-batch row of every row of the gathered (rank-ordered) output."""


def _rows(offsets: list[int], seqs: list[int]) -> np.ndarray:
    parts = [np.arange(offsets[i], offsets[i + 1]) for i in seqs]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def build_cfg_plan(layout: PackedLayout, cfg_size: int, cfg_rank: int) -> CfgPlan:
    """Split `layout`'s sequences over the cfg ranks (`assign_cfg_ranks`) and build this rank's part."""
    seq_ranks = assign_cfg_ranks(layout.specs, cfg_size)
    seqs = [[i for i, r in enumerate(seq_ranks) if r == c] for c in range(cfg_size)]
    img_rows = [_rows(layout.img_row_offsets, s) for s in seqs]
    mine = seqs[cfg_rank]
    sub_layout = None
    if mine:
        sub_layout = build_packed_layout([layout.specs[i] for i in mine], layout.positions, layout.device)

    def to_device(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.asarray(a, dtype=np.int64)).to(layout.device)

    return CfgPlan(
        layout=sub_layout,
        seq_index=to_device(np.array(mine, dtype=np.int64)),
        img_index=to_device(img_rows[cfg_rank]),
        txt_index=to_device(_rows(layout.txt_row_offsets, mine)),
        img_counts=[len(r) for r in img_rows],
        gather_index=to_device(np.concatenate(img_rows)),
    )

"""Pieces of the parallel modes that need no second process: config, rank layout, row cuts, CFG split,
ring blocks and the log-sum-exp merge (against SDPA)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from vllm_omni.config import ParallelConfig
from vllm_omni.diffusion.distributed.cfg_parallel import assign_cfg_ranks, build_cfg_plan
from vllm_omni.diffusion.distributed.parallel_state import _member_ranks
from vllm_omni.diffusion.distributed.ring_attention import attention_with_lse, overlapping_blocks
from vllm_omni.diffusion.distributed.sequence_parallel import balanced_bounds, shard_layout
from vllm_omni.diffusion.models.qwen_image.packing import SequenceSpec, build_packed_layout

AXES = (4, 6, 6)
SPECS = [
    SequenceSpec(5, (1, 2, 3), "a"),
    SequenceSpec(3, (1, 4, 2), "b"),
    SequenceSpec(7, (1, 4, 2), "b", is_negative=True),
    SequenceSpec(4, (1, 3, 3), "c"),
]


def test_parallel_config_validation():
    cfg = ParallelConfig(tensor_parallel_size=2, ulysses_degree=2, ring_degree=3, cfg_parallel_size=2)
    assert cfg.world_size == 24 and cfg.sequence_parallel_size == 6
    cfg.validate_model(24)
    with pytest.raises(ValueError, match="divisible by tensor_parallel_size \\* ulysses_degree"):
        cfg.validate_model(6)
    with pytest.raises(ValueError, match="world size 8 must equal"):
        cfg.validate_world_size(8)
    with pytest.raises(ValueError, match="cfg_parallel_size must be 1 or 2"):
        ParallelConfig(cfg_parallel_size=3)
    with pytest.raises(ValueError, match="ring_degree must be an int >= 1"):
        ParallelConfig(ring_degree=0)
    assert not ParallelConfig().is_parallel


def test_rank_layout_and_groups():
    cfg = ParallelConfig(tensor_parallel_size=2, ulysses_degree=2, cfg_parallel_size=2)
    coords = [cfg.coords(r) for r in range(cfg.world_size)]
    assert [cfg.rank_of(*c) for c in coords] == list(range(8))
    assert coords[0] == (0, 0, 0, 0) and coords[4][0] == 1  # cfg outermost: rank 0 is positive
    assert _member_ranks(cfg, "tp") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert _member_ranks(cfg, "ulysses") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert _member_ranks(cfg, "cfg") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    ring = ParallelConfig(ulysses_degree=2, ring_degree=2)
    assert _member_ranks(ring, "sp") == [(0, 1, 2, 3)]  # sp rank = ring_rank * U + ulysses_rank
    assert _member_ranks(ring, "ring") == [(0, 2), (1, 3)]


def test_cfg_assignment_and_plan():
    assert assign_cfg_ranks(SPECS, 2) == [0, 0, 1, 1]  # b+ / b- split; then a, c to the lighter rank
    pairs = [SequenceSpec(4, (1, 2, 2), r, neg) for r in "xy" for neg in (False, True)]
    assert assign_cfg_ranks(pairs, 2) == [0, 1, 0, 1]
    layout = build_packed_layout(SPECS, AXES)
    plan = build_cfg_plan(layout, 2, 1)
    assert plan.layout.specs == (SPECS[2], SPECS[3]) and plan.img_counts == [6 + 8, 8 + 9]
    assert plan.seq_index.tolist() == [2, 3] and plan.txt_index.tolist() == list(range(8, 19))
    assert sorted(plan.gather_index.tolist()) == list(range(layout.num_img_rows))


@pytest.mark.parametrize("sp", [2, 3, 5])
def test_shards_cover_the_joint_buffer_in_order(sp):
    layout = build_packed_layout(SPECS, AXES)
    bounds = balanced_bounds(layout.total_tokens, sp)
    joint_of_rows = []
    img_rows = []
    for rank in range(sp):
        shard = shard_layout(layout, sp, rank)
        local = shard.layout
        assert local.total_tokens == bounds[rank + 1] - bounds[rank]
        # local rows land in the local joint buffer exactly where the global rows land globally
        img_global = layout.img_to_joint[shard.img_rows]
        assert torch.equal(local.img_to_joint + bounds[rank], img_global)
        assert torch.equal(local.txt_to_joint + bounds[rank], layout.txt_to_joint[shard.txt_rows])
        assert torch.equal(local.img_seq_ids, layout.img_seq_ids[shard.img_rows])
        assert torch.equal(local.img_rope[0], layout.img_rope[0][shard.img_rows])
        joint_of_rows += torch.cat([local.txt_to_joint, local.img_to_joint]).add(bounds[rank]).tolist()
        img_rows += list(range(layout.num_img_rows))[shard.img_rows]
        assert shard.img_counts[rank] == shard.img_rows.stop - shard.img_rows.start
    assert sorted(joint_of_rows) == list(range(layout.total_tokens))
    assert img_rows == list(range(layout.num_img_rows))


def test_overlapping_blocks_never_mix_sequences():
    starts = [0, 11, 22, 37, 50]
    assert overlapping_blocks(starts, (25, 50), (0, 25)) == [(slice(0, 12), slice(22, 25))]
    assert overlapping_blocks(starts, (0, 25), (25, 50)) == [(slice(22, 25), slice(0, 12))]
    assert overlapping_blocks(starts, (0, 10), (12, 20)) == []


def test_lse_merge_of_key_blocks_equals_full_attention():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(9, 3, 8, generator=gen) for _ in range(3))
    scale = 1 / math.sqrt(8)
    want = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
    out, lse = attention_with_lse(q, k, v, scale)
    assert torch.allclose(out, want.transpose(0, 1), atol=1e-6)
    # two key blocks merged with log-sum-exp == one softmax over all keys
    out_a, lse_a = attention_with_lse(q, k[:4], v[:4], scale)
    out_b, lse_b = attention_with_lse(q, k[4:], v[4:], scale)
    merged = torch.logaddexp(lse_a, lse_b)
    out_m = out_a * torch.exp(lse_a - merged)[..., None] + out_b * torch.exp(lse_b - merged)[..., None]
    assert torch.allclose(merged, lse, atol=1e-6) and torch.allclose(out_m, out, atol=1e-6)

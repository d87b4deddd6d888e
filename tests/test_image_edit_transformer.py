"""Packed forward with several image grids per sequence (Qwen-Image-Edit) vs diffusers' transformer.

An edit sequence's image stream is [target ; condition]: diffusers' `QwenImageTransformer2DModel` takes
it with `img_shapes=[[target, condition]]` (RoPE over both grids, text after the largest). One packed
forward over edit sequences of different target and condition sizes, next to a text-to-image sequence,
must equal each sequence's diffusers forward alone, and the condition rows must matter.
"""

from __future__ import annotations

import pytest
import torch
from utils import AXES, make_models

from vllm_omni.diffusion.models.qwen_image.fused_ops import BlockOps
from vllm_omni.diffusion.models.qwen_image.packing import SequenceSpec, build_packed_layout
from vllm_omni.diffusion.models.qwen_image.rope import grids_rope, image_positions, image_rope


@pytest.fixture(scope="module")
def models():
    return make_models(7)  # the condition-rows assertion below was written for these weights


def test_condition_grid_frame_offset_and_single_grid_identity():
    assert image_positions((1, 2, 2), frame_offset=1)[:, 0].tolist() == [1, 1, 1, 1]
    one = grids_rope(((1, 3, 2),), AXES)
    assert all(torch.equal(a, b) for a, b in zip(one, image_rope((1, 3, 2), AXES)))
    two = grids_rope(((1, 3, 2), (1, 2, 2)), AXES)
    assert two[0].shape == (10, 8)


def test_spec_counts_and_validation():
    spec = SequenceSpec(5, (1, 2, 3), cond_shapes=((1, 4, 4),))
    assert (spec.num_target_tokens, spec.num_img_tokens, spec.seq_len) == (6, 22, 27)
    with pytest.raises(ValueError, match="cond_shapes"):
        build_packed_layout([SequenceSpec(5, (1, 2, 3), cond_shapes=((1, 0, 4),))], AXES)


@pytest.mark.parametrize("fuse_joint", [False, True], ids=["per_stream", "fused_joint"])
def test_packed_edit_sequences_equal_diffusers_alone(models, fuse_joint):
    ref, ours = models
    ours.block_ops = BlockOps(compiled=False, fuse_joint=fuse_joint)  # the CUDA path's join math
    gen = torch.Generator().manual_seed(0)
    # (text length, target grid, condition grids); the last is text-to-image in the same forward
    cases = [(7, (1, 2, 3), ((1, 4, 4),)), (4, (1, 5, 2), ((1, 3, 6),)), (6, (1, 3, 3), ())]
    specs = [SequenceSpec(n, g, req_id=str(i), cond_shapes=c) for i, (n, g, c) in enumerate(cases)]
    img = [torch.randn(s.num_img_tokens, 64, generator=gen) for s in specs]
    txt = [torch.randn(s.num_txt_tokens, 32, generator=gen) for s in specs]
    t = torch.rand(len(specs), generator=gen)
    layout = build_packed_layout(specs, AXES)
    with torch.no_grad():
        out = layout.split_img(ours.forward_packed(torch.cat(img), torch.cat(txt), t, layout))
        for i, spec in enumerate(specs):
            expected = ref(
                img[i][None], txt[i][None], None, t[i : i + 1], [list(spec.grids)], return_dict=False
            )[0][0]
            torch.testing.assert_close(out[i], expected, atol=1e-5, rtol=1e-4)
        # the condition rows reach the target rows
        num_target = specs[0].num_target_tokens
        img0 = img[0].clone()
        img0[num_target:] += 1.0  # condition rows only
        moved = layout.split_img(ours.forward_packed(torch.cat([img0, *img[1:]]), torch.cat(txt), t, layout))
        assert (moved[0][:num_target] - out[0][:num_target]).abs().max() > 1e-2
        for i in (1, 2):  # other sequences cannot see it
            torch.testing.assert_close(moved[i], out[i], atol=0, rtol=0)
    ours.block_ops = BlockOps(compiled=False)

"""RoPE per request vs diffusers' QwenEmbedRope for that request's shape and text length."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.transformers.transformer_qwenimage import QwenEmbedRope, apply_rotary_emb_qwen

from vllm_omni.diffusion.models.qwen_image.packing import SequenceSpec, build_packed_layout
from vllm_omni.diffusion.models.qwen_image.rope import apply_rope, image_rope, text_rope, text_start

SHAPES = [(1, 1, 1), (1, 2, 2), (1, 3, 5), (1, 4, 2), (1, 6, 6), (1, 7, 3), (1, 64, 96), (2, 3, 4)]


@pytest.mark.parametrize("axes", [(4, 6, 6), (16, 56, 56)])
@pytest.mark.parametrize("img_shape", SHAPES)
def test_tables_equal_diffusers(axes, img_shape):
    num_txt = 11
    diffusers_rope = QwenEmbedRope(theta=10000, axes_dim=list(axes), scale_rope=True)
    vid, txt = diffusers_rope([img_shape], device=torch.device("cpu"), max_txt_seq_len=num_txt)
    img_cos, img_sin = image_rope(img_shape, axes)
    txt_cos, txt_sin = text_rope(img_shape, num_txt, axes)
    assert torch.equal(img_cos, vid.real) and torch.equal(img_sin, vid.imag)
    assert torch.equal(txt_cos, txt.real) and torch.equal(txt_sin, txt.imag)


def test_text_starts_after_this_requests_grid():
    assert text_start((1, 3, 5)) == 2
    assert text_start((1, 64, 96)) == 48
    # text j has position s + j on all three axes: its cos on axis 0 pair 0 is cos(s + j)
    cos, _ = text_rope((1, 6, 6), 4, (4, 6, 6))
    assert torch.allclose(cos[:, 0], torch.cos(torch.arange(3, 7, dtype=torch.float32)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_rope_equals_diffusers_complex_multiply(dtype):
    cos, sin = image_rope((1, 3, 5), (4, 6, 6))
    x = torch.randn(2, 15, 3, 16).to(dtype)  # [B, S, H, D]
    expected = apply_rotary_emb_qwen(x, torch.complex(cos, sin), use_real=False)
    assert torch.equal(apply_rope(x, cos, sin), expected)
    packed = apply_rope(x[0], cos, sin)  # [T, H, D]
    assert torch.equal(packed, expected[0])


def test_layout_rope_is_each_requests_own():
    """Packed offsets never leak into positions: every sequence gets the tables it gets alone."""
    axes = (4, 6, 6)
    specs = [
        SequenceSpec(5, (1, 2, 2), "a"),
        SequenceSpec(3, (1, 3, 5), "b"),
        SequenceSpec(7, (1, 3, 5), "b", True),
    ]
    layout = build_packed_layout(specs, axes)
    img_off, txt_off = layout.img_row_offsets, layout.txt_row_offsets
    for i, spec in enumerate(specs):
        img_cos, img_sin = image_rope(spec.img_shape, axes)
        txt_cos, txt_sin = text_rope(spec.img_shape, spec.num_txt_tokens, axes)
        assert torch.equal(layout.img_rope[0][img_off[i] : img_off[i + 1]], img_cos)
        assert torch.equal(layout.img_rope[1][img_off[i] : img_off[i + 1]], img_sin)
        assert torch.equal(layout.txt_rope[0][txt_off[i] : txt_off[i + 1]], txt_cos)
        assert torch.equal(layout.txt_rope[1][txt_off[i] : txt_off[i + 1]], txt_sin)


def test_positions_beyond_diffusers_table_raise():
    with pytest.raises(ValueError, match="RoPE positions"):
        text_rope((1, 2, 2), 5000, (4, 6, 6))
    with pytest.raises(ValueError, match="even"):
        image_rope((1, 2, 2), (3, 6, 7))

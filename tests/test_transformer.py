"""Our Qwen-Image transformer vs diffusers' QwenImageTransformer2DModel on identical (tiny) weights.

Dense: a same-shape batch with different text lengths (masked padding) equals diffusers' batched forward.
Packed: one forward over requests of different grids, text lengths and timesteps (plus a CFG pair)
equals each request's diffusers forward run alone; requests cannot influence each other.
"""

from __future__ import annotations

import pytest
import torch
from diffusers import QwenImageTransformer2DModel
from utils import AXES, JOINT, TINY, make_models, make_packed_batch, rel_err, run_ref

from vllm_omni.diffusion.attention import SDPABackend
from vllm_omni.diffusion.models.qwen_image import transformer as transformer_module
from vllm_omni.diffusion.models.qwen_image.fused_ops import BlockOps
from vllm_omni.diffusion.models.qwen_image.packing import SequenceSpec, build_packed_layout, latent_grid
from vllm_omni.diffusion.models.qwen_image.transformer import QwenImageTransformer, QwenImageTransformerConfig


@pytest.fixture(scope="module")
def models():
    return make_models(1234)


@pytest.fixture(params=["per_stream", "fused_joint", "fused_joint_rows"])
def join_impl(request, models, monkeypatch):
    """The ways of building the joint q/k/v: per stream then a join copy, or `joint_qkv` (the
    compiled path's math, run eager here); `fused_joint_rows` also runs the image out-projection
    over the joint rows (read back by index), which the tiny texts are otherwise too long for."""
    _, ours = models
    ours.block_ops = BlockOps(compiled=False, fuse_joint=request.param != "per_stream")
    if request.param == "fused_joint_rows":
        monkeypatch.setattr(transformer_module, "JOINT_ROWS_MAX_TXT_SHARE", 0)
    yield request.param
    ours.block_ops = BlockOps(compiled=False)


def test_state_dict_names_and_shapes_match_diffusers():
    ref = QwenImageTransformer2DModel(**TINY)
    ours = QwenImageTransformer(QwenImageTransformerConfig.from_dict(dict(ref.config)))
    ref_shapes = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    our_shapes = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    assert our_shapes == ref_shapes
    assert list(ours.buffers()) == []  # nothing non-persistent that a meta-device build would lose


def test_config_from_dict():
    d = dict(QwenImageTransformer2DModel(**TINY).config)
    d.update(_class_name="QwenImageTransformer2DModel", _diffusers_version="0.42.1", some_future_key=1)
    cfg = QwenImageTransformerConfig.from_dict(d)
    assert cfg.axes_dims_rope == AXES and cfg.num_layers == 2 and cfg.inner_dim == 32
    assert QwenImageTransformerConfig.from_dict({"in_channels": 8, "out_channels": None}).out_channels == 8
    for flag in ("zero_cond_t", "use_additional_t_cond", "use_layer3d_rope", "guidance_embeds"):
        with pytest.raises(ValueError, match=flag):
            QwenImageTransformerConfig.from_dict({**d, flag: True})
    with pytest.raises(ValueError, match="attention_head_dim"):
        QwenImageTransformerConfig(attention_head_dim=64)


def test_meta_device_build_and_assign_load(models):
    ref, _ = models
    with torch.device("meta"):
        model = QwenImageTransformer(QwenImageTransformerConfig(**TINY))
    model.load_state_dict(ref.state_dict(), assign=True)
    layout = build_packed_layout([SequenceSpec(3, (1, 2, 2))], AXES)
    out = model.forward_packed(torch.randn(4, 64), torch.randn(3, JOINT), torch.tensor([0.5]), layout)
    assert out.shape == (4, 64) and torch.isfinite(out).all()


def test_dense_batch_with_text_mask_matches_diffusers(models, join_impl):
    ref, ours = models
    gen = torch.Generator().manual_seed(0)
    img_shape, txt_lens = (1, 3, 5), [4, 9, 1]
    img = torch.randn(3, 15, 64, generator=gen)
    txt = torch.randn(3, max(txt_lens), JOINT, generator=gen)
    mask = torch.zeros(3, max(txt_lens), dtype=torch.long)
    for i, n in enumerate(txt_lens):
        mask[i, :n] = 1
    t = torch.tensor([0.95, 0.5, 0.02])
    expected = run_ref(ref, img, txt, mask, t, img_shape)
    with torch.no_grad():
        out = ours(img, txt, mask, t, [img_shape] * 3)
    assert rel_err(out, expected) <= 1e-5
    with torch.no_grad():  # pipeline-style nested img_shapes are accepted too
        assert torch.equal(ours(img, txt, mask, t, [[img_shape]] * 3), out)


def test_dense_bf16_error_within_diffusers_own(models):
    """bf16: our error vs the fp32 reference is at most ~2x diffusers' own bf16 error (catches casts)."""
    ref, ours = models
    gen = torch.Generator().manual_seed(1)
    img, txt = torch.randn(2, 8, 64, generator=gen), torch.randn(2, 5, JOINT, generator=gen)
    mask, t = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]), torch.tensor([0.7, 0.3])
    expected = run_ref(ref, img, txt, mask, t, (1, 2, 4))
    ref_bf16 = QwenImageTransformer2DModel(**TINY).eval()
    ref_bf16.load_state_dict(ref.state_dict())
    ref_bf16.to(torch.bfloat16)
    ours_bf16 = QwenImageTransformer(ours.config).eval()
    ours_bf16.load_state_dict(ref.state_dict())
    ours_bf16.to(torch.bfloat16)
    ref_err = rel_err(run_ref(ref_bf16, img.bfloat16(), txt.bfloat16(), mask, t, (1, 2, 4)), expected)
    with torch.no_grad():
        our_err = rel_err(ours_bf16(img.bfloat16(), txt.bfloat16(), mask, t, [(1, 2, 4)] * 2), expected)
    assert our_err <= 2 * ref_err + 1e-6


@pytest.mark.parametrize("packed_impl", ["per_seq", "mask"])
def test_packed_forward_matches_each_request_alone(models, packed_impl, join_impl):
    ref, ours = models
    specs, imgs, txts, steps = make_packed_batch()
    layout = build_packed_layout(specs, AXES)
    ours.attn_backend = SDPABackend(packed_impl=packed_impl)
    try:
        with torch.no_grad():
            out = ours.forward_packed(torch.cat(imgs), torch.cat(txts), steps, layout)
    finally:
        ours.attn_backend = None
    assert out.shape == (sum(x.shape[0] for x in imgs), 64)
    assert len(specs) == 5 and specs[2].is_negative and specs[1].req_id == specs[2].req_id
    for spec, img, txt, t, got in zip(specs, imgs, txts, steps, layout.split_img(out), strict=True):
        alone = run_ref(ref, img[None], txt[None], None, t[None], spec.img_shape)[0]
        assert rel_err(got, alone) <= 1e-5, spec


def test_modulation_runs_per_sequence_not_per_token(models):
    _, ours = models
    specs, imgs, txts, steps = make_packed_batch()
    rows_seen = []
    hook = (
        ours.transformer_blocks[0]
        .img_mod[1]
        .register_forward_hook(lambda mod, inp, out: rows_seen.append(inp[0].shape[0]))
    )
    try:
        with torch.no_grad():
            ours.forward_packed(torch.cat(imgs), torch.cat(txts), steps, build_packed_layout(specs, AXES))
    finally:
        hook.remove()
    assert rows_seen == [len(specs)]


def test_packed_requests_are_isolated(models):
    """Changing one request's latents, text and timestep leaves every other output bit-identical."""
    _, ours = models
    specs, imgs, txts, steps = make_packed_batch()
    layout = build_packed_layout(specs, AXES)
    with torch.no_grad():
        base = layout.split_img(ours.forward_packed(torch.cat(imgs), torch.cat(txts), steps, layout))
        changed = 3  # the (4, 2) request
        imgs[changed] = imgs[changed] + 1.0
        txts[changed] = torch.randn_like(txts[changed])
        steps[changed] = 0.11
        after = layout.split_img(ours.forward_packed(torch.cat(imgs), torch.cat(txts), steps, layout))
    for i, (a, b) in enumerate(zip(base, after, strict=True)):
        assert torch.equal(a, b) != (i == changed), i


def test_packed_bad_inputs_raise(models):
    _, ours = models
    specs, imgs, txts, steps = make_packed_batch()
    layout = build_packed_layout(specs, AXES)
    img_rows, txt_rows = torch.cat(imgs), torch.cat(txts)
    with pytest.raises(ValueError, match="img_rows.*sum of the grids"):
        ours.forward_packed(img_rows[:-1], txt_rows, steps, layout)
    with pytest.raises(ValueError, match="txt_rows"):
        ours.forward_packed(img_rows, txt_rows[:-2], steps, layout)
    with pytest.raises(ValueError, match="timestep"):
        ours.forward_packed(img_rows, txt_rows, steps[:-1], layout)
    with pytest.raises(ValueError, match="layout RoPE"):
        ours.forward_packed(img_rows, txt_rows, steps, build_packed_layout(specs, (8, 4, 4)))
    with pytest.raises(ValueError, match="multiple of 16"):
        latent_grid(1000, 1020)
    assert latent_grid(48, 64) == (1, 3, 4)
    with pytest.raises(ValueError, match=r"specs\[1\].img_shape"):
        build_packed_layout([SequenceSpec(2, (1, 2, 2)), SequenceSpec(2, (1, 0, 2))], AXES)
    with pytest.raises(ValueError, match=r"specs\[0\].num_txt_tokens"):
        build_packed_layout([SequenceSpec(0, (1, 2, 2))], AXES)


def test_dense_bad_inputs_raise(models):
    _, ours = models
    img, txt, t = torch.randn(2, 6, 64), torch.randn(2, 3, JOINT), torch.tensor([0.5, 0.5])
    with pytest.raises(ValueError, match="one image shape"):
        ours(img, txt, None, t, [(1, 2, 3), (1, 3, 2)])
    with pytest.raises(ValueError, match="tokens"):
        ours(img, txt, None, t, [(1, 2, 2)] * 2)
    with pytest.raises(ValueError, match="encoder_hidden_states_mask"):
        ours(img, txt, torch.ones(2, 4), t, [(1, 2, 3)] * 2)


def test_layout_indices_match_design_doc():
    """The example drawn in docs/design/packed_forward.md."""
    specs = [
        SequenceSpec(3, (1, 2, 2), "a"),
        SequenceSpec(2, (1, 2, 3), "b"),
        SequenceSpec(4, (1, 2, 3), "b", True),
    ]
    layout = build_packed_layout(specs, AXES)
    assert layout.attn.cu_seqlens_q.tolist() == [0, 7, 15, 25]
    assert layout.txt_to_joint.tolist() == [0, 1, 2, 7, 8, 15, 16, 17, 18]
    assert layout.img_to_joint.tolist() == [3, 4, 5, 6, *range(9, 15), *range(19, 25)]
    assert layout.img_seq_ids.tolist() == [0] * 4 + [1] * 6 + [2] * 6
    assert layout.txt_seq_ids.tolist() == [0] * 3 + [1] * 2 + [2] * 4
    assert (layout.num_img_rows, layout.num_txt_rows, layout.total_tokens) == (16, 9, 25)
    moved = layout.to("meta")
    assert moved.img_to_joint.device.type == "meta" and moved.attn.cu_seqlens_q.device.type == "meta"
    assert moved.img_rope[0].device.type == "meta" and layout.device.type == "cpu"

"""Our Qwen-Image-2.1 transformer (prefix prefill + packed steps over image rows) against diffusers'
`QwenImage21Transformer2DModel` with the same weights, per request, with and without diffusers' KV cache
(CPU, fp32)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from vllm_omni.diffusion.layout import SequenceSpec, build_packed_layout
from vllm_omni.diffusion.models import registry
from vllm_omni.diffusion.models.qwen_image21.tiny import TINY_MODEL_NAME
from vllm_omni.diffusion.models.qwen_image21.transformer import (
    QwenImage21Transformer,
    QwenImage21TransformerConfig,
)

ATOL = 1e-4

# (prompt rows, latent grid, timestep / 1000): different sizes, prompt lengths and steps
REQUESTS = [(5, (1, 4, 2), 0.9), (13, (1, 2, 2), 0.35), (9, (1, 4, 6), 0.6)]


@pytest.fixture(scope="module")
def models():
    from diffusers import QwenImage21Transformer2DModel

    path = registry.resolve_model_path(TINY_MODEL_NAME) / "transformer"
    reference = QwenImage21Transformer2DModel.from_pretrained(path).eval()
    ours = QwenImage21Transformer(QwenImage21TransformerConfig.from_dict(dict(reference.config))).eval()
    ours.load_state_dict(load_file(path / "diffusion_pytorch_model.safetensors"), strict=True)
    return reference, ours


def _inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for num_txt, grid, t in REQUESTS:
        txt = torch.randn(num_txt, 32, generator=gen)
        img = torch.randn(grid[1] * grid[2], 16, generator=gen)
        out.append((txt, img, grid, torch.tensor([t])))
    return out


@torch.no_grad()
def _reference(model, txt, img, grid, t, use_kv_cache: bool, t_extract: float = 0.97):
    """diffusers' velocity of the target rows: one full forward, or an 'extract' forward at another
    timestep followed by a 'cached' one."""
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

    n = img.shape[0]
    img_mask = torch.cat([torch.zeros(txt.shape[0], dtype=torch.bool), torch.ones(n // 4, dtype=torch.bool)])
    kwargs = dict(
        encoder_hidden_states=txt[None], img_shapes=[[grid]], img_mask=img_mask[None], return_dict=False
    )
    if not use_kv_cache:
        return model(hidden_states=img[None], timestep=t, **kwargs)[0][0, -n:]
    cache = QwenImage21KVCache(len(model.transformer_blocks))
    noise = torch.randn_like(img)
    model(
        hidden_states=noise[None],
        timestep=torch.tensor([t_extract]),
        kv_cache=cache,
        kv_cache_mode="extract",
        **kwargs,
    )
    return model(hidden_states=img[None], timestep=t, kv_cache=cache, kv_cache_mode="cached", **kwargs)[0][
        0, -n:
    ]


@pytest.mark.parametrize(
    "use_kv_cache,step_attention", [(False, "per_seq"), (True, "per_seq"), (True, "mask")]
)
def test_packed_forward_matches_diffusers_per_request(models, use_kv_cache, step_attention):
    """Packed steps (cu_seqlens_q != cu_seqlens_k) equal diffusers per request, with the step's
    attention as per-sequence SDPA or one masked SDPA built from the two boundary lists."""
    from vllm_omni.diffusion.attention import SDPABackend

    reference, ours = models
    ours.attn_backend = SDPABackend(step_attention)
    inputs = _inputs()
    specs = [SequenceSpec(txt.shape[0], grid, req_id=f"r{i}") for i, (txt, _, grid, _) in enumerate(inputs)]
    layout = build_packed_layout(specs, ours.position_tables)
    for i, (txt, *_rest) in enumerate(inputs):
        ours.prefix_cache.put(f"r{i}", False, ours.prefill(txt))
    img_rows = torch.cat([img for _, img, _, _ in inputs])
    timesteps = torch.cat([t for *_, t in inputs])
    txt_rows = torch.cat([txt for txt, *_ in inputs])
    with torch.no_grad():
        out = ours.forward_packed(img_rows, txt_rows, timesteps, layout)
    ours.prefix_cache.release([s.req_id for s in specs])
    assert len(ours.prefix_cache) == 0
    worst = 0.0
    for (txt, img, grid, t), got in zip(inputs, layout.split_img(out), strict=True):
        want = _reference(reference, txt, img, grid, t, use_kv_cache)
        assert want.abs().max() > 0.1  # not a degenerate output
        worst = max(worst, (got - want).abs().max().item())
    print(f"max abs vs diffusers (kv_cache={use_kv_cache}): {worst:.2e}")
    assert worst < ATOL


def test_uncached_prefix_and_dense_forward_match(models):
    """A sequence without a cached prefix is prefilled in the forward; the dense forward too."""
    reference, ours = models
    txt, img, grid, t = _inputs(seed=3)[0]
    want = _reference(reference, txt, img, grid, t, use_kv_cache=False)
    layout = build_packed_layout([SequenceSpec(txt.shape[0], grid, req_id="x")], ours.position_tables)
    with torch.no_grad():
        packed = ours.forward_packed(img, txt, t, layout)
        dense = ours(img[None], txt[None], None, t, [grid])[0]
    assert (packed - want).abs().max() < ATOL
    assert (dense - want).abs().max() < ATOL
    assert len(ours.prefix_cache) == 0


def test_prefix_size_and_a_prompt_moves_the_output(models):
    _, ours = models
    gen = torch.Generator().manual_seed(5)
    txt_a, txt_b = torch.randn(7, 32, generator=gen), torch.randn(7, 32, generator=gen)
    prefix = ours.prefill(txt_a)
    cfg = ours.config
    assert prefix.key.shape == (cfg.num_layers, 7, cfg.num_attention_heads, cfg.attention_head_dim)
    assert prefix.num_bytes == 2 * cfg.num_layers * 7 * cfg.inner_dim * 4
    img, t = torch.randn(8, 16, generator=gen), torch.tensor([0.5])
    layout = build_packed_layout([SequenceSpec(7, (1, 4, 2), req_id="a")], ours.position_tables)
    with torch.no_grad():
        a = ours.forward_packed(img, txt_a, t, layout)
        b = ours.forward_packed(img, txt_b, t, layout)
    assert (a - b).abs().mean() > 1e-3


def test_config_from_diffusers_dict():
    config = QwenImage21TransformerConfig.from_dict(
        {
            "_class_name": "QwenImage21Transformer2DModel",
            "in_channels": 16,
            "out_channels": None,
            "unknown": 1,
        }
    )
    assert config.out_channels == 16 and config.inner_dim == 4096
    with pytest.raises(ValueError, match="must sum to attention_head_dim"):
        QwenImage21TransformerConfig.from_dict({"axes_dims_rope": [16, 56, 48]})


def test_dense_forward_takes_diffusers_img_shapes(models):
    reference, ours = models
    txt, img, grid, t = _inputs(seed=4)[1]
    want = _reference(reference, txt, img, grid, t, use_kv_cache=False)
    with torch.no_grad():
        got = ours(img[None], txt[None], torch.ones(1, txt.shape[0], dtype=torch.bool), t, [[grid]])[0]
    assert (got - want).abs().max() < ATOL


# An edit prefix: text, reference A (2 slots = 1x2x4 rows), text, reference B (4 slots = 1x4x4), text.
EDIT_SLOTS = [False] * 3 + [True] * 2 + [False] * 4 + [True] * 4 + [False] * 2
EDIT_GRIDS = [(1, 2, 4), (1, 4, 4)]


@torch.no_grad()
def _edit_reference(model, txt, cond, img, grid, t, use_kv_cache: bool):
    """diffusers' target velocity for an encoder sequence with reference-image slots."""
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

    n = img.shape[0]
    img_mask = torch.tensor(EDIT_SLOTS + [True] * (n // 4))[None]
    kwargs = dict(encoder_hidden_states=txt[None], img_shapes=[[*EDIT_GRIDS, grid]], img_mask=img_mask)
    hidden = torch.cat([cond, img])[None]
    if not use_kv_cache:
        return model(hidden_states=hidden, timestep=t, return_dict=False, **kwargs)[0][0, -n:]
    cache = QwenImage21KVCache(len(model.transformer_blocks))
    noise = torch.cat([cond, torch.randn_like(img)])[None]
    model(
        hidden_states=noise, timestep=torch.tensor([0.9]), kv_cache=cache, kv_cache_mode="extract", **kwargs
    )
    out = model(hidden_states=hidden, timestep=t, kv_cache=cache, kv_cache_mode="cached", **kwargs)
    return out.sample[0, -n:]


@pytest.mark.parametrize("use_kv_cache", [False, True])
def test_edit_prefix_with_two_references_packed_with_t2i(models, use_kv_cache):
    """Reference-image blocks in the prefix (bidirectional inside, their own RoPE, the target's frame
    after them), packed with a text-to-image sequence, vs diffusers per sequence."""
    reference, ours = models
    gen = torch.Generator().manual_seed(9)
    txt = torch.randn(len(EDIT_SLOTS), 32, generator=gen)
    cond = torch.randn(sum(f * h * w for f, h, w in EDIT_GRIDS), 16, generator=gen)
    grid, img, t = (1, 4, 2), torch.randn(8, 16, generator=gen), torch.tensor([0.4])
    t2i_txt, t2i_img, t2i_grid, t2i_t = _inputs(seed=6)[2]

    prefix = ours.prefill(txt, EDIT_SLOTS, cond, EDIT_GRIDS)
    assert prefix.num_rows == 3 + 8 + 4 + 16 + 2
    ours.prefix_cache.put("edit", False, prefix)
    ours.prefix_cache.put("t2i", False, ours.prefill(t2i_txt))
    specs = [
        SequenceSpec(len(EDIT_SLOTS), grid, req_id="edit"),
        SequenceSpec(t2i_txt.shape[0], t2i_grid, req_id="t2i"),
    ]
    layout = build_packed_layout(specs, ours.position_tables)
    with torch.no_grad():
        out = ours.forward_packed(
            torch.cat([img, t2i_img]), torch.cat([txt, t2i_txt]), torch.cat([t, t2i_t]), layout
        )
    ours.prefix_cache.release(["edit", "t2i"])
    got_edit, got_t2i = layout.split_img(out)
    want_edit = _edit_reference(reference, txt, cond, img, grid, t, use_kv_cache)
    want_t2i = _reference(reference, t2i_txt, t2i_img, t2i_grid, t2i_t, use_kv_cache)
    worst = max((got_edit - want_edit).abs().max().item(), (got_t2i - want_t2i).abs().max().item())
    print(f"edit prefix, max abs vs diffusers (kv_cache={use_kv_cache}): {worst:.2e}")
    assert worst < ATOL
    # the references matter: another reference image moves the target
    other = ours.prefill(txt, EDIT_SLOTS, torch.randn_like(cond), EDIT_GRIDS)
    ours.prefix_cache.put("edit", False, other)
    with torch.no_grad():
        moved = ours.forward_packed(img, txt, t, build_packed_layout(specs[:1], ours.position_tables))
    ours.prefix_cache.release(["edit"])
    assert (moved - got_edit).abs().mean() > 1e-3


def test_edit_prefix_plan():
    from vllm_omni.diffusion.models.qwen_image21.prefix import plan_prefix

    plan = plan_prefix(EDIT_SLOTS, EDIT_GRIDS)
    assert plan.block_ids.tolist() == [-1] * 3 + [0] * 8 + [-1] * 4 + [1] * 16 + [-1] * 2
    # text 0..2, image A at frame 3 (advances 4), text 7..10, image B at 11 (advances 4), text 15, 16
    assert plan.positions[:3, 0].tolist() == [0, 1, 2] and plan.positions[3:11, 0].unique().tolist() == [3]
    assert plan.positions[11:15, 0].tolist() == [7, 8, 9, 10]
    assert plan.positions[15:31, 0].unique().tolist() == [11] and plan.positions[31:, 0].tolist() == [15, 16]
    assert plan.target_frame == 17
    visible = plan.visibility()
    assert visible[3, 10] and not visible[2, 3] and not visible[14, 15] and visible[30, 0]
    with pytest.raises(ValueError, match="slots"):
        plan_prefix(EDIT_SLOTS, EDIT_GRIDS[:1])


def test_cuda_graphs_are_on_for_the_packed_step():
    """2.1's packed step is captured through its own static step (`packed_graph_steps`, graphs.py): the
    pipeline gives no reason to stay eager; a pipeline's reason is still reported as such."""
    from vllm_omni.diffusion.models.qwen_image21.pipeline import QwenImage21StepPipeline
    from vllm_omni.diffusion.models.qwen_image21.transformer import (
        QwenImage21Transformer,
        QwenImage21TransformerConfig,
    )
    from vllm_omni.diffusion.worker.cuda_graphs import graphs_off_reason

    assert QwenImage21StepPipeline.cuda_graphs_off_reason is None
    config = QwenImage21TransformerConfig(
        num_layers=1, attention_head_dim=16, num_attention_heads=2, axes_dims_rope=(4, 6, 6)
    )
    transformer = QwenImage21Transformer(config)
    assert callable(transformer.packed_graph_steps)
    cuda = torch.device("cuda")
    reason = graphs_off_reason(transformer, cuda, False, False, "its step is not captured")
    assert reason == "QwenImage21Transformer: its step is not captured"
    assert graphs_off_reason(transformer, cuda, True, False, "x") == "--enforce-eager"
    from vllm_omni.diffusion.distributed.parallel_transformer import ParallelTransformer

    wrapper = ParallelTransformer.__new__(ParallelTransformer)  # its declared reason, no groups needed
    assert "parallel wrapper" in graphs_off_reason(wrapper, cuda, False, False)

"""LoRA on the transformer: per-run deltas vs a dense per-row reference, and mixed adapters in one
packed / dense forward vs diffusers' QwenImageTransformer2DModel with the same adapter loaded by peft."""

from __future__ import annotations

import pytest
import torch
from diffusers import QwenImagePipeline
from test_transformer import AXES, TINY, make_models, make_packed_batch, rel_err, run_ref
from torch import nn

from vllm_omni.diffusion.layers.linear import Linear
from vllm_omni.diffusion.models.qwen_image import transformer as transformer_module
from vllm_omni.diffusion.models.qwen_image.fused_ops import BlockOps
from vllm_omni.diffusion.models.qwen_image.packing import build_packed_layout
from vllm_omni.lora import LoRAConfig
from vllm_omni.lora.layers import (
    LoRAMapping,
    LoRAModuleWeights,
    LoRAStepState,
    SeqLoRA,
    make_lora_linear,
    row_stream,
)
from vllm_omni.lora.manager import LoRAManager
from vllm_omni.lora.random_adapter import block_targets, random_lora_state_dict, save_lora_dir

pytest.importorskip("peft")

EXTRA_TARGETS = [
    "img_in",
    "txt_in",
    "proj_out",
    "norm_out.linear",
    "time_text_embed.timestep_embedder.linear_1",
    "transformer_blocks.0.img_mod.1",
    "transformer_blocks.1.txt_mod.1",
]
ADAPTERS = {
    # name: (targets, rank, alpha, key prefix)
    "style": (block_targets(2) + EXTRA_TARGETS, 4, None, "transformer."),
    "detail": (
        block_targets(2, ("attn.to_q", "attn.add_v_proj", "img_mlp.net.2")),
        2,
        8.0,
        "diffusion_model.",
    ),
    "mods": (
        ["transformer_blocks.1.img_mod.1", "norm_out.linear", "transformer_blocks.0.attn.to_k"],
        3,
        1.5,
        "",
    ),
}


@pytest.fixture(scope="module")
def lora_models(tmp_path_factory):
    """(diffusers + peft adapters, ours + LoRAManager, {name: id}) with identical base and adapter weights."""
    ref, ours = make_models(1234)
    root = tmp_path_factory.mktemp("loras")
    manager = LoRAManager(ours, LoRAConfig(enabled=True, max_lora_rank=8))
    ids = {}
    for seed, (name, (targets, rank, alpha, prefix)) in enumerate(ADAPTERS.items()):
        state = random_lora_state_dict(ours, targets, rank, seed, 0.2, alpha, prefix)
        path = save_lora_dir(root / name, state)
        ids[name] = manager.add(name, str(path))
        ref.load_lora_adapter(
            QwenImagePipeline.lora_state_dict(str(path)), prefix="transformer", adapter_name=name
        )
    return ref, ours, manager, ids


def ref_forward(ref, name: str | None, scale: float, *args):
    if name is None:
        ref.disable_lora()
    else:
        ref.enable_lora()
        ref.set_adapters([name], [scale])
    try:
        return run_ref(ref, *args)
    finally:
        ref.enable_lora()


# (adapter, scale) per request of test_transformer.REQUESTS (the third request has CFG: two sequences)
ASSIGNMENT = [("style", 1.0), ("detail", 0.7), (None, 1.0), ("mods", -0.5), ("style", 0.3)]


def _seq_loras(specs, ids, assignment):
    by_req = {f"req-{i}": a for i, a in enumerate(assignment)}
    out = []
    for spec in specs:
        name, scale = by_req[spec.req_id]
        out.append(SeqLoRA(ids[name], scale) if name else SeqLoRA(0))
    return out


@pytest.fixture(params=["per_stream", "fused_joint", "fused_joint_rows"])
def join_impl(request, lora_models, monkeypatch):
    """The CUDA path's fused join (one QKV GEMM per stream, deltas added to its columns), and the
    image out-projection over joint rows where to_out is its base, run eager on CPU."""
    _, ours, _, _ = lora_models
    ours.block_ops = BlockOps(compiled=False, fuse_joint=request.param != "per_stream")
    if request.param == "fused_joint_rows":
        monkeypatch.setattr(transformer_module, "JOINT_ROWS_MAX_TXT_SHARE", 0)
    yield request.param
    ours.block_ops = BlockOps(compiled=False)


def test_mixed_adapters_in_one_packed_forward_match_diffusers(lora_models, join_impl):
    ref, ours, manager, ids = lora_models
    specs, imgs, txts, steps = make_packed_batch()
    layout = build_packed_layout(specs, AXES)
    seqs = _seq_loras(specs, ids, ASSIGNMENT)
    with torch.no_grad(), manager.activate(LoRAMapping.for_packed(seqs, layout)):
        out = ours.forward_packed(torch.cat(imgs), torch.cat(txts), steps, layout)
    by_req = {f"req-{i}": a for i, a in enumerate(ASSIGNMENT)}
    for spec, img, txt, t, got in zip(specs, imgs, txts, steps, layout.split_img(out), strict=True):
        name, scale = by_req[spec.req_id]
        want = ref_forward(ref, name, scale, img[None], txt[None], None, t[None], spec.img_shape)[0]
        base = ref_forward(ref, None, 1.0, img[None], txt[None], None, t[None], spec.img_shape)[0]
        assert rel_err(got, want) <= 1e-5, spec
        if name is not None:  # the adapter really changed this sequence's output
            assert rel_err(got, base) > 1e-3, spec


def test_dense_forward_with_mixed_adapters_matches_diffusers(lora_models, join_impl):
    ref, ours, manager, ids = lora_models
    gen = torch.Generator().manual_seed(7)
    img_shape, batch = (1, 2, 3), [("style", 1.0), (None, 1.0), ("detail", 2.0), ("style", 0.5)]
    img = torch.randn(len(batch), 6, 64, generator=gen)
    txt = torch.randn(len(batch), 5, TINY["joint_attention_dim"], generator=gen)
    mask = torch.ones(len(batch), 5, dtype=torch.long)
    mask[1, 3:] = 0
    t = torch.tensor([0.9, 0.5, 0.3, 0.1])
    seqs = [SeqLoRA(ids[n], s) if n else SeqLoRA(0) for n, s in batch]
    with torch.no_grad(), manager.activate(LoRAMapping.for_dense(seqs)):
        out = ours(img, txt, mask, t, [img_shape] * len(batch))
    for b, (name, scale) in enumerate(batch):
        n = int(mask[b].sum())
        want = ref_forward(
            ref, name, scale, img[b : b + 1], txt[b : b + 1, :n], None, t[b : b + 1], img_shape
        )
        assert rel_err(out[b], want[0]) <= 1e-5, b


def test_outside_activate_the_model_is_its_base(lora_models):
    ref, ours, _, _ = lora_models
    specs, imgs, txts, steps = make_packed_batch()
    layout = build_packed_layout(specs, AXES)
    with torch.no_grad():
        out = ours.forward_packed(torch.cat(imgs), torch.cat(txts), steps, layout)
    spec, got = specs[0], layout.split_img(out)[0]
    want = ref_forward(ref, None, 1.0, imgs[0][None], txts[0][None], None, steps[:1], spec.img_shape)[0]
    assert rel_err(got, want) <= 1e-5


def test_row_streams_follow_module_names():
    assert row_stream("transformer_blocks.3.attn.to_q") == "img"
    assert row_stream("transformer_blocks.3.attn.add_k_proj") == "txt"
    assert row_stream("transformer_blocks.3.txt_mlp.net.2") == "txt"
    assert row_stream("transformer_blocks.3.img_mod.1") == "seq"
    assert row_stream("norm_out.linear") == "seq"
    assert row_stream("time_text_embed.timestep_embedder.linear_2") == "seq"
    assert row_stream("proj_out") == "img" and row_stream("txt_in") == "txt"


class _Layout:  # the two fields LoRAMapping.for_packed reads
    def __init__(self, img_offsets):
        self.img_row_offsets, self.txt_row_offsets = img_offsets, img_offsets
        self.specs = [None] * (len(img_offsets) - 1)


@pytest.mark.parametrize("invariant", [False, True])
def test_per_run_delta_equals_dense_per_row_reference(invariant):
    """Rows of 4 adapters (some repeated, some absent) in one call vs each row's own base + delta."""
    gen = torch.Generator().manual_seed(0)
    linear = Linear(24, 40)
    if invariant:
        from vllm_omni.diffusion.batch_invariant import apply_batch_invariance

        apply_batch_invariance(linear)
    slot = make_lora_linear(linear, "transformer_blocks.0.attn.to_q", state := LoRAStepState())
    adapters = {}
    for lora_id, rank in ((1, 2), (2, 5), (3, 3), (4, 1)):
        adapters[lora_id] = LoRAModuleWeights(
            torch.randn(rank, 24, generator=gen), torch.randn(40, rank, generator=gen), 0.5 * lora_id
        )
        slot.weights[lora_id] = adapters[lora_id]
    seqs = [
        SeqLoRA(2, 1.0),
        SeqLoRA(2, 1.0),
        SeqLoRA(0),
        SeqLoRA(1, -0.3),
        SeqLoRA(3, 2.0),
        SeqLoRA(2, 0.5),
        SeqLoRA(9),
    ]
    offsets = [0, 3, 5, 9, 10, 14, 20, 22]  # seq 6 uses an adapter this linear does not have
    x = torch.randn(22, 24, generator=gen)
    mapping = LoRAMapping.for_packed(seqs, _Layout(offsets))
    assert mapping.runs("img", x)[0] == (0, 5, SeqLoRA(2, 1.0))  # neighbours with one adapter merge
    with torch.no_grad(), state.activate(mapping):
        got = linear(x)
    with torch.no_grad():
        want = nn.functional.linear(x, linear.weight, linear.bias)
        for i, seq in enumerate(seqs):
            w = adapters.get(seq.lora_int_id)
            for row in range(offsets[i], offsets[i + 1]):
                if w is not None:
                    want[row] += seq.scale * w.scaling * (w.lora_b @ (w.lora_a @ x[row]))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_mapping_refuses_rows_it_does_not_describe():
    mapping = LoRAMapping.for_packed([SeqLoRA(1), SeqLoRA(0)], _Layout([0, 3, 5]))
    with pytest.raises(ValueError, match="img-stream linear got"):
        mapping.runs("img", torch.zeros(6, 4))
    with pytest.raises(ValueError, match="2 sequences, the forward has 3"):
        mapping.runs("seq", torch.zeros(3, 4))
    with pytest.raises(ValueError, match="for_packed"):
        LoRAMapping.for_dense([SeqLoRA(1)]).runs("img", torch.zeros(6, 4))

"""LoRA on the transformer: per-run deltas vs a dense per-row reference, and mixed adapters in one
packed / dense forward vs diffusers' QwenImageTransformer2DModel with the same adapter loaded by peft."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import QwenImagePipeline
from triton_interpreter import PATCH, run_interpreted
from utils import (
    AXES,
    GROUP_OFFSETS,
    OFFSETS,
    SLOT_ADAPTERS,
    SLOT_SEQS,
    TINY,
    RowLayout,
    group_qkv,
    group_reference,
    make_models,
    make_packed_batch,
    per_row_reference,
    rel_err,
    run_ref,
    slot_linear,
)

from vllm_omni.diffusion.models.qwen_image import transformer as transformer_module
from vllm_omni.diffusion.models.qwen_image.fused_ops import BlockOps
from vllm_omni.diffusion.models.qwen_image.packing import build_packed_layout
from vllm_omni.diffusion.models.qwen_image.transformer import QwenImageTransformer
from vllm_omni.lora import LoRAConfig
from vllm_omni.lora.batch import LoRABatch, max_tiles, merge_runs, tile_runs
from vllm_omni.lora.layers import (
    LoRAMapping,
    LoRAModuleWeights,
    SeqLoRA,
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
    "style": (block_targets(QwenImageTransformer.plans, 2) + EXTRA_TARGETS, 4, None, "transformer."),
    "detail": (
        block_targets(QwenImageTransformer.plans, 2, ("attn.to_q", "attn.add_v_proj", "img_mlp.net.2")),
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
    with torch.no_grad(), manager.activate(LoRAMapping.for_dense(seqs, img.shape[1], txt.shape[1])):
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
    row_stream = QwenImageTransformer.plans.lora.row_stream
    assert row_stream("transformer_blocks.3.attn.to_q") == "img"
    assert row_stream("transformer_blocks.3.attn.add_k_proj") == "txt"
    assert row_stream("transformer_blocks.3.txt_mlp.net.2") == "txt"
    assert row_stream("transformer_blocks.3.img_mod.1") == "seq"
    assert row_stream("norm_out.linear") == "seq"
    assert row_stream("time_text_embed.timestep_embedder.linear_2") == "seq"
    assert row_stream("proj_out") == "img" and row_stream("txt_in") == "txt"


@pytest.mark.parametrize("invariant", [False, True])
def test_slot_delta_equals_a_per_row_reference(invariant):
    """Rows of 4 adapters of ranks 2..16 (padded to 16), repeated, absent and scaled, in one call."""
    linear, state, adapters = slot_linear(invariant)
    seqs = [SeqLoRA(slot, scale) for slot, scale in SLOT_SEQS]  # ids = slots here
    mapping = LoRAMapping.for_packed(seqs, RowLayout(OFFSETS))
    batch = LoRABatch.build(mapping, {s: s for s in SLOT_ADAPTERS}, "cpu")
    assert batch.streams["img"].runs[0] == (0, 5, 2, 1.0)  # neighbours with one adapter and scale merge
    x = torch.randn(OFFSETS[-1], 24, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(linear(x), linear.base_forward(x))  # no batch active: the base only
        with state.activate(batch):
            assert not linear.runs_plain_gemm(x)
            got = linear(x)
        want = per_row_reference(linear, x, adapters, SLOT_SEQS, OFFSETS)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    no_adapter = slice(OFFSETS[2], OFFSETS[3])
    assert torch.equal(got[no_adapter], linear.base_forward(x)[no_adapter])  # slot 0: exactly the base


def test_merged_projection_slots_are_one_group_and_match_a_per_row_reference():
    """The host path through a merged group's slots (views of its stacks): adapters on some members."""
    module, state, adapters, batch = group_qkv()
    group = module.to_q.lora.group
    assert group is not None and all(m.lora.group is group for m in (module.to_k, module.to_v))
    assert (group.lora_a.shape, group.lora_b.shape, group.scaling.shape) == (
        (5, 48, 24),
        (5, 120, 16),
        (3, 6),
    )
    k = module.to_k.lora
    assert k.lora_a.data_ptr() == group.lora_a[:, 16:].data_ptr()
    assert (
        k.lora_b.data_ptr() == group.lora_b[:, 40:].data_ptr()
        and k.scaling.data_ptr() == group.scaling[1].data_ptr()
    )
    assert k.scaling_cpu[2] == 0 and not group.lora_a[1, 16:32].any() and float(group.scaling[1, 3]) == 2.0
    x = torch.randn(GROUP_OFFSETS[-1], 24, generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), state.activate(batch):
        got = module.merged("qkv")(x)
    torch.testing.assert_close(got, group_reference(module, x, adapters), rtol=1e-5, atol=1e-4)


def test_runs_cut_into_tiles():
    runs = merge_runs([1, 1, 0, 2, 1], [1.0, 1.0, 1.0, 0.5, 1.0], (0, 30, 40, 50, 50, 130))
    assert runs == ((0, 40, 1, 1.0), (50, 130, 1, 1.0))  # slot 0 and empty sequences leave no run
    tiles, scales = tile_runs(runs)
    assert tiles.tolist() == [[0, 40, 1], [50, 114, 1], [114, 130, 1]]  # TILE_ROWS 64
    assert scales.tolist() == [1.0] * 3
    tiles, _ = tile_runs(runs, tile_rows=32)  # the kernel benchmark's other tile sizes
    assert tiles.tolist() == [[0, 32, 1], [32, 40, 1], [50, 82, 1], [82, 114, 1], [114, 130, 1]]


def test_graph_tables_fit_every_composition_and_no_more():
    """`max_tiles` (a graph's static table size: ceil(rows / TILE_ROWS) + runs - 1) holds the tiles of
    any composition of a bucket, the covering tables too, and some composition needs all of them (a
    larger bound gives the kernels spare programs, a smaller one refuses a batch the graph serves)."""
    rng = np.random.default_rng(0)
    needed = set()
    for _ in range(400):
        num_seqs = int(rng.integers(1, 7))  # + the padding sequence, as a packed bucket has
        lengths = [int(n) for n in rng.integers(0, 200, num_seqs)] + [int(rng.integers(0, 64))]
        offsets = tuple(np.cumsum([0, *lengths]).tolist())
        seqs = [SeqLoRA(int(rng.integers(0, 3))) for _ in range(num_seqs)] + [SeqLoRA(0)]
        mapping = LoRAMapping(tuple(seqs), offsets, offsets)
        batch = LoRABatch.build(mapping, {1: 1, 2: 2}, "cpu")
        rows = {"img": offsets[-1], "txt": offsets[-1], "seq": num_seqs + 1}
        LoRABatch.static(rows, num_seqs + 1, "cpu").load(batch)  # raises when a table does not fit
        size = max_tiles(offsets[-1], num_seqs + 1)
        needed.add(max(len(batch.streams["img"].tiles), len(batch.streams["img"].all_tiles)) == size)
    assert needed == {True, False}
    # one sequence: its tiles and a partial tile of padding rows
    assert max_tiles(256, 2) == 5 and len(tile_runs(((0, 200, 1, 1.0), (200, 256, 0, 0.0)))[0]) == 5


def test_rewriting_a_slot_in_place_keeps_the_tensors():
    """Loading / unloading writes the slot's rows of the fixed stacks: same storage, new values."""
    linear, state, adapters = slot_linear()
    slots = linear.lora
    ptrs = (slots.lora_a.data_ptr(), slots.lora_b.data_ptr(), slots.scaling.data_ptr())
    version = state.version
    slots.clear(2)
    assert slots.scaling_cpu[2] == 0 and not slots.lora_a[1].any() and not slots.lora_b[1].any()
    new = LoRAModuleWeights(torch.ones(4, 24), torch.ones(40, 4), 0.25)
    slots.write(2, new)
    assert (slots.lora_a.data_ptr(), slots.lora_b.data_ptr(), slots.scaling.data_ptr()) == ptrs
    assert state.version == version  # in-place writes never invalidate captured graphs
    assert torch.equal(slots.lora_a[1, :4], new.lora_a) and not slots.lora_a[1, 4:].any()
    assert float(slots.scaling[2]) == 0.25 and slots.ranks[2] == 4
    x = torch.randn(3, 24)
    batch = LoRABatch.build(LoRAMapping.for_packed([SeqLoRA(2, 2.0)], RowLayout([0, 3])), {2: 2}, "cpu")
    with torch.no_grad(), state.activate(batch):
        got = linear(x)
    want = linear.base_forward(x) + 2.0 * 0.25 * (x @ new.lora_a.t()) @ new.lora_b.t()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="do not fit"):
        slots.write(1, LoRAModuleWeights(torch.ones(17, 24), torch.ones(40, 17), 1.0))  # rank > slots'


def test_batch_refuses_rows_it_does_not_describe():
    linear, state, _ = slot_linear()
    mapping = LoRAMapping.for_packed([SeqLoRA(1), SeqLoRA(0)], RowLayout([0, 3, 5]))
    batch = LoRABatch.build(mapping, {1: 1}, "cpu")
    with torch.no_grad(), state.activate(batch), pytest.raises(ValueError, match="img-stream linear got"):
        linear(torch.zeros(6, 24))
    with pytest.raises(ValueError, match="2 sequences, the forward has 3"):
        LoRAMapping.for_packed([SeqLoRA(1), SeqLoRA(0)], RowLayout([0, 3, 5, 6]))


KERNEL_CHECK = (
    PATCH
    + """
import numpy, torch
import sys
sys.path.insert(0, "tests")
from utils import OFFSETS, per_row_reference, RowLayout, SLOT_ADAPTERS, slot_linear, SLOT_SEQS
from vllm_omni.lora import kernels
from vllm_omni.lora.batch import LoRABatch, LoRAMapping, SeqLoRA

import dataclasses
seqs = [SeqLoRA(slot, scale) for slot, scale in SLOT_SEQS] + [SeqLoRA(5, 1.0)]
offsets = OFFSETS + [OFFSETS[-1] + 7]
batch = LoRABatch.build(LoRAMapping.for_packed(seqs, RowLayout(offsets)), {s: s for s in range(1, 6)}, "cpu")
rows = batch.streams["img"]
x = torch.randn(offsets[-1], 24, generator=torch.Generator().manual_seed(1))
for max_rank in (16, 32):  # slots of rank 32: the expand's path over several rank blocks
    linear, state, adapters = slot_linear(max_loras=5, max_rank=max_rank)  # slot 5 stays empty
    s = linear.lora
    default = kernels.plan_delta(rows.tiles.shape[0], 1, 24, 40, max_rank, 4)
    plans = [
        default,  # one split, one column block
        # in_features over two programs (partials), 16-column blocks two to a program (the last empty)
        dataclasses.replace(
            default, block_k=16, split_k=2, k_per_split=16, block_n=16, n_chunks=2, n_programs=2,
            expand_block_r=16,
        ),
    ]
    with torch.no_grad():
        want = per_row_reference(linear, x, adapters, SLOT_SEQS + [(5, 1.0)], offsets)
        for plan in plans:
            got = linear.base_forward(x)
            fused = torch.zeros(x.shape[0], 3 * 40)  # a fused GEMM's middle columns: a strided output
            fused[:, 40:80] = got
            stacks = (s.lora_a, s.lora_b, s.scaling, rows.tiles, rows.scales, plan)
            kernels.lora_delta(x, got, *stacks)
            kernels.lora_delta(x, fused[:, 40:80], *stacks)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
            assert torch.equal(fused[:, 40:80], got) and not fused[:, :40].any() and not fused[:, 80:].any()
        # padded static tables (a graph's): the same rows, empty entries after
        static = LoRABatch.static({"img": x.shape[0], "txt": x.shape[0], "seq": len(seqs)}, len(seqs), "cpu")
        static.load(batch)
        got = linear.base_forward(x)
        table = static.streams["img"]
        kernels.lora_delta(x, got, s.lora_a, s.lora_b, s.scaling, table.tiles, table.scales)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
print("ok")
"""
)


GROUP_KERNEL_CHECK = (
    PATCH
    + """
import dataclasses, sys
import numpy, torch
sys.path.insert(0, "tests")
from utils import GROUP_OFFSETS, group_qkv, group_reference
from vllm_omni.lora import kernels
from vllm_omni.lora.batch import LoRABatch

x = torch.randn(GROUP_OFFSETS[-1], 24, generator=torch.Generator().manual_seed(1))
for max_rank in (16, 32):  # 32: the expand over several rank blocks
    module, state, adapters, batch = group_qkv(max_rank=max_rank)
    group, members = module.to_q.lora.group, (module.to_q, module.to_k, module.to_v)
    rows = batch.streams["img"]
    num_tiles = rows.tiles.shape[0]
    default = kernels.plan_delta(num_tiles, 3, 24, 40, max_rank, 4)
    assert default.r_blocks == 1 and default.block_r >= 3 * max_rank  # x read once for q, k and v
    plans = [
        default,
        dataclasses.replace(  # split-K partials, narrow shrink programs (3 r blocks), column chunks
            default, block_k=16, split_k=2, k_per_split=16, block_r=16, r_blocks=3 * max_rank // 16,
            block_n=16, n_chunks=2, n_programs=2, expand_block_r=16,
        ),
    ]
    with torch.no_grad():
        base = module.merged("qkv").layer.base_forward(x)  # [rows, 120]
        want = group_reference(module, x, adapters)
        for plan in plans:
            got = base.clone()  # one launch pair for the three members
            stacks = (group.lora_a, group.lora_b, group.scaling, rows.tiles, rows.scales, plan)
            kernels.lora_delta(x, got, *stacks)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
            per_member = base.clone()  # each member's own pair, over its views of the stacks
            for i, m in enumerate(members):
                s = m.lora
                out = per_member[:, 40 * i : 40 * (i + 1)]
                kernels.lora_delta(x, out, s.lora_a, s.lora_b, s.scaling, rows.tiles, rows.scales)
            torch.testing.assert_close(got, per_member, rtol=1e-5, atol=1e-4)  # numpy GEMM shapes differ
            skipped = slice(GROUP_OFFSETS[5], GROUP_OFFSETS[6])  # slot 2's rows: its adapter skips k
            assert torch.equal(got[skipped, 40:80], base[skipped, 40:80])
            assert not torch.equal(got[skipped, :40], base[skipped, :40])
        # through MergedLinear on the CUDA path (one call for the group), over a graph's padded tables
        static = LoRABatch.static({"img": x.shape[0], "txt": x.shape[0], "seq": 9}, 9, "cpu")
        static.load(batch)
        calls, launch = [], kernels.lora_delta
        kernels.lora_delta = lambda *args, **kw: calls.append(args[4].shape) or launch(*args, **kw)
        from vllm_omni.lora import layers
        layers.use_kernels = lambda x: True
        with state.activate(static):
            got = module.merged("qkv")(x)
        kernels.lora_delta, layers.use_kernels = launch, lambda x: x.is_cuda
        assert calls == [(3, 6)]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
print("ok")
"""
)

MODEL_KERNEL_CHECK = (
    PATCH
    + """
import sys
import numpy, torch
sys.path.insert(0, "tests")
from utils import batch, GRAPH_SPECS as SPECS, GRAPHS, TINY_CONFIG as TINY, tiny_lora_model
from vllm_omni.diffusion.worker.cuda_graphs import CUDAGraphRunner
from vllm_omni.lora import kernels, layers
from vllm_omni.lora.batch import LoRAMapping, SeqLoRA
from vllm_omni.lora.random_adapter import block_targets, random_lora_adapter

model, manager = tiny_lora_model()
targets = block_targets(model.plans, TINY.num_layers) + ["transformer_blocks.1.img_mod.1", "proj_out"]
a = manager.add_adapter("a", random_lora_adapter(model, targets, 8, 1, std=0.2), "<random>")
b = manager.add_adapter("b", random_lora_adapter(model, targets[::2], 3, 2, std=0.2), "<random>")
img, txt, t, layout = batch(SPECS)
mapping = LoRAMapping.for_packed([SeqLoRA(a), SeqLoRA(0), SeqLoRA(b, -0.5)], layout)
runner = CUDAGraphRunner(model, "cpu", torch.float32, GRAPHS, capture=False, lora_state=manager.state)
with torch.inference_mode():
    with manager.activate(mapping):
        want = model.forward_packed(img, txt, t, layout)  # the host loop over runs, unpadded
        layers.use_kernels = lambda x: True  # the CUDA path, in the interpreter
        calls, pairs = [], []
        launch, launch_pair = kernels.lora_delta, kernels.lora_delta_pair
        kernels.lora_delta = lambda *args, **kw: calls.append(args[-2].data_ptr()) or launch(*args, **kw)
        kernels.lora_delta_pair = lambda f, s, plan=None: pairs.append(
            (f.tiles.data_ptr(), s.tiles.data_ptr(), f.num_members, kernels.can_pair(f, s), f.activation)
        ) or launch_pair(f, s, plan)
        got = runner.forward_packed(img, txt, t, layout)  # the LoRA graph's padded batch and tables
    base = model.forward_packed(img, txt, t, layout)
assert runner.last_path == "graph" and list(runner._packed)[0][1]
# every LoRA linear, the table of its stream (three streams: three tables), the MLP up projections
# (their GELU in the expand) the table of every row of theirs (two more); the two streams' linears
# at each of a block's 4 points one launch pair (q, k, v of a stream: their group's stacks); the
# modulation and proj_out alone
assert len(pairs) == 4 * TINY.num_layers and all(ok for *_, ok, _ in pairs)
assert sum(members == 3 for _, _, members, _, _ in pairs) == TINY.num_layers
assert sum(act == "gelu_tanh" for *_, act in pairs) == TINY.num_layers
assert len(calls) == len(targets) - 12 * TINY.num_layers == 2  # 12 linears a block
assert len({*calls, *(p[0] for p in pairs), *(p[1] for p in pairs)}) == 5
torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
assert not torch.allclose(got, base, rtol=1e-3, atol=1e-3)
print("ok")
"""
)


def test_triton_kernels_through_a_padded_lora_graph_equal_the_host_path():
    """The whole LoRA graph path on CPU: the padded bucket's static tile tables through the Triton
    kernels (interpreter) in every linear of the model, fused QKV columns included, against the host
    loop over the unpadded batch's runs."""
    pytest.importorskip("triton")
    run_interpreted(MODEL_KERNEL_CHECK)


def test_triton_group_kernels_equal_the_per_member_path():
    """A merged q/k/v group's one shrink over its stacked A slots and one expand into the members'
    columns (triton's CPU interpreter, fp32) against each member's own launches and a per-row
    reference: adapters on all, some or one member, ranks padded, an empty slot, split-K partials,
    several shrink / expand blocks, and MergedLinear over a graph's padded tables."""
    pytest.importorskip("triton")
    run_interpreted(GROUP_KERNEL_CHECK)


def test_triton_slot_kernels_equal_the_per_row_reference():
    """The CUDA path's Triton kernels (lora/kernels.py), run by triton's CPU interpreter
    (TRITON_INTERPRET must be set before triton loads, hence the subprocess), in fp32: mixed slots
    incl. none and an empty slot, ranks padded, scales, split-K partials, a strided output, and a
    graph's padded static tables."""
    pytest.importorskip("triton")
    run_interpreted(KERNEL_CHECK)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernels on CUDA, in bf16")
def test_cuda_group_kernels_match_the_member_kernels_and_an_fp32_reference():
    """On the GPU, bf16 at a real rank (64) and real launch plans: a merged group's launch pair (one
    with an adapter that skips the middle member) against the members' own pairs and fp32 math."""
    pytest.importorskip("triton")
    from vllm_omni.lora import kernels

    device, dtype, gen = "cuda", torch.bfloat16, torch.Generator().manual_seed(5)
    rows, k, n, rank = 300, 512, 192, 64
    x = torch.randn(rows, k, generator=gen)
    a, b = (
        torch.randn(2, 3 * rank, k, generator=gen) * 0.05,
        torch.randn(2, 3 * n, rank, generator=gen) * 0.05,
    )
    scaling = torch.tensor([[0.0, 1.0, 0.5], [0.0, 2.0, 0.0], [0.0, -1.0, 1.5]])  # slot 2 skips member 1
    b[1, n : 2 * n] = 0
    a[1, rank : 2 * rank] = 0
    runs = ((0, 130, 1, 1.0), (200, 300, 2, 0.5))
    tiles, scales = (torch.from_numpy(t).to(device) for t in tile_runs(runs))
    base = torch.randn(rows, 3 * n, generator=gen).to(dtype).float()  # exact in bf16
    want = base.clone()
    for start, end, slot, scale in runs:
        for m in range(3):
            shrunk = x[start:end] @ a[slot - 1, m * rank : (m + 1) * rank].t()
            delta = shrunk @ b[slot - 1, m * n : (m + 1) * n].t()
            want[start:end, m * n : (m + 1) * n] += scale * float(scaling[m, slot]) * delta
    x, a, b, base, scaling = (t.to(device) for t in (x, a, b, base, scaling))
    x, a, b, base = (t.to(dtype) for t in (x, a, b, base))
    got, per_member = base.clone(), base.clone()
    kernels.lora_delta(x, got, a, b, scaling, tiles, scales)
    for m in range(3):
        kernels.lora_delta(
            x, per_member[:, m * n : (m + 1) * n], a[:, m * rank : (m + 1) * rank], b[:, m * n : (m + 1) * n],
            scaling[m], tiles, scales,
        )  # fmt: skip
    torch.cuda.synchronize()
    assert torch.equal(got[130:200], base[130:200])  # no adapter: the base bits
    assert torch.equal(got[200:, n : 2 * n], base[200:, n : 2 * n])  # slot 2 skips member 1
    delta, member_delta = (got.float() - base.float()).cpu(), (per_member.float() - base.float()).cpu()
    want_delta = want - base.float().cpu()
    assert rel_err(delta, want_delta) < 2e-2 and rel_err(delta, member_delta) < 2e-2  # bf16 roundings

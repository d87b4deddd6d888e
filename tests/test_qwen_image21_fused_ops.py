"""Qwen-Image-2.1's fused block ops (models/qwen_image21/fused_ops.py): the compiled forward (inductor on
CPU) equals the eager one for a packed multi-sequence batch and for the prefix prefill, the compiled
functions are what runs, and a compiled op that raises falls back to eager for that shape only."""

from __future__ import annotations

import collections

import pytest
import torch
from safetensors.torch import load_file

from vllm_omni.diffusion.attention import SDPABackend
from vllm_omni.diffusion.layout import SequenceSpec, build_packed_layout
from vllm_omni.diffusion.models import registry
from vllm_omni.diffusion.models.qwen_image21 import configs
from vllm_omni.diffusion.models.qwen_image21.fused_ops import Block21Ops, modulated_norm
from vllm_omni.diffusion.models.qwen_image21.tiny import TINY_MODEL_NAME
from vllm_omni.diffusion.models.qwen_image21.transformer import (
    QwenImage21Transformer,
    QwenImage21TransformerConfig,
)

RTOL = 1e-5
"""fp32: inductor sums the norms' statistics in another order, nothing else differs."""

# (prompt rows, latent grid, timestep / 1000): three sizes, three prompt lengths, three steps
REQUESTS = [(5, (1, 4, 2), 0.9), (13, (1, 2, 2), 0.35), (9, (1, 4, 6), 0.6)]


@pytest.fixture(scope="module")
def model():
    path = registry.resolve_model_path(TINY_MODEL_NAME) / "transformer"
    config = QwenImage21TransformerConfig.from_dict(configs.TINY_TRANSFORMER_CONFIG)
    model = QwenImage21Transformer(config, attn_backend=SDPABackend("per_seq")).eval()
    model.load_state_dict(load_file(path / "diffusion_pytorch_model.safetensors"), strict=True)
    return model


def packed_batch(model, seed: int = 0):
    """Prompts, and the packed step's inputs: every sequence's image rows after its prompt."""
    gen = torch.Generator().manual_seed(seed)
    txts = [torch.randn(n, 32, generator=gen) for n, _, _ in REQUESTS]
    specs = [SequenceSpec(n, grid, req_id=f"r{i}") for i, (n, grid, _) in enumerate(REQUESTS)]
    layout = build_packed_layout(specs, model.position_tables)
    img = torch.randn(layout.num_img_rows, 16, generator=gen)
    timestep = torch.tensor([t for *_, t in REQUESTS])
    return txts, (img, torch.cat(txts), timestep, layout)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


@torch.inference_mode()
def run(model, txts, inputs):
    """(each prompt's prefill K/V, the packed step over the cached prefixes, the dense forward)."""
    prefixes = [model.prefill(txt) for txt in txts]
    for i, prefix in enumerate(prefixes):
        model.prefix_cache.put(f"r{i}", False, prefix)
    try:
        packed = model.forward_packed(*inputs)
    finally:
        model.prefix_cache.release([f"r{i}" for i in range(len(txts))])
    img, _, timestep, layout = inputs
    rows = layout.img_row_offsets
    dense = model(img[None, rows[0] : rows[1]], txts[0][None], None, timestep[:1], [REQUESTS[0][1]])
    return prefixes, packed, dense


def test_compiled_forward_and_prefill_equal_eager_through_the_compiled_ops(model):
    txts, inputs = packed_batch(model)
    want_prefixes, want_packed, want_dense = run(model, txts, inputs)
    model.enable_compile()
    try:
        ops = model.block_ops
        assert ops.compiled and ops.num_fallbacks == 0
        calls = collections.Counter()
        compiled = dict(ops._fns)
        assert all(fn is not ops.table[name][0] for name, fn in compiled.items()), "not compiled"

        def counted(name):
            def call(*args):
                calls[name] += 1
                return compiled[name](*args)

            return call

        ops._fns = {name: counted(name) for name in compiled}
        frames = torch._dynamo.utils.counters["frames"]["ok"]
        got_prefixes, got_packed, got_dense = run(model, txts, inputs)
        assert torch._dynamo.utils.counters["frames"]["ok"] > frames, "dynamo compiled nothing"
    finally:
        model.disable_compile()
    assert model.num_compile_fallbacks == 0 and ops.num_fallbacks == 0
    num_layers, num_seqs = len(model.transformer_blocks), len(txts)
    # prefill: every block but the last runs its residuals; steps (packed + dense): every block
    num_prefill = num_seqs + 1
    assert calls["qk"] == (num_prefill + 2) * num_layers
    assert calls["silu_mul"] == num_prefill * (num_layers - 1) + 2 * num_layers
    assert calls["gated_norm"] == 2 * calls["silu_mul"]
    assert calls["norm"] == num_prefill + 2
    for got, want in zip(got_prefixes, want_prefixes, strict=True):
        assert rel_err(got.key, want.key) < RTOL and rel_err(got.value, want.value) < RTOL
    assert want_packed.abs().max() > 0.1  # not a degenerate output
    print(f"compiled vs eager: packed rel {rel_err(got_packed, want_packed):.1e}")
    assert rel_err(got_packed, want_packed) < RTOL
    assert rel_err(got_dense, want_dense) < RTOL
    # back to eager: the same bits as before compiling
    assert torch.equal(run(model, txts, inputs)[1], want_packed)


def test_compiled_ops_gather_per_sequence_values_by_row():
    """The compiled op reads per-sequence values through seq_ids; eager gathers them once per forward."""
    gen = torch.Generator().manual_seed(0)
    x, scale = torch.randn(7, 8, generator=gen), torch.randn(3, 8, generator=gen)
    seq_ids = torch.tensor([0, 0, 2, 2, 2, 1, 1])
    want = torch.nn.functional.layer_norm(x, (8,), eps=1e-6) * (1 + scale[seq_ids])
    eager = Block21Ops(compiled=False)
    assert eager.per_row(scale, seq_ids)[1] is None
    assert torch.equal(eager.modulated_norm(x, *eager.per_row(scale, seq_ids), 1e-6), want)
    compiled = Block21Ops(compiled=True)
    values, ids = compiled.per_row(scale, seq_ids)
    assert values is scale and ids is seq_ids
    torch.testing.assert_close(compiled.modulated_norm(x, values, ids, 1e-6), want)
    assert compiled.num_fallbacks == 0


def test_a_failing_compiled_op_falls_back_for_that_shape_only(model):
    gen = torch.Generator().manual_seed(1)
    x, scale = torch.randn(10, 8, generator=gen), torch.randn(2, 8, generator=gen)
    seq_ids = torch.tensor([0] * 4 + [1] * 6)
    ops = Block21Ops(compiled=False)
    want = ops.modulated_norm(x, scale, seq_ids, 1e-6)
    calls = []

    def flaky(rows, *args):
        calls.append(rows.shape[0])
        if rows.shape[0] == 10:
            raise RuntimeError("inductor failed")
        return modulated_norm(rows, *args)

    ops.compiled, ops._fns = True, {name: flaky for name in ops._fns}  # as if one shape broke
    assert torch.equal(ops.modulated_norm(x, scale, seq_ids, 1e-6), want)
    assert ops.num_fallbacks == 1 and ops.compiled
    ops.modulated_norm(x, scale, seq_ids, 1e-6)
    assert calls == [10], "the failed shape is not tried again"
    ops.modulated_norm(x[:5], scale, seq_ids[:5], 1e-6)  # another shape: compiled again
    assert calls == [10, 5] and ops.num_fallbacks == 1

    # in the model: q/k of one prompt length fail; the forward is still right and counted once
    txts, inputs = packed_batch(model, seed=2)
    _, want_packed, _ = run(model, txts, inputs)
    model.block_ops = ops = Block21Ops(compiled=False)
    eager_qk = ops.table["qk"][0]

    def qk_fails_for_13_rows(q, *args):
        if q.shape[0] == 13:
            raise RuntimeError("inductor failed")
        return eager_qk(q, *args)

    ops.compiled = True
    ops._fns = {name: fn for name, (fn, _) in ops.table.items()} | {"qk": qk_fails_for_13_rows}
    try:
        _, got_packed, _ = run(model, txts, inputs)
    finally:
        model.disable_compile()
    assert ops.num_fallbacks == 1  # the 13-row prompt's first layer; later layers skip straight to eager
    assert rel_err(got_packed, want_packed) < RTOL


def test_compiled_ops_in_the_padded_static_step_a_graph_captures(model):
    """The worker's graph path (padded bucket, static buffers, a padding sequence; run eagerly on CPU,
    `capture=False`) with the compiled ops equals the unpadded eager forward."""
    from vllm_omni.diffusion.worker.cuda_graphs import CudaGraphConfig, CUDAGraphRunner

    txts, inputs = packed_batch(model, seed=3)
    with torch.inference_mode():
        for i, txt in enumerate(txts):
            model.prefix_cache.put(f"r{i}", False, model.prefill(txt))
        want = model.forward_packed(*inputs)
        model.enable_compile()
        model.attn_backend = SDPABackend("mask")  # reads the padded boundaries on the device
        try:
            grid = CudaGraphConfig(num_seqs=(2, 4), img_rows=(64, 128), txt_rows=(64, 128))
            runner = CUDAGraphRunner(model, "cpu", torch.float32, grid, capture=False)
            got = runner.forward_packed(*inputs)
            assert runner.last_path == "graph" and model.num_compile_fallbacks == 0
        finally:
            model.disable_compile()
            model.attn_backend = SDPABackend("per_seq")
            model.prefix_cache.release([f"r{i}" for i in range(len(txts))])
    (graph,) = runner._packed.values()
    assert graph.bucket.num_img_rows > inputs[3].num_img_rows  # padding rows ran through the ops
    assert rel_err(got, want) < RTOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_qk_op_is_the_modules_chain_bit_for_bit(dtype):
    """The compiled ops' q/k function (eager here) against what the eager path runs: the RMSNorm modules
    then RoPE, on strided views of a merged projection."""
    from vllm_omni.diffusion.models.qwen_image.layers import RMSNorm
    from vllm_omni.diffusion.models.qwen_image.rope import apply_rope
    from vllm_omni.diffusion.models.qwen_image21.fused_ops import qk_norm_rope

    gen = torch.Generator().manual_seed(4)
    norm_q, norm_k = RMSNorm(16).to(dtype), RMSNorm(16).to(dtype)
    with torch.no_grad():
        norm_q.weight.copy_(torch.randn(16, generator=gen))
        norm_k.weight.copy_(torch.randn(16, generator=gen))
    q, k, _ = torch.randn(7, 3 * 2 * 16, generator=gen).to(dtype).chunk(3, dim=-1)
    q, k = q.unflatten(-1, (2, 16)), k.unflatten(-1, (2, 16))  # [7, 2, 16] views
    cos, sin = torch.randn(7, 8, generator=gen), torch.randn(7, 8, generator=gen)
    got = qk_norm_rope(q, k, norm_q.weight, norm_k.weight, cos, sin, norm_q.eps)
    want = (apply_rope(norm_q(q).to(dtype), cos, sin), apply_rope(norm_k(k).to(dtype), cos, sin))
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    eager = Block21Ops(compiled=False).qk_norm_rope(q, k, norm_q, norm_k, (cos, sin))
    assert all(torch.equal(g, w) for g, w in zip(eager, want, strict=True))

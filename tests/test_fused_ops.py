"""The block's fused elementwise chains: row-flattening wrappers and the compile-failure fallback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from vllm_omni.diffusion.models.qwen_image.fused_ops import (
    BlockOps,
    joint_qkv,
    modulated_layer_norm,
    qk_norm_rope,
)
from vllm_omni.diffusion.models.qwen_image.packing import SequenceSpec, build_packed_layout


def _inputs(batch=2, seq=5, dim=8):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, seq, dim, generator=gen)
    shift, scale1p, gate = (torch.randn(batch, dim, generator=gen) for _ in range(3))
    return x, shift, scale1p, gate, torch.arange(batch).repeat_interleave(seq)


def test_modulation_gathers_per_sequence_values_by_row():
    x, shift, scale1p, gate, ids = _inputs()
    ops = BlockOps(compiled=False)
    want = F.layer_norm(x, (8,), eps=1e-6) * scale1p[:, None] + shift[:, None]
    torch.testing.assert_close(ops.modulated_layer_norm(x, shift, scale1p, ids, 1e-6), want)
    torch.testing.assert_close(ops.gated_residual(x, 2 * x, gate, ids), x + gate[:, None] * 2 * x)


def test_a_failing_compiled_op_falls_back_for_that_shape_and_is_counted():
    x, shift, scale1p, _, ids = _inputs()
    ops = BlockOps(compiled=False)
    want = ops.modulated_layer_norm(x, shift, scale1p, ids, 1e-6)
    calls = []

    def flaky(rows, *args):
        calls.append(rows.shape[0])
        if rows.shape[0] == 10:
            raise RuntimeError("inductor failed")
        return modulated_layer_norm(rows, *args)

    ops.compiled, ops._fns = True, {name: flaky for name in ops._fns}  # as if compilation broke for one shape
    assert torch.equal(ops.modulated_layer_norm(x, shift, scale1p, ids, 1e-6), want)
    assert ops.num_fallbacks == 1 and ops.compiled
    ops.modulated_layer_norm(x, shift, scale1p, ids, 1e-6)
    assert calls == [10], "the failed shape is not tried again"
    x3, ids3 = x[:1], ids[:5]  # another shape: compiled again
    ops.modulated_layer_norm(x3, shift, scale1p, ids3, 1e-6)
    assert calls == [10, 5] and ops.num_fallbacks == 1


def test_a_failing_kernel_falls_back_to_eager_for_that_shape(monkeypatch):
    """A Triton kernel that raises (e.g. out of resources on another GPU) costs nothing but speed."""
    x, shift, scale1p, _, ids = _inputs()
    ops = BlockOps(compiled=False)
    want = ops.modulated_layer_norm(x, shift, scale1p, ids, 1e-6)

    def broken_kernel(*args):
        raise RuntimeError("triton: out of resources")

    ops.compiled = True
    monkeypatch.setattr(ops, "_triton_kernel", lambda name, x: broken_kernel if name == "mln" else None)
    assert torch.equal(ops.modulated_layer_norm(x, shift, scale1p, ids, 1e-6), want)
    assert ops.num_fallbacks == 1


def test_engine_warm_up_runs_every_specialised_shape(tiny_model_dir):
    """The start-up warm-up (which triggers compilation on CUDA) runs packed and dense forwards."""
    from vllm_omni.config import OmniDiffusionConfig
    from vllm_omni.diffusion.engine import DiffusionEngine

    engine = DiffusionEngine(
        OmniDiffusionConfig(model=str(tiny_model_dir), dtype="float32", device="cpu"), autostart=False
    )
    calls = []
    block = engine.executor.driver_worker.pipeline.transformer.transformer_blocks[0]
    block.register_forward_pre_hook(lambda mod, args: calls.append(args[0].dim()))
    engine.executor.driver_worker._warm_up()
    assert calls == [2, 2, 3, 3], "packed with 1 and 2 sequences, then dense with batch 1 and 2"


def test_compile_fallbacks_reach_metrics():
    from vllm_omni.config import OmniDiffusionConfig
    from vllm_omni.diffusion.sched.interface import ForwardPath, StepStats
    from vllm_omni.entrypoints.openai.metrics import PrometheusStatLogger

    metrics = PrometheusStatLogger(OmniDiffusionConfig(), "m")
    stats = StepStats(1, 1, 10, [(32, 32)], ForwardPath.PACKED, 0.01, num_compile_fallbacks=2)
    metrics.on_step(stats, 1, 0)
    assert "vllm_omni:compile_fallbacks_total 2.0" in metrics.render().decode()


def test_joint_qkv_equals_norm_rope_per_stream_then_the_join():
    """The fused join is a gather of the per-stream results: bit-equal to norm + RoPE per stream
    followed by the packed join's scatter (three sequences of different grids and text lengths)."""
    heads, head_dim = 2, 8
    specs = [SequenceSpec(3, (1, 2, 2)), SequenceSpec(5, (1, 1, 3)), SequenceSpec(1, (1, 2, 1))]
    layout = build_packed_layout(specs, (2, 2, 4))
    gen = torch.Generator().manual_seed(0)
    txt_qkv = torch.randn(layout.num_txt_rows, 3 * heads * head_dim, generator=gen)
    img_qkv = torch.randn(layout.num_img_rows, 3 * heads * head_dim, generator=gen)
    weights = tuple(torch.randn(head_dim, generator=gen) for _ in range(4))
    src = layout.joint_src()
    got = joint_qkv(txt_qkv, img_qkv, src, weights, layout.txt_rope, layout.img_rope, 1e-6)

    def per_stream(qkv, w_q, w_k, rope):
        q, k, v = qkv.unflatten(-1, (3, heads, head_dim)).unbind(1)
        return qk_norm_rope(q, w_q, *rope, 1e-6), qk_norm_rope(k, w_k, *rope, 1e-6), v

    txt = per_stream(txt_qkv, weights[0], weights[1], layout.txt_rope)
    img = per_stream(img_qkv, weights[2], weights[3], layout.img_rope)
    for got_t, txt_t, img_t in zip(got, txt, img, strict=True):
        want = torch.empty(layout.total_tokens, heads, head_dim)
        want[layout.txt_to_joint], want[layout.img_to_joint] = txt_t, img_t
        assert torch.equal(got_t, want)


def test_joint_qkv_of_a_shard_with_one_stream_only():
    """A sequence-parallel rank may hold image rows only (or text rows only)."""
    heads, head_dim = 2, 8
    gen = torch.Generator().manual_seed(1)
    rows = torch.randn(5, 3 * heads * head_dim, generator=gen)
    weights = tuple(torch.randn(head_dim, generator=gen) for _ in range(4))
    rope = (torch.randn(5, head_dim // 2, generator=gen), torch.randn(5, head_dim // 2, generator=gen))
    empty = (rows[:0], (rope[0][:0], rope[1][:0]))
    order = torch.tensor([3, 0, 4, 1, 2])
    for txt, img, w_q, w_k in (
        (empty, (rows, rope), weights[2], weights[3]),
        ((rows, rope), empty, *weights[:2]),
    ):
        got = joint_qkv(txt[0], img[0], order, weights, txt[1], img[1], 1e-6)
        q, k, v = rows.unflatten(-1, (3, heads, head_dim)).unbind(1)
        want = (qk_norm_rope(q, w_q, *rope, 1e-6), qk_norm_rope(k, w_k, *rope, 1e-6), v)
        for got_t, want_t in zip(got, want, strict=True):
            assert torch.equal(got_t, want_t[order])


def test_gated_residual_norm_is_the_two_ops_in_a_row():
    x, shift, scale1p, gate, ids = _inputs()
    ops = BlockOps(compiled=False)
    y = torch.randn_like(x)
    new_x, normed = ops.gated_residual_norm(x, y, gate, shift, scale1p, ids, 1e-6)
    assert torch.equal(new_x, ops.gated_residual(x, y, gate, ids))
    assert torch.equal(normed, ops.modulated_layer_norm(new_x, shift, scale1p, ids, 1e-6))
    # y given in other rows (the attention output in joint rows) and read by index
    num_rows, dim = ids.shape[0], x.shape[-1]  # x, y: [B, S, C]
    y_rows = torch.randperm(num_rows + 3)[:num_rows]
    joint = torch.randn(num_rows + 3, dim)
    joint[y_rows] = y.reshape(num_rows, dim)
    by_index = ops.gated_residual_norm(x, joint, gate, shift, scale1p, ids, 1e-6, y_rows=y_rows)
    assert all(torch.equal(a, b) for a, b in zip(by_index, (new_x, normed), strict=True))


TRITON_CHECK = """
import torch
from vllm_omni.diffusion.models.qwen_image import triton_ops
from vllm_omni.diffusion.models.qwen_image.fused_ops import (
    gated_residual, gated_residual_norm, gated_residual_norm_rows, joint_qkv, modulated_layer_norm,
)
from vllm_omni.diffusion.models.qwen_image.packing import SequenceSpec, build_packed_layout

heads, head_dim = 3, 16
specs = [SequenceSpec(3, (1, 2, 2)), SequenceSpec(5, (1, 1, 3)), SequenceSpec(1, (1, 2, 1))]
layout = build_packed_layout(specs, (4, 6, 6))
src = layout.joint_src()
gen = torch.Generator().manual_seed(0)
for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 0.0)):
    txt = torch.randn(layout.num_txt_rows, 3 * heads * head_dim, generator=gen).to(dtype)
    img = torch.randn(layout.num_img_rows, 3 * heads * head_dim, generator=gen).to(dtype)
    weights = tuple(torch.randn(head_dim, generator=gen).to(dtype) for _ in range(4))
    args = (txt, img, src, weights, layout.txt_rope, layout.img_rope, 1e-6)
    for got, want in zip(triton_ops.joint_qkv(*args), joint_qkv(*args), strict=True):
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
gen = torch.Generator().manual_seed(1)
ids = torch.tensor([0, 0, 1, 2, 2, 2, 1])
for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 1e-3)):
    x, y = (torch.randn(7, 40, generator=gen).to(dtype) for _ in range(2))
    mod = torch.randn(3, 6 * 40, generator=gen).to(dtype)
    shift, scale, gate = mod.chunk(6, dim=-1)[:3]  # column slices of one output, as in a block
    torch.testing.assert_close(
        triton_ops.modulated_layer_norm(x, shift, scale, ids, 1e-6),
        modulated_layer_norm(x, shift, scale, ids, 1e-6), atol=tol, rtol=tol,
    )
    # the gated residual alone (the block's last op): one rounding of x + gate * y, as torch.addcmul
    torch.testing.assert_close(
        triton_ops.gated_residual(x, y, gate, ids), gated_residual(x, y, gate, ids), atol=tol, rtol=tol
    )
    assert triton_ops.KERNELS["gated"] is triton_ops.gated_residual
    got, want = triton_ops.gated_residual_norm(x, y, gate, shift, scale, ids, 1e-6), gated_residual_norm(
        x, y, gate, shift, scale, ids, 1e-6
    )
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)
    joint = torch.randn(11, 40, generator=gen).to(dtype)  # y in joint rows, read by index
    y_rows = torch.tensor([3, 4, 0, 9, 10, 7, 1])
    got = triton_ops.gated_residual_norm_rows(x, joint, y_rows, gate, shift, scale, ids, 1e-6)
    want = gated_residual_norm_rows(x, joint, y_rows, gate, shift, scale, ids, 1e-6)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)
print("ok")
"""


def test_triton_kernels_equal_the_torch_functions():
    """The Triton kernels (joint q/k/v; modulated LayerNorm with and without the gated residual; the
    gated residual alone)
    against the torch functions, run by triton's CPU interpreter when triton is installed
    (TRITON_INTERPRET must be set before triton loads, hence the subprocess): fp32 to rounding, fp16
    joint q/k/v bit-equal, the norms to 1e-3 (their sums run in another order). bf16 is checked on
    the GPU (the interpreter rounds fp32 -> bf16 by truncation, the GPU to nearest), where it was
    measured when the kernels were written (the performance dashboard's history).
    """
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", TRITON_CHECK], env=env, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]

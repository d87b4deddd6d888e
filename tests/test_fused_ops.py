"""The block's fused elementwise chains: row-flattening wrappers and the compile-failure fallback."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_omni.diffusion.models.qwen_image.fused_ops import BlockOps


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


def test_a_failing_compiled_op_falls_back_to_eager_for_good():
    x, shift, scale1p, _, ids = _inputs()
    ops = BlockOps(compiled=False)
    want = ops.modulated_layer_norm(x, shift, scale1p, ids, 1e-6)
    calls = []

    def broken(*args):
        calls.append(1)
        raise RuntimeError("inductor failed")

    ops.compiled, ops._fns = True, {name: broken for name in ops._fns}  # as if compilation had broken
    assert torch.equal(ops.modulated_layer_norm(x, shift, scale1p, ids, 1e-6), want)
    assert ops.compiled is False and len(calls) == 1
    ops.modulated_layer_norm(x, shift, scale1p, ids, 1e-6)
    assert len(calls) == 1, "after the failure the compiled op is not tried again"


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

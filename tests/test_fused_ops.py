"""The block's fused elementwise chains: row-flattening wrappers and the compile-failure fallback."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_omni.diffusion.models.qwen_image.fused_ops import BlockOps, modulated_layer_norm


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

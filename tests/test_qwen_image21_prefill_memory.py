"""Qwen-Image-2.1's prefill attends in row chunks of bounded score memory (`prefill_attention`): the
same output as one SDPA call with the whole block-causal mask (torch's, `PrefixPlan.visibility`), with
a peak that no longer grows with the square of the prefix rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllm_omni.diffusion.memory import TensorPeak
from vllm_omni.diffusion.models.qwen_image21.prefill_attention import prefill_attention, rows_per_chunk
from vllm_omni.diffusion.models.qwen_image21.prefix import plan_prefix


def _edit_prefix(num_refs: int, grid=(1, 8, 12)):
    """An edit prefix: text, then `num_refs` reference blocks of `grid` separated by text rows."""
    slots = grid[1] * grid[2] // 4
    mask = [False] * 5
    for _ in range(num_refs):
        mask += [True] * slots + [False] * 3
    return plan_prefix(mask, [grid] * num_refs)


def _reference(q, k, v, visible):
    qh, kh, vh = (t.transpose(0, 1) for t in (q, k, v))
    if visible is None:
        return F.scaled_dot_product_attention(qh, kh, vh, is_causal=True).transpose(0, 1)
    return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=visible).transpose(0, 1)


@pytest.mark.parametrize("num_refs", [0, 1, 3])
@pytest.mark.parametrize("score_bytes", [1, 4096, 1 << 30])
def test_chunked_prefill_equals_one_call_with_the_whole_mask(num_refs, score_bytes):
    plan = _edit_prefix(num_refs) if num_refs else None
    num_rows = plan.num_rows if plan is not None else 77
    g = torch.Generator().manual_seed(num_refs)
    q, k, v = (torch.randn(num_rows, 2, 16, generator=g) for _ in range(3))
    want = _reference(q, k, v, None if plan is None else plan.visibility())
    got = prefill_attention(q, k, v, None if plan is None else plan.block_ids, score_bytes)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_peak_is_bounded_by_the_chunk_not_the_square_of_the_rows():
    """3 references, 4 heads: one call holds [4, L, L] scores and an [L, L] mask; chunks hold at most
    the bound, whatever L is."""
    plan = _edit_prefix(3, grid=(1, 16, 24))
    num_rows, heads, bound = plan.num_rows, 4, 1 << 20
    q, k, v = (torch.randn(num_rows, heads, 16) for _ in range(3))
    io_bytes = 4 * q.numel() * 4  # q, k, v and the output
    with TensorPeak() as whole:
        _reference(q, k, v, plan.visibility())
    with TensorPeak() as chunked:
        prefill_attention(q, k, v, plan.block_ids, bound)
    assert whole.peak > heads * num_rows * num_rows * 4  # the whole score matrix
    # a chunk's scores and softmax (2 x bound), its mask and index rows, the chunk outputs and their concat
    assert chunked.peak < io_bytes + 4 * bound, (chunked.peak, whole.peak)
    assert rows_per_chunk(num_rows, heads, bound) < num_rows


def test_admission_charges_the_measured_prefill_peak(monkeypatch):
    """A 2-reference edit prefix on the tiny model, the chunk bound lowered to 1 MiB: the tensors the
    prefill holds at its peak (measured) stay within what admission charges for it (the prefix cache
    plus `prefill_peak_bytes`), and the engine's estimate carries that transient."""
    from tiny21 import tiny21_engine

    from vllm_omni.diffusion.models.interface import RequestGeometry
    from vllm_omni.diffusion.models.qwen_image21 import prefill_attention as chunking
    from vllm_omni.inputs import OmniDiffusionSamplingParams

    monkeypatch.setattr(chunking, "PREFILL_SCORE_BYTES", 1 << 20)
    engine = tiny21_engine()
    pipeline = engine.executor.driver_worker.pipeline
    transformer, config = pipeline.transformer, pipeline.transformer.config
    grids = [(1, 32, 32), (1, 32, 48)]
    slot_mask = [False] * 6
    for _, h, w in grids:
        slot_mask += [True] * (h * w // 4) + [False] * 3
    g = torch.Generator().manual_seed(0)
    txt_rows = torch.randn(len(slot_mask), config.context_in_dim, generator=g)
    cond_rows = torch.randn(sum(h * w for _, h, w in grids), config.in_channels, generator=g)
    with torch.inference_mode(), TensorPeak() as peak:
        prefix = transformer.prefill(txt_rows, slot_mask, cond_rows, grids)
    rows = prefix.num_rows
    assert rows > 2 * 1024 * 4 // 4 and chunking.rows_per_chunk(rows, config.num_attention_heads) < rows
    charged = pipeline.prefill_peak_bytes(rows) + rows * pipeline.prefix_row_bytes
    assert peak.peak <= charged, (peak.peak, charged)
    assert peak.peak < config.num_attention_heads * rows * rows * 4, "no whole score matrix"
    geometry = RequestGeometry(32, (1, 2, 2), num_txt_tokens=rows, num_prefix_cache_rows=rows)
    need = engine.memory.estimate(OmniDiffusionSamplingParams(height=32, width=32), geometry)
    assert need.prefill_bytes == pipeline.prefill_peak_bytes(rows) > 0


def test_a_prefill_is_charged_as_a_transient_next_to_the_decode():
    """Admission counts the largest transient once: a request whose prefill is larger than what is
    free beside the others' latents waits, one whose prefill fits is admitted."""
    from vllm_omni.diffusion.memory import MemoryBudget
    from vllm_omni.diffusion.models.interface import RequestGeometry
    from vllm_omni.inputs import OmniDiffusionSamplingParams

    def budget(prefill_per_row: int) -> MemoryBudget:
        return MemoryBudget(
            "cpu", torch.float32, 1.0, free_bytes=(10**8, 10**8), latent_row_width=64,
            prefill_bytes=lambda rows: rows * prefill_per_row,
        )  # fmt: skip

    geometry = RequestGeometry(32, (1, 2, 2), num_txt_tokens=1000, num_prefix_cache_rows=1000)
    params = OmniDiffusionSamplingParams(height=32, width=32, output_type="latent")
    assert budget(1000).try_reserve("small", params, geometry)  # 1 MB of prefill: fits
    assert not budget(10**5).try_reserve("large", params, geometry)  # 100 MB: over the 90 MB share

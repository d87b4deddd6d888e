"""One CFG combine (`solvers/guidance.apply_guidance`) for the packed step and a request stepped alone."""

from __future__ import annotations

import pytest
import torch

from vllm_omni.diffusion.solvers.guidance import apply_guidance


def diffusers_cfg(pos, neg, scale: float, normalize: bool):
    """diffusers' QwenImagePipeline: comb = neg + s * (pos - neg), rescaled to ||pos|| per token."""
    comb = neg + scale * (pos - neg)
    if not normalize:
        return comb
    return comb * (torch.norm(pos, dim=-1, keepdim=True) / torch.norm(comb, dim=-1, keepdim=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_rows_equal_each_request_alone_and_diffusers(dtype):
    gen = torch.Generator().manual_seed(0)
    requests = [(4.0, True, 6), (2.5, False, 4), (7.0, True, 3)]  # (scale, normalize, rows)
    pos = [torch.randn(n, 16, generator=gen).to(dtype) for _, _, n in requests]
    neg = [torch.randn(n, 16, generator=gen).to(dtype) for _, _, n in requests]
    scales = torch.cat([torch.full((n, 1), s) for s, _, n in requests])  # fp32 [rows, 1]
    normalize = torch.cat([torch.full((n, 1), f) for _, f, n in requests])  # bool [rows, 1]
    batched = apply_guidance(torch.cat(pos), torch.cat(neg), scales, normalize)
    alone = [apply_guidance(p, q, s, f) for p, q, (s, f, _) in zip(pos, neg, requests)]
    assert torch.equal(batched, torch.cat(alone))
    for p, q, (s, f, _), got in zip(pos, neg, requests, alone):
        assert torch.equal(got, diffusers_cfg(p, q, s, f))
    assert torch.equal(apply_guidance(pos[0], neg[0], scales[:6]), apply_guidance(pos[0], neg[0], 4.0))

"""The elementwise chains of a Qwen-Image block, written once, run eager or compiled.

Eager PyTorch runs each of these as several kernels and materialises the per-sequence modulation
for every row (`[num_rows, 6 * hidden]` per block and stream). Compiled with inductor
(`dynamic=True`, so one compile serves every batch composition) each chain becomes one kernel that
gathers the per-sequence values by row id on the fly. The math (and the eager op order, which the
CPU tests compare against diffusers) is the same either way.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)


def modulated_layer_norm(
    x: torch.Tensor, shift: torch.Tensor, scale_plus_one: torch.Tensor, row_ids: torch.Tensor, eps: float
) -> torch.Tensor:
    """`LayerNorm(x) * (1 + scale) + shift` with per-sequence shift/scale.

    x: [..., C] rows of one stream (flattened to [num_rows, C]); shift, scale_plus_one: [num_seqs, C];
    row_ids: [num_rows] sequence index of every row.
    """
    rows = x.reshape(-1, x.shape[-1])
    normed = F.layer_norm(rows, (rows.shape[-1],), eps=eps)
    return torch.addcmul(shift[row_ids], normed, scale_plus_one[row_ids]).view_as(x)


def gated_residual(
    x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, row_ids: torch.Tensor
) -> torch.Tensor:
    """`x + gate * y` with a per-sequence gate [num_seqs, C]; x, y: [..., C]."""
    rows = x.reshape(-1, x.shape[-1])
    return torch.addcmul(rows, gate[row_ids], y.reshape(rows.shape)).view_as(x)


def qk_norm_rope(
    x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float
) -> torch.Tensor:
    """RMSNorm over head_dim (diffusers' casting) then rotary embedding on adjacent channel pairs.

    x: [..., T, H, D]; weight: [D]; cos, sin: fp32 [T, D/2]. Norm statistics and the rotation in fp32.
    """
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if weight.dtype in (torch.float16, torch.bfloat16):
        normed = normed.to(weight.dtype)
    normed = (normed * weight).float()
    x_re, x_im = normed.unflatten(-1, (-1, 2)).unbind(-1)  # [..., T, H, D/2] each
    cos, sin = cos[:, None, :], sin[:, None, :]
    out = torch.stack([x_re * cos - x_im * sin, x_re * sin + x_im * cos], dim=-1)
    return out.flatten(-2).to(x.dtype)


RECOMPILE_LIMIT = 64
"""Dynamo's per-function recompile limit while fused ops are compiled: dense and packed calls, and
the norm_out's (scale, shift) layout, each compile once; the default limit (8) is too tight."""


MAX_FAILED_SHAPES = 256
"""Failed (op, shapes) remembered; beyond this, failures are retried (and counted) every call."""


class BlockOps:
    """The block's elementwise chains; compiled into fused kernels when `compiled`.

    Compiled inputs are flattened to rows first ([num_rows, C] and [num_rows, H, D]), so the dense
    `[B, S, ...]` and packed layouts share one graph each and only sizes vary (`dynamic=True`).
    """

    def __init__(self, compiled: bool = False):
        self.compiled = compiled
        self.num_fallbacks = 0
        """Calls that fell back to the eager chain after the compiled one raised (counted in /metrics)."""
        self._failed: set[tuple] = set()
        """(op, input shapes) whose compiled call raised: they run eager; other shapes keep compiling."""
        self._eager = {"mln": modulated_layer_norm, "gated": gated_residual, "qk": qk_norm_rope}
        self._fns = dict(self._eager)
        if compiled:
            import torch._dynamo.config as dynamo_config

            for name in ("recompile_limit", "cache_size_limit"):
                if getattr(dynamo_config, name, RECOMPILE_LIMIT) < RECOMPILE_LIMIT:
                    setattr(dynamo_config, name, RECOMPILE_LIMIT)
            compile_fn = torch.compile(dynamic=True)
            self._fns = {name: compile_fn(fn) for name, fn in self._eager.items()}

    def _call(self, name: str, *args):
        if not self.compiled:
            return self._eager[name](*args)
        key = (name, *(tuple(a.shape) for a in args if isinstance(a, torch.Tensor)))
        if key in self._failed:
            return self._eager[name](*args)
        try:
            return self._fns[name](*args)
        except Exception:
            # A compile (or compiled-kernel) failure must not take requests down, nor disable compilation
            # for every other shape (it may be a transient OOM): this shape runs eager from now on.
            self.num_fallbacks += 1
            if len(self._failed) < MAX_FAILED_SHAPES:
                self._failed.add(key)
            logger.exception("compiled block op %s failed for shapes %s; running it eager", name, key[1:])
            return self._eager[name](*args)

    def modulated_layer_norm(self, x, shift, scale_plus_one, row_ids, eps: float) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        return self._call("mln", rows, shift, scale_plus_one, row_ids, eps).view_as(x)

    def gated_residual(self, x, y, gate, row_ids) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        return self._call("gated", rows, y.reshape(rows.shape), gate, row_ids).view_as(x)

    def qk_norm_rope(self, x, weight, cos, sin, eps: float) -> torch.Tensor:
        if x.dim() == 4 and self.compiled:  # dense [B, S, H, D]: rows of all items, tables repeated
            batch = x.shape[0]
            out = self._call(
                "qk", x.reshape(-1, *x.shape[2:]), weight, cos.repeat(batch, 1), sin.repeat(batch, 1), eps
            )
            return out.view_as(x)
        return self._call("qk", x, weight, cos, sin, eps)

    def __repr__(self) -> str:
        return f"BlockOps(compiled={self.compiled})"

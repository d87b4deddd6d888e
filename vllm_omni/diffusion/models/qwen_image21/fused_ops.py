"""The elementwise chains of a Qwen-Image-2.1 block, written once, run eager or compiled.

A 2.1 block is single-stream and reads one modulation shared by every block, per sequence
`[num_seqs, 4 * dim] = [scale1 | gate1 | scale2 | gate2]`. Between its GEMMs and its attention call a
block runs these chains (R rows, C = dim, sequence i's values reach its rows through `seq_ids [R]`):

    norm         LayerNorm(x) * (1 + scale1)                                before the q/k/v GEMM
    qk           RMSNorm over head_dim (fp32) then RoPE, q and k in one op   after it
    gated_norm   x + tanh(gate1) * attn_out, then LayerNorm(x) * (1 + scale2)   one pass
    silu_mul     silu(gate) * proj (SwiGLU)                                  between the MLP's GEMMs
    gated_norm   x + tanh(gate2) * mlp_out (fp16: clipped), then the next block's
                 LayerNorm(x) * (1 + scale1), or the final norm_out's after the last block

Eager, each chain is several kernels and reads per-row values (the runner's eager forward gathers the
modulation to rows once per forward, `[R, 4 * dim]`). Compiled (`Block21Ops(compiled=True)`: inductor,
only row and sequence counts dynamic, layers/compiled_ops.py) each chain is one or two kernels that
gather the per-sequence values by `seq_ids` on the fly, so `[R, 4 * dim]` never exists. The compiled
ops read no host values and have no data-dependent shapes: the packed step's CUDA graphs (graphs.py)
capture them. The math, and the eager op order the CPU tests compare against diffusers, is the same
either way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vllm_omni.diffusion.layers.compiled_ops import CompiledOps, OpTable
from vllm_omni.diffusion.models.qwen_image import fused_ops as qwen_image_ops
from vllm_omni.diffusion.models.qwen_image.layers import RMSNorm
from vllm_omni.diffusion.models.qwen_image.rope import apply_rope

FP16_MAX = 65504.0


def modulated_norm(
    x: torch.Tensor, scale: torch.Tensor, seq_ids: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """`LayerNorm(x) * (1 + scale)` (no affine weights): x [R, C]; scale [N, C] per sequence, gathered
    by seq_ids long [R], or (seq_ids None) [R, C] / [1, C] already per row."""
    if seq_ids is not None:
        scale = scale[seq_ids]
    return F.layer_norm(x, (x.shape[-1],), eps=eps) * (1 + scale)


def gated_residual_norm(
    x: torch.Tensor,
    y: torch.Tensor,
    gate: torch.Tensor,
    scale: torch.Tensor,
    seq_ids: torch.Tensor | None,
    eps: float,
    clip_fp16: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`x + tanh(gate) * y` (with `clip_fp16`, fp16 results clipped to its range, as diffusers after
    the MLP), then `modulated_norm` of it: (new x [R, C], its normed rows [R, C]).

    x, y [R, C]; gate, scale: per sequence [N, C] with seq_ids [R], or per row (seq_ids None)."""
    if seq_ids is not None:
        gate = gate[seq_ids]
    x = x + gate.tanh() * y
    if clip_fp16 and x.dtype == torch.float16:
        x = x.clip(-FP16_MAX, FP16_MAX)
    return x, modulated_norm(x, scale, seq_ids, eps)


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k [R, H, D] (views of the merged q/k/v GEMM are fine) -> each RMS-normed over D with its
    weight [D] (fp32 statistics, diffusers' casts) and rotated by fp32 cos, sin [R, D/2]: Qwen-Image's
    per-stream chain (`qwen_image.fused_ops.qk_norm_rope`), both in one op. Bit-equal to the modules'
    chain (`apply_rope(RMSNorm(q).to(q.dtype))`, CPU math) when weight and activations share a dtype;
    with fp32 weights and half activations it skips that chain's rounding of the normed q before RoPE."""
    return (
        qwen_image_ops.qk_norm_rope(q, q_weight, cos, sin, eps),
        qwen_image_ops.qk_norm_rope(k, k_weight, cos, sin, eps),
    )


def silu_mul(gate: torch.Tensor, proj: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation: `silu(gate) * proj`, gate and proj [R, hidden] (halves of one GEMM)."""
    return F.silu(gate) * proj


OPS: OpTable = {
    "norm": (modulated_norm, (0, 1, 2)),
    "gated_norm": (gated_residual_norm, (0, 1, 2, 3, 4)),
    "qk": (qk_norm_rope, (0, 1, 4, 5)),
    "silu_mul": (silu_mul, (0, 1)),
}
"""name -> (eager function, arguments whose first dim counts rows or sequences: the only dynamic dims)."""


@dataclass(frozen=True)
class Modulation:
    """The shared modulation of one forward as the blocks read it: per sequence with `seq_ids`
    (compiled: gathered inside the kernels), or already per row (`seq_ids` None)."""

    scale1: torch.Tensor
    """[N or R, C] (or [1, C]: one sequence, broadcast): the scale before attention."""
    gate1: torch.Tensor
    """The attention residual's gate (before tanh)."""
    scale2: torch.Tensor
    """The scale before the MLP."""
    gate2: torch.Tensor
    """The MLP residual's gate (before tanh)."""
    out_scale: torch.Tensor | None
    """The final `norm_out`'s scale, same layout (None in the prefill, which stops before it)."""
    seq_ids: torch.Tensor | None
    """long [R]: each row's sequence; None when the values above are per row already."""


class Block21Ops(CompiledOps):
    """2.1's block chains (`OPS`); compiled into fused kernels when `compiled` (the compile, dynamic
    rows and the per-shape eager fallback: layers/compiled_ops.py)."""

    def __init__(self, compiled: bool = False):
        super().__init__(OPS, compiled)

    def per_row(
        self, values: torch.Tensor, seq_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-sequence values [N, ...] as the ops take them: compiled, unchanged with `seq_ids` (the
        kernels gather); eager, gathered to rows once here, `(values[seq_ids], None)`: one gather per
        forward instead of one per op."""
        return (values, seq_ids) if self.compiled else (values[seq_ids], None)

    def modulation(self, mod: torch.Tensor, seq_ids: torch.Tensor | None, dim: int) -> Modulation:
        """`Modulation` of mod [N, 4 * dim] or [N, 5 * dim] (the final norm's scale last) per sequence
        (seq_ids [R]), or of mod [1, 4 * dim] for every row (seq_ids None).

        NOTE(compile): one tensor for all five keeps every per-sequence operand at the same strides:
        a separate [N, dim] out_scale made dynamo compile the last block's op a second time."""
        if seq_ids is not None:
            mod, seq_ids = self.per_row(mod, seq_ids)
        chunks = mod.split(dim, dim=-1)
        return Modulation(*chunks[:4], out_scale=chunks[4] if len(chunks) == 5 else None, seq_ids=seq_ids)

    def modulated_norm(self, x, scale, seq_ids, eps: float) -> torch.Tensor:
        return self._call("norm", x, scale, seq_ids, eps)

    def gated_residual_norm(self, x, y, gate, scale, seq_ids, eps: float, clip_fp16: bool):
        return self._call("gated_norm", x, y, gate, scale, seq_ids, eps, clip_fp16)

    def silu_mul(self, gate: torch.Tensor, proj: torch.Tensor) -> torch.Tensor:
        return self._call("silu_mul", gate, proj)

    def qk_norm_rope(
        self, q: torch.Tensor, k: torch.Tensor, norm_q: nn.Module, norm_k: nn.Module, rope
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k [R, H, D] normed by their modules' math and rotated by rope (cos, sin) [R, D/2].

        NOTE(eager): not compiled, the modules themselves run (on CUDA `RMSNorm` is one F.rms_norm
        kernel; batch-invariant mode replaces them), exactly the chain before these ops existed."""
        plain = type(norm_q) is RMSNorm and type(norm_k) is RMSNorm and norm_q.eps == norm_k.eps
        if not (self.compiled and plain):
            return apply_rope(norm_q(q).to(q.dtype), *rope), apply_rope(norm_k(k).to(k.dtype), *rope)
        return self._call("qk", q, k, norm_q.weight, norm_k.weight, *rope, norm_q.eps)

    def __repr__(self) -> str:
        return f"Block21Ops(compiled={self.compiled})"

"""The elementwise chains of a Qwen-Image block, written once, run eager or compiled.

Eager PyTorch runs each of these as several kernels and materialises the per-sequence modulation
for every row (`[num_rows, 6 * hidden]` per block and stream). Compiled with inductor
(`dynamic=True`, so one compile serves every batch composition) each chain becomes one kernel that
gathers the per-sequence values by row id on the fly. The math (and the eager op order, which the
CPU tests compare against diffusers) is the same either way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_omni.diffusion.layers.compiled_ops import CompiledOps
from vllm_omni.diffusion.layers.fp8 import Fp8Activation, quantize_activation


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
    # Pairs (re, im) = (x[2i], x[2i+1]) rotate to (re cos - im sin, im cos + re sin), written as
    # x * [cos, cos] + swap_pairs(x) * [-sin, sin]: the same products and sums (bit-equal) in the
    # norm's own [.., D] index space, which inductor compiles ~15% faster than stacking the halves
    # (about 15 % faster at 4096 rows). On CUDA the Triton kernel (triton_ops.py) replaces both.
    cos2 = cos[..., None].expand(*cos.shape, 2).flatten(-2)[:, None, :]  # [T, 1, D]
    sin2 = torch.stack([-sin, sin], dim=-1).flatten(-2)[:, None, :]  # [T, 1, D]
    swapped = normed.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    return (normed * cos2 + swapped * sin2).to(x.dtype)


def gated_residual_norm(
    x: torch.Tensor,
    y: torch.Tensor,
    gate: torch.Tensor,
    shift: torch.Tensor,
    scale_plus_one: torch.Tensor,
    row_ids: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`gated_residual` then the next `modulated_layer_norm` of its result: (new x, its normed input).

    One pass over x instead of two when compiled; the same two ops in the same order eager.
    """
    x = gated_residual(x, y, gate, row_ids)
    return x, modulated_layer_norm(x, shift, scale_plus_one, row_ids, eps)


def gated_residual_norm_rows(
    x: torch.Tensor,
    y: torch.Tensor,
    y_rows: torch.Tensor,
    gate: torch.Tensor,
    shift: torch.Tensor,
    scale_plus_one: torch.Tensor,
    row_ids: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`gated_residual_norm` with x's row r reading y's row `y_rows[r]` (y: [any rows, C]): the
    attention output in joint rows, read without first copying the image rows out."""
    return gated_residual_norm(x, y[y_rows], gate, shift, scale_plus_one, row_ids, eps)


def modulated_layer_norm_fp8(
    x: torch.Tensor, shift: torch.Tensor, scale_plus_one: torch.Tensor, row_ids: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`modulated_layer_norm` (x [R, C]) quantised for an FP8 linear: (q [R, C] e4m3, scale [R, 1]
    fp32), `quantize_activation` of the output in the activation dtype. On CUDA one Triton kernel
    (triton_ops.py) computes both from the registers holding the row, with the same bits."""
    return quantize_activation(modulated_layer_norm(x, shift, scale_plus_one, row_ids, eps))


def gated_residual_norm_fp8(x, y, gate, shift, scale_plus_one, row_ids, eps: float):
    """`gated_residual_norm` with the normed rows quantised: (new x [R, C], q [R, C] e4m3, scale [R, 1])."""
    x, normed = gated_residual_norm(x, y, gate, shift, scale_plus_one, row_ids, eps)
    return x, *quantize_activation(normed)


def gated_residual_norm_rows_fp8(x, y, y_rows, gate, shift, scale_plus_one, row_ids, eps: float):
    """`gated_residual_norm_rows` with the normed rows quantised: (new x, q, scale)."""
    return gated_residual_norm_fp8(x, y[y_rows], gate, shift, scale_plus_one, row_ids, eps)


def joint_qkv(
    txt_qkv: torch.Tensor,
    img_qkv: torch.Tensor,
    joint_src: torch.Tensor,
    norm_weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    txt_rope: tuple[torch.Tensor, torch.Tensor],
    img_rope: tuple[torch.Tensor, torch.Tensor],
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Both streams' fused QKV projections -> the joint attention inputs q, k, v, in one pass.

    txt_qkv [num_txt_rows, 3 * H * D], img_qkv [num_img_rows, 3 * H * D]: the projections' outputs.
    joint_src long [T]: for every joint row, its row in the virtual `cat([txt rows, img rows])`.
    norm_weights: (txt q, txt k, img q, img k) RMSNorm weights [D]; ropes fp32 (cos, sin) [rows, D/2].
    Returns q, k, v [T, H, D] in joint order, q and k RMS-normed and rotated per stream: the same
    per-row math as `qk_norm_rope` on each stream followed by the join, without the join's copies
    (compiled, every joint row is gathered straight from its stream's projection).
    """
    is_txt = (joint_src < txt_qkv.shape[0])[:, None]  # [T, 1]
    # gathers from the virtual concatenation (either stream may be empty: a sequence-parallel shard)
    qkv = torch.cat([txt_qkv, img_qkv])[joint_src]  # [T, 3 * H * D]
    cos, sin = (torch.cat([t, i])[joint_src] for t, i in zip(txt_rope, img_rope, strict=True))  # [T, D/2]
    txt_q_w, txt_k_w, img_q_w, img_k_w = norm_weights
    q, k, v = qkv.unflatten(-1, (3, -1, txt_q_w.shape[0])).unbind(1)  # [T, H, D] each
    q = qk_norm_rope(q, torch.where(is_txt, txt_q_w, img_q_w)[:, None], cos, sin, eps)
    k = qk_norm_rope(k, torch.where(is_txt, txt_k_w, img_k_w)[:, None], cos, sin, eps)
    return q, k, v


OPS = {
    "mln": (modulated_layer_norm, (0, 1, 2, 3)),
    "gated": (gated_residual, (0, 1, 2, 3)),
    "gated_norm": (gated_residual_norm, (0, 1, 2, 3, 4, 5)),
    "gated_norm_rows": (gated_residual_norm_rows, (0, 1, 2, 3, 4, 5, 6)),
    "qk": (qk_norm_rope, (0, 2, 3)),
    "joint_qkv": (joint_qkv, (0, 1, 2, 4, 5)),
    "mln_fp8": (modulated_layer_norm_fp8, (0, 1, 2, 3)),
    "gated_norm_fp8": (gated_residual_norm_fp8, (0, 1, 2, 3, 4, 5)),
    "gated_norm_rows_fp8": (gated_residual_norm_rows_fp8, (0, 1, 2, 3, 4, 5, 6)),
}
"""name -> (eager function, positions of the arguments whose first dim is a row or sequence count): the
block's `OpTable`. Only those dims are compiled as dynamic; every other size (hidden, heads, head_dim)
stays static (`compiled_ops.mark_rows_dynamic` says why)."""


class BlockOps(CompiledOps):
    """The block's elementwise chains; compiled into fused kernels when `compiled` (the compile, the
    dynamic rows and the per-shape eager fallback: layers/compiled_ops.py).

    Compiled inputs are flattened to rows first ([num_rows, C] and [num_rows, H, D]), so the dense
    `[B, S, ...]` and packed layouts share one graph each and only row counts vary (marked dynamic).
    `fuse_joint` (default: when compiled) builds the joint q/k/v straight from both streams'
    projections (`joint_qkv`; on CUDA the Triton kernel of triton_ops.py) instead of norm + RoPE
    per stream and a join copy.
    """

    def __init__(self, compiled: bool = False, fuse_joint: bool | None = None, use_triton: bool = True):
        super().__init__(OPS, compiled)
        self.fuse_joint = compiled if fuse_joint is None else fuse_joint
        self.use_triton = use_triton
        """Compiled on CUDA: the Triton kernels of triton_ops.py where they exist (False: inductor's
        kernels for every chain; benchmarks compare the two)."""

    def kernel_for(self, name: str, args: tuple):
        """The Triton kernel of `name` for these arguments (see `_triton_kernel`)."""
        return self._triton_kernel(name, args[0])

    def _triton_kernel(self, name: str, x: torch.Tensor):
        """The Triton kernel of `name` when one serves this call (CUDA, fp16/bf16, triton importable)."""
        if not (self.use_triton and x.is_cuda and x.dtype in (torch.float16, torch.bfloat16)):
            return None
        from vllm_omni.diffusion.models.qwen_image import triton_ops

        return triton_ops.KERNELS.get(name) if triton_ops.available() else None

    def emits_fp8(self, x: torch.Tensor) -> bool:
        """Whether the norms emit an `Fp8Activation` for rows like x when asked (`fp8_ok`): a Triton
        kernel serves them (compiled, CUDA, fp16/bf16). Elsewhere they return x's dtype, as before."""
        return self.compiled and self._triton_kernel("mln_fp8", x) is not None

    def modulated_layer_norm(
        self, x, shift, scale_plus_one, row_ids, eps: float, fp8_ok: bool = False
    ) -> torch.Tensor | Fp8Activation:
        """`modulated_layer_norm`; with `fp8_ok` (every consumer of the output takes an
        `Fp8Activation`: `accepts_fp8_input`) the output already quantised, where `emits_fp8`."""
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        if fp8_ok and self.emits_fp8(rows):
            q, q_scale = self._call("mln_fp8", rows, shift, scale_plus_one, row_ids, eps)
            return Fp8Activation(q, q_scale, x.shape, x.dtype)
        return self._call("mln", rows, shift, scale_plus_one, row_ids, eps).view_as(x)

    def gated_residual(self, x, y, gate, row_ids) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        return self._call("gated", rows, y.reshape(rows.shape), gate, row_ids).view_as(x)

    def gated_residual_norm(
        self,
        x,
        y,
        gate,
        shift,
        scale_plus_one,
        row_ids,
        eps: float,
        y_rows: torch.Tensor | None = None,
        fp8_ok: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | Fp8Activation]:
        """`gated_residual_norm`; with `y_rows`, y is [any rows, C] and x's row r reads y[y_rows[r]];
        with `fp8_ok`, the normed output as `modulated_layer_norm`'s."""
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        if y_rows is None:
            name, y_args = "gated_norm", (y.reshape(rows.shape).contiguous(),)
        else:
            name, y_args = "gated_norm_rows", (y.contiguous(), y_rows)
        fp8 = fp8_ok and self.emits_fp8(rows)
        name = name + "_fp8" if fp8 else name
        out = self._call(name, rows, *y_args, gate, shift, scale_plus_one, row_ids, eps)
        normed = Fp8Activation(out[1], out[2], x.shape, x.dtype) if fp8 else out[1].view_as(x)
        return out[0].view_as(x), normed

    def qk_norm_rope(self, x, weight, cos, sin, eps: float) -> torch.Tensor:
        if x.dim() == 4 and self.compiled:  # dense [B, S, H, D]: rows of all items, tables repeated
            batch = x.shape[0]
            out = self._call(
                "qk", x.reshape(-1, *x.shape[2:]), weight, cos.repeat(batch, 1), sin.repeat(batch, 1), eps
            )
            return out.view_as(x)
        return self._call("qk", x, weight, cos, sin, eps)

    def joint_qkv(self, txt_qkv, img_qkv, joint_src, norm_weights, txt_rope, img_rope, eps: float):
        """See `joint_qkv`: rows in, q, k, v [T, H, D] out; compiled, the Triton kernel on CUDA."""
        return self._call("joint_qkv", txt_qkv, img_qkv, joint_src, norm_weights, txt_rope, img_rope, eps)

    def __repr__(self) -> str:
        return (
            f"BlockOps(compiled={self.compiled}, fuse_joint={self.fuse_joint}, use_triton={self.use_triton})"
        )

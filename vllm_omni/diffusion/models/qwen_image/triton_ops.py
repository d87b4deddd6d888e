"""Triton kernels of a block: the joint q/k/v (both streams' QKV projections -> attention inputs)
and the modulated LayerNorm (with or without the gated residual before it).

`fused_ops.joint_qkv` states the math (RMS QK-norm with diffusers' casts, RoPE on adjacent pairs,
the [text ; image] join per sequence); this is the same math as one kernel, one program per joint
row: it reads the row's q, k and v once from its stream's projection, normalises and rotates q and
k per head in fp32 and writes the three joint tensors. inductor's version of the same function runs
as three kernels (a separate reduction for the RMS, a pointwise pass and the v gather), about 4x
this kernel's time (docs/design/packed_forward.md).
The modulated LayerNorm kernel (with or without the gated residual before it) holds a whole row in
registers, so it reads it once (the gated residual alone, the block's last op, is the same kernel
shape without the norm); inductor's looped reduction reads it twice (0.054 vs 0.097 ms per
block for the four calls). Its `_fp8` variants store the output row as e4m3 codes and a per-row scale
instead (`fp8_triton.store_e4m3_row`: `quantize_rows`' arithmetic on the unfused output), the
input of an FP8 QKV or MLP-up projection (`fp8.Fp8Activation`), so that projection pays no
quantisation pass.

Used only on CUDA for fp16/bf16 activations when triton imports (`available()`), through the
compiled block ops (`KERNELS`, with their per-shape fallback); everything else runs the torch
function. Nothing here reads a host value of a device tensor, so it captures in a CUDA graph.
"""

from __future__ import annotations

import functools

import torch

from vllm_omni.diffusion.layers import fp8_triton

try:
    import triton
    import triton.language as tl

    from vllm_omni.diffusion.layers.fp8_triton import store_e4m3_row
except ImportError:  # CPU wheels of torch come without triton
    triton = None


@functools.cache
def available() -> bool:
    return triton is not None and torch.cuda.is_available()


if triton is not None:

    @triton.jit
    def _norm_rope_store(x_ptr, w_ptr, dst_ptr, offs, mask, cos, sin, d, eps,
                         BLOCK_H: tl.constexpr, D: tl.constexpr, ROUND_TO_WEIGHT: tl.constexpr):  # fmt: skip
        """RMS-norm one row's heads ([BLOCK_H, D] at `offs`), rotate adjacent pairs, store at dst.

        Loads and stores are whole contiguous heads (vector accesses); the pairs are split and
        joined in registers (a stride-2 access per half ran at a fifth of the bandwidth)."""
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]  # [BLOCK_H, 1]
        w = tl.load(w_ptr + d).to(tl.float32)  # [1, D]
        n = x * rstd
        if ROUND_TO_WEIGHT:  # diffusers: normed -> weight dtype, times the weight in that dtype
            wdt = w_ptr.dtype.element_ty
            n = (n.to(wdt).to(tl.float32) * w).to(wdt).to(tl.float32)
        else:
            n = n * w
        re, im = tl.split(tl.reshape(n, [BLOCK_H, D // 2, 2]))  # [BLOCK_H, D/2] each
        out = tl.reshape(tl.join(re * cos - im * sin, im * cos + re * sin), [BLOCK_H, D])
        tl.store(dst_ptr + offs, out.to(dst_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _joint_qkv_kernel(
        txt_ptr, img_ptr, src_ptr, num_txt, txt_stride, img_stride,
        txt_wq, txt_wk, img_wq, img_wk,
        txt_cos, txt_sin, img_cos, img_sin,
        q_ptr, k_ptr, v_ptr, eps,
        H: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, ROUND_TO_WEIGHT: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        src = tl.load(src_ptr + row)
        half: tl.constexpr = D // 2
        if src < num_txt:  # a text row
            base, wq, wk = txt_ptr + src * txt_stride, txt_wq, txt_wk
            cos_ptr, sin_ptr = txt_cos + src * half, txt_sin + src * half
        else:
            r = src - num_txt
            base, wq, wk = img_ptr + r * img_stride, img_wq, img_wk
            cos_ptr, sin_ptr = img_cos + r * half, img_sin + r * half
        h = tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1] heads
        d = tl.arange(0, D)[None, :]  # [1, D] channels
        j = tl.arange(0, half)[None, :]  # [1, D/2] channel pairs
        mask = h < H
        offs = h * D + d  # [BLOCK_H, D] within q (or k, v) of one row
        cos, sin = tl.load(cos_ptr + j), tl.load(sin_ptr + j)  # fp32 [1, D/2]
        out = row * H * D
        _norm_rope_store(base, wq, q_ptr + out, offs, mask, cos, sin, d, eps, BLOCK_H, D, ROUND_TO_WEIGHT)
        _norm_rope_store(
            base + H * D, wk, k_ptr + out, offs, mask, cos, sin, d, eps, BLOCK_H, D, ROUND_TO_WEIGHT
        )
        v = tl.load(base + 2 * H * D + offs, mask=mask, other=0.0)
        tl.store(v_ptr + out + offs, v, mask=mask)


def joint_qkv(txt_qkv, img_qkv, joint_src, norm_weights, txt_rope, img_rope, eps: float):
    """`fused_ops.joint_qkv` as one Triton kernel (same arguments, same results up to the order of
    the RMS sum); q, k, v [T, H, D] contiguous. ValueError for a head_dim that is not a power of two
    (the caller runs the torch function instead)."""
    head_dim = norm_weights[0].shape[0]
    if head_dim < 2 or head_dim & (head_dim - 1):
        raise ValueError(f"the joint q/k/v kernel needs a power-of-two head_dim, got {head_dim}")
    heads = txt_qkv.shape[1] // (3 * head_dim)
    total = joint_src.shape[0]
    q, k, v = (txt_qkv.new_empty(total, heads, head_dim) for _ in range(3))
    if total == 0:
        return q, k, v
    txt_cos, txt_sin = (t.contiguous() for t in txt_rope)
    img_cos, img_sin = (t.contiguous() for t in img_rope)
    weights = [w.contiguous() for w in norm_weights]
    _joint_qkv_kernel[(total,)](
        txt_qkv, img_qkv, joint_src, txt_qkv.shape[0], txt_qkv.stride(0), img_qkv.stride(0),
        *weights, txt_cos, txt_sin, img_cos, img_sin, q, k, v, eps,
        H=heads, D=head_dim, BLOCK_H=triton.next_power_of_2(heads),
        ROUND_TO_WEIGHT=norm_weights[0].dtype in (torch.float16, torch.bfloat16),
        num_warps=4,
    )  # fmt: skip
    return q, k, v


if triton is not None:

    @triton.jit
    def _gated_add(x, gate, y, act: tl.constexpr):
        """x + gate * y in fp32, rounded once to the activation dtype (torch.addcmul's result)."""
        return (x.to(tl.float32) + gate.to(tl.float32) * y.to(tl.float32)).to(act)

    @triton.jit
    def _gated_residual_kernel(
        x_ptr, y_ptr, gate_ptr, ids_ptr, out_ptr, gate_stride, C, BLOCK_C: tl.constexpr
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        seq = tl.load(ids_ptr + row)
        c = tl.arange(0, BLOCK_C)
        mask = c < C
        x = tl.load(x_ptr + row * C + c, mask=mask, other=0.0)
        gate = tl.load(gate_ptr + seq * gate_stride + c, mask=mask, other=0.0)
        y = tl.load(y_ptr + row * C + c, mask=mask, other=0.0)
        tl.store(out_ptr + row * C + c, _gated_add(x, gate, y, x_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _modulated_layer_norm_kernel(
        x_ptr, y_ptr, y_rows_ptr, gate_ptr, shift_ptr, scale_ptr, ids_ptr, new_x_ptr, out_ptr, q_scale_ptr,
        mod_stride, C, eps,
        GATED: tl.constexpr, Y_ROWS: tl.constexpr, BLOCK_C: tl.constexpr,
        QUANTIZE: tl.constexpr, EXPLICIT_ROUND: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        seq = tl.load(ids_ptr + row)
        c = tl.arange(0, BLOCK_C)
        mask = c < C
        act = x_ptr.dtype.element_ty  # the activation dtype
        x = tl.load(x_ptr + row * C + c, mask=mask, other=0.0)
        if GATED:  # x + gate * y in fp32, rounded once (torch.addcmul), kept as the new residual
            y_row = tl.load(y_rows_ptr + row) if Y_ROWS else row  # y's row: by index, or the same
            gate = tl.load(gate_ptr + seq * mod_stride + c, mask=mask, other=0.0)
            y = tl.load(y_ptr + y_row * C + c, mask=mask, other=0.0)
            x = _gated_add(x, gate, y, act)
            tl.store(new_x_ptr + row * C + c, x, mask=mask)
        x = x.to(tl.float32)
        mean = tl.sum(x, axis=0) / C
        centered = tl.where(mask, x - mean, 0.0)
        rstd = tl.rsqrt(tl.sum(centered * centered, axis=0) / C + eps)
        normed = (centered * rstd).to(act).to(tl.float32)  # F.layer_norm's output
        shift = tl.load(shift_ptr + seq * mod_stride + c, mask=mask, other=0.0).to(tl.float32)
        scale = tl.load(scale_ptr + seq * mod_stride + c, mask=mask, other=0.0).to(tl.float32)
        out = (shift + normed * scale).to(act)  # the unfused output, rounded as it is stored
        if QUANTIZE:  # the FP8 GEMM's input straight from the registers (fp8_triton.quantize_rows' ops)
            out = tl.where(mask, out.to(tl.float32), 0.0)
            store_e4m3_row(out, out_ptr + row * C + c, mask, q_scale_ptr + row, EXPLICIT_ROUND)
        else:
            tl.store(out_ptr + row * C + c, out, mask=mask)


NORM_NUM_WARPS = 4
"""Warps per row of the LayerNorm kernels: the fastest of 2, 4 and 8 in a sweep on the GPU."""


def _mod_rows(*mods: torch.Tensor) -> int:
    """Row stride shared by the per-sequence modulation chunks (column slices of one [S, k*C] output)."""
    strides = {m.stride(0) for m in mods}
    if len(strides) != 1 or any(m.stride(1) != 1 for m in mods):
        raise ValueError("modulation chunks must share a row stride and be contiguous along channels")
    return strides.pop()


def _norm(x, y, y_rows, gate, shift, scale_plus_one, row_ids, eps: float, quantize: bool):
    """One launch of the modulated LayerNorm kernel: (new x or None, out, out's scales or None)."""
    rows, channels = x.shape
    gated = y is not None
    new_x = torch.empty_like(x) if gated else None
    out = torch.empty_like(x, dtype=torch.float8_e4m3fn if quantize else x.dtype)
    q_scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device) if quantize else None
    mods = (gate, shift, scale_plus_one) if gated else (shift, scale_plus_one)
    if rows:
        _modulated_layer_norm_kernel[(rows,)](
            x, y if gated else x, row_ids if y_rows is None else y_rows, gate if gated else shift,
            shift, scale_plus_one, row_ids, new_x if gated else out, out, out if q_scale is None else q_scale,
            _mod_rows(*mods), channels, eps,
            GATED=gated, Y_ROWS=y_rows is not None, BLOCK_C=triton.next_power_of_2(channels),
            QUANTIZE=quantize, EXPLICIT_ROUND=quantize and fp8_triton.interpreted(), num_warps=NORM_NUM_WARPS,
        )  # fmt: skip
    return new_x, out, q_scale


def gated_residual(x, y, gate, row_ids) -> torch.Tensor:
    """`fused_ops.gated_residual` (x, y [R, C]) as one kernel, one program per row: the block's last
    op (x + gate * MLP output). inductor's kernel for it took several times the ~40 us the image rows'
    ~150 MB a call need at the memory's rate; this one is the norm kernels' shape without the norm."""
    x, y = x.contiguous(), y.contiguous()
    out = torch.empty_like(x)
    rows, channels = x.shape
    if rows:
        _gated_residual_kernel[(rows,)](
            x, y, gate, row_ids, out, _mod_rows(gate), channels,
            BLOCK_C=triton.next_power_of_2(channels), num_warps=NORM_NUM_WARPS,
        )  # fmt: skip
    return out


def modulated_layer_norm(x, shift, scale_plus_one, row_ids, eps: float) -> torch.Tensor:
    """`fused_ops.modulated_layer_norm` (x [R, C] contiguous) as one kernel, one program per row."""
    return _norm(x, None, None, None, shift, scale_plus_one, row_ids, eps, quantize=False)[1]


def gated_residual_norm(x, y, gate, shift, scale_plus_one, row_ids, eps: float, y_rows=None):
    """`fused_ops.gated_residual_norm` (x, y [R, C] contiguous) as one kernel: (new x, normed);
    with `y_rows` (long [R]) y is [any rows, C] and row r reads y[y_rows[r]]."""
    return _norm(x, y, y_rows, gate, shift, scale_plus_one, row_ids, eps, quantize=False)[:2]


def gated_residual_norm_rows(x, y, y_rows, gate, shift, scale_plus_one, row_ids, eps: float):
    """`fused_ops.gated_residual_norm_rows` as one kernel."""
    return gated_residual_norm(x, y, gate, shift, scale_plus_one, row_ids, eps, y_rows=y_rows)


def modulated_layer_norm_fp8(x, shift, scale_plus_one, row_ids, eps: float):
    """`fused_ops.modulated_layer_norm_fp8`: the normed rows quantised in the same kernel,
    (q [R, C] e4m3, scale [R, 1] fp32), `quantize_rows(modulated_layer_norm(...))`' arithmetic.

    NOTE(fp8): equal bit for bit under triton's interpreter; on the GPU 2 of 12.6M codes came out one
    e4m3 step apart from the unfused kernel's output quantised: this variant's layout sums the row's
    mean and variance in another order, moving a few outputs by a bf16 ulp."""
    _, q, q_scale = _norm(x, None, None, None, shift, scale_plus_one, row_ids, eps, quantize=True)
    return q, q_scale


def gated_residual_norm_fp8(x, y, gate, shift, scale_plus_one, row_ids, eps: float, y_rows=None):
    """`fused_ops.gated_residual_norm_fp8`: (new x, q, scale) in one kernel."""
    return _norm(x, y, y_rows, gate, shift, scale_plus_one, row_ids, eps, quantize=True)


def gated_residual_norm_rows_fp8(x, y, y_rows, gate, shift, scale_plus_one, row_ids, eps: float):
    """`fused_ops.gated_residual_norm_rows_fp8` as one kernel."""
    return gated_residual_norm_fp8(x, y, gate, shift, scale_plus_one, row_ids, eps, y_rows=y_rows)


KERNELS = {
    "mln": modulated_layer_norm,
    "gated": gated_residual,
    "gated_norm": gated_residual_norm,
    "gated_norm_rows": gated_residual_norm_rows,
    "joint_qkv": joint_qkv,
    "mln_fp8": modulated_layer_norm_fp8,
    "gated_norm_fp8": gated_residual_norm_fp8,
    "gated_norm_rows_fp8": gated_residual_norm_rows_fp8,
}
"""fused_ops.OPS names served by a kernel here (same arguments and results as the torch function)."""

"""Batch-invariant FP8 (W8A8) linears: `Fp8LinearMethod`'s numbers, with rows that do not depend on M.

The FP8 linear is two steps, and only the second one depends on the batch:

    quantise   x [M, K] -> x8 [M, K] e4m3, sx [M, 1]      row-local already: a row's codes and scale
                                                          come from that row alone (one Triton program
                                                          per row on CUDA, torch's exact elementwise
                                                          ops and an amax on CPU)
    product    x8 @ W8^T, times sx[m] * sw[n], + bias     `torch._scaled_mm`: cuBLAS picks the tiling,
                                                          split-K and kernel from M  ->  replaced here

so batch-invariant mode keeps the quantisation (and accepts an `Fp8Activation` from the fused producer
kernels, which are one program per row as well: a row's codes still depend only on that row) and
replaces the product with one of a fixed order:

    CUDA  one Triton kernel, one tiling (FP8_MATMUL_CONFIG), no split-K: e4m3 x e4m3 `tl.dot` with an
          fp32 accumulator over K = 0, BK, 2BK, ... in order, then in the epilogue
          y[m, n] = acc[m, n] * sx[m] * sw[n] + bias[n] (fp32), rounded once to the activation dtype.
          A row's bits depend only on that row and the weights, never on M or the row's position.
          No host reads: it captures in a CUDA graph.
    CPU   the dequantised product one row at a time, as BF16 batch-invariant mode does: W8 widened to
          fp32 once per call, then one `F.linear` per row on a fresh (allocator-aligned) fp32 copy of
          the row's codes, so every GEMM call has the same shape and alignment whatever the batch; the
          same epilogue as elementwise torch ops (exactly rounded, so position independent).

NOTE(fp8-bi): on Hopper, FP8 wgmma accumulates in less than fp32 inside an instruction, and triton's
default there (max_num_imprecise_acc = 2**30) never promotes. The kernel passes 0, so every wgmma's
partial sum (k = 32) is added to the fp32 accumulator: the precision of cuBLAS's FP8 GEMM without fast
accumulation (what `fp8_linear` runs), at the cost of one add per instruction.

The results are close to `fp8_linear` (the same operands, a different summation order), not its bits.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from vllm_omni.diffusion.layers.fp8 import Fp8Activation, Fp8LinearMethod
from vllm_omni.diffusion.layers.linear import Linear

FP8_MATMUL_CONFIG = (128, 128, 64, 8, 4)
"""(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): one tiling for every shape (changing it changes
the bits, still batch invariant). 4 stages of 128 x 64 e4m3 tiles of both operands are 64 KiB of shared
memory: within Ada's 99 KiB per block as well as Hopper's 227 KiB."""

GROUP_M = 8
"""Tile raster grouping (L2 reuse only: does not change any sum)."""


@functools.cache
def _matmul_kernel():
    """The Triton FP8 matmul; ValueError naming the fix when triton is missing."""
    try:
        import triton
        import triton.language as tl
    except ImportError as exc:
        raise ValueError(
            "batch-invariant FP8 on CUDA needs triton (shipped with CUDA builds of torch); install it, "
            "or unset VLLM_BATCH_INVARIANT or --quantization"
        ) from exc

    @triton.jit(do_not_specialize=["M"])
    def fp8_matmul_kernel(
        x_ptr, sx_ptr, w_ptr, sw_ptr, b_ptr, out_ptr, M, N, K,
        stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_on,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
    ):  # fmt: skip
        # out[M, N] = (x8[M, K] @ w8[N, K]^T) * sx[M, 1] * sw[N] (+ b[N]); one program per
        # (BLOCK_M, BLOCK_N) tile, no split-K. M is not specialised (M = 1 gets no kernel of its own).
        pid = tl.program_id(0)
        num_pid_m = tl.cdiv(M, BLOCK_M)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        group_size = GROUP * num_pid_n
        first_m = (pid // group_size) * GROUP
        rows_in_group = tl.minimum(num_pid_m - first_m, GROUP)
        pid_m = first_m + (pid % group_size) % rows_in_group
        pid_n = (pid % group_size) // rows_in_group
        offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        offs_k = tl.arange(0, BLOCK_K).to(tl.int64)
        # both operands K-major (x8 rows, w8 rows): the layout FP8 wgmma takes
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk  # [BM, BK]
        w_ptrs = w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk  # [BK, BN]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k_start in range(0, K, BLOCK_K):  # K reduced sequentially, same order for every row
            k_mask = offs_k < K - k_start
            a = tl.load(x_ptrs, mask=(offs_m[:, None] < M) & k_mask[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=k_mask[:, None] & (offs_n[None, :] < N), other=0.0)
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=0)  # NOTE(fp8-bi) in the module docstring
            x_ptrs += BLOCK_K * stride_xk
            w_ptrs += BLOCK_K * stride_wk
        sx = tl.load(sx_ptr + offs_m, mask=offs_m < M, other=0.0)  # [BM] fp32
        sw = tl.load(sw_ptr + offs_n, mask=offs_n < N, other=0.0)  # [BN] fp32
        acc = acc * sx[:, None] * sw[None, :]
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)

    return fp8_matmul_kernel


def _aligned(t: torch.Tensor) -> torch.Tensor:
    # one pointer alignment (triton specialises on 16 bytes), so one compiled variant for every call
    # (a request's rows or a merged member's slice may start anywhere)
    t = t.contiguous()
    return t.clone() if t.data_ptr() % 16 else t


def triton_fp8_matmul(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """`(xq @ weight^T) * x_scale * weight_scale + bias` through the fixed-tiling Triton kernel.

    Args:
        xq: [M, K] e4m3 (rows contiguous); x_scale: [M, 1] (or [M]) fp32.
        weight: [N, K] e4m3 (rows contiguous); weight_scale: [N] fp32; bias: [N] (any float dtype) or None.
        out_dtype: the output dtype (the activation dtype).
    Returns:
        [M, N] in out_dtype; row m depends only on xq[m], x_scale[m] and the weights. Runs on CUDA, or
        on CPU tensors under triton's interpreter (TRITON_INTERPRET=1).
    """
    kernel = _matmul_kernel()
    num_rows, k = xq.shape
    n = weight.shape[0]
    out = torch.empty((num_rows, n), dtype=out_dtype, device=xq.device)
    if num_rows == 0:
        return out
    xq, weight = _aligned(xq), _aligned(weight)
    x_scale, weight_scale = _aligned(x_scale.reshape(-1)), _aligned(weight_scale.reshape(-1))  # [M], [N]
    bias = _aligned(bias) if bias is not None else None
    block_m, block_n, block_k, num_warps, num_stages = FP8_MATMUL_CONFIG
    grid = (math.ceil(num_rows / block_m) * math.ceil(n / block_n),)
    kernel[grid](
        xq, x_scale, weight, weight_scale, bias if bias is not None else weight_scale, out, num_rows, n, k,
        xq.stride(0), xq.stride(1), weight.stride(0), weight.stride(1), out.stride(0), out.stride(1),
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP=GROUP_M,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out


def cpu_fp8_matmul(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """`triton_fp8_matmul`'s function on CPU, one row per GEMM call (same arguments, same [M, N] result
    up to summation order): see the module docstring."""
    n = weight.shape[0]
    w = weight.float()  # [N, K], exact: every e4m3 value is an fp32 value
    if xq.shape[0] == 0:
        return torch.empty((0, n), dtype=out_dtype)
    acc = torch.cat([F.linear(row.float(), w) for row in xq.split(1)])  # [M, N]; .float(): a fresh copy
    out = acc * x_scale.reshape(-1, 1) * weight_scale.reshape(1, n)
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def batch_invariant_fp8_linear(
    x: torch.Tensor | Fp8Activation,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """`fp8.fp8_linear` whose every output row depends only on its input row.

    Args:
        x: [..., K] in the activation dtype, or the same activation already quantised (`Fp8Activation`,
            from a fused producer): both give the same bits.
        weight: [N, K] e4m3; weight_scale: [N] fp32; bias: [N] or None.
    Returns:
        [..., N] in the activation dtype. Bitwise equal rows for any number of rows M (1, 7, 300, ...).
    """
    act = x if isinstance(x, Fp8Activation) else Fp8Activation.quantize(x)
    device = act.data.device.type
    if device == "cuda":
        matmul = triton_fp8_matmul
    elif device == "cpu":
        matmul = cpu_fp8_matmul
    else:
        raise ValueError(f"batch-invariant FP8 supports cpu and cuda devices, got {device}")
    out = matmul(act.data, act.scale, weight, weight_scale, bias, act.dtype)
    return out.view(*act.shape[:-1], weight.shape[0])


class BatchInvariantFp8LinearMethod(Fp8LinearMethod):
    """`Fp8LinearMethod` (same parameters, same quantisation, an `Fp8Activation` input accepted) with
    the product through `batch_invariant_fp8_linear`: its rows do not depend on the row count.

    Batch-invariant mode switches a loaded FP8 layer to it in place (`apply_batch_invariance`): the
    weights are already e4m3, so there is nothing to convert."""

    name = "fp8_batch_invariant"
    batch_invariant = True

    def apply(
        self, layer: Linear, x: torch.Tensor | Fp8Activation, bias: torch.Tensor | None
    ) -> torch.Tensor:
        return batch_invariant_fp8_linear(x, layer.weight, layer.weight_scale, bias)

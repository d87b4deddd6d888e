"""FP8 (W8A8) linears: e4m3 weights with per-output-channel scales, dynamic per-token activation scales.

    weight  W [N, K] (bf16 / fp32 as loaded)  ->  W8 [N, K] e4m3, sw [N] fp32      at load, once
    x       [M, K] (activation dtype)          ->  x8 [M, K] e4m3, sx [M, 1] fp32   every forward
    y       = _scaled_mm(x8, W8^T, sx, sw) in the activation dtype, + bias (high precision, after)

so y[m, n] = sx[m] * sw[n] * sum_k x8[m, k] * W8[n, k] (fp32 accumulation), with x ~ x8 * sx and
W ~ W8 * sw: symmetric, amax / 448 per row (448 is e4m3's largest finite value).

The activation arrives already quantised (`Fp8Activation`) from the kernel that produced it, where
that kernel is one of ours and fuses the quantisation; otherwise `apply` quantises x itself, in one
Triton pass on CUDA (`fp8_triton.py`, bit for bit `quantize_rows`), the torch ops elsewhere. Each
stream's q, k, v are merged at load (`merged_linear.py`): one quantisation and one `_scaled_mm` per
stream. This method declares `plain_gemm = False`, so the GELU epilogue and the joint-row out
projection (BF16 fast paths) call it.

NOTE(fp8): the fused producers. A producer emits an `Fp8Activation` only when
every consumer of its output `accepts_fp8_input(x)` (`Linear`, `MergedLinear`: this method, and no
active LoRA slot, since a delta needs the high-precision x) and its Triton kernel serves the device
(CUDA; elsewhere the unfused path). The Qwen-Image block's modulated LayerNorm kernels (its
`triton_ops.py`: before the merged QKV and the MLP up projection) and `fp8_triton`'s GELU kernel
(between an FP8 up projection and an FP8 down projection) do so, ending in
`fp8_triton.store_e4m3_row`, so their bits are `quantize_rows` of the unfused output (rounded to the
activation dtype first, as the unfused kernels store it); tests/test_fp8_fusion.py checks. Still
quantised in a pass of their own: the attention output before the out projections (written by the
attention backend's kernel) and every input of Qwen-Image-2.1's blocks.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from vllm_omni.diffusion.layers import fp8_triton
from vllm_omni.diffusion.layers.linear import Linear, LinearMethod

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)
"""448: the largest finite e4m3 value; a row's amax maps onto it."""
MIN_SCALE = 1e-12
"""Floor of a scale, so an all-zero row quantises to zeros instead of dividing by zero."""


def quantize_rows(x2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row e4m3: `x2d [M, K]` -> (q [M, K] e4m3, scale [M, 1] fp32), x ~ q * scale.

    NOTE(fp8): the exact operations are the Triton kernel's, so both give the same bits on every device:
    amax is divided by a tensor of 448, not by the Python number (torch computes a division by a Python
    number as a multiply by its reciprocal on CUDA, a true division on CPU), and x is multiplied by the
    row's IEEE reciprocal of the scale (one division per row, not per element: a per-element IEEE
    division made the kernel compute-bound)."""
    xf = x2d.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)  # [M, 1]
    scale = (amax / torch.full_like(amax, FP8_MAX)).clamp(min=MIN_SCALE)  # [M, 1]
    inv_scale = torch.ones_like(scale) / scale  # [M, 1], IEEE
    return (xf * inv_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def quantize_activation(x2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows` for a GEMM's input: the one-pass Triton kernel on CUDA (fp8_triton.py, the same
    bits), the torch ops elsewhere."""
    if x2d.is_cuda and fp8_triton.available():
        return fp8_triton.quantize_rows(x2d)
    return quantize_rows(x2d)


@functools.cache
def _cpu_scaled_mm_takes_row_scales() -> bool:
    """Whether this torch's CPU `_scaled_mm` takes per-row / per-column scales (2.13 does; 2.11
    allows only per-tensor scales on CPU). CUDA always does (SM89+)."""
    a = torch.zeros(2, 16).to(FP8_DTYPE)
    b = torch.zeros(16, 16).to(FP8_DTYPE).t()
    try:
        torch._scaled_mm(a, b, scale_a=torch.ones(2, 1), scale_b=torch.ones(1, 16), out_dtype=torch.float32)
    except RuntimeError:
        return False
    return True


@dataclass(frozen=True)
class Fp8Activation:
    """A linear's input already quantised per row, as its producer kernel emitted it (the modulated
    LayerNorm before QKV / MLP-up, the GELU before MLP-down): what `quantize_rows` returns for the
    activation, plus the activation's shape and dtype. An FP8 linear's `apply` takes it in place of x
    (`Linear.accepts_fp8_input`), so the GEMM pays no quantisation pass of its own."""

    data: torch.Tensor
    """[M, K] e4m3, contiguous: the activation's rows (M = the product of `shape[:-1]`)."""
    scale: torch.Tensor
    """[M, 1] fp32: x ~ data * scale."""
    shape: torch.Size
    """The activation's shape `[..., K]` (a linear's output is `[..., N]`)."""
    dtype: torch.dtype
    """The activation dtype: the GEMM's output dtype."""

    @classmethod
    def quantize(cls, x: torch.Tensor) -> Fp8Activation:
        """`x [..., K]` quantised in a pass of its own (`quantize_activation`): the unfused path."""
        data, scale = quantize_activation(x.reshape(-1, x.shape[-1]))
        return cls(data, scale, x.shape, x.dtype)


def fp8_linear(
    x: torch.Tensor | Fp8Activation,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """`x [..., K]` (bf16 / fp16 / fp32, or already an `Fp8Activation`) through e4m3 `weight [N, K]`
    with fp32 `weight_scale [N]`: per-token activation scales, fp32 accumulation, output `[..., N]` in
    the activation dtype, then the bias. A tensor x is quantised first (`quantize_activation`), so
    both forms of the same activation give the same bits."""
    act = x if isinstance(x, Fp8Activation) else Fp8Activation.quantize(x)
    xq, x_scale, dtype = act.data, act.scale, act.dtype
    n = weight.shape[0]
    out_shape = (*act.shape[:-1], n)
    if xq.shape[0] == 0:
        out = torch.empty((0, n), dtype=dtype, device=xq.device)
    elif xq.is_cuda and dtype == torch.bfloat16 and bias is not None and bias.dtype == dtype:
        # the bias in the GEMM's epilogue: a separate add is one more pass over [M, N] (a fifth of
        # the MLP up projection's GEMM time at 8192 rows)
        out = torch._scaled_mm(
            xq, weight.t(), scale_a=x_scale, scale_b=weight_scale.view(1, n), bias=bias, out_dtype=dtype
        )
        return out.view(out_shape)
    elif xq.is_cuda or _cpu_scaled_mm_takes_row_scales():
        # b must be column-major: weight [N, K] row-major, so weight.t() [K, N] is
        out = torch._scaled_mm(
            xq, weight.t(), scale_a=x_scale, scale_b=weight_scale.view(1, n), out_dtype=dtype
        )
    else:  # an older torch's CPU kernel: the same product, dequantised, in fp32
        w = weight.float() * weight_scale.view(n, 1)
        out = ((xq.float() * x_scale) @ w.t()).to(dtype)
    if bias is not None:
        out = out + bias
    return out.view(out_shape)


class Fp8LinearMethod(LinearMethod):
    """W8A8 e4m3 (see the module docstring). Created like the unquantized method (the checkpoint's
    high-precision `weight` / `bias`); `process_weights_after_loading` quantises the weight once."""

    name = "fp8"
    accepts_fp8_activation = True
    param_dims: ClassVar[dict[str, tuple[int | None, int | None]]] = {
        "weight": (0, 1),
        "bias": (0, None),
        "weight_scale": (0, None),  # per output channel: a column shard slices it, a row shard keeps it
    }
    layer_attrs: ClassVar[tuple[str, ...]] = ("fp8_out_dtype",)

    def process_weights_after_loading(self, layer: Linear) -> None:
        weight = layer.weight
        if weight.dtype == FP8_DTYPE:  # already quantised (e.g. a tensor-parallel shard's copy)
            return
        if weight.is_meta:
            raise ValueError("fp8: quantize after the weights are loaded (the layer is on the meta device)")
        if not weight.is_floating_point() or weight.element_size() < 2:
            raise ValueError(f"fp8: cannot quantize a {weight.dtype} weight; load BF16 / FP16 / FP32 weights")
        with torch.no_grad():
            q, scale = quantize_rows(weight.detach())  # per output channel = per row of [N, K]
        layer.fp8_out_dtype = weight.dtype
        layer.weight = nn.Parameter(q, requires_grad=False)
        layer.weight_scale = nn.Parameter(scale.view(-1), requires_grad=False)  # [N] fp32

    def apply(
        self, layer: Linear, x: torch.Tensor | Fp8Activation, bias: torch.Tensor | None
    ) -> torch.Tensor:
        return fp8_linear(x, layer.weight, layer.weight_scale, bias)

    def compute_dtype(self, layer: Linear) -> torch.dtype:
        return layer.fp8_out_dtype

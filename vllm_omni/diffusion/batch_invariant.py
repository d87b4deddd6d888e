"""Batch-invariant mode (`VLLM_BATCH_INVARIANT=1`): a request's image does not depend on its batch.

A packed step runs every layer over the rows of all running requests at once, so a request's rows
pass through kernels whose *shape* (row count M, number of sequences) changes with the batch. Kernels
pick tilings, split-K/split-reduction factors and SIMD tails from the shape, so the same row can be
summed in a different order and come out a few ulps apart. This module removes every such dependency
from a family's transformer (the norms its plans list):

    op                     default kernel's dependency on the batch        replacement here
    Linear (GEMM)          cuBLAS/MKL pick tiles, split-K, GEMV for M=1    fixed-tile product, K in order
    RMSNorm (mean(x^2))    CUDA reduce config depends on the row count     one program per row (Triton) /
                           (block width for < 16 rows); CPU splits a row   fixed-size row chunks (CPU)
                           across threads when there are few rows
    GELU-tanh, SiLU, ...   CPU: SIMD main loop vs scalar tail give         (CPU) fixed-size chunks with
                           different bits; which elements land in the      no tail, so every element takes
                           tail depends on the tensor size                 the vectorised path
    attention              varlen kernels may split KV by batch size       one SDPA call per sequence
    LayerNorm, elementwise row-local already (one row per block / thread;   kept
    (CUDA), index ops      CUDA elementwise code is the same per element)

How the products are made invariant:

    CUDA  one Triton kernel, one tiling (BLOCK_M x BLOCK_N tiles, BLOCK_K steps), no split-K: every
          output element is acc += x[m, k:k+BK] . w[n, k:k+BK] for k = 0, BK, 2BK, ... in fp32, so a
          row's result depends only on that row and the weights, never on M or the row's position.
    CPU   one `F.linear` per row, on a fresh aligned copy of the row: every call has the same shape
          and alignment whatever the batch (fixed 32-row chunks were bit-invariant on the CI CPU but
          not on another x86 host's CPU, where a row's position inside the chunk changed its bits).
    FP8   (`--quantization fp8`) the same two constructions over e4m3 operands, the per-row activation
          quantisation kept (it is row-local): `layers/fp8_batch_invariant.py`.

`make_batch_invariant(transformer)` applies all of it in place (each `Linear` switches its quant method
to its invariant twin, `INVARIANT_METHODS`; parameters, names and state_dict keys unchanged) and installs
`BatchInvariantAttentionBackend`. The runner completes the guarantee: packed path only, each prompt
encoded alone, each image decoded alone, a seed per request.
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from vllm_omni.diffusion.attention.backends.base import AttentionBackend
from vllm_omni.diffusion.attention.metadata import AttentionMetadata
from vllm_omni.diffusion.layers.fp8 import Fp8LinearMethod
from vllm_omni.diffusion.layers.fp8_batch_invariant import BatchInvariantFp8LinearMethod
from vllm_omni.diffusion.layers.linear import Linear, LinearMethod, UnquantizedLinearMethod, foreign_linears
from vllm_omni.diffusion.layers.merged_linear import merge_linears

CPU_ELEMENTWISE_CHUNK = 8192
"""Elements per CPU elementwise call: a multiple of every SIMD loop width (2 x 64 bytes) and below
torch's parallel grain (32768), so each call runs on one thread with no scalar tail."""

CPU_REDUCTION_CHUNK = 16384
"""Most elements per CPU row-reduction call: below torch's parallel grain, so no row is split across
threads (torch splits rows when there are fewer rows than threads)."""

TRITON_MATMUL_CONFIG = {
    # dtype -> (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages); one tiling per dtype, never per shape
    torch.bfloat16: (128, 128, 64, 8, 3),
    torch.float16: (128, 128, 64, 8, 3),
    torch.float32: (64, 64, 32, 4, 3),
}
"""Fixed CUDA tilings: changing one changes the bits (still batch invariant), not the guarantee."""

GROUP_M = 8
"""Tile raster grouping (L2 reuse only: does not change any sum)."""


# ---- CUDA kernels (built on first use: importing this module never needs triton) ----------------


@functools.cache
def _triton_kernels():
    """The Triton matmul and RMSNorm kernels; ValueError naming the fix when triton is missing."""
    try:
        import triton
        import triton.language as tl
    except ImportError as exc:
        raise ValueError(
            "batch-invariant mode on CUDA needs triton (shipped with CUDA builds of torch); "
            "install it or unset VLLM_BATCH_INVARIANT"
        ) from exc

    @triton.jit(do_not_specialize=["M"])
    def matmul_kernel(
        x_ptr, w_ptr, b_ptr, out_ptr, M, N, K,
        stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_on,
        HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
    ):  # fmt: skip
        # out[M, N] = x[M, K] @ w[N, K]^T (+ b[N]); one program per (BLOCK_M, BLOCK_N) tile, no split-K.
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
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk  # [BM, BK]
        w_ptrs = w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk  # [BK, BN]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k_iter in range(0, tl.cdiv(K, BLOCK_K)):  # K reduced sequentially, same order for every row
            k_mask = offs_k < K - k_iter * BLOCK_K
            a = tl.load(x_ptrs, mask=(offs_m[:, None] < M) & k_mask[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=k_mask[:, None] & (offs_n[None, :] < N), other=0.0)
            if IEEE:  # fp32 inputs: true fp32 products, as torch's default (no TF32)
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
            x_ptrs += BLOCK_K * stride_xk
            w_ptrs += BLOCK_K * stride_wk
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def rms_norm_kernel(
        x_ptr, w_ptr, out_ptr, N, stride_x, stride_out, eps,
        HAS_WEIGHT: tl.constexpr, ROUND_BEFORE_WEIGHT: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        # One program per row: sum of squares over fixed BLOCK chunks in order, then one tree sum.
        row = tl.program_id(0).to(tl.int64)
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, N, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + row * stride_x + cols, mask=cols < N, other=0.0).to(tl.float32)
            acc += x * x
        rstd = 1.0 / tl.sqrt_rn(tl.sum(acc, axis=0) / N + eps)
        for start in range(0, N, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + row * stride_x + cols, mask=cols < N, other=0.0).to(tl.float32)
            y = x * rstd
            if HAS_WEIGHT:
                w = tl.load(w_ptr + cols, mask=cols < N, other=0.0)
                if ROUND_BEFORE_WEIGHT:  # half weights: round to the weight dtype first (diffusers)
                    y = y.to(w.dtype).to(tl.float32)
                y = y * w.to(tl.float32)
            tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=cols < N)

    return matmul_kernel, rms_norm_kernel


def triton_linear(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`x2d [M, K] @ weight[N, K]^T + bias[N]` through the fixed-tiling Triton kernel -> [M, N]."""
    matmul_kernel, _ = _triton_kernels()
    num_rows, k = x2d.shape
    n = weight.shape[0]
    out = torch.empty((num_rows, n), dtype=x2d.dtype, device=x2d.device)
    if num_rows == 0:
        return out
    block_m, block_n, block_k, num_warps, num_stages = TRITON_MATMUL_CONFIG[x2d.dtype]
    grid = (math.ceil(num_rows / block_m) * math.ceil(n / block_n),)
    matmul_kernel[grid](
        x2d, weight, bias if bias is not None else weight, out, num_rows, n, k,
        x2d.stride(0), x2d.stride(1), weight.stride(0), weight.stride(1), out.stride(0), out.stride(1),
        HAS_BIAS=bias is not None, IEEE=x2d.dtype == torch.float32,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP=GROUP_M,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out


def triton_rms_norm(x2d: torch.Tensor, weight: torch.Tensor | None, eps: float, out_dtype) -> torch.Tensor:
    """Row-wise RMSNorm of contiguous-row `x2d [M, N]`, one Triton program per row -> [M, N]."""
    _, rms_norm_kernel = _triton_kernels()
    num_rows, n = x2d.shape
    out = torch.empty((num_rows, n), dtype=out_dtype, device=x2d.device)
    if num_rows == 0:
        return out
    block = min(4096, 1 << (n - 1).bit_length())
    rms_norm_kernel[(num_rows,)](
        x2d, weight if weight is not None else x2d, out, n, x2d.stride(0), out.stride(0), eps,
        HAS_WEIGHT=weight is not None,
        ROUND_BEFORE_WEIGHT=weight is not None and weight.dtype in (torch.float16, torch.bfloat16),
        BLOCK=block, num_warps=4 if block <= 1024 else 8,
    )  # fmt: skip
    return out


# ---- the invariant ops --------------------------------------------------------------------------


def _cpu_linear(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # One `F.linear` per row, each on a fresh (allocator-aligned) copy of that row: the call's shape,
    # alignment and data never depend on the other rows. A fixed-size row *chunk* is not enough on
    # every CPU: on one x86 host a row's bits changed with its position inside the chunk.
    if x2d.shape[0] == 0:
        return F.linear(x2d, weight, bias)
    return torch.cat([F.linear(row.clone(), weight, bias) for row in x2d.split(1)])  # [M, N]


def batch_invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` whose every output row depends only on its input row.

    Args:
        x: [..., K] (any strides); weight [N, K]; bias [N] or None; one dtype for all three.
    Returns:
        [..., N] in x's dtype. Bitwise equal rows for any number of rows M (1, 7, 300, ...).
    """
    if x.dtype != weight.dtype:
        raise ValueError(
            f"batch-invariant linear needs x and weight of one dtype, got {x.dtype} and {weight.dtype}"
        )
    x2d = x.reshape(-1, x.shape[-1])
    if x.device.type == "cuda":
        x2d = x2d.contiguous()
        if x2d.data_ptr() % 16:  # one alignment, so one compiled kernel variant, for every call
            x2d = x2d.clone()
        out = triton_linear(x2d, weight, bias)
    elif x.device.type == "cpu":
        out = _cpu_linear(x2d, weight, bias)
    else:
        raise ValueError(f"batch-invariant mode supports cpu and cuda devices, got {x.device.type}")
    return out.view(*x.shape[:-1], weight.shape[0])


def _rms_norm_rows(x2d: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    # Our transformer's RMSNorm (diffusers' casting rules), op for op.
    variance = x2d.to(torch.float32).pow(2).mean(-1, keepdim=True)
    y = x2d * torch.rsqrt(variance + eps)
    if weight is None:
        return y.to(x2d.dtype)
    if weight.dtype in (torch.float16, torch.bfloat16):
        y = y.to(weight.dtype)
    return y * weight


def batch_invariant_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim (fp32 variance, diffusers' casting rules), computed row by row.

    CPU: torch's own ops on chunks of whole rows small enough never to be split across threads
    (bit-identical to the unpatched module). CUDA: one Triton program per row.
    """
    n = x.shape[-1]
    x2d = x.reshape(-1, n)
    if x.device.type == "cuda":
        if weight is None:
            out_dtype = x.dtype
        elif weight.dtype in (torch.float16, torch.bfloat16):
            out_dtype = weight.dtype
        else:
            out_dtype = torch.promote_types(torch.promote_types(x.dtype, torch.float32), weight.dtype)
        out = triton_rms_norm(x2d.contiguous(), weight, eps, out_dtype)
    else:
        rows_per_call = max(1, CPU_REDUCTION_CHUNK // n)
        out = torch.cat([_rms_norm_rows(part, weight, eps) for part in x2d.split(rows_per_call)])
    return out.view(x.shape)


CPU_CHUNKED_FUNCTIONS = frozenset(
    {
        F.silu, F.gelu, F.sigmoid, F.tanh, torch.sigmoid, torch.tanh, torch.exp, torch.sin, torch.cos,
        torch.Tensor.sigmoid, torch.Tensor.tanh, torch.Tensor.exp, torch.Tensor.sin, torch.Tensor.cos,
    }
)  # fmt: skip
"""Elementwise functions whose CPU SIMD and scalar code give different bits (e.g. GELU-tanh, SiLU)."""


def _cpu_fixed_chunks(func, x: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
    kwargs = dict(kwargs)
    inplace = bool(kwargs.pop("inplace", False))
    flat = x.reshape(-1)
    size = flat.numel()
    chunk = CPU_ELEMENTWISE_CHUNK
    padded = flat.new_zeros(max(1, -(-size // chunk)) * chunk)
    padded[:size] = flat
    out = torch.cat([func(part, *args, **kwargs) for part in padded.split(chunk)])[:size].view(x.shape)
    return x.copy_(out) if inplace else out


class CpuElementwiseMode(TorchFunctionMode):
    """Runs `CPU_CHUNKED_FUNCTIONS` on CPU tensors in fixed chunks with no SIMD tail.

    Without it, the elements that fall in the scalar tail of a vectorised CPU loop (which ones
    depends on the tensor's size, i.e. on the batch) get different bits from GELU-tanh and SiLU.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in CPU_CHUNKED_FUNCTIONS and args:
            x = args[0]
            if isinstance(x, torch.Tensor) and x.device.type == "cpu" and x.is_floating_point():
                return _cpu_fixed_chunks(func, x, args[1:], kwargs)
        return func(*args, **kwargs)


# ---- modules ------------------------------------------------------------------------------------


class BatchInvariantLinearMethod(LinearMethod):
    """A `Linear`'s GEMM through `batch_invariant_linear`: its rows do not depend on the row count.

    Same parameters as the unquantized method (nothing to convert): batch-invariant mode switches a
    loaded layer to it in place (`apply_batch_invariance`).
    """

    name = "batch_invariant"
    batch_invariant = True

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return batch_invariant_linear(x, layer.weight, bias)


class _BatchInvariantRMSNorm:
    """Mixin put in front of an RMSNorm class: forward through `batch_invariant_rms_norm`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return batch_invariant_rms_norm(x, self.weight, self.eps)


@functools.cache
def _invariant_rms_class(cls: type) -> type:
    return type(f"BatchInvariant{cls.__name__}", (_BatchInvariantRMSNorm, cls), {})


INVARIANT_METHODS: dict[type[LinearMethod], type[LinearMethod]] = {
    UnquantizedLinearMethod: BatchInvariantLinearMethod,
    Fp8LinearMethod: BatchInvariantFp8LinearMethod,  # same e4m3 weights and scales, invariant product
}
"""A linear's method (exact type) -> the batch-invariant method over the same parameters."""


def apply_batch_invariance(model: nn.Module) -> int:
    """Switch every `Linear` of `model` to its method's invariant twin (`INVARIANT_METHODS`), in place;
    returns how many changed.

    Idempotent (already invariant linears are not counted). Raises ValueError naming the module for a
    torch `nn.Linear` (its GEMM cannot be switched) and for a `Linear` whose method has no invariant
    twin (no invariant kernel for its weight format), either of which would silently stay variant.
    """
    for name, module in foreign_linears(model).items():
        raise ValueError(
            f"module {name!r} is a {type(module).__name__} (torch's nn.Linear), not the model's Linear "
            "layer, so batch-invariant mode cannot make it invariant; unset VLLM_BATCH_INVARIANT or "
            "build the model from vllm_omni.diffusion.layers.linear.Linear"
        )
    count = 0
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            method = module.quant_method
            if method.batch_invariant:
                continue
            invariant = INVARIANT_METHODS.get(type(method))
            if invariant is None:
                raise ValueError(
                    f"module {name!r} is a {method.name} linear, which batch-invariant mode cannot make "
                    f"invariant (it can: {', '.join(m.name for m in INVARIANT_METHODS)}); unset "
                    "VLLM_BATCH_INVARIANT or serve without that quantization"
                )
            module.set_quant_method(invariant())
            count += 1
    merge_linears(model)  # merged projections run the invariant GEMM over their stacked weights
    return count


def apply_batch_invariant_norms(model: nn.Module, norms: tuple[type, ...]) -> int:
    """Route every module of `model` that is one of the `norms` classes (the family's
    `plans.invariant_norms`: RMS norms with `weight` and `eps`) through `batch_invariant_rms_norm`, in
    place; returns the count."""
    count = 0
    for module in model.modules():
        if isinstance(module, norms) and not isinstance(module, _BatchInvariantRMSNorm):
            module.__class__ = _invariant_rms_class(type(module))
            count += 1
    return count


# ---- attention ----------------------------------------------------------------------------------


class BatchInvariantAttentionBackend(AttentionBackend):
    """Packed attention as one SDPA call per sequence, on a fresh contiguous `[1, H, n, D]` copy.

    A sequence's call sees only that sequence, laid out the same way wherever it sits in the packed
    buffer, so SDPA's kernel choice and its reduction order are those of the request served alone.
    Slower than one varlen call for many short sequences; exact.
    """

    name: ClassVar[str] = "BATCH_INVARIANT_SDPA"
    supports_varlen: ClassVar[bool] = True
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32, torch.float16, torch.bfloat16)
    supported_devices: ClassVar[tuple[str, ...]] = ("cpu", "cuda")

    @staticmethod
    def _one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # [n, H, D] each -> [n, H, D]
        q, k, v = (t.transpose(0, 1).unsqueeze(0).contiguous() for t in (q, k, v))  # [1, H, n, D]
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=False)[0].transpose(0, 1)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        self.check_inputs(q, k, v, metadata)
        out = torch.empty_like(q)
        if not metadata.is_varlen:  # dense [B, S, H, D]: each item alone, its padding keys dropped
            for b in range(q.shape[0]):
                keep = slice(None) if metadata.attn_mask is None else metadata.attn_mask[b]
                out[b] = self._one(q[b], k[b][keep], v[b][keep])
            return out
        start = start_k = 0
        # a sequence's keys / values may outnumber its queries (`seq_lens_k`: a cached prefix's rows)
        for n, n_k in zip(metadata.seq_lens, metadata.seq_lens_k, strict=True):
            end, end_k = start + n, start_k + n_k
            out[start:end] = self._one(q[start:end], k[start_k:end_k], v[start_k:end_k])
            start, start_k = end, end_k
        return out


# ---- the whole transformer ----------------------------------------------------------------------


@dataclass(frozen=True)
class BatchInvariantSummary:
    """What `make_batch_invariant` changed."""

    num_linears: int
    num_rms_norms: int
    attention_backend: str


def _params_on_cpu(model: nn.Module) -> bool:
    param = next(model.parameters(), None)
    return param is not None and param.device.type == "cpu"


def _cpu_elementwise_in_chunks(model: nn.Module, forward: Callable) -> Callable:
    """`forward` (a bound forward of `model`) with CPU elementwise activations in fixed chunks."""

    @functools.wraps(forward)
    def wrapped(*args, **kwargs):
        if not _params_on_cpu(model):  # CUDA elementwise kernels are already position independent
            return forward(*args, **kwargs)
        with CpuElementwiseMode():
            return forward(*args, **kwargs)

    return wrapped


_INVARIANT_MODELS: weakref.WeakSet[nn.Module] = weakref.WeakSet()
"""The transformers `make_batch_invariant` has been applied to."""


def is_batch_invariant(transformer: nn.Module) -> bool:
    """Whether `make_batch_invariant` has been applied to `transformer`."""
    return transformer in _INVARIANT_MODELS


def make_batch_invariant(transformer: nn.Module) -> BatchInvariantSummary:
    """Put a family's transformer in batch-invariant mode, in place (idempotent).

    Switches every `Linear` to its invariant method (plain or FP8), re-classes the norms its plan lists
    (`plans.invariant_norms`), runs CPU elementwise activations in fixed chunks, switches the blocks'
    fused elementwise ops back to eager, and sets `transformer.attn_backend` to
    `BatchInvariantAttentionBackend()`. Parameters and state_dict keys are unchanged.
    """
    if any(p.device.type == "cuda" for p in transformer.parameters()):
        _triton_kernels()  # fail now, not in the first step, when triton is missing
    num_linears = apply_batch_invariance(transformer)
    num_norms = apply_batch_invariant_norms(transformer, transformer.plans.invariant_norms)
    transformer.attn_backend = BatchInvariantAttentionBackend()
    # NOTE(bi): compiled fused ops specialise on shapes (e.g. a batch of one sequence gets its own
    # kernel), so a row's bits could depend on the batch; the eager chains are row-local.
    transformer.disable_compile()
    if not is_batch_invariant(transformer):
        transformer.forward = _cpu_elementwise_in_chunks(transformer, transformer.forward)
        transformer.forward_packed = _cpu_elementwise_in_chunks(transformer, transformer.forward_packed)
        _INVARIANT_MODELS.add(transformer)
    return BatchInvariantSummary(num_linears, num_norms, BatchInvariantAttentionBackend.name)

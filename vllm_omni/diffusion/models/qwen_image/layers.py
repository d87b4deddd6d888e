"""Building blocks of the Qwen-Image transformer: norms, MLP, timestep embedding.

Math ported from diffusers' `QwenImageTransformer2DModel` (models/transformers/transformer_qwenimage.py);
module and parameter names match its state dict.
"""

from __future__ import annotations

import logging
import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from vllm_omni.diffusion.layers import fp8_triton
from vllm_omni.diffusion.layers.fp8 import Fp8Activation
from vllm_omni.diffusion.layers.linear import Linear
from vllm_omni.diffusion.layers.paired_linear import paired_linear

logger = logging.getLogger(__name__)


def timestep_sinusoid(timestep: torch.Tensor, num_channels: int = 256) -> torch.Tensor:
    """fp32 `[N, num_channels]` [cos | sin] embedding of `timestep [N]` (already / 1000; scaled by 1000).

    diffusers' `Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=0, scale=1000)`, same op order.
    """
    half = num_channels // 2
    exponent = -math.log(10000) * torch.arange(half, dtype=torch.float32, device=timestep.device) / half
    angles = 1000 * (timestep[:, None].float() * torch.exp(exponent)[None, :])  # [N, half]
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)


def scale_plus_one(mod: torch.Tensor, num_chunks: int, scale_chunks: tuple[int, ...]) -> torch.Tensor:
    """Add 1 to the scale chunks of per-sequence modulation `[num_seqs, num_chunks * C]` (one small op,
    before the broadcast to rows, instead of one `1 + scale` per row tensor).

    NOTE(graphs): integer indexing only (a fill kernel per chunk): indexing with a Python list builds a
    host index tensor and copies it to the device, which CUDA graph capture refuses.
    """
    chunk = mod.shape[-1] // num_chunks
    one = torch.zeros(num_chunks, chunk, dtype=mod.dtype, device=mod.device)
    for i in scale_chunks:
        one[i] = 1
    return mod + one.flatten()


class RMSNorm(nn.Module):
    """RMSNorm with weight; variance in fp32, diffusers' casting rules."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            # One fused kernel instead of ~8 (fp32 inside; may differ from diffusers by 1 ulp in bf16).
            return F.rms_norm(x, (x.shape[-1],), self.weight.to(x.dtype), self.eps)
        variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            x = x.to(self.weight.dtype)
        return x * self.weight


class GELUTanhProj(nn.Module):
    """Linear then tanh-approximate GELU (diffusers' `GELU(approximate="tanh")`, weights under `proj`)."""

    cublas_epilogue: ClassVar[bool] = True
    """On CUDA, GELU inside the GEMM (cuBLASLt epilogue); benchmarks turn it off to measure it."""
    fuse_fp8: ClassVar[bool] = False
    """Emit the output quantised for an FP8 consumer from one GELU + quantisation kernel. Off:
    NOTE(perf): that kernel (one program per 12288-wide row, a quarter of its 16384 lanes masked, tanh in
    every lane) made GELU + down slower than `F.gelu` followed by the one-pass quantisation at 8192 rows
    (docs/quantization.md).
    The tests and the benchmark turn it on."""
    fused_fp8_failed: ClassVar[bool] = False
    """Set when the GELU + FP8 quantisation kernel raised once: the process runs it unfused after."""

    def __init__(self, dim_in: int, dim_out: int):
        super().__init__()
        self.proj = Linear(dim_in, dim_out)

    def forward(
        self, x: torch.Tensor | Fp8Activation, quantize_for: Linear | None = None
    ) -> torch.Tensor | Fp8Activation:
        """[..., dim_in] -> GELU output [..., dim_out]; x may be an `Fp8Activation` when `proj` takes
        one. `quantize_for`: the linear that consumes the output; with `fuse_fp8` the output comes
        quantised for it (GELU and the per-row quantisation in one Triton pass) where it takes an FP8
        input and the kernel serves the device, else in x's dtype."""
        proj = self.proj
        # the epilogue computes proj itself: only while proj is exactly a plain GEMM for x (a LoRA delta
        # must come before the GELU; a quantized or batch-invariant method runs its own GEMM)
        plain = isinstance(x, torch.Tensor) and proj.runs_plain_gemm(x)
        if self.cublas_epilogue and plain and x.is_cuda and proj.bias is not None:
            # cuBLASLt's GELU epilogue (the tanh approximation) inside the GEMM: saves writing and
            # re-reading the [rows, 4 * hidden] activations (about 9 % faster at 4096 rows).
            rows = x.reshape(-1, x.shape[-1])
            out = torch._addmm_activation(proj.bias, rows, proj.weight.t(), use_gelu=True)
            return out.view(*x.shape[:-1], out.shape[-1])
        if (
            isinstance(x, torch.Tensor)
            and proj.adds_lora_delta(x)
            and not self.quantizes_for(x, quantize_for)
        ):
            # the GELU after proj's LoRA deltas, inside their expand kernel where it runs
            return proj(x, activation="gelu_tanh")
        return self.gelu(proj(x), quantize_for)

    @staticmethod
    def quantizes_for(x: torch.Tensor, quantize_for: Linear | None) -> bool:
        """Whether the output for x (the input, or the output: the same rows) comes quantised for
        `quantize_for` from the fused GELU + FP8 kernel (`fuse_fp8`, a consumer that takes FP8 in this
        forward, the kernel serving x's device)."""
        fuse = quantize_for is not None and GELUTanhProj.fuse_fp8 and not GELUTanhProj.fused_fp8_failed
        return fuse and fp8_triton.serves(x) and quantize_for.accepts_fp8_input(x)

    def gelu(self, h: torch.Tensor, quantize_for: Linear | None = None) -> torch.Tensor | Fp8Activation:
        """GELU of `proj`'s output h [..., dim_out] (its LoRA deltas added), quantised for `quantize_for`
        as `forward` says."""
        if self.quantizes_for(h, quantize_for):
            try:
                q, scale = fp8_triton.gelu_tanh_quantize_rows(h.reshape(-1, h.shape[-1]))
                return Fp8Activation(q, scale, h.shape, h.dtype)
            except Exception:
                # as the block ops' kernels: a kernel that fails to compile (it first runs in the eager
                # warm-up, before any capture) must not take requests down; the down projection then
                # quantises its own input
                GELUTanhProj.fused_fp8_failed = True
                logger.exception("the fused GELU + FP8 quantisation kernel failed; running it unfused")
        return F.gelu(h, approximate="tanh")


class FeedForward(nn.Module):
    """4x MLP with GELU-tanh; `net.0.proj` / `net.2` as in diffusers (net.1 is its parameterless dropout)."""

    def __init__(self, dim: int, mult: int = 4):
        super().__init__()
        self.net = nn.ModuleList([GELUTanhProj(dim, dim * mult), nn.Identity(), Linear(dim * mult, dim)])

    def accepts_fp8_input(self, x: torch.Tensor) -> bool:
        """`Linear.accepts_fp8_input` of the up projection (the norm before it may emit FP8)."""
        return self.net[0].proj.accepts_fp8_input(x)

    def forward(self, x: torch.Tensor | Fp8Activation) -> torch.Tensor:
        up, down = self.net[0], self.net[2]
        return down(up(x, quantize_for=down))  # net.1 (dropout) is the identity


def paired_feed_forward(
    first: FeedForward, first_x: torch.Tensor, second: FeedForward, second_x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(first(first_x), second(second_x)) for two streams' MLPs of one shape, interleaved so that each
    projection's two LoRA deltas run as one launch pair (`paired_linear`): both ups (the GELU after
    their deltas), then both downs. Without deltas on both ups, each up is its own call (the cuBLASLt
    GELU epilogue, the fused FP8 output)."""
    (up, down), (other_up, other_down) = (first.net[0], first.net[2]), (second.net[0], second.net[2])
    if up.proj.adds_lora_delta(first_x) and other_up.proj.adds_lora_delta(second_x):
        if up.quantizes_for(first_x, down) or other_up.quantizes_for(second_x, other_down):
            h, other_h = paired_linear(up.proj, first_x, other_up.proj, second_x)  # [..., 4 * dim] each
            h, other_h = up.gelu(h, quantize_for=down), other_up.gelu(other_h, quantize_for=other_down)
        else:  # the GELU inside the deltas' expand launch
            h, other_h = paired_linear(up.proj, first_x, other_up.proj, second_x, activation="gelu_tanh")
    else:
        h, other_h = up(first_x, quantize_for=down), other_up(second_x, quantize_for=other_down)
    return paired_linear(down, h, other_down, other_h)


class TimestepEmbedder(nn.Module):
    """linear_1 -> SiLU -> linear_2 (diffusers' `TimestepEmbedding`)."""

    def __init__(self, in_channels: int, dim: int):
        super().__init__()
        self.linear_1 = Linear(in_channels, dim)
        self.linear_2 = Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


class TimeTextEmbed(nn.Module):
    """Timestep -> conditioning vector `temb` (diffusers' `QwenTimestepProjEmbeddings`)."""

    def __init__(self, dim: int, num_channels: int = 256):
        super().__init__()
        self.num_channels = num_channels
        self.timestep_embedder = TimestepEmbedder(num_channels, dim)

    def forward(self, timestep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # [N] -> [N, 256] fp32 -> [N, hidden] in the activation dtype
        return self.timestep_embedder(timestep_sinusoid(timestep, self.num_channels).to(dtype))

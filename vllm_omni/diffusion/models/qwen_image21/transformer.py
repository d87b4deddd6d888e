"""Qwen-Image-2.1's transformer: a prefill of each request's prefix, then packed steps over image rows.

Ported from diffusers 0.42.1 `transformer_qwenimage21.py` (same parameter names, same math); the
forward is cut differently. One sequence (a request's prompt, or its negative prompt with CFG) is

    [ prefix: text rows (causal, modulated from t = 0) ; target image rows (bidirectional, its own t) ]

and the mask is block-causal: a prefix row sees the prefix rows before it, an image row sees the whole
prefix and its whole image. Prefix rows never see image rows and are modulated from t = 0, so their
keys and values at every layer do not depend on the step: `prefill` computes them once (at admission)
into a `PrefixKV`, and every step runs only the image rows, attending to [cached prefix ; own image]:

    queries  (image rows):       | img 0 .... | img 1 .. | img 2 ...... |
    cu_seqlens_q:                0            ^          ^              ^
    keys / values, per layer:    | pre 0 | img 0 .... | pre 1 | img 1 .. | pre 2 | img 2 ...... |
    cu_seqlens_k:                0                    ^                  ^                       ^

`forward_packed` takes the runner's `PackedLayout` (image rows, per-sequence timestep, RoPE tables from
`Rope21`) and finds each sequence's prefix in `prefix_cache` by (req_id, is_negative). The step's
attention is one varlen call with those two boundary lists (`AttentionMetadata.kv_seq_lens`): FA3 / FA2
varlen on CUDA, per-sequence SDPA elsewhere, chosen like Qwen-Image's (`--attention-backend`, AUTO).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, fields
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from vllm_omni.diffusion.attention import AttentionBackend, AttentionMetadata, backend_class, get_attn_backend
from vllm_omni.diffusion.attention.metadata import build_varlen_metadata
from vllm_omni.diffusion.layers.linear import Linear
from vllm_omni.diffusion.layers.merged_linear import HasMergedLinears
from vllm_omni.diffusion.layout import PackedLayout, SequenceSpec
from vllm_omni.diffusion.models.interface import GraphContextAxis
from vllm_omni.diffusion.models.plans import TransformerPlans
from vllm_omni.diffusion.models.qwen_image.layers import RMSNorm
from vllm_omni.diffusion.models.qwen_image21.fused_ops import Block21Ops, Modulation
from vllm_omni.diffusion.models.qwen_image21.graphs import ARENA_PREFIX_ROW_BUCKETS, PrefixStepGraphs
from vllm_omni.diffusion.models.qwen_image21.plans import QWEN_IMAGE21_PLANS
from vllm_omni.diffusion.models.qwen_image21.prefill_attention import prefill_attention
from vllm_omni.diffusion.models.qwen_image21.prefix import PrefixPlan, plan_prefix
from vllm_omni.diffusion.models.qwen_image21.prefix_arena import PrefixArena, arena_rows
from vllm_omni.diffusion.models.qwen_image21.prefix_cache import PrefixCache, PrefixKV, prefix_num_bytes
from vllm_omni.diffusion.models.qwen_image21.rope import Rope21, image_positions, prefix_positions, rope_table

LoRAScope = Callable[[int, int], AbstractContextManager]
"""`scope(num_img_rows, num_txt_rows)`: the context in which the transformer's LoRA linears apply one
sequence's adapter to a forward of that many image-stream and text-stream rows (and one
per-sequence row); the pipeline makes it from the request's adapter (`pipeline.prefill_lora`)."""


def _no_lora(num_img_rows: int, num_txt_rows: int) -> AbstractContextManager:
    return contextlib.nullcontext()


# ---------------------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class QwenImage21TransformerConfig:
    """`transformer/config.json` of a Qwen-Image-2.1 checkpoint (diffusers' constructor arguments)."""

    patch_size: int = 1
    in_channels: int = 64
    out_channels: int = 64
    num_layers: int = 32
    attention_head_dim: int = 128
    num_attention_heads: int = 32
    context_in_dim: int = 4096
    mlp_ratio: int = 3
    axes_dims_rope: tuple[int, int, int] = (16, 56, 56)
    eps: float = 1e-6
    causal_condition: bool = True

    def __post_init__(self) -> None:
        if sum(self.axes_dims_rope) != self.attention_head_dim:
            raise ValueError(
                f"axes_dims_rope {self.axes_dims_rope} must sum to attention_head_dim "
                f"{self.attention_head_dim}"
            )

    @classmethod
    def from_dict(cls, config: dict) -> QwenImage21TransformerConfig:
        """From a diffusers transformer config.json dict (private and unknown keys ignored)."""
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in config.items() if k in known}
        kwargs["axes_dims_rope"] = tuple(int(d) for d in kwargs.get("axes_dims_rope", cls.axes_dims_rope))
        if kwargs.get("out_channels") is None:  # diffusers: out_channels or in_channels
            kwargs["out_channels"] = kwargs.get("in_channels", cls.in_channels)
        return cls(**kwargs)

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def joint_attention_dim(self) -> int:
        """Text row width (the runner's name for `context_in_dim`)."""
        return self.context_in_dim


# ---------------------------------------------------------------------------------------------------------
# Embeddings and small layers
# ---------------------------------------------------------------------------------------------------------


class TimeProj(nn.Module):
    """Sinusoid [cos | sin] of `1000 * t` over 256 channels (diffusers' `QwenImage21TemporalTimesteps`)."""

    def __init__(self, num_channels: int = 256, max_period: int = 10000):
        super().__init__()
        half = num_channels // 2
        freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32) / half)
        self.register_buffer("freqs", freqs, persistent=False)

    def forward(self, timestep: torch.Tensor) -> torch.Tensor:
        args = (1000.0 * timestep.float())[:, None] * self.freqs[None].to(timestep.device)  # [N, 128]
        return torch.cat([torch.cos(args), torch.sin(args)], dim=-1).to(timestep.dtype)


class TimestepEmbedder(nn.Module):
    """linear_1 -> SiLU -> linear_2, no biases."""

    def __init__(self, in_channels: int, dim: int):
        super().__init__()
        self.linear_1 = Linear(in_channels, dim, bias=False)
        self.linear_2 = Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


class TimeTextEmbed(nn.Module):
    """Timestep [N] (already / 1000) -> conditioning vector `temb` [N, dim]."""

    def __init__(self, dim: int):
        super().__init__()
        self.time_proj = TimeProj(256)
        self.timestep_embedder = TimestepEmbedder(256, dim)

    def forward(self, timestep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.timestep_embedder(self.time_proj(timestep).to(dtype))


class ZeroCenterRMSNorm(nn.Module):
    """RMSNorm whose stored weight is `scale - 1`; computed in fp32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        rrms = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * rrms * (self.weight.float() + 1)).to(x.dtype)


class TextProjection(nn.Module):
    """Text rows [L, J] -> hidden [L, dim]: zero-centred RMSNorm, Linear, GELU (tanh), Linear."""

    def __init__(self, context_in_dim: int, dim: int, eps: float):
        super().__init__()
        self.text_norm = ZeroCenterRMSNorm(context_in_dim, eps)
        self.in_layer = Linear(context_in_dim, dim, bias=False)
        self.out_layer = Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_layer(F.gelu(self.in_layer(self.text_norm(x)), approximate="tanh"))


class SwiGLU(HasMergedLinears):
    """out(silu(gate_layer(x)) * proj(x)), no biases; gate_layer and proj run as one GEMM over their
    weights merged at load (layers/merged_linear.py)."""

    merged_linears: ClassVar[dict[str, tuple[str, ...]]] = {"gate_proj": ("gate_layer", "proj")}

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.proj = Linear(dim, hidden, bias=False)
        self.out = Linear(hidden, dim, bias=False)
        self.gate_layer = Linear(dim, hidden, bias=False)
        self.merge_linears()

    def forward(self, x: torch.Tensor, ops: Block21Ops) -> torch.Tensor:
        merged = self.merged("gate_proj")
        if merged is None:  # not merged (e.g. only one of them quantized): one GEMM each
            gate, proj = self.gate_layer(x), self.proj(x)
        else:
            gate, proj = merged(x).chunk(2, dim=-1)  # [..., hidden] each
        return self.out(ops.silu_mul(gate, proj))


# ---------------------------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------------------------


def prefix_attention_metadata(
    img_offsets: list[int], prefix_lens: list[int], device: torch.device
) -> AttentionMetadata:
    """Varlen boundaries of one step: sequence i's n_i image rows (queries) over its L_i prefix rows
    plus those image rows (keys / values): cu_seqlens_q = img_offsets, cu_seqlens_k = cumsum(L_i + n_i)."""
    sizes = [hi - lo for lo, hi in zip(img_offsets[:-1], img_offsets[1:])]
    return build_varlen_metadata(sizes, device, kv_seq_lens=[p + n for p, n in zip(prefix_lens, sizes)])


def prefix_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix_k: list[torch.Tensor],
    prefix_v: list[torch.Tensor],
    metadata: AttentionMetadata,
    backend: AttentionBackend,
) -> torch.Tensor:
    """Image rows attend to [their sequence's cached prefix ; their sequence's image rows].

    q, k, v: [num_img_rows, H, D], sequence i's rows at cu_seqlens_q[i]:cu_seqlens_q[i + 1].
    prefix_k[i], prefix_v[i]: [L_i, H, D] (one layer of sequence i's `PrefixKV`).
    metadata: `prefix_attention_metadata`. Returns [num_img_rows, H, D].
    """
    offsets = [0]
    for n in metadata.seq_lens:
        offsets.append(offsets[-1] + n)
    spans = list(zip(offsets[:-1], offsets[1:]))
    # [sum(L_i + n_i), H, D]: each sequence's prefix, then its image rows
    keys = torch.cat([t for i, (lo, hi) in enumerate(spans) for t in (prefix_k[i], k[lo:hi])])
    values = torch.cat([t for i, (lo, hi) in enumerate(spans) for t in (prefix_v[i], v[lo:hi])])
    return backend.forward(q, keys, values, metadata)


class Attention(HasMergedLinears):
    """QKV projections, per-head RMSNorm and RoPE; the attention call is the caller's (prefill: causal
    over the prefix; step: `prefix_varlen_attention`). q, k, v run as one GEMM over their weights
    merged at load (layers/merged_linear.py)."""

    merged_linears: ClassVar[dict[str, tuple[str, ...]]] = {"qkv": ("to_q", "to_k", "to_v")}

    def __init__(self, dim: int, heads: int, head_dim: int, eps: float):
        super().__init__()
        self.heads = heads
        self.to_q = Linear(dim, heads * head_dim, bias=False)
        self.to_k = Linear(dim, heads * head_dim, bias=False)
        self.to_v = Linear(dim, heads * head_dim, bias=False)
        self.to_out = nn.ModuleList([Linear(heads * head_dim, dim, bias=False)])
        self.norm_q = RMSNorm(head_dim, eps=eps)
        self.norm_k = RMSNorm(head_dim, eps=eps)
        self.merge_linears()

    def qkv(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], ops: Block21Ops):
        """x [T, dim] (normed, modulated) -> q, k, v [T, H, D] (q, k normed and rotated by rope
        (cos, sin) [T, D/2])."""
        merged = self.merged("qkv")
        if merged is None:  # not merged (e.g. a projection kept out of quantisation): one GEMM each
            q, k, v = self.to_q(x), self.to_k(x), self.to_v(x)
        else:
            q, k, v = merged(x).chunk(3, dim=-1)  # [T, H * D] each
        q, k, v = (t.unflatten(-1, (self.heads, -1)) for t in (q, k, v))
        q, k = ops.qk_norm_rope(q, k, self.norm_q, self.norm_k, rope)
        return q, k, v


# ---------------------------------------------------------------------------------------------------------
# Block
# ---------------------------------------------------------------------------------------------------------


class Block(nn.Module):
    """Single-stream block; its scales and gates come from the model's one shared modulation
    [scale1 | gate1 | scale2 | gate2] (`Modulation`; prefix rows: t = 0).

    Its input is `normed = LayerNorm(x) * (1 + scale1)`, computed by the previous block's last fused op
    (or the model, for the first block); its last op computes the next block's (or the final norm's),
    so every LayerNorm runs in one pass with the residual before it (fused_ops.py)."""

    def __init__(self, dim: int, heads: int, head_dim: int, mlp_ratio: int, eps: float):
        super().__init__()
        self.eps = eps
        self.attn = Attention(dim, heads, head_dim, eps)
        self.img_mlp = SwiGLU(dim, dim * mlp_ratio)

    def residuals(
        self,
        x: torch.Tensor,
        attn: torch.Tensor,
        mod: Modulation,
        next_scale: torch.Tensor,
        ops: Block21Ops,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual attention (gated) then the residual SwiGLU (gated), then the next LayerNorm,
        modulated by next_scale (as mod's scales): x [T, dim], attn [T, H, D] -> (x, normed) [T, dim]."""
        out = self.attn.to_out[0](attn.flatten(-2))  # [T, dim]
        x, h = ops.gated_residual_norm(x, out, mod.gate1, mod.scale2, mod.seq_ids, self.eps, False)
        mlp = self.img_mlp(h, ops)  # [T, dim]
        return ops.gated_residual_norm(x, mlp, mod.gate2, next_scale, mod.seq_ids, self.eps, True)


# ---------------------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------------------


class QwenImage21Transformer(nn.Module):
    """Qwen-Image-2.1's DiT: `prefill` (a sequence's prefix, once) and `forward_packed` (image rows of
    many sequences, every step). State-dict names are diffusers' `QwenImage21Transformer2DModel`'s."""

    plans: ClassVar[TransformerPlans] = QWEN_IMAGE21_PLANS
    """LoRA streams and targets, FP8 kept layers, blocks (plans.py)."""
    cuda_graphs_off_reason: ClassVar[str | None] = None
    """Its step is captured through `packed_graph_steps`."""

    def __init__(
        self, config: QwenImage21TransformerConfig, attn_backend: AttentionBackend | str | None = None
    ):
        """`attn_backend`: a backend instance, a name, or None (chosen at first use for the activations'
        device and dtype, as Qwen-Image's, see `get_attn_backend`)."""
        super().__init__()
        if not config.causal_condition:
            raise ValueError("Qwen-Image-2.1 with causal_condition=False has no step-independent prefix")
        self.config = config
        dim, heads, head_dim = config.inner_dim, config.num_attention_heads, config.attention_head_dim
        self.position_tables = Rope21(tuple(config.axes_dims_rope))
        self.prefix_cache = PrefixCache()
        """Each admitted sequence's `PrefixKV`, by (req_id, is_negative)."""
        self.time_text_embed = TimeTextEmbed(dim)
        self.txt_in = TextProjection(config.context_in_dim, dim, config.eps)
        self.img_in = Linear(config.in_channels * config.patch_size**2, dim, bias=False)
        self.modulation = nn.Sequential(nn.SiLU(), Linear(dim, 4 * dim, bias=False))
        self.transformer_blocks = nn.ModuleList(
            [Block(dim, heads, head_dim, config.mlp_ratio, config.eps) for _ in range(config.num_layers)]
        )
        self.norm_out = nn.Module()
        self.norm_out.linear = Linear(dim, dim, bias=False)
        self.proj_out = Linear(dim, config.patch_size**2 * config.out_channels, bias=False)
        if isinstance(attn_backend, str):
            backend_class(attn_backend)  # unknown names fail here, not at the first forward
        self.attn_backend = attn_backend
        self.block_ops = Block21Ops(compiled=False)
        """The blocks' elementwise chains; `enable_compile()` fuses them into compiled kernels."""

    @property
    def dtype(self) -> torch.dtype:
        return self.img_in.compute_dtype

    def step_attention_backend(self, device: torch.device) -> AttentionBackend:
        """The packed step's backend (varlen with cu_seqlens_q != cu_seqlens_k), resolved on first use."""
        if not isinstance(self.attn_backend, AttentionBackend):
            head_dim = self.config.attention_head_dim
            self.attn_backend = get_attn_backend(self.attn_backend, device, head_dim, dtype=self.dtype)
        return self.attn_backend

    # ---- what the runner's CUDA graphs and compile switch ask of a transformer ------------------

    def enable_compile(self) -> None:
        """Run the blocks' elementwise chains as torch.compile'd fused kernels (fused_ops.py): only row
        and sequence counts dynamic, one compile per specialisation for every batch composition, and
        capturable by the packed step's CUDA graphs. Linears and attention stay as they are."""
        self.block_ops = Block21Ops(compiled=True)

    def disable_compile(self) -> None:
        """Run the chains eagerly again (--enforce-eager's path; batch-invariant mode: row-local)."""
        self.block_ops = Block21Ops(compiled=False)

    @property
    def num_compile_fallbacks(self) -> int:
        """Compiled chains that fell back to eager so far (0 when not compiled)."""
        return self.block_ops.num_fallbacks

    def get_attn_backend(self, device: torch.device) -> AttentionBackend:
        """The step's backend (`step_attention_backend`); the graph runner checks it is graph-safe."""
        return self.step_attention_backend(device)

    def check_packed(
        self, img_rows: torch.Tensor, txt_rows: torch.Tensor, timestep: torch.Tensor, layout: PackedLayout
    ) -> None:
        """ValueError when `forward_packed`'s inputs do not fit (checked before a graph replay)."""
        if layout.positions != self.position_tables:
            raise ValueError("layout was built with another family's position tables")
        cfg = self.config
        expected = (
            ("img_rows", img_rows.shape, (layout.num_img_rows, cfg.in_channels * cfg.patch_size**2)),
            ("txt_rows", txt_rows.shape, (layout.num_txt_rows, cfg.context_in_dim)),
            ("timestep", timestep.shape, (layout.num_seqs,)),
        )
        for name, got, want in expected:
            if tuple(got) != want:
                raise ValueError(f"{name} must be {list(want)} for this layout, got {list(got)}")

    def packed_graph_steps(
        self, max_img_rows: int, max_prefix_rows: int, device: torch.device, dtype: torch.dtype
    ) -> PrefixStepGraphs:
        """The packed step over static buffers, for CUDA graphs (`interface.PackedStepGraphs`): buckets'
        second axis counts prefix rows; their static K/V buffers hold `max_prefix_rows` + `max_img_rows`
        rows (graphs.py)."""
        return PrefixStepGraphs(self, max_img_rows, max_prefix_rows, device, dtype)

    @property
    def prefix_arena(self) -> PrefixArena | None:
        """The fixed rows the prefix cache lives in (None: each prefix owns its tensors)."""
        return self.prefix_cache.arena

    def enable_prefix_arena(
        self, kv_cache_bytes: int | None, device: torch.device, dtype: torch.dtype
    ) -> PrefixArena:
        """Keep every later admitted prefix in one `PrefixArena` (the runner calls this at start-up on
        CUDA with graphs on, before it builds them): `kv_cache_bytes` // bytes per row rows when given
        (--kv-cache-memory-bytes), else `prefix_arena.arena_rows`' default (the smaller of 65536 rows and
        a quarter of the free device memory). Only while no prefix is cached."""
        if len(self.prefix_cache):
            raise ValueError("the prefix arena must be enabled before any prefix is cached")
        cfg, device = self.config, torch.device(device)
        heads, head_dim = cfg.num_attention_heads, cfg.attention_head_dim
        row_bytes = prefix_num_bytes(1, cfg.num_layers, heads, head_dim, dtype)
        free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0
        rows = arena_rows(row_bytes, kv_cache_bytes, free)
        if rows < 1:
            raise ValueError(
                f"the prefix KV arena would hold no row (one row is {row_bytes} bytes; "
                f"--kv-cache-memory-bytes {kv_cache_bytes}, free device memory {free} bytes): raise the limit"
            )
        self.prefix_cache.arena = PrefixArena(cfg.num_layers, rows, heads, head_dim, device, dtype)
        return self.prefix_cache.arena

    @property
    def graph_context_axis(self) -> GraphContextAxis | None:
        """The packed graphs' prefix-row axis: up to 8192 rows (any sequence's share) with an arena, where
        a bucket only adds rows to one layer's K/V (graphs.py); None without one (the runner's grid, its
        staging store sized for its 2048 rows)."""
        if self.prefix_arena is None:
            return None
        return GraphContextAxis(rows=ARENA_PREFIX_ROW_BUCKETS, max_rows_per_seq=ARENA_PREFIX_ROW_BUCKETS[-1])

    def _temb(self, timestep: torch.Tensor) -> torch.Tensor:
        """[N] (t / 1000) -> temb [N, dim] in the model dtype."""
        return self.time_text_embed(timestep.to(self.dtype), self.dtype)

    @torch.inference_mode()
    def prefill(
        self,
        txt_rows: torch.Tensor,
        slot_mask: list[bool] | None = None,
        cond_rows: torch.Tensor | None = None,
        cond_grids: list[tuple[int, int, int]] = (),
        owner: str | None = None,
        lora: LoRAScope | None = None,
    ) -> PrefixKV:
        """One sequence's prefix, block-causal, modulated from t = 0 -> its K/V at every layer (`PrefixKV`,
        [num_layers, L, H, D] each). The last block's attention output and MLP are skipped.

        Text-to-image: txt_rows [L, J], causal. Edit: txt_rows [T, J] are the encoder rows with image
        slots where `slot_mask` is True; each slot becomes 4 rows of `cond_rows [sum h*w, C_in]` (the
        reference latents of `cond_grids`, in order), see `prefix.plan_prefix`.

        `owner` (a req_id) with a prefix arena attached: the K/V are written into L arena rows of that
        owner (its reservation, else free rows; `PrefixArenaFull` before any compute when none fit) and
        the result is a view of them. Otherwise (no arena, or no owner: a forward outside the engine)
        the prefix owns its tensors.

        `lora`: the sequence's LoRA adapter (`LoRAScope`, its request's), applied to the prefix's
        linears as diffusers applies it to every row; None: the base model.
        """
        arena = self.prefix_arena if owner is not None else None
        scope = lora if lora is not None else _no_lora
        if not cond_grids:
            with scope(txt_rows.shape[0], txt_rows.shape[0]):  # txt_in: text stream
                x = self.txt_in(txt_rows.to(self.dtype))  # [L, dim]
            positions, block_ids, target_frame = prefix_positions(x.shape[0]), None, x.shape[0]
        else:
            plan = plan_prefix(list(slot_mask), list(cond_grids))
            with scope(cond_rows.shape[0], len(slot_mask) - sum(slot_mask)):  # img_in / txt_in rows
                x = self._edit_prefix_rows(txt_rows, slot_mask, cond_rows, plan)
            positions, block_ids, target_frame = (
                plan.positions,
                plan.block_ids.to(x.device),
                plan.target_frame,
            )
        num_rows = x.shape[0]
        with scope(num_rows, 0):  # the blocks: every prefix row; the modulation: one row
            return self._prefill_blocks(x, positions, block_ids, target_frame, arena, owner)

    def _prefill_blocks(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        block_ids: torch.Tensor | None,
        target_frame: int,
        arena: PrefixArena | None,
        owner: str | None,
    ) -> PrefixKV:
        """The blocks over a prefix's rows x [L, dim] -> its `PrefixKV` (see `prefill`). `block_ids` long
        [L]: each row's image block (-1: text), None: a text-only prefix (causal)."""
        ops, dim, axes = self.block_ops, self.config.inner_dim, self.position_tables.axes_dims
        # [1, 4 * dim], the same for every prefix row: broadcast, nothing to gather
        mod = ops.modulation(self.modulation(self._temb(torch.zeros(1, device=x.device))), None, dim)
        num_rows = x.shape[0]
        # NOTE(arena): each layer's K/V goes straight into its arena rows (no stacked copy): the
        # transient peak stays one layer's K/V, not the whole prefix a second time (2 GiB for a
        # 4096-row edit prefix); rows are taken before the first layer, so a full arena fails here.
        start = None if arena is None else arena.allocate(owner, num_rows)
        cos, sin = rope_table(positions, axes, self.position_tables.theta)
        rope = (cos.to(x.device), sin.to(x.device))
        keys, values = [], []
        normed = ops.modulated_norm(x, mod.scale1, None, self.config.eps)  # [L, dim]
        for i, block in enumerate(self.transformer_blocks):
            q, k, v = block.attn.qkv(normed, rope, ops)  # [L, H, D]
            if arena is None:
                keys.append(k)
                values.append(v)
            else:
                arena.key[i, start : start + num_rows].copy_(k)
                arena.value[i, start : start + num_rows].copy_(v)
            if i + 1 == len(self.transformer_blocks):
                break
            attn = prefill_attention(q, k, v, block_ids)  # [L, H, D]; bounded score memory
            x, normed = block.residuals(x, attn, mod, mod.scale1, ops)
        if arena is not None:
            rows = slice(start, start + num_rows)
            return PrefixKV(arena.key[:, rows], arena.value[:, rows], target_frame, arena_start=start)
        return PrefixKV(key=torch.stack(keys), value=torch.stack(values), target_frame=target_frame)

    def _edit_prefix_rows(
        self, txt_rows: torch.Tensor, slot_mask: list[bool], cond_rows: torch.Tensor, plan: PrefixPlan
    ) -> torch.Tensor:
        """[L, dim]: projected text rows and reference latent rows, each at its prefix row."""
        is_text = ~torch.tensor(slot_mask, dtype=torch.bool, device=txt_rows.device)
        text = self.txt_in(txt_rows[is_text].to(self.dtype))  # [num_text_rows, dim]
        x = text.new_empty(plan.num_rows, text.shape[-1])
        x[plan.txt_index.to(x.device)] = text
        x[plan.img_index.to(x.device)] = self.img_in(cond_rows.to(self.dtype))
        return x

    def denoise_rows(
        self,
        img_rows: torch.Tensor,
        timestep: torch.Tensor,
        img_offsets: list[int],
        prefixes: list[PrefixKV],
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """Velocity of the image rows of several sequences, each after its cached prefix.

        img_rows [R, C_in]; timestep [num_seqs] (t / 1000); img_offsets [num_seqs + 1] (host);
        prefixes[i]: sequence i's `PrefixKV`; rope (cos, sin) [R, D/2]. Returns [R, C_out].
        """
        sizes = [hi - lo for lo, hi in zip(img_offsets[:-1], img_offsets[1:])]
        seq_ids = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes)).to(img_rows.device)
        metadata = prefix_attention_metadata(img_offsets, [p.num_rows for p in prefixes], img_rows.device)
        backend = self.step_attention_backend(img_rows.device)

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            keys = [p.key[layer] for p in prefixes]
            values = [p.value[layer] for p in prefixes]
            return prefix_varlen_attention(q, k, v, keys, values, metadata, backend)

        return self.denoise(img_rows, timestep, seq_ids, rope, attend)

    def denoise(
        self,
        img_rows: torch.Tensor,
        timestep: torch.Tensor,
        seq_ids: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        attend: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """The blocks over image rows; each layer's attention is `attend(layer, q, k, v)` -> [R, H, D]
        (eager: `prefix_varlen_attention`; a CUDA graph: its static K/V buffers, `graphs.py`).

        img_rows [R, C_in]; timestep [N] (t / 1000); seq_ids long [R] (each row's index into timestep);
        rope (cos, sin) [R, D/2]. Returns [R, C_out]. Device work only (a graph captures it).
        """
        ops, eps = self.block_ops, self.config.eps
        x = self.img_in(img_rows.to(self.dtype))  # [R, dim]
        temb = self._temb(timestep)  # [N, dim]
        # [N, 5 * dim]: the blocks' [scale1 | gate1 | scale2 | gate2], then the final norm's scale
        mod = torch.cat([self.modulation(temb), self.norm_out.linear(F.silu(temb))], dim=-1)
        # per sequence (compiled: gathered by seq_ids inside the ops) or per row (eager)
        mod = ops.modulation(mod, seq_ids, self.config.inner_dim)  # 5 x [N or R, dim]
        normed = ops.modulated_norm(x, mod.scale1, mod.seq_ids, eps)  # [R, dim]
        last = len(self.transformer_blocks) - 1
        for layer, block in enumerate(self.transformer_blocks):
            q, k, v = block.attn.qkv(normed, rope, ops)  # [R, H, D]
            next_scale = mod.out_scale if layer == last else mod.scale1  # the final norm after the last
            x, normed = block.residuals(x, attend(layer, q, k, v), mod, next_scale, ops)
        return self.proj_out(normed)

    def forward_packed(
        self, img_rows: torch.Tensor, txt_rows: torch.Tensor, timestep: torch.Tensor, layout: PackedLayout
    ) -> torch.Tensor:
        """[num_img_rows, C_in] + [num_txt_rows, J] + [num_seqs] -> [num_img_rows, C_out].

        Each sequence's prefix comes from `prefix_cache` (prefilled at admission); a sequence without one
        is prefilled here from its `txt_rows` and not kept (a forward outside the engine)."""
        if layout.positions != self.position_tables:
            raise ValueError("layout was built with another family's position tables")
        prefixes = self.step_prefixes(txt_rows, layout)
        rope = self.step_rope(layout, prefixes, img_rows.device)
        return self.denoise_rows(img_rows, timestep, layout.img_row_offsets, prefixes, rope)

    def step_prefixes(self, txt_rows: torch.Tensor, layout: PackedLayout) -> list[PrefixKV]:
        """Each sequence's `PrefixKV`: from `prefix_cache`, else prefilled now from its `txt_rows`."""
        prefixes = []
        for i, spec in enumerate(layout.specs):
            prefix = self.prefix_cache.get(spec.req_id, spec.is_negative)
            if prefix is None:
                lo, hi = layout.txt_row_offsets[i], layout.txt_row_offsets[i + 1]
                prefix = self.prefill(txt_rows[lo:hi])
            prefixes.append(prefix)
        return prefixes

    def step_rope(
        self, layout: PackedLayout, prefixes: list[PrefixKV], device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 (cos, sin) [num_img_rows, D/2] of the step's image rows: the layout's tables, except
        after an edit prefix, whose target sits past its reference blocks (not at its row count)."""
        if all(p.target_frame == s.num_txt_tokens for p, s in zip(prefixes, layout.specs, strict=True)):
            return layout.img_rope
        positions = [image_positions(p.target_frame, s.img_shape) for p, s in zip(prefixes, layout.specs)]
        cos, sin = rope_table(
            torch.cat(positions), self.position_tables.axes_dims, self.position_tables.theta
        )
        return cos.to(device), sin.to(device)

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        encoder_hidden_states_mask: torch.Tensor | None,
        timestep: torch.Tensor,
        img_shapes: list,
    ) -> torch.Tensor:
        """Dense forward of B same-shape sequences, each prefilled here (nothing cached):
        [B, S, C_in] + [B, L, J] (mask bool [B, L] or None) + [B] -> [B, S, C_out]."""
        num_seqs, num_rows = hidden_states.shape[:2]
        prefixes, specs = [], []
        for b in range(num_seqs):
            txt = encoder_hidden_states[b]
            if encoder_hidden_states_mask is not None:
                txt = txt[encoder_hidden_states_mask[b].bool()]
            prefixes.append(self.prefill(txt))
            shape = img_shapes[b] if b < len(img_shapes) else img_shapes[0]
            if isinstance(shape[0], (list, tuple)):  # diffusers' per-sample list, target grid last
                shape = shape[-1]
            specs.append(SequenceSpec(num_txt_tokens=txt.shape[0], img_shape=tuple(shape)))
        (cos, sin), _ = self.position_tables(specs)
        rope = (cos.to(hidden_states.device), sin.to(hidden_states.device))
        offsets = [b * num_rows for b in range(num_seqs + 1)]
        out = self.denoise_rows(hidden_states.flatten(0, 1), timestep, offsets, prefixes, rope)
        return out.view(num_seqs, num_rows, -1)

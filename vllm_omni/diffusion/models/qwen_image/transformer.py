"""Qwen-Image MMDiT transformer, dense `[B, S, C]` and packed (many requests, one forward).

Math ported from diffusers' `QwenImageTransformer2DModel` (models/transformers/transformer_qwenimage.py);
parameter names are identical to its state dict, so real checkpoints load unchanged. Torch only: no
diffusers import at run time.

The two paths share every layer. They differ only in the `JointGeometry` handed to the blocks, which
says which sequence every row belongs to (per-sequence modulation is gathered by row id inside the
fused ops, see fused_ops.py) and how the text and image streams join for attention:

    dense   streams [B, S_txt, C] / [B, S_img, C]; join = cat on dim 1; one dense attention call
    packed  streams [num_txt_rows, C] / [num_img_rows, C] (see packing.py); join = index_copy into
            [total_tokens, H, D]; one varlen attention call

Building blocks (norms, MLP, timestep embedding) live in layers.py; each stream's q, k, v projections
run as one GEMM over weights merged at load (layers/merged_linear.py). At each of the block's four
linear points (q/k/v, out projection, MLP up, MLP down) the two streams' LoRA deltas run as one kernel
launch pair (layers/paired_linear.py).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from vllm_omni.diffusion.attention import AttentionBackend, AttentionMetadata, backend_class, get_attn_backend
from vllm_omni.diffusion.cache.step import SeqSubset, StepCache
from vllm_omni.diffusion.layers.fp8 import Fp8Activation
from vllm_omni.diffusion.layers.linear import Linear
from vllm_omni.diffusion.layers.merged_linear import HasMergedLinears
from vllm_omni.diffusion.layers.paired_linear import paired_linear
from vllm_omni.diffusion.layout import PackedLayout, joint_source
from vllm_omni.diffusion.models.interface import DenseInputs
from vllm_omni.diffusion.models.plans import TransformerPlans
from vllm_omni.diffusion.models.qwen_image.fused_ops import BlockOps
from vllm_omni.diffusion.models.qwen_image.layers import (
    FeedForward,
    RMSNorm,
    TimeTextEmbed,
    paired_feed_forward,
    scale_plus_one,
)
from vllm_omni.diffusion.models.qwen_image.plans import QWEN_IMAGE_PLANS
from vllm_omni.diffusion.models.qwen_image.rope import QwenRope, apply_rope, image_rope, text_rope

ROPE_THETA = 10000.0
FP16_MAX = 65504.0
JOINT_ROWS_MAX_TXT_SHARE = 16
"""The image out-projection runs over all joint rows when text rows are at most 1/16 of the image
rows: the wasted text rows (2 * rows * C^2 FLOPs) then cost less than copying the image rows out
(4 * rows * C bytes), whose break-even a GPU's GEMM and copy rates put near 1/9 at C = 3072.
Measured interleaved: 0.75-0.8 % less time per block on three CFG steps."""


@dataclass
class QwenImageTransformerConfig:
    """Architecture of the transformer; field names are diffusers' config.json keys."""

    patch_size: int = 2
    in_channels: int = 64
    out_channels: int = 16
    num_layers: int = 60
    attention_head_dim: int = 128
    num_attention_heads: int = 24
    joint_attention_dim: int = 3584
    guidance_embeds: bool = False
    """Guidance-distilled variant: not supported (diffusers' own forward cannot run it either)."""
    axes_dims_rope: tuple[int, int, int] = (16, 56, 56)
    """RoPE channels per axis (frame, row, column); sums to attention_head_dim."""

    UNSUPPORTED_FLAGS: ClassVar[dict[str, str]] = {
        "zero_cond_t": "per-token timestep conditioning of edit models",
        "use_additional_t_cond": "additional timestep conditioning of layered models",
        "use_layer3d_rope": "layered 3D RoPE",
        "guidance_embeds": "guidance embeddings",
    }

    def __post_init__(self) -> None:
        self.axes_dims_rope = tuple(int(d) for d in self.axes_dims_rope)
        if self.guidance_embeds:
            raise ValueError("guidance_embeds=True is not supported by QwenImageTransformer")
        if sum(self.axes_dims_rope) != self.attention_head_dim:
            raise ValueError(
                f"axes_dims_rope {self.axes_dims_rope} must sum to attention_head_dim "
                f"{self.attention_head_dim}"
            )

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @classmethod
    def from_dict(cls, d: dict) -> QwenImageTransformerConfig:
        """From a diffusers transformer config.json dict; ignores private and unknown keys, raises
        ValueError for variant flags we do not implement."""
        for flag, what in cls.UNSUPPORTED_FLAGS.items():
            if d.get(flag):
                raise ValueError(
                    f"transformer config {flag}=True ({what}) is not supported by QwenImageTransformer"
                )
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in known}
        if kwargs.get("out_channels") is None:  # diffusers: out_channels or in_channels
            kwargs["out_channels"] = kwargs.get("in_channels", cls.in_channels)
        return cls(**kwargs)


class AdaNormOut(nn.Module):
    """Final AdaLN (diffusers' `AdaLayerNormContinuous`): `linear(silu(temb))` -> (scale, shift).

    NOTE(model): scale comes first here, unlike the blocks' (shift, scale, gate)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.linear = Linear(dim, 2 * dim)
        self.norm = nn.LayerNorm(dim, eps=eps, elementwise_affine=False)

    def forward(self, x: torch.Tensor, temb: torch.Tensor, geom: JointGeometry) -> torch.Tensor:
        emb = scale_plus_one(self.linear(F.silu(temb).to(x.dtype)), 2, (0,))  # [num_seqs, 2*hidden]
        scale1p, shift = emb.chunk(2, dim=-1)
        return geom.ops.modulated_layer_norm(x, shift, scale1p, geom.img_ids, self.norm.eps)


@dataclass
class JointGeometry:
    """How the two streams of one forward join for attention and receive per-sequence values.

    Per-sequence values (modulation, gates) reach rows through `img_ids` / `txt_ids` (the sequence
    index of every row, in the stream's flattened row order); RoPE comes per stream.
    """

    img_ids: torch.Tensor
    """long [num_img_rows]: sequence of each image row."""
    txt_ids: torch.Tensor
    """long [num_txt_rows]: sequence of each text row."""
    img_rope: tuple[torch.Tensor, torch.Tensor]
    """fp32 (cos, sin) [image tokens of one sequence's layout, D/2] (dense: one image; packed: all rows)."""
    txt_rope: tuple[torch.Tensor, torch.Tensor]
    metadata: AttentionMetadata
    backend: AttentionBackend
    ops: BlockOps

    @functools.cached_property
    def joint_src(self) -> torch.Tensor:
        """long [joint rows]: each joint row's row in `cat([txt rows, img rows])` (flattened), the
        inverse of the two joint-row indices, built on first use (only the fused join reads it)."""
        return joint_source(self.txt_joint_rows, self.img_joint_rows)

    @property
    def img_joint_rows(self) -> torch.Tensor:
        """long [num_img_rows]: the joint row of every image row (both flattened)."""
        raise NotImplementedError

    @property
    def txt_joint_rows(self) -> torch.Tensor:
        """long [num_txt_rows]: the joint row of every text row."""
        raise NotImplementedError

    def joint_view(self, rows: torch.Tensor) -> torch.Tensor:
        """Joint rows `[T, H, D]` in the layout the attention backend takes."""
        return rows

    @functools.cached_property
    def rows_ropes(self) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        """(txt, img) RoPE (cos, sin) for every row of each stream (dense tables are one item's)."""
        return tuple(
            rope
            if rope[0].shape[0] == ids.shape[0]
            else tuple(t.repeat(ids.shape[0] // t.shape[0], 1) for t in rope)
            for rope, ids in ((self.txt_rope, self.txt_ids), (self.img_rope, self.img_ids))
        )

    def join(self, txt: torch.Tensor, img: torch.Tensor) -> torch.Tensor:
        """Text and image heads -> one joint q/k/v tensor, each sequence as [text ; image]."""
        raise NotImplementedError

    def split(self, joint: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Inverse of `join`: (text, image)."""
        raise NotImplementedError


@dataclass
class DenseGeometry(JointGeometry):
    """Same-shape batch: streams [B, S, C], text padded to S_txt and masked as keys."""

    num_txt: int = 0
    batch: int = 1

    @functools.cached_property
    def img_joint_rows(self) -> torch.Tensor:
        return self._joint_rows(self.num_txt, self.img_ids.shape[0] // self.batch)

    @functools.cached_property
    def txt_joint_rows(self) -> torch.Tensor:
        return self._joint_rows(0, self.num_txt)

    def _joint_rows(self, start: int, count: int) -> torch.Tensor:
        """Item b's joint rows start + [0, count) of its S_txt + S_img, flattened over items."""
        device = self.img_ids.device
        seq_len = self.num_txt + self.img_ids.shape[0] // self.batch
        items = torch.arange(self.batch, device=device)[:, None] * seq_len  # [B, 1]
        return (items + start + torch.arange(count, device=device)).flatten()

    def joint_view(self, rows):
        return rows.view(self.batch, -1, *rows.shape[1:])  # [B, S_txt + S_img, H, D]

    def join(self, txt, img):
        return torch.cat([txt, img], dim=1)  # [B, S_txt + S_img, H, D]

    def split(self, joint):
        # contiguous like diffusers: a strided [B, S, C] input takes another (not bit-equal) GEMM path
        return joint[:, : self.num_txt].contiguous(), joint[:, self.num_txt :].contiguous()


@dataclass
class PackedGeometry(JointGeometry):
    """Packed rows of many sequences (see packing.py): gather/scatter by precomputed indices."""

    layout: PackedLayout | None = None

    @property
    def img_joint_rows(self) -> torch.Tensor:
        return self.layout.img_to_joint

    @property
    def txt_joint_rows(self) -> torch.Tensor:
        return self.layout.txt_to_joint

    def join(self, txt, img):
        joint = txt.new_empty((self.layout.total_tokens, *txt.shape[1:]))  # [total_tokens, H, D]
        joint.index_copy_(0, self.layout.txt_to_joint, txt)
        return joint.index_copy_(0, self.layout.img_to_joint, img)

    def split(self, joint):
        return joint.index_select(0, self.layout.txt_to_joint), joint.index_select(
            0, self.layout.img_to_joint
        )


class QwenImageJointAttention(HasMergedLinears):
    """Joint text+image attention with separate projections per stream, RMS QK-norm and 3-axis RoPE.

    Each stream's q, k, v projections run as ONE GEMM over their weights stacked at load
    (`merged_linears`, layers/merged_linear.py), whatever their quant method; the modules and their
    state-dict names stay separate."""

    merged_linears: ClassVar[dict[str, tuple[str, ...]]] = {
        "img_qkv": ("to_q", "to_k", "to_v"),
        "txt_qkv": ("add_q_proj", "add_k_proj", "add_v_proj"),
    }

    def __init__(self, dim: int, num_heads: int, head_dim: int, eps: float = 1e-6):
        super().__init__()
        self.head_dim = head_dim
        inner = num_heads * head_dim
        self.to_q, self.to_k, self.to_v = (Linear(dim, inner) for _ in range(3))
        self.add_q_proj, self.add_k_proj, self.add_v_proj = (Linear(dim, inner) for _ in range(3))
        self.norm_q, self.norm_k = RMSNorm(head_dim, eps), RMSNorm(head_dim, eps)
        self.norm_added_q, self.norm_added_k = RMSNorm(head_dim, eps), RMSNorm(head_dim, eps)
        self.to_out = nn.ModuleList([Linear(inner, dim)])
        self.to_add_out = Linear(inner, dim)
        self.merge_linears()

    def accepts_fp8_input(self, group: str, x: torch.Tensor) -> bool:
        """Whether a stream's input may come as an `Fp8Activation`: its q, k, v run merged (one FP8
        GEMM) with no LoRA delta in this forward (`MergedLinear.accepts_fp8_input`; x: the norm's input)."""
        merged = self.merged(group)
        return merged is not None and merged.accepts_fp8_input(x)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (-1, self.head_dim))  # [..., hidden] -> [..., H, D]

    def _qkv(self, x: torch.Tensor, group: str):
        """q, k, v heads of one stream: ONE GEMM over the merged [3 * inner, dim] weights, or the three
        projections one by one when the group is not merged (e.g. a layer kept out of quantisation)."""
        merged = self.merged(group)
        if merged is None:
            return tuple(self._heads(p(x)) for p in self.members(group))
        return tuple(self._heads(t) for t in merged(x).chunk(3, dim=-1))

    def _stream_qkvs(self, img: torch.Tensor, txt: torch.Tensor):
        """((img q, k, v), (txt q, k, v)) heads: both streams' merged GEMMs with their LoRA deltas in
        one launch pair (`paired_linear`), or `_qkv` per stream when a group is not merged."""
        img_proj, txt_proj = self.merged("img_qkv"), self.merged("txt_qkv")
        if img_proj is None or txt_proj is None:
            return self._qkv(img, "img_qkv"), self._qkv(txt, "txt_qkv")
        img_qkv, txt_qkv = paired_linear(img_proj, img, txt_proj, txt)  # [..., 3 * inner] each
        return tuple(tuple(self._heads(t) for t in qkv.chunk(3, dim=-1)) for qkv in (img_qkv, txt_qkv))

    @staticmethod
    def _norm_rope(
        x: torch.Tensor, norm: nn.Module, rope: tuple[torch.Tensor, torch.Tensor], ops
    ) -> torch.Tensor:
        if type(norm) is RMSNorm:  # the fused chain; replaced norms (batch-invariant) run as modules
            return ops.qk_norm_rope(x, norm.weight, *rope, norm.eps)
        return apply_rope(norm(x), *rope)

    def _joint_qkv(self, img: torch.Tensor, txt: torch.Tensor, geom: JointGeometry):
        """q, k, v of the joint sequence in one fused pass over both streams' merged projections, or
        None when a stream's group is not merged or a norm is not the plain module (batch invariant)."""
        norms = (self.norm_added_q, self.norm_added_k, self.norm_q, self.norm_k)
        img_proj, txt_proj = self.merged("img_qkv"), self.merged("txt_qkv")
        if img_proj is None or txt_proj is None or any(type(n) is not RMSNorm for n in norms):
            return None
        # [rows, 3 * hidden] per stream; the GEMMs take the stream's own shape (a LoRA delta finds
        # its rows by it), the rows are flattened after; both streams' deltas in one launch pair
        img_qkv, txt_qkv = paired_linear(img_proj, img, txt_proj, txt)
        img_qkv = img_qkv.reshape(-1, img_proj.out_features)
        txt_qkv = txt_qkv.reshape(-1, txt_proj.out_features)
        qkv = geom.ops.joint_qkv(
            txt_qkv, img_qkv, geom.joint_src, tuple(n.weight for n in norms),
            *geom.rows_ropes, norms[0].eps,
        )  # fmt: skip
        return tuple(geom.joint_view(t) for t in qkv)

    def forward(
        self, img: torch.Tensor | Fp8Activation, txt: torch.Tensor | Fp8Activation, geom: JointGeometry
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(image attention output, text attention output, image rows); a stream's input is an
        `Fp8Activation` only while `accepts_fp8_input` (its merged FP8 QKV takes it). The image output is
        `[..., C]` per image row when the rows are None, else `[joint rows, C]` with the image rows'
        positions in it (`geom.img_joint_rows`), for the block to read by index."""
        qkv = self._joint_qkv(img, txt, geom) if geom.ops.fuse_joint else None
        fused = qkv is not None
        if qkv is None:  # per stream: projections, norm + RoPE, then the join copies
            (img_q, img_k, img_v), (txt_q, txt_k, txt_v) = self._stream_qkvs(img, txt)
            nr, ops = self._norm_rope, geom.ops
            qkv = (
                geom.join(
                    nr(txt_q, self.norm_added_q, geom.txt_rope, ops),
                    nr(img_q, self.norm_q, geom.img_rope, ops),
                ),
                geom.join(
                    nr(txt_k, self.norm_added_k, geom.txt_rope, ops),
                    nr(img_k, self.norm_k, geom.img_rope, ops),
                ),
                geom.join(txt_v, img_v),
            )  # each [..., joint tokens, H, D]
        q, k, v = qkv
        out = geom.backend(q, k, v, geom.metadata).flatten(-2).to(q.dtype)  # [..., joint tokens, hidden]
        num_img, num_txt = geom.img_ids.shape[0], geom.txt_ids.shape[0]
        # a LoRA delta on to_out must see the image rows in their order; to_add_out sees the text rows.
        # Any GEMM method serves joint rows (FP8 quantises each row on its own, as it would the image rows)
        img_proj_any_rows = not self.to_out[0].adds_lora_delta(out)
        if fused and img_proj_any_rows and num_txt * JOINT_ROWS_MAX_TXT_SHARE <= num_img:
            # Every joint row through the image projection, text rows wasted: cheaper than the copy
            # of [img rows, C] that splitting them out costs, while text is a small share (FP8: the
            # gather was ~1 % of a 1024x1024 CFG step).
            rows = out.reshape(-1, out.shape[-1])  # [joint rows, hidden]
            img_attn = self.to_out[0](rows)  # [joint rows, C]
            return img_attn, self.to_add_out(rows[geom.txt_joint_rows]), geom.img_joint_rows
        txt_out, img_out = geom.split(out)
        img_attn, txt_attn = paired_linear(self.to_out[0], img_out, self.to_add_out, txt_out)
        return img_attn, txt_attn, None


class QwenImageTransformerBlock(nn.Module):
    """Dual-stream MMDiT block: per-stream AdaLN (shift, scale, gate) x 2, joint attention, GELU MLPs."""

    def __init__(self, dim: int, num_heads: int, head_dim: int, eps: float = 1e-6):
        super().__init__()
        self.img_mod = nn.Sequential(nn.SiLU(), Linear(dim, 6 * dim))
        self.txt_mod = nn.Sequential(nn.SiLU(), Linear(dim, 6 * dim))
        self.img_norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=eps)
        self.img_norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=eps)
        self.txt_norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=eps)
        self.txt_norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=eps)
        self.attn = QwenImageJointAttention(dim, num_heads, head_dim, eps)
        self.img_mlp = FeedForward(dim)
        self.txt_mlp = FeedForward(dim)

    def forward(
        self, img: torch.Tensor, txt: torch.Tensor, temb: torch.Tensor, geom: JointGeometry
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Per-sequence modulation [num_seqs, 6 * hidden] with scales as (1 + scale):
        # (shift1, scale1, gate1, shift2, scale2, gate2), gathered to rows inside the fused ops.
        img_mod = scale_plus_one(self.img_mod(temb), 6, (1, 4)).chunk(6, dim=-1)
        txt_mod = scale_plus_one(self.txt_mod(temb), 6, (1, 4)).chunk(6, dim=-1)
        ops, img_ids, txt_ids, eps = geom.ops, geom.img_ids, geom.txt_ids, self.img_norm1.eps

        # a norm's output comes quantised (Fp8Activation) when its consumer is an FP8 linear without
        # an active LoRA slot and a Triton kernel serves it (fp8_ok; layers/fp8.py)
        img_attn, txt_attn, img_attn_rows = self.attn(
            ops.modulated_layer_norm(
                img, img_mod[0], img_mod[1], img_ids, eps, fp8_ok=self.attn.accepts_fp8_input("img_qkv", img)
            ),
            ops.modulated_layer_norm(
                txt, txt_mod[0], txt_mod[1], txt_ids, eps, fp8_ok=self.attn.accepts_fp8_input("txt_qkv", txt)
            ),
            geom,
        )
        img, img_normed = ops.gated_residual_norm(
            img, img_attn, *img_mod[2:5], img_ids, eps, y_rows=img_attn_rows,
            fp8_ok=self.img_mlp.accepts_fp8_input(img),
        )  # fmt: skip
        txt, txt_normed = ops.gated_residual_norm(
            txt, txt_attn, *txt_mod[2:5], txt_ids, eps, fp8_ok=self.txt_mlp.accepts_fp8_input(txt)
        )

        img_mlp, txt_mlp = paired_feed_forward(self.img_mlp, img_normed, self.txt_mlp, txt_normed)
        img = ops.gated_residual(img, img_mlp, img_mod[5], img_ids)
        txt = ops.gated_residual(txt, txt_mlp, txt_mod[5], txt_ids)

        if img.dtype == torch.float16:  # keep fp16 activations finite, as diffusers does
            img, txt = img.clip(-FP16_MAX, FP16_MAX), txt.clip(-FP16_MAX, FP16_MAX)
        return img, txt


class QwenImageTransformer(nn.Module):
    """Qwen-Image MMDiT with a dense forward (same-shape batch) and a packed forward (any shapes).

    `attn_backend`: a backend instance, a backend name, or None (selected at first use for the
    activations' device and dtype, see `get_attn_backend`). Holds no buffers: safe to build on the
    meta device and load with `load_state_dict(assign=True)`; RoPE tables are built lazily.
    """

    supports_mixfusion: ClassVar[bool] = True
    """Can run heterogeneous requests (shapes, text lengths, timesteps) in one packed forward."""
    plans: ClassVar[TransformerPlans] = QWEN_IMAGE_PLANS
    """LoRA streams, tensor-parallel shards, invariant norms, FP8 kept layers, blocks (plans.py)."""
    packed_graph_steps: ClassVar[None] = None
    """No own graph step: the runner captures `forward_packed` over a static layout."""
    enable_prefix_arena: ClassVar[None] = None
    """No prefix cache."""
    graph_context_axis: ClassVar[None] = None
    """The runner's text-row buckets."""
    cuda_graphs_off_reason: ClassVar[str | None] = None
    """Its forward can be captured."""

    def __init__(
        self, config: QwenImageTransformerConfig, attn_backend: AttentionBackend | str | None = None
    ):
        super().__init__()
        self.config = config
        dim = config.inner_dim
        self.time_text_embed = TimeTextEmbed(dim)
        self.txt_norm = RMSNorm(config.joint_attention_dim, eps=1e-6)
        self.img_in = Linear(config.in_channels, dim)
        self.txt_in = Linear(config.joint_attention_dim, dim)
        self.transformer_blocks = nn.ModuleList(
            QwenImageTransformerBlock(dim, config.num_attention_heads, config.attention_head_dim)
            for _ in range(config.num_layers)
        )
        self.norm_out = AdaNormOut(dim)
        self.proj_out = Linear(dim, config.patch_size**2 * config.out_channels)
        if isinstance(attn_backend, str):
            backend_class(attn_backend)  # unknown names fail here, not at the first forward
        self.attn_backend = attn_backend
        self._dense_rope: dict[tuple, tuple] = {}  # plain cache, not state
        self.position_tables = QwenRope(tuple(config.axes_dims_rope), ROPE_THETA, scale_rope=True)
        """This model's position tables for a packed layout: `build_packed_layout(specs, position_tables)`."""
        self.block_ops = BlockOps(compiled=False)
        """Elementwise chains of the blocks; `enable_compile()` fuses them into compiled kernels."""

    def enable_compile(self) -> None:
        """Run the blocks' elementwise chains as torch.compile'd fused kernels (CUDA, dynamic shapes).

        Linears and attention stay eager; no CUDA graphs. One compile serves every batch composition.
        """
        self.block_ops = BlockOps(compiled=True)

    @property
    def num_compile_fallbacks(self) -> int:
        """Compiled elementwise chains that fell back to eager so far (0 when not compiled)."""
        return self.block_ops.num_fallbacks

    def disable_compile(self) -> None:
        """Run the blocks' elementwise chains eagerly again (batch-invariant mode: row-local chains)."""
        self.block_ops = BlockOps(compiled=False)

    def get_attn_backend(self, device: torch.device) -> AttentionBackend:
        """The backend, resolved on first use for `device` and the weights' dtype (the activation dtype)."""
        if not isinstance(self.attn_backend, AttentionBackend):
            self.attn_backend = get_attn_backend(
                self.attn_backend,
                device,
                self.config.attention_head_dim,
                for_packed=True,
                dtype=self.img_in.compute_dtype,
            )
        return self.attn_backend

    def _run(
        self,
        img: torch.Tensor,
        txt: torch.Tensor,
        timestep: torch.Tensor,
        geom: JointGeometry,
        cache: StepCache | None = None,
    ):
        # img [..., C_in] and txt [..., joint_dim] rows of either geometry; timestep [num_seqs]
        img = self.img_in(img)  # [..., hidden]
        timestep = timestep.to(img.dtype)  # diffusers rounds t to the activation dtype first
        txt = self.txt_in(self.txt_norm(txt))  # [..., hidden]
        temb = self.time_text_embed(timestep, img.dtype)  # [num_seqs, hidden]
        if cache is not None:  # packed only: each sequence may skip its middle blocks this step
            img, txt = cache.run(img, txt, _PackedSegments(self, temb, geom))
        else:
            for block in self.transformer_blocks:
                img, txt = block(img, txt, temb, geom)
        return self.proj_out(self.norm_out(img, temb, geom))  # [..., patch**2 * out_channels]

    def packed_geometry(self, layout: PackedLayout, device: torch.device) -> PackedGeometry:
        """The blocks' view of a packed layout."""
        return PackedGeometry(
            img_ids=layout.img_seq_ids,
            txt_ids=layout.txt_seq_ids,
            img_rope=layout.img_rope,
            txt_rope=layout.txt_rope,
            metadata=layout.attn,
            backend=self.get_attn_backend(device),
            ops=self.block_ops,
            layout=layout,
        )

    def forward_packed(
        self,
        img_rows: torch.Tensor,
        txt_rows: torch.Tensor,
        timestep: torch.Tensor,
        layout: PackedLayout,
        cache: StepCache | None = None,
    ) -> torch.Tensor:
        """Packed forward of `layout.num_seqs` sequences of any shapes.

        Args:
            img_rows: [num_img_rows, in_channels] latents, sequences in layout order.
            txt_rows: [num_txt_rows, joint_attention_dim] prompt embeddings (real tokens only).
            timestep: [num_seqs] per-sequence timestep, already / 1000.
            layout: `layout.build_packed_layout(specs, self.position_tables, device=...)`.
            cache: per-sequence step caching (`diffusion/cache/step.py`), or None: every block runs.
        Returns:
            [num_img_rows, patch_size**2 * out_channels]; `layout.split_img` splits it per sequence.
        """
        self.check_packed(img_rows, txt_rows, timestep, layout)
        geom = self.packed_geometry(layout, img_rows.device)
        return self._run(img_rows, txt_rows, timestep, geom, cache)

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        encoder_hidden_states_mask: torch.Tensor | None,
        timestep: torch.Tensor,
        img_shapes: list,
    ) -> torch.Tensor:
        """Dense forward of B requests with one image shape (diffusers' signature).

        Args:
            hidden_states: [B, S_img, in_channels].
            encoder_hidden_states: [B, S_txt, joint_attention_dim], padded.
            encoder_hidden_states_mask: [B, S_txt], 1 real / 0 padding (masked as keys), or None.
            timestep: [B], already / 1000.
            img_shapes: per item (frames, h, w), or [(frames, h, w)] as diffusers' pipeline passes.
        Returns:
            [B, S_img, patch_size**2 * out_channels].
        """
        img_shape = self.check_dense(
            DenseInputs(
                hidden_states, encoder_hidden_states, encoder_hidden_states_mask, timestep, img_shapes
            )
        )
        batch, num_img = hidden_states.shape[:2]
        num_txt = encoder_hidden_states.shape[1]
        mask = None
        if encoder_hidden_states_mask is not None:
            img_mask = torch.ones(batch, num_img, dtype=torch.bool, device=hidden_states.device)
            mask = torch.cat(
                [encoder_hidden_states_mask.to(torch.bool), img_mask], dim=1
            )  # [B, S_txt + S_img]
        backend = self.get_attn_backend(hidden_states.device)
        img_rope, txt_rope = self._dense_rope_tables(img_shape, num_txt, hidden_states.device)
        seq = torch.arange(batch, device=hidden_states.device)
        geom = DenseGeometry(
            img_ids=seq.repeat_interleave(num_img),  # rows of [B, S_img] flattened
            txt_ids=seq.repeat_interleave(num_txt),
            img_rope=img_rope,
            txt_rope=txt_rope,
            metadata=AttentionMetadata(is_varlen=False, attn_mask=mask),
            backend=backend,
            ops=self.block_ops,
            num_txt=num_txt,
            batch=batch,
        )
        return self._run(hidden_states, encoder_hidden_states, timestep, geom)

    def _dense_rope_tables(self, img_shape, num_txt: int, device: torch.device):
        """((img cos, sin), (txt cos, sin)) for one image shape and padded text length, cached."""
        key = (img_shape, num_txt, device)
        if key not in self._dense_rope:
            if len(self._dense_rope) >= 64:
                self._dense_rope.clear()
            axes, theta = self.config.axes_dims_rope, ROPE_THETA
            img = tuple(t.to(device) for t in image_rope(img_shape, axes, theta))
            txt = tuple(t.to(device) for t in text_rope(img_shape, num_txt, axes, theta))
            self._dense_rope[key] = (img, txt)
        return self._dense_rope[key]

    def check_packed(self, img_rows, txt_rows, timestep, layout: PackedLayout) -> None:
        """ValueError naming the argument when `forward_packed`'s inputs do not fit `layout` or this model
        (a replayed CUDA graph runs the same check before it copies the inputs in)."""
        cfg = self.config
        grids = [s.img_shape for s in layout.specs]
        if img_rows.dim() != 2 or tuple(img_rows.shape) != (layout.num_img_rows, cfg.in_channels):
            raise ValueError(
                f"img_rows must be [num_img_rows, in_channels] = [{layout.num_img_rows}, {cfg.in_channels}] "
                f"(sum of the grids {grids}), got {list(img_rows.shape)}"
            )
        if txt_rows.dim() != 2 or tuple(txt_rows.shape) != (layout.num_txt_rows, cfg.joint_attention_dim):
            raise ValueError(
                f"txt_rows must be [num_txt_rows, joint_attention_dim] = "
                f"[{layout.num_txt_rows}, {cfg.joint_attention_dim}], got {list(txt_rows.shape)}"
            )
        if tuple(timestep.shape) != (layout.num_seqs,):
            raise ValueError(f"timestep must be [num_seqs] = [{layout.num_seqs}], got {list(timestep.shape)}")
        if layout.positions != self.position_tables:
            raise ValueError(
                f"layout RoPE {layout.positions} must match the model's {self.position_tables} "
                "(build the layout with transformer.position_tables)"
            )
        if layout.device != img_rows.device or txt_rows.device != img_rows.device:
            raise ValueError(
                f"layout ({layout.device}), img_rows ({img_rows.device}) and txt_rows ({txt_rows.device}) "
                "must "
                "share a device: build_packed_layout(..., device=...) or layout.to(device)"
            )

    def check_dense(self, inputs: DenseInputs) -> tuple[int, int, int]:
        """ValueError naming the argument when the dense `forward`'s inputs are inconsistent; else the
        batch's one (frames, h, w) grid."""
        hidden_states, encoder_hidden_states, mask, timestep, img_shapes = inputs.args
        cfg = self.config
        if hidden_states.dim() != 3 or hidden_states.shape[-1] != cfg.in_channels:
            raise ValueError(
                f"hidden_states must be [B, S_img, {cfg.in_channels}], got {list(hidden_states.shape)}"
            )
        batch, num_img = hidden_states.shape[:2]
        if encoder_hidden_states.dim() != 3 or tuple(encoder_hidden_states.shape[::2]) != (
            batch,
            cfg.joint_attention_dim,
        ):
            raise ValueError(
                f"encoder_hidden_states must be [{batch}, S_txt, {cfg.joint_attention_dim}], "
                f"got {list(encoder_hidden_states.shape)}"
            )
        if mask is not None and tuple(mask.shape) != tuple(encoder_hidden_states.shape[:2]):
            raise ValueError(
                f"encoder_hidden_states_mask must be [B, S_txt] = {list(encoder_hidden_states.shape[:2])}, "
                f"got {list(mask.shape)}"
            )
        if tuple(timestep.shape) != (batch,):
            raise ValueError(f"timestep must be [B] = [{batch}], got {list(timestep.shape)}")
        if len(img_shapes) != batch:
            raise ValueError(
                f"img_shapes must have one entry per batch item ({batch}), got {len(img_shapes)}"
            )
        shapes = {_single_img_shape(s) for s in img_shapes}
        if len(shapes) != 1:
            raise ValueError(
                f"the dense forward needs one image shape, got {sorted(shapes)}; use forward_packed"
            )
        (img_shape,) = shapes
        if math.prod(img_shape) != num_img:
            raise ValueError(
                f"img_shapes {img_shape} has {math.prod(img_shape)} tokens, hidden_states has {num_img}"
            )
        return img_shape


@dataclass
class _PackedSegments:
    """The blocks of one packed forward, lent to the step cache (`BlockSegments`): run a block range
    over some sequences' rows, and TeaCache's signal (block 0's modulated image input)."""

    model: QwenImageTransformer
    temb: torch.Tensor
    """[num_seqs, hidden] of the full layout."""
    geom: PackedGeometry

    @property
    def num_blocks(self) -> int:
        return len(self.model.transformer_blocks)

    def run_blocks(self, start: int, end: int, img, txt, subset: SeqSubset | None):
        temb, geom = self.temb, self.geom
        if subset is not None:
            temb = temb.index_select(0, subset.seq_index)  # [num_sub_seqs, hidden]
            geom = self.model.packed_geometry(subset.layout, img.device)
        for block in self.model.transformer_blocks[start:end]:
            img, txt = block(img, txt, temb, geom)
        return img, txt

    def modulated_input(self, img: torch.Tensor) -> torch.Tensor:
        block = self.model.transformer_blocks[0]
        shift, scale1p = scale_plus_one(block.img_mod(self.temb), 6, (1, 4)).chunk(6, dim=-1)[:2]
        return self.geom.ops.modulated_layer_norm(img, shift, scale1p, self.geom.img_ids, block.img_norm1.eps)


def _single_img_shape(entry) -> tuple[int, int, int]:
    """(f, h, w) from `(f, h, w)` or diffusers' pipeline style `[(f, h, w)]`.

    More than one grid per item is an edit model's input: refused."""
    if isinstance(entry, list):
        if len(entry) != 1:
            raise ValueError(f"one image grid per batch item is supported (no edit inputs), got {entry}")
        entry = entry[0]
    shape = tuple(int(n) for n in entry)
    if len(shape) != 3 or min(shape) <= 0:
        raise ValueError(f"img_shapes entries must be (frames, h, w) with positive sides, got {entry}")
    return shape

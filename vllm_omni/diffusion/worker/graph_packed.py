"""One packed CUDA graph: a bucket's static buffers (or the family's own static step), the padded-batch
loader and the captured forward (the padding rule: cuda_graphs.py's module docstring)."""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from vllm_omni.diffusion.attention.metadata import AttentionMetadata
from vllm_omni.diffusion.layout import PackedLayout, SequenceSpec
from vllm_omni.diffusion.models.interface import StaticPackedStep
from vllm_omni.diffusion.worker.graph_buckets import PackedBucket
from vllm_omni.lora.batch import LoRABatch
from vllm_omni.lora.layers import LoRAStepState


def _graph_layout(bucket: PackedBucket, like: PackedLayout, device, rope_dim: int) -> PackedLayout:
    """A layout of static buffers for `bucket`, initially one padding sequence over every row."""
    n_img, n_txt, total = bucket.num_img_rows, bucket.num_txt_rows, bucket.total_tokens
    slots = bucket.num_seqs + 1
    cu = torch.full((slots + 1,), total, dtype=torch.int32, device=device)
    cu[0] = 0
    attn = AttentionMetadata(
        is_varlen=True,
        cu_seqlens_q=cu,
        cu_seqlens_k=cu,
        max_seqlen_q=total,
        max_seqlen_k=total,
        seq_lens=[total] + [0] * (slots - 1),
        for_graph=True,
    )
    ones = lambda n: torch.ones(n, rope_dim, device=device)  # noqa: E731
    zeros = lambda n: torch.zeros(n, rope_dim, device=device)  # noqa: E731
    arange = torch.arange(total, device=device)
    # host offsets: the whole bucket as one block (only sizes are read from them in the forward)
    return dataclasses.replace(
        like,
        specs=tuple(SequenceSpec(1, (1, 1, 1)) for _ in range(slots)),
        attn=attn,
        txt_to_joint=arange[:n_txt].clone(),
        img_to_joint=arange[n_txt:].clone(),
        txt_seq_ids=torch.zeros(n_txt, dtype=torch.long, device=device),
        img_seq_ids=torch.zeros(n_img, dtype=torch.long, device=device),
        img_rope=(ones(n_img), zeros(n_img)),
        txt_rope=(ones(n_txt), zeros(n_txt)),
        img_row_offsets=[0] * slots + [n_img],
        txt_row_offsets=[0] * slots + [n_txt],
    )


def lora_scope(lora_state: LoRAStepState | None, static: LoRABatch | None):
    """The scope in which a graph's forward runs: its static LoRA tables active (None: a plain graph,
    which must capture no delta even when called inside a step's LoRA scope)."""
    if lora_state is None:
        return contextlib.nullcontext()
    return lora_state.activate(static)


class PackedGraph:
    """One packed bucket: static inputs, the padded-batch loader, and its captured graph.

    `lora_state`: the model's LoRA state when LoRA is enabled; `with_lora`: this graph adds the
    deltas (its static tables in `self.lora`), else it runs with no LoRA batch. `family_step`: the
    family's own static step for this bucket (`interface.StaticPackedStep`), which replaces the
    static layout below."""

    def __init__(
        self,
        transformer,
        bucket: PackedBucket,
        like: PackedLayout,
        device,
        dtype,
        lora_state: LoRAStepState | None = None,
        with_lora: bool = False,
        family_step: StaticPackedStep | None = None,
    ):
        cfg = transformer.config
        self.transformer, self.bucket, self.lora_state = transformer, bucket, lora_state
        self.family_step = family_step
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | None = None
        self.lora: LoRABatch | None = None
        """Static LoRA tables (per stream: the bucket's rows, one run per sequence slot at most)."""
        self._lora_loaded: LoRABatch | None = None  # the forward's batch last copied in (held: no id reuse)
        if with_lora:
            rows = {"img": bucket.num_img_rows, "txt": bucket.num_txt_rows, "seq": bucket.num_seqs + 1}
            self.lora = LoRABatch.static(rows, bucket.num_seqs + 1, device)
        if family_step is not None:  # the family's buffers replace the static layout
            return
        self.img = torch.zeros(bucket.num_img_rows, cfg.in_channels, device=device, dtype=dtype)
        self.txt = torch.zeros(bucket.num_txt_rows, cfg.joint_attention_dim, device=device, dtype=dtype)
        self.timestep = torch.zeros(bucket.num_seqs + 1, device=device, dtype=dtype)
        self.layout = _graph_layout(bucket, like, device, cfg.attention_head_dim // 2)
        self.arange = torch.arange(max(bucket.num_img_rows, bucket.num_txt_rows), device=device)
        self._loaded: tuple[int, int] | None = None  # ids of the layout and text rows last loaded

    def run_eager(self) -> torch.Tensor:
        """The padded batch through the eager forward (the reference a replay must equal)."""
        with lora_scope(self.lora_state, self.lora):
            if self.family_step is not None:
                return self.family_step.run_eager()
            return self.transformer.forward_packed(self.img, self.txt, self.timestep, self.layout)

    def load(self, img_rows, txt_rows, timestep, layout: PackedLayout, lora: LoRABatch | None = None) -> None:
        """Write a batch into the static buffers; composition-only parts only when they changed.
        `lora`: the forward's LoRA batch (a LoRA graph's; its rows are the padded batch's first rows)."""
        if self.lora is not None and lora is not self._lora_loaded:
            self.lora.load(lora)
            self._lora_loaded = lora
        if self.family_step is not None:
            self.family_step.load(img_rows, txt_rows, timestep, layout)
            return
        n_img, n_txt, n = layout.num_img_rows, layout.num_txt_rows, layout.num_seqs
        self.img[:n_img].copy_(img_rows)
        self.img[n_img:].zero_()
        self.timestep[:n].copy_(timestep)
        self.timestep[n:].zero_()
        key = (id(layout), id(txt_rows))
        if self._loaded == key:  # same composition as the last step: indices, RoPE and text unchanged
            return
        g, b, real = self.layout, self.bucket, layout.total_tokens
        pad_txt = b.num_txt_rows - n_txt
        self.txt[:n_txt].copy_(txt_rows)
        self.txt[n_txt:].zero_()
        # padding rows fill joint positions [real, total): text padding first, then image padding
        g.txt_to_joint[:n_txt].copy_(layout.txt_to_joint)
        torch.add(self.arange[:pad_txt], real, out=g.txt_to_joint[n_txt:])
        g.img_to_joint[:n_img].copy_(layout.img_to_joint)
        torch.add(self.arange[: b.num_img_rows - n_img], real + pad_txt, out=g.img_to_joint[n_img:])
        for dst, src, rows in (
            (g.txt_seq_ids, layout.txt_seq_ids, n_txt),
            (g.img_seq_ids, layout.img_seq_ids, n_img),
        ):
            dst[:rows].copy_(src)
            dst[rows:].fill_(n)  # the padding sequence's slot
        for (cos, sin), (src_cos, src_sin), rows in (
            (g.txt_rope, layout.txt_rope, n_txt),
            (g.img_rope, layout.img_rope, n_img),
        ):
            cos[:rows].copy_(src_cos)
            sin[:rows].copy_(src_sin)
            cos[rows:].fill_(1.0)
            sin[rows:].fill_(0.0)
        cu = g.attn.cu_seqlens_q
        cu[: n + 1].copy_(layout.attn.cu_seqlens_q)
        cu[n + 1 :].fill_(b.total_tokens)
        self._loaded = key

    def run(self) -> torch.Tensor:
        """Replay when captured, else the eager forward of the padded batch."""
        if self.graph is None:
            return self.run_eager()
        self.graph.replay()
        return self.out

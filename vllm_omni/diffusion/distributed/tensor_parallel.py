"""Tensor parallelism for the Qwen-Image MMDiT: attention heads and MLP hidden units split over ranks.

Megatron-style, per dual-stream block (both streams alike)::

    x (replicated) --> to_q / to_k / to_v        column: rank r owns heads [r*H/tp, (r+1)*H/tp)
                   --> attention on H/tp heads   (RMS QK-norm and RoPE are per head: unchanged)
                   --> to_out.0 / to_add_out     row: partial sums over the owned heads,
                                                 all_reduce(SUM), then the bias (added once)
    x (replicated) --> img_mlp/txt_mlp net.0.proj  column: 4*hidden/tp units, GELU per unit
                   --> net.2                       row + all_reduce, then the bias

Everything else (img_in, txt_in, txt_norm, time embedding, AdaLN modulation img_mod/txt_mod,
norm_out, proj_out) stays replicated: every rank holds the same activations between blocks. Two
all-reduces per stream per block. The joint attention's head count per rank comes from the shards'
shapes (the model splits heads with `unflatten(-1, (-1, head_dim))`), so the model needs no change.

Parameters keep their names (shards are `Linear` / `RowParallelLinear` with the whole layer's quant
method and a `LinearShard`): `state_dict()` of a rank is its shard. Loading full checkpoints happens
before sharding; each shard takes its slice of the whole layer's parameters through `Linear.load_weight`,
which slices along the dims the quant method declares (`param_dims`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from vllm_omni.diffusion.layers.linear import Linear, LinearShard
from vllm_omni.diffusion.layers.merged_linear import merge_linears

COLUMN_ATTN = ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj")
"""Attention projections split by output rows (heads)."""


class RowParallelLinear(Linear):
    """`y = all_reduce(x_shard @ W_shard^T) + b`: the input's last dim is this rank's shard.

    `weight` is `[out_features, in_features / tp]` (through the quant method: an FP8 weight keeps its
    whole per-output-channel scale); `bias` is the full `[out_features]`, added after the reduction so
    it counts once.
    """

    def __init__(self, in_features: int, out_features: int, group: dist.ProcessGroup | None, **kwargs):
        super().__init__(in_features, out_features, **kwargs)
        self.group = group

    def base_forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.quant_method.apply(self, x, None)
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.group)
        return out if self.bias is None else out + self.bias

    def runs_plain_gemm(self, x: torch.Tensor) -> bool:
        return False  # the all-reduce sits between the GEMM and the bias: no fused path may replace it

    def extra_repr(self) -> str:
        return super().extra_repr() + ", all_reduce=True"


def _shard_range(total: int, rank: int, size: int, what: str) -> slice:
    if total % size != 0:
        raise ValueError(f"{what} ({total}) must be divisible by tensor_parallel_size ({size})")
    per = total // size
    return slice(rank * per, (rank + 1) * per)


def _load_shard(shard: Linear, linear: Linear) -> Linear:
    """Every parameter of the whole `linear` through `shard.load_weight` (which keeps its slice)."""
    for name, param in linear.named_parameters(recurse=False):
        shard.load_weight(name, param)
    for name in set(dict(shard.named_parameters(recurse=False))) - set(dict(linear.named_parameters())):
        delattr(shard, name)  # a parameter the (processed) method no longer has
    for attr in linear.quant_method.layer_attrs:
        setattr(shard, attr, getattr(linear, attr))
    return shard


def column_shard(linear: Linear, rank: int, size: int, unit: int = 1, what: str = "") -> Linear:
    """A `Linear` with this rank's block of output rows, in units of `unit` rows (a head); same method."""
    _check_linear(linear)
    rows = _shard_range(linear.out_features // unit, rank, size, what or "output features")
    shard = Linear(
        linear.in_features,
        (rows.stop - rows.start) * unit,
        bias=linear.bias is not None,
        quant_method=linear.quant_method,
        shard=LinearShard("column", rows.start * unit, rows.stop * unit),
        device="meta",
    )
    return _load_shard(shard, linear)


def row_shard(
    linear: Linear, rank: int, size: int, group: dist.ProcessGroup | None, unit: int = 1, what: str = ""
) -> RowParallelLinear:
    """A `RowParallelLinear` with this rank's block of input columns, in units of `unit` columns."""
    _check_linear(linear)
    cols = _shard_range(linear.in_features // unit, rank, size, what or "input features")
    shard = RowParallelLinear(
        (cols.stop - cols.start) * unit,
        linear.out_features,
        group,
        bias=linear.bias is not None,
        quant_method=linear.quant_method,
        shard=LinearShard("row", cols.start * unit, cols.stop * unit),
        device="meta",
    )
    return _load_shard(shard, linear)


def _check_linear(linear: nn.Module) -> None:
    if not isinstance(linear, Linear) or linear.shard is not None or linear.lora is not None:
        raise ValueError(
            f"tensor parallelism shards an unsharded Linear without LoRA adapters, got {linear!r}"
        )


def apply_tensor_parallel(transformer: nn.Module, group: dist.ProcessGroup | None) -> int:
    """Shard every block of a `QwenImageTransformer` over `group`, in place; returns the layers sharded.

    `group=None` means the default (world) group. Column shards: to_q/k/v, add_q/k/v_proj (whole
    heads) and both MLPs' `net.0.proj`; row shards with an all-reduce: `to_out.0`, `to_add_out` and
    both MLPs' `net.2`. Raises ValueError when the heads (or MLP width) do not split evenly.
    Call it on every rank of the group, after the weights are loaded and before the first forward.
    """
    size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if size == 1:
        return 0
    config = transformer.config
    heads, head_dim = config.num_attention_heads, config.attention_head_dim
    if heads % size != 0:
        raise ValueError(f"num_attention_heads ({heads}) must be divisible by tensor_parallel_size ({size})")
    num_sharded = 0
    for block in transformer.transformer_blocks:
        attn = block.attn
        for name in COLUMN_ATTN:
            setattr(attn, name, column_shard(getattr(attn, name), rank, size, head_dim, "attention heads"))
        # each stream's q, k, v shards stacked again (rows [q heads ; k heads ; v heads] of this rank),
        # which also frees the whole layers' stacked weights
        merge_linears(attn)
        attn.to_out[0] = row_shard(attn.to_out[0], rank, size, group, head_dim, "attention heads")
        attn.to_add_out = row_shard(attn.to_add_out, rank, size, group, head_dim, "attention heads")
        for mlp in (block.img_mlp, block.txt_mlp):
            mlp.net[0].proj = column_shard(mlp.net[0].proj, rank, size, what="MLP hidden units")
            mlp.net[2] = row_shard(mlp.net[2], rank, size, group, what="MLP hidden units")
        num_sharded += len(COLUMN_ATTN) + 2 + 4
    return num_sharded

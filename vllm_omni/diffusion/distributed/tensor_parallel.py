"""Tensor parallelism of a transformer's blocks: attention heads and MLP hidden units split over ranks.

Megatron-style, as the family's `TensorParallelPlan` (models/plans.py) lists per block::

    x (replicated) --> column linears (q, k, v)     rank r owns heads [r*H/tp, (r+1)*H/tp)
                   --> attention on H/tp heads      (per-head norms and RoPE: unchanged)
                   --> row linear (out projection)  partial sums over the owned heads,
                                                    all_reduce(SUM), then the bias (added once)
    x (replicated) --> column linear (MLP up)       hidden/tp units, the activation per unit
                   --> row linear (MLP down)        row + all_reduce, then the bias

Every module the plan does not list stays replicated: every rank holds the same activations between
blocks. The attention's head count per rank comes from the shards' shapes (the model splits heads with
`unflatten(-1, (-1, head_dim))`), so the model needs no change.

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
    """Shard every block of `transformer` over `group` as its `plans.tensor_parallel` says, in place;
    returns the layers sharded.

    `group=None` means the default (world) group. Column shards split output rows, row shards input
    columns (with an all-reduce), in whole heads where the plan says so; merged projections (q, k, v)
    are stacked again from the shards. Raises ValueError when the family has no plan, or when the heads
    (or MLP width) do not split evenly. Call it on every rank of the group, after the weights are
    loaded and before the first forward.
    """
    size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if size == 1:
        return 0
    plans = transformer.plans
    if plans.tensor_parallel is None:
        raise ValueError(f"{type(transformer).__name__} declares no tensor-parallel plan")
    config = transformer.config
    heads, head_dim = config.num_attention_heads, config.attention_head_dim
    if heads % size != 0:
        raise ValueError(f"num_attention_heads ({heads}) must be divisible by tensor_parallel_size ({size})")
    num_sharded = 0
    for block in plans.block_list(transformer):
        for spec in plans.tensor_parallel.shards:
            unit, what = (head_dim, "attention heads") if spec.per_head else (1, "MLP hidden units")
            parent_path, _, leaf = spec.path.rpartition(".")
            parent = block.get_submodule(parent_path)
            linear = parent.get_submodule(leaf)
            if spec.style == "column":
                shard = column_shard(linear, rank, size, unit, what)
            else:
                shard = row_shard(linear, rank, size, group, unit, what)
            setattr(parent, leaf, shard)  # a ModuleList entry ("0") too
            num_sharded += 1
        # each merged projection's shards stacked again (rows [q heads ; k heads ; v heads] of this
        # rank), which also frees the whole layers' stacked weights
        merge_linears(block)
    return num_sharded

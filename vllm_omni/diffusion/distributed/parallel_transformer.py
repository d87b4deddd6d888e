"""`parallelize(transformer, groups)`: one Qwen-Image transformer run by all ranks of a replica.

Returns a `ParallelTransformer` with the transformer's own call API (`forward_packed(img_rows,
txt_rows, timestep, layout)`, dense `forward(...)`, `.config`), so the model runner uses it unchanged.
Every rank calls it with the same full inputs and gets the same full output:

    forward_packed(full batch)
      cfg parallel  -> this cfg rank's sub-batch (cfg_parallel.py)
      seq parallel  -> this sp rank's rows (sequence_parallel.py); attention backend wrapped in
                       Ulysses and/or Ring
      tensor par.   -> inside the blocks (tensor_parallel.py, applied once here)
      <- all_gather over sp, then over cfg: [num_img_rows, C_out] in full-batch row order

The dense path (same-shape batches) runs as is with tensor parallelism alone; with cfg parallelism
alone the batch items are split (even items on cfg rank 0, odd on rank 1: for a CFG batch, positives
and negatives); with sequence parallelism the dense batch is converted to a packed one.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
from torch import nn

from vllm_omni.diffusion.distributed.cfg_parallel import CfgPlan, build_cfg_plan
from vllm_omni.diffusion.distributed.parallel_state import ParallelGroups, all_gather_rows
from vllm_omni.diffusion.distributed.ring_attention import RingAttention
from vllm_omni.diffusion.distributed.sequence_parallel import SequenceShard, UlyssesAttention, shard_layout
from vllm_omni.diffusion.distributed.tensor_parallel import apply_tensor_parallel
from vllm_omni.diffusion.layout import PackedLayout, SequenceSpec, build_packed_layout
from vllm_omni.diffusion.models.interface import DenseInputs


def _img_shape(entry) -> tuple[int, int, int]:
    """(f, h, w) from `(f, h, w)` or the pipeline style `[(f, h, w)]`."""
    if isinstance(entry, list) and len(entry) == 1:
        entry = entry[0]
    return tuple(int(n) for n in entry)


class ParallelTransformer(nn.Module):
    """A family's transformer (already sharded by `parallelize`) driven across the replica's ranks."""

    packed_graph_steps: ClassVar[None] = None
    enable_prefix_arena: ClassVar[None] = None
    graph_context_axis: ClassVar[None] = None
    cuda_graphs_off_reason: ClassVar[str] = "parallel wrapper: its collectives stay eager"

    def __init__(self, transformer: nn.Module, groups: ParallelGroups):
        super().__init__()
        self.transformer = transformer
        self.groups = groups
        self.config = transformer.config
        self.position_tables = transformer.position_tables
        self.plans = dataclasses.replace(transformer.plans, blocks=f"transformer.{transformer.plans.blocks}")
        """The inner transformer's plans (`models/plans.py`), its blocks reached through this wrapper."""
        self._packed: tuple[PackedLayout | None, CfgPlan | None, SequenceShard | None] = (None, None, None)
        self._dense: tuple[tuple | None, PackedLayout | None, torch.Tensor | None] = (None, None, None)
        self.num_split_forwards = 0
        """Forwards whose work was split over cfg / sp ranks (not run whole by every rank)."""

    @property
    def num_compile_fallbacks(self) -> int:
        return self.transformer.num_compile_fallbacks

    @property
    def out_channels(self) -> int:
        return self.config.patch_size**2 * self.config.out_channels

    # ---- packed -------------------------------------------------------------------------------

    def _plan(self, layout: PackedLayout) -> tuple[CfgPlan | None, SequenceShard | None]:
        """This rank's cfg sub-batch and row shard of `layout` (cached while the layout object lives)."""
        if self._packed[0] is not layout:
            cfg, sp = self.groups.cfg, self.groups.sp
            cfg_plan = build_cfg_plan(layout, cfg.size, cfg.rank) if cfg.size > 1 else None
            sp_layout = cfg_plan.layout if cfg_plan is not None else layout
            shard = None
            # Fewer tokens than sp ranks: every sp rank runs the whole sub-batch (attention wrappers
            # see unsharded metadata and call their inner backend).
            if sp.size > 1 and sp_layout is not None and sp_layout.total_tokens >= sp.size:
                shard = shard_layout(sp_layout, sp.size, sp.rank)
            self._packed = (layout, cfg_plan, shard)
        return self._packed[1], self._packed[2]

    def _sp_forward(self, img_rows, txt_rows, timestep, layout: PackedLayout, shard: SequenceShard | None):
        if shard is None:
            return self.transformer.forward_packed(img_rows, txt_rows, timestep, layout)
        out = self.transformer.forward_packed(
            img_rows[shard.img_rows], txt_rows[shard.txt_rows], timestep, shard.layout
        )  # [local img rows, C_out]
        return all_gather_rows(out, self.groups.sp, shard.img_counts)

    def forward_packed(
        self, img_rows: torch.Tensor, txt_rows: torch.Tensor, timestep: torch.Tensor, layout: PackedLayout
    ) -> torch.Tensor:
        """Same contract as the inner transformer's `forward_packed`; call on every rank with the same
        full inputs. Returns the full `[num_img_rows, patch**2 * out_channels]` on every rank."""
        cfg_plan, shard = self._plan(layout)
        self.num_split_forwards += int(cfg_plan is not None or shard is not None)
        if cfg_plan is None:
            return self._sp_forward(img_rows, txt_rows, timestep, layout, shard)
        if cfg_plan.layout is None:  # nothing assigned to this cfg rank
            out = img_rows.new_empty((0, self.out_channels))
        else:
            out = self._sp_forward(
                img_rows.index_select(0, cfg_plan.img_index),
                txt_rows.index_select(0, cfg_plan.txt_index),
                timestep.index_select(0, cfg_plan.seq_index),
                cfg_plan.layout,
                shard,
            )
        gathered = all_gather_rows(out, self.groups.cfg, cfg_plan.img_counts)  # cfg-rank order
        return torch.empty_like(gathered).index_copy_(0, cfg_plan.gather_index, gathered)

    # ---- dense --------------------------------------------------------------------------------

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        encoder_hidden_states_mask: torch.Tensor | None,
        timestep: torch.Tensor,
        img_shapes: list,
    ) -> torch.Tensor:
        """The inner transformer's dense `forward` (`interface.DenseInputs`), on every rank."""
        inputs = DenseInputs(
            hidden_states, encoder_hidden_states, encoder_hidden_states_mask, timestep, img_shapes
        )
        if self.groups.sp.size > 1:
            return self._dense_as_packed(inputs)
        if self.groups.cfg.size == 1:
            return self.transformer(*inputs.args)
        return self._dense_cfg_split(inputs)

    def _dense_cfg_split(self, inputs: DenseInputs) -> torch.Tensor:
        """cfg rank c runs batch items c, c + 2, ... (a CFG batch alternates positive / negative)."""
        hidden_states, encoder_hidden_states, mask, timestep, img_shapes = inputs.args
        cfg = self.groups.cfg
        self.num_split_forwards += 1
        batch, num_img = hidden_states.shape[:2]
        items = [list(range(c, batch, cfg.size)) for c in range(cfg.size)]
        mine = items[cfg.rank]
        if mine:
            sel = torch.tensor(mine, device=hidden_states.device)
            out = self.transformer(
                hidden_states.index_select(0, sel),
                encoder_hidden_states.index_select(0, sel),
                None if mask is None else mask.index_select(0, sel),
                timestep.index_select(0, sel),
                [img_shapes[i] for i in mine],
            ).flatten(0, 1)  # [len(mine) * S_img, C_out]
        else:
            out = hidden_states.new_empty((0, self.out_channels))
        gathered = all_gather_rows(out, cfg, [len(i) * num_img for i in items])
        order = torch.tensor([i for part in items for i in part], device=hidden_states.device)
        result = torch.empty_like(gathered).view(batch, num_img, -1)
        return result.index_copy_(0, order, gathered.view(batch, num_img, -1))

    def _dense_as_packed(self, inputs: DenseInputs) -> torch.Tensor:
        """Run a dense batch through the packed path (sequence parallelism needs packed rows)."""
        hidden_states, encoder_hidden_states, mask, timestep, img_shapes = inputs.args
        batch, num_img, _ = hidden_states.shape
        max_txt = encoder_hidden_states.shape[1]
        device = hidden_states.device
        if mask is None:
            txt_lens = [max_txt] * batch
        else:
            txt_lens = mask.to(torch.long).sum(dim=1).tolist()
            prefix = (
                torch.arange(max_txt, device=device)[None, :] < torch.tensor(txt_lens, device=device)[:, None]
            )
            if not torch.equal(mask.to(torch.bool), prefix):
                raise ValueError("encoder_hidden_states_mask must mark a prefix of real tokens per item")
        shapes = [_img_shape(s) for s in img_shapes]
        key = (tuple(shapes), tuple(txt_lens), max_txt, device)
        if self._dense[0] != key:
            # items 2j, 2j+1 as a (positive, negative) pair: what a CFG batch is, harmless otherwise
            specs = [
                SequenceSpec(n, shape, req_id=f"item-{b // 2}", is_negative=b % 2 == 1)
                for b, (n, shape) in enumerate(zip(txt_lens, shapes))
            ]
            layout = build_packed_layout(specs, self.position_tables, device=device)
            txt_index = torch.cat([torch.arange(n) + b * max_txt for b, n in enumerate(txt_lens)]).to(device)
            self._dense = (key, layout, txt_index)
        _, layout, txt_index = self._dense
        txt_rows = encoder_hidden_states.flatten(0, 1).index_select(0, txt_index)
        out = self.forward_packed(hidden_states.flatten(0, 1), txt_rows, timestep, layout)
        return out.view(batch, num_img, -1)


def parallelize(transformer: nn.Module, groups: ParallelGroups) -> ParallelTransformer:
    """Shard `transformer` in place for this rank and wrap it; call on every rank of the replica.

    Tensor parallel: `apply_tensor_parallel` over `groups.tp`. Sequence parallel: the attention
    backend (resolved now for the weights' device and dtype) is wrapped in `RingAttention` (ring
    degree > 1) and then `UlyssesAttention` (ulysses degree > 1). Raises ValueError when the heads
    do not split over tensor_parallel_size * ulysses_degree.
    """
    config = groups.config
    config.validate_model(transformer.config.num_attention_heads)
    if groups.tp.size > 1:
        apply_tensor_parallel(transformer, groups.tp.group)
    if groups.sp.size > 1:
        device = next(transformer.parameters()).device
        backend = base = transformer.get_attn_backend(device)
        if groups.ring.size > 1:
            backend = RingAttention(groups.ring, fallback=base, stride=groups.ulysses.size)
        if groups.ulysses.size > 1:
            backend = UlyssesAttention(
                backend, groups.ulysses, sp_offset=groups.ring.rank * groups.ulysses.size
            )
        transformer.attn_backend = backend
    return ParallelTransformer(transformer, groups)

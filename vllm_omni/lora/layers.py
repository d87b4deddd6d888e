"""LoRA on the transformer's linears: adapters in fixed device slots, one pass for rows of many adapters.

Every targeted `Linear` (`vllm_omni/diffusion/layers/linear.py`) gets a `LoRALinearSlots` in its `lora`
slot (parameters, names, class and state_dict keys unchanged). It holds up to `max_loras` adapters in
*slots* allocated once, rank padded to `max_lora_rank` (rounded up to 16, the kernels' smallest tile):

    lora_a   [max_loras, R, in]      slot s = 1 .. max_loras at index s - 1 (rows past the rank: zeros)
    lora_b   [max_loras, out, R]
    scaling  fp32 [max_loras + 1]    alpha / rank of the adapter in slot s on this linear; 0 = none.
                                     Slot 0 is "no adapter": its scaling is always 0.

The members of a merged projection (q, k, v of one stream: `MergedLinear`, one GEMM over their stacked
weights) share ONE set of stacks, `LoRAGroupSlots`, created for all members as soon as an adapter
targets any of them; each member's slots are views of it:

    lora_a   [max_loras, M * R, in]    member m: rows [m R, (m + 1) R)     (an adapter that skips a
    lora_b   [max_loras, M * out, R]   member m: rows [m out, (m + 1) out)  member leaves zeros and
    scaling  fp32 [M, max_loras + 1]   member m: row m                      scaling 0 there)

so on CUDA the group's deltas are one shrink over the stacked A (x read once: [rows, M R]) and one
expand into each member's output columns, two launches for the three projections.

Loading or unloading an adapter writes its slot in place (`copy_` / `zero_`, never a new tensor), so a
captured CUDA graph keeps pointing at valid memory and sees the new adapter. After its quant method's
GEMM (plain, batch invariant or FP8) a LoRA linear adds, in the activation dtype, for every run g of
rows that share a slot and a scale (batch.py):

    y[rows_g] += scale_g * scaling[slot_g] * (x[rows_g] @ A[slot_g]^T) @ B[slot_g]^T

    CUDA             kernels.py: two Triton kernels over the run tiles (per linear, or per merged
                     group), fixed launch shapes (graph-safe); tiles of slot 0, or of an adapter
                     this linear lacks, return at once. `kernel_delta` hands the launch's
                     arguments to a caller instead: diffusion/layers/paired_linear.py launches
                     the two streams' linears of one block point together (one pair for both)
    CPU, or batch-   a host loop over the runs, two GEMMs each at the adapter's own rank (the
    invariant mode   batch-invariant matmul in that mode: graphs are off there)

Which rows a linear sees is fixed by its name, through the family's LoRA plan (`LoRAPlan.row_stream`,
models/plans.py). The forward's `LoRABatch` reaches the
layers through `LoRAStepState.activate(batch)`, one scoped context manager per model; outside it every
LoRA linear is its base, and computes exactly what it would without slots.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vllm_omni.diffusion.layers.linear import Linear
from vllm_omni.diffusion.layers.merged_linear import HasMergedLinears
from vllm_omni.lora import kernels
from vllm_omni.lora.batch import (  # noqa: F401  (LoRABatch, LoRAMapping, SeqLoRA re-exported)
    LoRABatch,
    LoRAMapping,
    RowStream,
    SeqLoRA,
    StreamRuns,
)
from vllm_omni.lora.kernels import KernelDelta

RANK_ALIGN = 16
"""Slot ranks are padded to a multiple of this (tl.dot's smallest side)."""


@dataclass(frozen=True)
class LoRAModuleWeights:
    """One adapter's matrices for one linear: delta = scaling * (x @ lora_a^T) @ lora_b^T."""

    lora_a: torch.Tensor
    """[rank, in_features], the model's dtype."""
    lora_b: torch.Tensor
    """[out_features, rank]."""
    scaling: float
    """alpha / rank (1.0 when the file has no alpha)."""

    @property
    def rank(self) -> int:
        return self.lora_a.shape[0]


class LoRAStepState:
    """What the LoRA linears of one model read: the forward's batch, and the slots' layout version."""

    def __init__(self) -> None:
        self.batch: LoRABatch | None = None
        """The rows each slot adapts in the forward in flight (None: every LoRA linear is its base)."""
        self.version = 0
        """Bumped whenever a linear gains or loses its slots: CUDA graphs captured with LoRA before
        are stale (they launch no delta for a new linear, or read freed slots)."""

    @contextlib.contextmanager
    def activate(self, batch: LoRABatch | None):
        """Within the block, the model's LoRA linears apply `batch` (None: base only)."""
        previous, self.batch = self.batch, batch
        try:
            yield
        finally:
            self.batch = previous


def _padded_rank(max_rank: int) -> int:
    return -(-max_rank // RANK_ALIGN) * RANK_ALIGN


def _zero_stacks(linear: Linear, num_members: int, max_loras: int, max_rank: int):
    """(lora_a, lora_b, scaling) zeros for `num_members` linears shaped like `linear`, stacked."""
    rank = _padded_rank(max_rank)
    factory = dict(device=linear.weight.device, dtype=linear.compute_dtype)
    # normal tensors even when built under inference mode: slots are rewritten outside it
    with torch.inference_mode(False), torch.no_grad():
        return (
            torch.zeros(max_loras, num_members * rank, linear.in_features, **factory),
            torch.zeros(max_loras, num_members * linear.out_features, rank, **factory),
            torch.zeros(num_members, max_loras + 1, dtype=torch.float32, device=linear.weight.device),
        )


class LoRAGroupSlots:
    """The slot stacks shared by the members of a merged projection (see the module docstring): each
    member's `LoRALinearSlots` is a view of them; the group adds all members' deltas at once."""

    def __init__(
        self,
        members: tuple[Linear, ...],
        stream: RowStream,
        state: LoRAStepState,
        max_loras: int,
        max_rank: int,
    ):
        self.members = members
        self.lora_a, self.lora_b, self.scaling = _zero_stacks(members[0], len(members), max_loras, max_rank)
        for i, m in enumerate(members):
            m.lora = LoRALinearSlots(m, stream, state, max_loras, max_rank, group=(self, i))

    @property
    def is_empty(self) -> bool:
        """No member's slot holds an adapter (the group's memory can go)."""
        return all(m.lora.is_empty for m in self.members)

    def kernel_delta(
        self, x: torch.Tensor, out: torch.Tensor, batch_invariant: bool, activation: str | None = None
    ) -> KernelDelta | None:
        """All members' deltas into out [..., M * out] (the merged GEMM's output) as one segment of a
        kernel launch (the group's stacks), then `activation` over all of out, or None: no LoRA batch,
        or the host path."""
        rows = self.members[0].lora.rows_of(x)
        if rows is None:
            return None
        return _kernel_delta(
            x, out, self.lora_a, self.lora_b, self.scaling, rows, batch_invariant, activation
        )

    def add_delta(self, x: torch.Tensor, out: torch.Tensor, batch_invariant: bool) -> None:
        """out [..., M * out] (the merged GEMM's output) += every member's deltas for x. On CUDA two
        launches for all members; on the host path each member adds its own (as it would unmerged)."""
        rows = self.members[0].lora.rows_of(x)
        if rows is None:
            return
        delta = _kernel_delta(x, out, self.lora_a, self.lora_b, self.scaling, rows, batch_invariant)
        if delta is not None:
            kernels.lora_delta_segment(delta)
            return
        num_out = self.members[0].out_features
        for i, m in enumerate(self.members):
            m.lora.add_delta(x, out[..., i * num_out : (i + 1) * num_out], batch_invariant)


class LoRALinearSlots:
    """The adapter slots of one `Linear` (its `lora` slot); see the module docstring for the layout.

    `group`: (the merged group's shared stacks, this member's index): the slots are views of them."""

    def __init__(
        self,
        linear: Linear,
        stream: RowStream,
        state: LoRAStepState,
        max_loras: int,
        max_rank: int,
        group: tuple[LoRAGroupSlots, int] | None = None,
    ):
        self.stream = stream
        self.state = state
        self.group = group[0] if group is not None else None
        """The merged group whose stacks hold these slots (None: a linear of its own)."""
        if group is None:
            lora_a, lora_b, scaling = _zero_stacks(linear, 1, max_loras, max_rank)
            self.lora_a, self.lora_b, self.scaling = lora_a, lora_b, scaling[0]
        else:
            stacks, i = group
            rank, num_out = _padded_rank(max_rank), linear.out_features
            self.lora_a = stacks.lora_a[:, i * rank : (i + 1) * rank]  # [max_loras, R, in]
            self.lora_b = stacks.lora_b[:, i * num_out : (i + 1) * num_out]  # [max_loras, out, R]
            self.scaling = stacks.scaling[i]  # [max_loras + 1]
        self.scaling_cpu = [0.0] * (max_loras + 1)
        """Host copy of `scaling` (the host path reads it without a device sync)."""
        self.ranks = [0] * (max_loras + 1)
        """Each slot's adapter's own rank (the host path multiplies only those columns)."""

    @property
    def num_slots(self) -> int:
        return self.lora_a.shape[0]

    @property
    def is_empty(self) -> bool:
        """No slot holds an adapter on this linear."""
        return not any(self.scaling_cpu)

    @property
    def can_free(self) -> bool:
        """No adapter left on this linear, nor on its group's other members (one allocation)."""
        return self.group.is_empty if self.group is not None else self.is_empty

    def add_merged_delta(
        self, members: tuple[Linear, ...], x: torch.Tensor, out: torch.Tensor, batch_invariant: bool
    ) -> bool:
        """For a merged GEMM over `members` (this linear first): out [..., sum(out)] += all members'
        deltas at once and True, when these slots are those members' group; else False (the caller
        adds each member's own)."""
        if self.group is None or self.group.members != members:
            return False
        self.group.add_delta(x, out, batch_invariant)
        return True

    def merged_kernel_delta(
        self,
        members: tuple[Linear, ...],
        x: torch.Tensor,
        out: torch.Tensor,
        batch_invariant: bool,
        activation: str | None = None,
    ) -> KernelDelta | None:
        """`add_merged_delta` as one segment of a kernel launch: the group's `kernel_delta` when these
        slots are `members`' group, else None (also: no LoRA batch, the host path)."""
        if self.group is None or self.group.members != members:
            return None
        return self.group.kernel_delta(x, out, batch_invariant, activation)

    def rows_of(self, x: torch.Tensor) -> StreamRuns | None:
        """The forward's rows of this linear's stream (None: no LoRA batch), checked against x."""
        batch = self.state.batch
        if batch is None:
            return None
        rows = batch.streams[self.stream]
        if math.prod(x.shape[:-1]) != rows.num_rows:
            raise ValueError(
                f"LoRA: a {self.stream}-stream linear got {list(x.shape)} rows, the forward's LoRA batch "
                f"has {rows.num_rows}; build it from LoRAMapping.for_packed(seqs, layout) / for_dense"
            )
        return rows

    @torch.no_grad()
    def write(self, slot: int, weights: LoRAModuleWeights) -> None:
        """Put an adapter's matrices in `slot` (1 .. max_loras), in place."""
        self._check_slot(slot)
        rank = weights.rank
        if rank > self.lora_a.shape[1] or weights.lora_a.shape[1] != self.lora_a.shape[2]:
            raise ValueError(f"LoRA weights of shape {list(weights.lora_a.shape)} do not fit slots {self}")
        a, b = self.lora_a[slot - 1], self.lora_b[slot - 1]  # [R, in], [out, R]
        a[rank:].zero_()
        a[:rank].copy_(weights.lora_a)
        b[:, rank:].zero_()
        b[:, :rank].copy_(weights.lora_b)
        self.scaling[slot].fill_(weights.scaling)
        self.scaling_cpu[slot], self.ranks[slot] = float(weights.scaling), rank

    @torch.no_grad()
    def clear(self, slot: int) -> None:
        """Empty `slot` in place ("no adapter": scaling 0, zero matrices)."""
        self._check_slot(slot)
        self.scaling[slot].zero_()
        self.lora_a[slot - 1].zero_()
        self.lora_b[slot - 1].zero_()
        self.scaling_cpu[slot], self.ranks[slot] = 0.0, 0

    def _check_slot(self, slot: int) -> None:
        if not 1 <= slot <= self.num_slots:
            raise ValueError(f"LoRA slot {slot} is not in [1, {self.num_slots}]")

    def is_active(self, x: torch.Tensor) -> bool:
        """Whether this forward adds deltas. Every LoRA linear of a forward with a batch is, whatever
        its rows hold: a captured graph must launch the same kernels for any adapters in its tables."""
        return self.state.batch is not None

    def add_delta(self, x: torch.Tensor, out: torch.Tensor, batch_invariant: bool) -> None:
        """out += the deltas of x's adapted rows. `out` is the linear's base output `[..., out]`, or its
        columns of a fused GEMM's output (a strided view, written in place). `batch_invariant`: the
        base is batch invariant, so the deltas use the invariant matmul too."""
        rows = self.rows_of(x)
        if rows is None:
            return
        delta = _kernel_delta(x, out, self.lora_a, self.lora_b, self.scaling, rows, batch_invariant)
        if delta is not None:
            kernels.lora_delta_segment(delta)
            return
        x2d, out2d = x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1])  # [rows, in], [rows, out]
        x2d = x2d.to(out.dtype)
        add_delta = _add_delta_invariant if batch_invariant else _add_delta
        for start, end, slot, scale in rows.runs:
            scaling = self.scaling_cpu[slot]
            if scaling:
                rank = self.ranks[slot]
                a, b = (
                    self.lora_a[slot - 1, :rank],
                    self.lora_b[slot - 1, :, :rank],
                )  # [rank, in], [out, rank]
                add_delta(out2d[start:end], x2d[start:end], a, b, scale * scaling)

    def kernel_delta(
        self, x: torch.Tensor, out: torch.Tensor, batch_invariant: bool, activation: str | None = None
    ) -> KernelDelta | None:
        """`add_delta`'s deltas as one segment of a kernel launch, or None: no LoRA batch, or the host
        path (CPU, batch-invariant mode), where `add_delta` loops over the runs. With an `activation`
        (`kernels.ACTIVATIONS`) the segment also applies it to every row of out (the tiles of every
        row of the stream)."""
        rows = self.rows_of(x)
        if rows is None:
            return None
        return _kernel_delta(
            x, out, self.lora_a, self.lora_b, self.scaling, rows, batch_invariant, activation
        )

    def __repr__(self) -> str:
        return f"LoRALinearSlots({self.stream}, a {list(self.lora_a.shape)}, b {list(self.lora_b.shape)})"


def use_kernels(x: torch.Tensor) -> bool:
    """Whether the deltas of x run as the Triton kernels (CUDA) rather than the host loop over runs
    (tests point it at triton's CPU interpreter)."""
    return x.is_cuda


def _kernel_delta(
    x: torch.Tensor,
    out: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: torch.Tensor,
    rows: StreamRuns,
    batch_invariant: bool,
    activation: str | None = None,
) -> KernelDelta | None:
    """The launch segment of x's deltas into out over these stacks (x [..., in], out [..., columns]),
    then `activation` over every row of out, or None on the host path (not CUDA, or batch-invariant
    mode)."""
    if not use_kernels(x) or batch_invariant:
        return None
    x2d = x.reshape(-1, x.shape[-1]).to(out.dtype)  # [rows, in]
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    tiles, scales = rows.tables(every_row=activation is not None)
    return KernelDelta(x2d, out.view(-1, out.shape[-1]), lora_a, lora_b, scaling, tiles, scales, activation)


def _add_delta(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> None:
    """out += scale * (x @ a^T) @ b^T; the expand GEMM accumulates into `out` (no delta tensor)."""
    out.addmm_(F.linear(x, a), b.t(), alpha=scale)  # [n, rank] @ [rank, out]


def _add_delta_invariant(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float):
    """`_add_delta` with the batch-invariant matmul: each row's bits depend only on that row."""
    from vllm_omni.diffusion.batch_invariant import batch_invariant_linear

    shrunk = batch_invariant_linear(x, a, None) * scale  # [n, rank]
    out += batch_invariant_linear(shrunk, b, None)  # [n, out]


def is_lora_linear(module: nn.Module) -> bool:
    """Whether `module` is a `Linear` with adapter slots."""
    return isinstance(module, Linear) and isinstance(module.lora, LoRALinearSlots)


def make_lora_linear(
    module: nn.Module, name: str, state: LoRAStepState, max_loras: int, max_rank: int, *, stream: RowStream
) -> LoRALinearSlots:
    """Give `module` (a `Linear`, any quant method) adapter slots of its own, applied to the rows of
    `stream` (the family's `LoRAPlan.row_stream(name)`); returns them. Idempotent.

    A new set of slots bumps `state.version`. (A model's linears get theirs from `make_lora_slots`,
    which gives a merged projection's members one shared group.)
    """
    if not isinstance(module, Linear):
        raise ValueError(f"LoRA target {name!r} is a {type(module).__name__}, not a linear layer")
    if module.lora is None:
        module.lora = LoRALinearSlots(module, stream, state, max_loras, max_rank)
        state.version += 1
    return module.lora


def merged_group_of(modules: Mapping[str, nn.Module], name: str) -> tuple[Linear, ...] | None:
    """The members of the merged projection (`HasMergedLinears.merged_linears`) that linear `name`
    belongs to, when they can share slot stacks (same shapes, dtype and device, no slots yet); else
    None. `modules`: the model's `named_modules()`."""
    parent_name, _, leaf = name.rpartition(".")
    parent = modules.get(parent_name)
    if not isinstance(parent, HasMergedLinears):
        return None
    for member_names in parent.merged_linears.values():
        if leaf not in member_names:
            continue
        members = tuple(parent.get_submodule(n) for n in member_names)
        first = members[0]
        if all(
            type(m) is Linear
            and m.lora is None
            and (m.in_features, m.out_features) == (first.in_features, first.out_features)
            and m.compute_dtype == first.compute_dtype
            and m.weight.device == first.weight.device
            for m in members
        ):
            return members
    return None


def make_lora_slots(
    modules: Mapping[str, nn.Module],
    name: str,
    state: LoRAStepState,
    max_loras: int,
    max_rank: int,
    *,
    stream: RowStream,
) -> LoRALinearSlots:
    """Adapter slots for the model's linear `name` (`modules`: the model's `named_modules()`) on the rows
    of `stream` (a merged projection's members share theirs: one stream per group); returns
    them. A member of a merged projection gets a `LoRAGroupSlots` shared with its siblings, made for all
    of them at once (those an adapter skips keep zeros); any other linear slots of its own. Idempotent."""
    module = modules.get(name)
    if isinstance(module, Linear) and module.lora is None:
        members = merged_group_of(modules, name)
        if members is not None:
            LoRAGroupSlots(members, stream, state, max_loras, max_rank)
            state.version += 1
    return make_lora_linear(module, name, state, max_loras, max_rank, stream=stream)


def restore_linear(module: nn.Module) -> None:
    """Undo `make_lora_linear` / `make_lora_slots` (the last adapter on `module` was unloaded): the
    slots are freed, for a merged group's member those of the whole group (`can_free` says when)."""
    if is_lora_linear(module):
        slots = module.lora
        slots.state.version += 1
        for m in slots.group.members if slots.group is not None else (module,):
            m.lora = None

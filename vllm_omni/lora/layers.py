"""LoRA on the transformer's linears: adapters in fixed device slots, one pass for rows of many adapters.

Every targeted `Linear` (`vllm_omni/diffusion/layers/linear.py`) gets a `LoRALinearSlots` in its `lora`
slot (parameters, names, class and state_dict keys unchanged). It holds up to `max_loras` adapters in
*slots* allocated once, rank padded to `max_lora_rank` (rounded up to 16, the kernels' smallest tile):

    lora_a   [max_loras, R, in]      slot s = 1 .. max_loras at index s - 1 (rows past the rank: zeros)
    lora_b   [max_loras, out, R]
    scaling  fp32 [max_loras + 1]    alpha / rank of the adapter in slot s on this linear; 0 = none.
                                     Slot 0 is "no adapter": its scaling is always 0.

Loading or unloading an adapter writes its slot in place (`copy_` / `zero_`, never a new tensor), so a
captured CUDA graph keeps pointing at valid memory and sees the new adapter. After its quant method's
GEMM (plain, batch invariant or FP8) a LoRA linear adds, in the activation dtype, for every run g of
rows that share a slot and a scale (batch.py):

    y[rows_g] += scale_g * scaling[slot_g] * (x[rows_g] @ A[slot_g]^T) @ B[slot_g]^T

    CUDA             kernels.py: two Triton kernels over the run tiles, fixed launch shapes (graph-safe);
                     tiles of slot 0, or of an adapter this linear lacks, return at once
    CPU, or batch-   a host loop over the runs, two GEMMs each at the adapter's own rank (the
    invariant mode   batch-invariant matmul in that mode: graphs are off there)

Which rows a linear sees is fixed by its name (`row_stream`). The forward's `LoRABatch` reaches the
layers through `LoRAStepState.activate(batch)`, one scoped context manager per model; outside it every
LoRA linear is its base, and computes exactly what it would without slots.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vllm_omni.diffusion.layers.linear import Linear
from vllm_omni.lora.batch import LoRABatch, LoRAMapping, RowStream, SeqLoRA  # noqa: F401  (re-exported)

SEQ_STREAM_MODULES = ("img_mod", "txt_mod", "norm_out", "time_text_embed")
"""Top-level names of modules whose linears see one row per sequence (modulation, timestep)."""
TXT_STREAM_MODULES = ("txt_in", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out", "txt_mlp")
"""Names whose linears see the text stream; every other linear sees the image stream."""
RANK_ALIGN = 16
"""Slot ranks are padded to a multiple of this (tl.dot's smallest side)."""


def row_stream(module_name: str) -> RowStream:
    """Which rows the linear `module_name` (a transformer module path) is applied to."""
    parts = module_name.split(".")
    if any(p in SEQ_STREAM_MODULES for p in parts):
        return "seq"
    if any(p in TXT_STREAM_MODULES for p in parts):
        return "txt"
    return "img"


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


class LoRALinearSlots:
    """The adapter slots of one `Linear` (its `lora` slot); see the module docstring for the layout."""

    def __init__(
        self, linear: Linear, stream: RowStream, state: LoRAStepState, max_loras: int, max_rank: int
    ):
        self.stream = stream
        self.state = state
        rank = -(-max_rank // RANK_ALIGN) * RANK_ALIGN
        factory = dict(device=linear.weight.device, dtype=linear.compute_dtype)
        # normal tensors even when built under inference mode: slots are rewritten outside it
        with torch.inference_mode(False), torch.no_grad():
            self.lora_a = torch.zeros(max_loras, rank, linear.in_features, **factory)
            self.lora_b = torch.zeros(max_loras, linear.out_features, rank, **factory)
            self.scaling = torch.zeros(max_loras + 1, dtype=torch.float32, device=linear.weight.device)
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
        batch = self.state.batch
        if batch is None:
            return
        rows = batch.streams[self.stream]
        x2d, out2d = x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1])  # [rows, in], [rows, out]
        if x2d.shape[0] != rows.num_rows:
            raise ValueError(
                f"LoRA: a {self.stream}-stream linear got {list(x.shape)} rows, the forward's LoRA batch "
                f"has {rows.num_rows}; build it from LoRAMapping.for_packed(seqs, layout) / for_dense"
            )
        x2d = x2d.to(out.dtype)
        if use_kernels(x2d) and not batch_invariant:
            from vllm_omni.lora.kernels import lora_delta

            if x2d.stride(-1) != 1:
                x2d = x2d.contiguous()
            lora_delta(x2d, out2d, self.lora_a, self.lora_b, self.scaling, rows.tiles, rows.scales)
            return
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

    def __repr__(self) -> str:
        return f"LoRALinearSlots({self.stream}, a {list(self.lora_a.shape)}, b {list(self.lora_b.shape)})"


def use_kernels(x: torch.Tensor) -> bool:
    """Whether the deltas of x run as the Triton kernels (CUDA) rather than the host loop over runs
    (tests point it at triton's CPU interpreter)."""
    return x.is_cuda


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
    module: nn.Module, name: str, state: LoRAStepState, max_loras: int, max_rank: int
) -> LoRALinearSlots:
    """Give `module` (a `Linear`, any quant method) adapter slots; returns them. Idempotent.

    A new set of slots bumps `state.version`. A merged GEMM over the linear and its siblings
    (`MergedLinear` in layers/merged_linear.py: the QKV projections) still runs as one GEMM, then adds
    each member's delta to its own output columns.
    """
    if not isinstance(module, Linear):
        raise ValueError(f"LoRA target {name!r} is a {type(module).__name__}, not a linear layer")
    if module.lora is None:
        module.lora = LoRALinearSlots(module, row_stream(name), state, max_loras, max_rank)
        state.version += 1
    return module.lora


def restore_linear(module: nn.Module) -> None:
    """Undo `make_lora_linear` (the last adapter on `module` was unloaded): the slots are freed."""
    if is_lora_linear(module):
        module.lora.state.version += 1
        module.lora = None

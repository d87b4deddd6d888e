"""LoRA on the transformer's linears: one forward for rows of many adapters (punica's idea, kept simple).

Every targeted `Linear` (`vllm_omni/diffusion/layers/linear.py`) gets a `LoRALinearSlot` in its `lora`
slot (parameters, names, class and state_dict keys unchanged); the layer adds, after its quant method's
GEMM (plain, batch invariant or FP8), one low-rank delta per *run* of rows that share an adapter and scale,
in the activation dtype:

    y = quant_method.apply(x) + sum over runs g:  scale_g * (x[rows_g] @ A_g^T) @ B_g^T  (no adapter: 0)

A run is a range of consecutive rows. The packed forward keeps each sequence's rows contiguous in its
stream (see packing.py), so the runs come from the layout's row offsets, with neighbouring sequences of
the same (adapter, scale) merged:

    img_rows  | seq 0 (A, 1.0) | seq 1 (A, 1.0) | seq 2 (none) | seq 3 (B, 0.5) |
    runs      | A x 1.0 ---------------------- |              | B x 0.5        |

The dense forward's `[B, S, C]` row b belongs to sequence b; modulation linears (`img_mod`, `txt_mod`,
`norm_out.linear`, `time_text_embed`) see one row per sequence, `[num_seqs, C]`. Which rows a linear
sees is fixed by its name (`row_stream`).

Which adapter each sequence uses reaches the layers through `LoRAStepState.activate(mapping)`, one
scoped context manager per model (restored in `finally`); outside it every LoRA linear is its base.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from vllm_omni.diffusion.layers.linear import Linear

RowStream = Literal["img", "txt", "seq"]

SEQ_STREAM_MODULES = ("img_mod", "txt_mod", "norm_out", "time_text_embed")
"""Top-level names of modules whose linears see one row per sequence (modulation, timestep)."""
TXT_STREAM_MODULES = ("txt_in", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out", "txt_mlp")
"""Names whose linears see the text stream; every other linear sees the image stream."""


def row_stream(module_name: str) -> RowStream:
    """Which rows the linear `module_name` (a transformer module path) is applied to."""
    parts = module_name.split(".")
    if any(p in SEQ_STREAM_MODULES for p in parts):
        return "seq"
    if any(p in TXT_STREAM_MODULES for p in parts):
        return "txt"
    return "img"


@dataclass(frozen=True)
class SeqLoRA:
    """The adapter of one sequence of a forward."""

    lora_int_id: int
    """The adapter's id (0 = no adapter)."""
    scale: float = 1.0
    """The request's `lora_scale` (multiplies the adapter's own alpha / rank)."""

    @classmethod
    def of(cls, sampling_params) -> SeqLoRA:
        """The adapter of a request's sequences, from its (engine-resolved) sampling params."""
        request = sampling_params.lora_request
        if request is None:
            return cls(0)
        if not request.lora_int_id:
            raise ValueError(f"lora: adapter {request.lora_name!r} reached the model unresolved")
        return cls(request.lora_int_id, float(sampling_params.lora_scale))


@dataclass(frozen=True)
class LoRAModuleWeights:
    """One adapter's matrices for one linear: delta = scaling * (x @ lora_a^T) @ lora_b^T."""

    lora_a: torch.Tensor
    """[rank, in_features], the model's dtype and device."""
    lora_b: torch.Tensor
    """[out_features, rank]."""
    scaling: float
    """alpha / rank (1.0 when the file has no alpha)."""


@dataclass
class LoRAMapping:
    """Which adapter every sequence of one forward uses, and where each sequence's rows are.

    `img_row_offsets` / `txt_row_offsets` ([num_seqs + 1], host ints) are the packed layout's; they are
    None for the dense forward, whose inputs are `[B, S, C]` with row b = sequence b.
    """

    seqs: tuple[SeqLoRA, ...]
    img_row_offsets: tuple[int, ...] | None = None
    txt_row_offsets: tuple[int, ...] | None = None
    _runs: dict[tuple, tuple[tuple[int, int, SeqLoRA], ...]] = field(default_factory=dict, repr=False)

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)

    @property
    def has_adapters(self) -> bool:
        return any(s.lora_int_id for s in self.seqs)

    @classmethod
    def for_packed(cls, seqs, layout) -> LoRAMapping:
        """Mapping for `forward_packed(..., layout)`; `seqs[i]` is sequence i's adapter."""
        mapping = cls(tuple(seqs), tuple(layout.img_row_offsets), tuple(layout.txt_row_offsets))
        mapping._check(len(layout.specs))
        return mapping

    @classmethod
    def for_dense(cls, seqs) -> LoRAMapping:
        """Mapping for the dense forward `[B, S, C]`; `seqs[b]` is batch item b's adapter."""
        return cls(tuple(seqs))

    def _check(self, num_seqs: int) -> None:
        if self.num_seqs != num_seqs:
            raise ValueError(f"LoRA mapping has {self.num_seqs} sequences, the forward has {num_seqs}")

    def runs(self, stream: RowStream, x: torch.Tensor) -> tuple[tuple[int, int, SeqLoRA], ...]:
        """(start, end, adapter) ranges over `x.reshape(-1, C)` rows, adapter-less rows left out."""
        if x.dim() == 3:  # dense [B, S, C]: row b is sequence b
            self._check(x.shape[0])
            offsets = tuple(range(0, x.shape[0] * x.shape[1] + 1, x.shape[1]))
        elif stream == "seq":  # [num_seqs, C]
            self._check(x.shape[0])
            offsets = tuple(range(self.num_seqs + 1))
        else:
            offsets = self.img_row_offsets if stream == "img" else self.txt_row_offsets
            if offsets is None or offsets[-1] != x.shape[0]:
                raise ValueError(
                    f"LoRA: a {stream}-stream linear got {list(x.shape)} rows, the mapping's "
                    f"{stream} offsets are {offsets}; build it with LoRAMapping.for_packed(seqs, layout)"
                )
        key = (stream, offsets)
        if key not in self._runs:
            self._runs[key] = _merge_runs(self.seqs, offsets)
        return self._runs[key]


def _merge_runs(seqs: tuple[SeqLoRA, ...], offsets: tuple[int, ...]) -> tuple[tuple[int, int, SeqLoRA], ...]:
    runs: list[list] = []
    for i, seq in enumerate(seqs):
        start, end = offsets[i], offsets[i + 1]
        if not seq.lora_int_id or end == start:
            continue
        if runs and runs[-1][2] == seq and runs[-1][1] == start:
            runs[-1][1] = end
        else:
            runs.append([start, end, seq])
    return tuple((s, e, seq) for s, e, seq in runs)


class LoRAStepState:
    """The mapping of the forward in flight for one model, shared by all of its LoRA linears."""

    def __init__(self) -> None:
        self.mapping: LoRAMapping | None = None

    @contextlib.contextmanager
    def activate(self, mapping: LoRAMapping | None):
        """Within the block, the model's LoRA linears apply `mapping` (None: base only)."""
        previous, self.mapping = self.mapping, mapping
        try:
            yield
        finally:
            self.mapping = previous


class LoRALinearSlot:
    """The adapters of one `Linear` (its `lora` slot): per-run deltas added after the base GEMM.

    `weights` maps lora_int_id -> this linear's matrices; the step's mapping comes from `state`.
    """

    def __init__(self, stream: RowStream, state: LoRAStepState):
        self.stream = stream
        self.state = state
        self.weights: dict[int, LoRAModuleWeights] = {}

    def runs(self, x: torch.Tensor) -> tuple[tuple[int, int, SeqLoRA], ...]:
        """The runs of x's rows that this forward adapts (empty: the linear is its base now)."""
        mapping = self.state.mapping
        if mapping is None or not self.weights:
            return ()
        return tuple(r for r in mapping.runs(self.stream, x) if r[2].lora_int_id in self.weights)

    def is_active(self, x: torch.Tensor) -> bool:
        return bool(self.runs(x))

    def add_delta(self, x: torch.Tensor, out: torch.Tensor, batch_invariant: bool) -> None:
        """out += the deltas of x's adapted rows. `out` is the linear's base output `[..., out]`, or its
        columns of a fused GEMM's output (a strided view, written in place). `batch_invariant`: the
        base is batch invariant, so the deltas use the invariant matmul too."""
        runs = self.runs(x)
        if not runs:
            return
        x2d, out2d = x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1])  # [rows, in], [rows, out]
        add_delta = _add_delta_invariant if batch_invariant else _add_delta
        for start, end, seq in runs:
            weights = self.weights[seq.lora_int_id]
            add_delta(out2d[start:end], x2d[start:end].to(out.dtype), weights, seq.scale * weights.scaling)


def _add_delta(out: torch.Tensor, x: torch.Tensor, weights: LoRAModuleWeights, scale: float) -> None:
    """out += scale * (x @ A^T) @ B^T; the expand GEMM accumulates into `out` (no delta tensor)."""
    shrunk = F.linear(x, weights.lora_a)  # [n, rank]
    out.addmm_(shrunk, weights.lora_b.t(), alpha=scale)  # [n, out]


def _add_delta_invariant(
    out: torch.Tensor, x: torch.Tensor, weights: LoRAModuleWeights, scale: float
) -> None:
    """`_add_delta` with the batch-invariant matmul: each row's bits depend only on that row."""
    from vllm_omni.diffusion.batch_invariant import batch_invariant_linear

    shrunk = batch_invariant_linear(x, weights.lora_a, None) * scale  # [n, rank]
    out += batch_invariant_linear(shrunk, weights.lora_b, None)  # [n, out]


def is_lora_linear(module: nn.Module) -> bool:
    """Whether `module` is a `Linear` with adapters installed."""
    return isinstance(module, Linear) and isinstance(module.lora, LoRALinearSlot)


def make_lora_linear(module: nn.Module, name: str, state: LoRAStepState) -> LoRALinearSlot:
    """Give `module` (a `Linear`, any quant method) a LoRA slot; returns it. Idempotent.

    A fused GEMM over it and its siblings (`fused_linear_params`: the QKV projections) still runs as one
    GEMM; `fused_linear` then adds each one's delta to its own output columns.
    """
    if not isinstance(module, Linear):
        raise ValueError(f"LoRA target {name!r} is a {type(module).__name__}, not a linear layer")
    if module.lora is None:
        module.lora = LoRALinearSlot(row_stream(name), state)
    return module.lora


def restore_linear(module: nn.Module) -> None:
    """Undo `make_lora_linear` (the last adapter on `module` was unloaded): the slot is emptied."""
    if is_lora_linear(module):
        module.lora = None

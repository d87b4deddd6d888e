"""What a family's transformer declares about its own modules, as class data (diffusers' `_tp_plan` /
`_no_split_modules` style): `plans: ClassVar[TransformerPlans]` on the transformer class.

The runtime's LoRA (`lora/`), tensor parallelism (`distributed/tensor_parallel.py`), batch-invariant
mode (`batch_invariant.py`), FP8 (`layers/quantization.py`) and the runner read a transformer's plans
and keep no module names of their own. A family gains one of them by writing its part of the plan:

    LoRAPlan            which linears adapters target, and which rows each linear sees
    TensorParallelPlan  which linears of a block split by output rows (column) or input rows (row)
    invariant_norms     the norm classes batch-invariant mode routes through its row-wise kernel
    quant_kept_layers   the linears FP8 keeps in high precision by default
    blocks              the attribute holding the transformer's block list

A *pattern* names modules by a run of the dotted parts of their path (`module_matches`): `img_mlp`
matches `transformer_blocks.3.img_mlp.net.2`, as `--diffusion-quantization-config`'s `ignored_layers`
does. Torch-free: `interface.py` and the registry import it before anything loads torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

RowStream = Literal["img", "txt", "seq"]
"""The rows a linear is applied to in a forward (lora/batch.py): image rows, text rows, or one row per
sequence (modulation, timestep embedding)."""


def module_matches(name: str, pattern: str) -> bool:
    """`pattern` is the module path `name` or a run of its dotted parts (`img_mlp`, `img_mlp.net.2`)."""
    return f".{pattern}." in f".{name}."


@dataclass(frozen=True)
class LoRAPlan:
    """LoRA on a family's linears: the rows each linear sees, and the usual adapter targets.

    A linear matching a `seq_modules` pattern sees one row per sequence; else one matching a
    `txt_modules` pattern sees the text rows; every other linear sees the image rows. A linear on the
    wrong stream would add the adapter of another sequence's rows, silently: a family lists every
    module whose rows are not image rows.
    """

    seq_modules: tuple[str, ...]
    """Patterns of modules whose linears see one row per sequence (modulation, timestep embedding)."""
    txt_modules: tuple[str, ...]
    """Patterns of modules whose linears see the text stream's rows."""
    block_targets: tuple[str, ...]
    """Per-block linears (paths inside one block) an adapter usually targets: attention and MLP."""

    def row_stream(self, module_name: str) -> RowStream:
        """Which rows the linear `module_name` (a path in the transformer) is applied to."""
        if any(module_matches(module_name, p) for p in self.seq_modules):
            return "seq"
        if any(module_matches(module_name, p) for p in self.txt_modules):
            return "txt"
        return "img"


@dataclass(frozen=True)
class BlockShard:
    """One linear of a block split over the tensor-parallel ranks."""

    path: str
    """The linear's path inside one block (`attn.to_q`, `img_mlp.net.2`)."""
    style: Literal["column", "row"]
    """column: each rank owns a block of output rows (no communication); row: a block of input
    columns, then an all-reduce of the partial sums (the bias added once, after it)."""
    per_head: bool = False
    """Shard in whole attention heads (`config.attention_head_dim` rows or columns): q, k, v and the
    attention's output projection; False: in single units (MLP hidden units)."""


@dataclass(frozen=True)
class TensorParallelPlan:
    """Megatron-style tensor parallelism of every block: the linears listed are split, every other
    module stays replicated (every rank holds the same activations between blocks)."""

    shards: tuple[BlockShard, ...]
    """The block's sharded linears, in the order they are replaced."""


@dataclass(frozen=True)
class TransformerPlans:
    """Everything the runtime needs to know about a transformer's modules (see the module docstring).
    A field left None (or empty) means the family does not support that feature; the family's
    capabilities say so before anything loads."""

    blocks: str
    """Attribute of the transformer holding its block list (an `nn.ModuleList`)."""
    lora: LoRAPlan | None = None
    """LoRA streams and targets; None: the family takes no LoRA adapters."""
    tensor_parallel: TensorParallelPlan | None = None
    """Column / row shards of a block; None: no tensor parallelism."""
    invariant_norms: tuple[type, ...] = ()
    """Norm classes (`forward(x)` = RMS norm over the last dim with `weight`, `eps`, no bias) that
    batch-invariant mode re-classes to its row-wise kernel."""
    quant_kept_layers: tuple[str, ...] | None = None
    """Patterns of the linears FP8 keeps in high precision unless `ignored_layers` says otherwise;
    None: no default (the config must give `ignored_layers`)."""
    tea_cache_coefficients: tuple[float, ...] | None = None
    """TeaCache's polynomial rescaling the relative L1 change of the first block's modulated input,
    highest power first (numpy's `polyval` order); None: no TeaCache (step caching: `cache/`)."""

    def block_list(self, transformer: Any) -> Any:
        """The transformer's blocks (`nn.ModuleList`)."""
        return transformer.get_submodule(self.blocks)

    def block_paths(self, num_layers: int, suffixes: tuple[str, ...]) -> list[str]:
        """`<blocks>.<i>.<suffix>` for every block and suffix (module paths in the transformer)."""
        return [f"{self.blocks}.{i}.{s}" for i in range(num_layers) for s in suffixes]

"""`Linear`: the one linear layer of our transformers, with a quantization method and a LoRA slot.

    y = quant_method.apply(layer, x, bias)            the base GEMM (plain, batch invariant, FP8, ...)
    y += lora.add_delta(x)                            when an adapter slot is set and adapts x's rows
    y = ACTIVATIONS[activation](y)                    when the caller asks (`forward(x, activation)`):
                                                      inside the LoRA kernels' expand where they run

Every way we change a linear is data on the layer, never a new class or a swapped module:

    what                     how                                       who sets it
    the GEMM                 `quant_method` (`LinearMethod`)          the model (unquantized), the loader
                                                                       (FP8), batch-invariant mode
    LoRA deltas              `lora` (a `LoRASlot`, or None)            the LoRA manager
    tensor-parallel shard    `shard` (a `LinearShard`, or None) and    distributed/tensor_parallel.py
                             `load_weight` slicing through it

Parameters are named `weight` / `bias` as in `nn.Linear` (diffusers' state-dict keys); a method may add
its own (FP8: `weight_scale`). The fused fast paths of a model (one GEMM over concatenated QKV weights,
cuBLASLt's GELU epilogue) compute a layer themselves only when `runs_plain_gemm(x)` says the layer is
exactly `F.linear(x, weight, bias)` for this x; every other layer is called. A kernel that produces
a layer's input may emit it already quantised (`fp8.Fp8Activation`) when `accepts_fp8_input(x)` says
the layer computes the same from it (FP8, no LoRA delta in this forward). `base_forward`,
`kernel_delta` and `add_lora_delta` split a call into its GEMM and its deltas, so that two streams'
linears can launch their deltas together (`paired_linear.py`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from vllm_omni.lora.kernels import KernelDelta


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_tanh": lambda h: F.gelu(h, approximate="tanh"),
}
"""Activations a linear applies to its output on request (`Linear.forward(x, activation)`); the LoRA
kernels fuse the same ones into the delta's expand (`vllm_omni/lora/kernels.py`, `ACTIVATIONS`)."""


def apply_activation(out: torch.Tensor, activation: str | None) -> torch.Tensor:
    """`ACTIVATIONS[activation](out)`, or out itself for None."""
    if activation is None:
        return out
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r} is not one of {list(ACTIVATIONS)}")
    return ACTIVATIONS[activation](out)


class LoRASlot(Protocol):
    """What a `Linear` asks of the adapter deltas the LoRA manager installs (`vllm_omni/lora/layers.py`)."""

    def is_active(self, x: torch.Tensor) -> bool:
        """Whether this forward adds deltas to the layer's output (then no fused path may bypass it)."""

    def add_delta(self, x: torch.Tensor, out: torch.Tensor, batch_invariant: bool) -> None:
        """out += the deltas of x's adapted rows, in out's dtype (x: [..., in]; out: [..., out], or
        this layer's columns of a fused GEMM's output)."""

    def add_merged_delta(
        self, members: tuple[Linear, ...], x: torch.Tensor, out: torch.Tensor, batch_invariant: bool
    ) -> bool:
        """For a merged GEMM over `members` (this layer first; out: [..., sum of their out]): add every
        member's deltas at once and return True, or return False when the slots cannot (the caller
        then adds each member's own)."""

    def kernel_delta(
        self, x: torch.Tensor, out: torch.Tensor, batch_invariant: bool, activation: str | None = None
    ) -> KernelDelta | None:
        """`add_delta`'s work as one segment of a kernel launch (so a caller may launch two layers'
        deltas together, `paired_linear.py`), or None where the kernels do not serve it (no LoRA batch
        in this forward, the host path); the caller then calls `add_delta`. With an `activation`
        (`ACTIVATIONS`) the launch also applies it to all of out, after the deltas."""

    def merged_kernel_delta(
        self,
        members: tuple[Linear, ...],
        x: torch.Tensor,
        out: torch.Tensor,
        batch_invariant: bool,
        activation: str | None = None,
    ) -> KernelDelta | None:
        """`kernel_delta` of a merged GEMM over `members` (see `add_merged_delta`): None also when the
        slots are not those members' one group."""


@dataclass(frozen=True)
class LinearShard:
    """This rank's slice of a tensor-parallel linear: features [start, stop) of one side.

    column: the output features (rows of `weight`, entries of `bias`); row: the input features
    (columns of `weight`), the bias stays whole and is added once after the all-reduce.
    """

    side: str
    """"column" or "row"."""
    start: int
    stop: int

    def __post_init__(self) -> None:
        if self.side not in ("column", "row"):
            raise ValueError(f"LinearShard.side must be 'column' or 'row', got {self.side!r}")


class LinearMethod:
    """How a `Linear` holds its weights and computes its GEMM. Stateless: per-layer tensors live on the
    layer as parameters (so `state_dict`, `.to()` and the loader see them)."""

    name: ClassVar[str] = "base"
    plain_gemm: ClassVar[bool] = False
    """`apply` is exactly `F.linear(x, layer.weight, bias)` with `weight` an [out, in] matrix in the
    activation dtype. The fused fast paths compute such a layer themselves (concatenated QKV weights,
    GEMM + GELU epilogue); with False they call the layer (its own path), never silently bypass it."""
    accepts_fp8_activation: ClassVar[bool] = False
    """`apply` also takes an `fp8.Fp8Activation` (x already quantised by the kernel that produced it)
    and computes from it what it computes from x. Producers emit one only for such a layer
    (`Linear.accepts_fp8_input`); every other layer gets x in the activation dtype."""
    batch_invariant: ClassVar[bool] = False
    """Every output row depends only on its input row (not on the row count): LoRA deltas over such a
    layer use the batch-invariant GEMM too."""
    param_dims: ClassVar[dict[str, tuple[int | None, int | None]]] = {"weight": (0, 1), "bias": (0, None)}
    """Per parameter: (output-feature dim, input-feature dim), None where it has none (tensor-parallel
    shards slice along them)."""
    layer_attrs: ClassVar[tuple[str, ...]] = ()
    """Plain (non-tensor) attributes the method keeps on a layer (a shard copies them)."""

    def create_weights(
        self, layer: Linear, in_features: int, out_features: int, bias: bool, **factory
    ) -> None:
        """Register `weight [out, in]` and `bias [out]` (or None) with nn.Linear's initialisation (the
        same RNG draws in the same order, so a seeded model is the same as with `nn.Linear`)."""
        layer.weight = nn.Parameter(torch.empty((out_features, in_features), **factory))
        if bias:
            layer.bias = nn.Parameter(torch.empty(out_features, **factory))
        else:
            layer.register_parameter("bias", None)
        nn.init.kaiming_uniform_(layer.weight, a=math.sqrt(5))
        if layer.bias is not None:
            bound = 1 / math.sqrt(in_features) if in_features > 0 else 0
            nn.init.uniform_(layer.bias, -bound, bound)

    def process_weights_after_loading(self, layer: Linear) -> None:
        """Turn the loaded (checkpoint-format) parameters into this method's (e.g. quantise)."""

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """[..., in] -> [..., out] in x's dtype."""
        raise NotImplementedError

    def compute_dtype(self, layer: Linear) -> torch.dtype:
        """The activation dtype this layer computes in (what LoRA matrices and callers use)."""
        return layer.weight.dtype


class UnquantizedLinearMethod(LinearMethod):
    """`F.linear` on the weights as loaded (bf16 / fp16 / fp32): what `nn.Linear` computes."""

    name = "unquantized"
    plain_gemm = True

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)


class Linear(nn.Module):
    """`y = x W^T + b` through `quant_method`, plus the LoRA slot's deltas (see the module docstring).

    Args:
        in_features, out_features, bias: as `nn.Linear`.
        quant_method: how weights are held and the GEMM computed (default: `UnquantizedLinearMethod`).
        shard: this rank's tensor-parallel slice (None: the whole layer); in/out features are the shard's.
        device, dtype: factory arguments of the parameters, as `nn.Linear`.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        quant_method: LinearMethod | None = None,
        shard: LinearShard | None = None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.quant_method = quant_method if quant_method is not None else UnquantizedLinearMethod()
        self.shard = shard
        self.lora: LoRASlot | None = None
        self.quantize_on_load: LinearMethod | None = None
        """A method to switch to as soon as `load_weight` sets the weight (`mark_for_quantization`): the
        high-precision weight is freed layer by layer, so a load never holds the whole model in it."""
        self.quant_method.create_weights(self, in_features, out_features, bias, device=device, dtype=dtype)

    # ---- the forward ------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, activation: str | None = None) -> torch.Tensor:
        """x [..., in] -> [..., out]; with an `activation` (`ACTIVATIONS`), that of the output, fused
        into the LoRA kernels' expand when they add this forward's deltas."""
        out = self.base_forward(x)
        if self.lora is not None:
            delta = self.kernel_delta(x, out, activation) if activation is not None else None
            if delta is not None:
                from vllm_omni.lora import kernels  # looked up at the call: tests wrap it

                kernels.lora_delta_segment(delta)
                return out
            self.add_lora_delta(x, out)
        return apply_activation(out, activation)

    def base_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The method's GEMM and the bias, without LoRA ([..., in] -> [..., out])."""
        return self.quant_method.apply(self, x, self.bias)

    def add_lora_delta(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """out += this layer's LoRA deltas for x (nothing without a slot). `out` may be this layer's
        columns of a fused GEMM's output (a strided view, written in place)."""
        if self.lora is not None:
            self.lora.add_delta(x, out, self.quant_method.batch_invariant)

    def kernel_delta(
        self, x: torch.Tensor, out: torch.Tensor, activation: str | None = None
    ) -> KernelDelta | None:
        """`add_lora_delta(x, out)` as one segment of a kernel launch (then `activation` over out), or
        None where the kernels do not serve it (no slot, no LoRA batch, the host path: then call
        `add_lora_delta`)."""
        if self.lora is None:
            return None
        return self.lora.kernel_delta(x, out, self.quant_method.batch_invariant, activation)

    def adds_lora_delta(self, x: torch.Tensor) -> bool:
        """Whether `self(x)` adds LoRA deltas to the base GEMM in this forward."""
        return self.lora is not None and self.lora.is_active(x)

    def runs_plain_gemm(self, x: torch.Tensor) -> bool:
        """Whether `self(x)` computes exactly `F.linear(x, weight, bias)` in this forward (a plain
        method, and no LoRA deltas in this forward), so a fused fast path may compute it in its place."""
        return self.quant_method.plain_gemm and not self.adds_lora_delta(x)

    def accepts_fp8_input(self, x: torch.Tensor) -> bool:
        """Whether `self(Fp8Activation of x)` computes `self(x)` in this forward: the method takes an
        FP8 input, and no LoRA deltas run (a delta needs x in high precision). x: the producer's input
        rows (one row per row of this layer's input; only the forward matters to a LoRA slot)."""
        return self.quant_method.accepts_fp8_activation and not self.adds_lora_delta(x)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The activation dtype (a quantized layer's weight dtype is not it)."""
        return self.quant_method.compute_dtype(self)

    # ---- changing the method and loading weights ---------------------------------------------

    def set_quant_method(self, method: LinearMethod) -> None:
        """Switch to `method` after loading (its `process_weights_after_loading` runs now). Only from
        the unquantized method (two methods' weight formats do not convert into each other), or to a
        subclass of the current method, which keeps its weight format (FP8 -> batch-invariant FP8)."""
        current = self.quant_method
        if isinstance(current, type(method)):  # already it, or a subclass over its weights (BI FP8)
            return
        if not isinstance(current, UnquantizedLinearMethod) and not isinstance(method, type(current)):
            raise ValueError(f"a {current.name} linear cannot switch to {method.name}")
        self.quant_method = method
        method.process_weights_after_loading(self)

    def load_weight(self, name: str, value: torch.Tensor) -> None:
        """Set parameter `name` from a full-layer tensor (a checkpoint's, or an unsharded layer's).

        A tensor-parallel shard keeps a copy of its slice (so the full tensor can be freed); a whole
        layer takes `value` itself (the loader hands over a fresh tensor: no second copy on the device).
        """
        dims = self.quant_method.param_dims.get(name)
        if dims is None:
            raise ValueError(f"{self.quant_method.name} linear has no parameter {name!r}")
        requires_grad = value.requires_grad and value.is_floating_point()
        value = value.detach()
        if self.shard is not None:
            dim = dims[0] if self.shard.side == "column" else dims[1]
            if dim is not None:
                value = value.narrow(dim, self.shard.start, self.shard.stop - self.shard.start)
            value = value.clone()
        self._parameters[name] = nn.Parameter(value, requires_grad=requires_grad)
        if name == "weight" and self.quantize_on_load is not None:
            method, self.quantize_on_load = self.quantize_on_load, None
            self.set_quant_method(method)

    def extra_repr(self) -> str:
        parts = [
            f"in_features={self.in_features}",
            f"out_features={self.out_features}",
            f"bias={self.bias is not None}",
        ]
        if not isinstance(self.quant_method, UnquantizedLinearMethod):
            parts.append(f"quant_method={self.quant_method.name}")
        if self.shard is not None:
            parts.append(f"shard={self.shard.side}[{self.shard.start}:{self.shard.stop}]")
        return ", ".join(parts)


def linears(model: nn.Module) -> dict[str, Linear]:
    """Every `Linear` of `model` by module path."""
    return {name: m for name, m in model.named_modules() if isinstance(m, Linear)}


def foreign_linears(model: nn.Module) -> dict[str, nn.Module]:
    """torch `nn.Linear`s (and subclasses) of `model` by module path: layers no quant method reaches."""
    return {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}

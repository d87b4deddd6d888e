"""Merged projections: linears that read the same input, run as ONE GEMM over their stacked parameters.

A module declares its groups as data (vLLM's `packed_modules_mapping`, by member name):

    merged_linears = {"img_qkv": ("to_q", "to_k", "to_v"), ...}

and the members stay ordinary `Linear`s, which own their parameters: state-dict keys, checkpoint
loading, LoRA slots, quantisation selection and tensor-parallel shards all see to_q, to_k, to_v. When
the weights are ready, `merge_linears` stacks each group's parameters along the output features and
re-points the members' parameters at row slices of the stacked tensors (no second copy):

    to_q.weight [N, K]  \\                                    rows [0, N)    of stacked weight [3N, K]
    to_k.weight [N, K]   >  one `Linear` of the members'      rows [N, 2N)
    to_v.weight [N, K]  /   method over the stacked params    rows [2N, 3N)
    (and bias [3N], FP8's per-output-channel weight_scale [3N]: per-row data stacks exactly)

so the merged GEMM is `quant_method.apply` of that hidden layer: for FP8, one activation quantisation
and one `_scaled_mm` per input instead of three of each.

When:   the end of every step that replaces parameters calls `merge_linears`: checkpoint loading and
        random weights (model_loader.py), quantisation, batch-invariant mode, tensor parallelism, and on
        the module itself `.to()` / `.half()` (`_apply`), `load_state_dict` (a post hook) and
        `copy.deepcopy` / unpickling (`__setstate__`). Never in a forward: a forward only checks (host
        pointers, no device reads) that the members still are the slices; when they are not, it runs
        the members one by one and logs it once.
Mergeable: members of one method type with the same input size, parameter names, dtypes and device,
        every parameter with output features on dim 0; else the group runs its members one by one.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from vllm_omni.diffusion.layers.linear import Linear

if TYPE_CHECKING:
    from vllm_omni.diffusion.layers.fp8 import Fp8Activation
    from vllm_omni.lora.kernels import KernelDelta

logger = logging.getLogger(__name__)


class MergedLinear:
    """One group's stacked GEMM. Not an `nn.Module` (its tensors are the members', and must not show
    in `state_dict()` or `parameters()` a second time)."""

    def __init__(self, members: tuple[Linear, ...], stacked: Linear):
        self.members = members
        self.out_features = stacked.out_features
        self.layer = stacked
        """A `Linear` of the members' method over the stacked parameters ([sum(out), in]); never
        registered as a submodule."""

    @classmethod
    def build(cls, members: tuple[Linear, ...]) -> MergedLinear | None:
        """Stack `members`' parameters and re-point them at the slices; None when they cannot merge."""
        if not _mergeable(members):
            return None
        first = members[0]
        names = [n for n, p in first._parameters.items() if p is not None]
        stacked = Linear(
            first.in_features,
            sum(m.out_features for m in members),
            bias=first.bias is not None,
            quant_method=first.quant_method,
            device="meta",
        )
        for attr in first.quant_method.layer_attrs:
            setattr(stacked, attr, getattr(first, attr))
        with torch.no_grad(), torch.inference_mode(False):
            for name in names:
                whole = torch.cat([m._parameters[name].detach() for m in members])
                stacked._parameters[name] = nn.Parameter(whole, requires_grad=False)
                row = 0
                for m in members:
                    n = m._parameters[name].shape[0]
                    m._parameters[name].data = whole[row : row + n]
                    row += n
        return cls(members, stacked)

    def is_current(self, members: tuple[Linear, ...]) -> bool:
        """Whether `members` (the owner's modules now) still are this merge's slices, with its method."""
        if members != self.members:
            return False
        method = type(self.layer.quant_method)
        row = 0
        for m in members:
            if type(m.quant_method) is not method:
                return False
            for name, whole in self.layer._parameters.items():
                p = m._parameters.get(name)
                if whole is None or p is None:
                    if whole is not p:
                        return False
                    continue
                offset = row * whole.stride(0) * whole.element_size()
                if p.data_ptr() != whole.data_ptr() + offset or p.dtype != whole.dtype:
                    return False
            row += m.out_features
        return True

    def accepts_fp8_input(self, x: torch.Tensor) -> bool:
        """`Linear.accepts_fp8_input` of the group: the stacked method takes an `Fp8Activation` and no
        member adds a LoRA delta in this forward (x: the producer's input rows)."""
        return all(m.accepts_fp8_input(x) for m in self.members)  # the members' method is the layer's

    def __call__(self, x: torch.Tensor | Fp8Activation) -> torch.Tensor:
        """x [..., in] -> [..., sum(out)]: the stacked GEMM, then the members' LoRA deltas added to their
        own output columns (in place; a delta needs x in high precision, which it gets here: an
        `Fp8Activation` comes only while `accepts_fp8_input`, when no delta runs)."""
        out = self.base_forward(x)
        self.add_lora_delta(x, out)
        return out

    def base_forward(self, x: torch.Tensor | Fp8Activation) -> torch.Tensor:
        """The stacked GEMM alone: [..., in] -> [..., sum(out)]."""
        return self.layer.base_forward(x)

    def adds_lora_delta(self, x: torch.Tensor) -> bool:
        """Whether `self(x)` adds any member's LoRA deltas in this forward."""
        return any(m.adds_lora_delta(x) for m in self.members)

    def add_lora_delta(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """out [..., sum(out)] += the members' deltas: all at once when their slots are one group
        (lora/layers.py), else member by member into their columns."""
        first = self.members[0].lora
        invariant = self.layer.quant_method.batch_invariant
        if first is not None and first.add_merged_delta(self.members, x, out, invariant):
            return
        col = 0
        for m in self.members:
            if m.lora is not None:
                m.add_lora_delta(x, out[..., col : col + m.out_features])
            col += m.out_features

    def kernel_delta(
        self, x: torch.Tensor, out: torch.Tensor, activation: str | None = None
    ) -> KernelDelta | None:
        """`add_lora_delta(x, out)` as one segment of a kernel launch (the members' group's stacks), then
        `activation` over out, or None where the kernels do not serve it (no group of exactly these
        members, no LoRA batch, the host path: then call `add_lora_delta`)."""
        first = self.members[0].lora
        if first is None:
            return None
        bi = self.layer.quant_method.batch_invariant
        return first.merged_kernel_delta(self.members, x, out, bi, activation)


def _mergeable(members: tuple[Linear, ...]) -> bool:
    first = members[0]
    method = first.quant_method
    names = {n: p for n, p in first._parameters.items() if p is not None}
    for m in members:
        params = {n: p for n, p in m._parameters.items() if p is not None}
        if (
            type(m) is not Linear  # a subclass (e.g. row-parallel) computes more than its method
            or type(m.quant_method) is not type(method)
            or m.in_features != first.in_features
            or params.keys() != names.keys()
            or any(getattr(m, a) != getattr(first, a) for a in method.layer_attrs)
        ):
            return False
        for name, p in params.items():
            if p.is_meta or p.dtype != names[name].dtype or p.device != names[name].device:
                return False
            if p.dim() == 0 or method.param_dims.get(name, (None,))[0] != 0:
                return False
    return True


class HasMergedLinears(nn.Module):
    """A module with merged projections (see the module docstring): declare `merged_linears`, call
    `merge_linears()` at the end of `__init__`, and compute a group with `merged(name)(x)`."""

    merged_linears: ClassVar[dict[str, tuple[str, ...]]] = {}
    """group name -> names of the member `Linear`s (submodules of this module), in output order."""

    def __init__(self):
        super().__init__()
        self._merged: dict[str, MergedLinear | None] = {}  # not state: views of the members' params
        self._merged_warned: set[str] = set()
        self.register_load_state_dict_post_hook(_merge_after_load)

    def members(self, group: str) -> tuple[Linear, ...]:
        return tuple(self.get_submodule(name) for name in self.merged_linears[group])

    def merge_linears(self) -> None:
        """(Re)build every group whose members are not its current slices; members on the meta
        device (not loaded yet) or that cannot merge leave the group unmerged."""
        for group in self.merged_linears:
            members = self.members(group)
            merged = self._merged.get(group)
            if merged is None or not merged.is_current(members):
                self._merged[group] = MergedLinear.build(members)

    def merged(self, group: str) -> MergedLinear | None:
        """The group's merged GEMM (`merged(x)`: [..., sum(out)]); None when the group is not merged
        (the caller runs the members), logged once when it was and is no longer current."""
        merged = self._merged.get(group)
        if merged is None:
            return None
        if not merged.is_current(self.members(group)):
            if group not in self._merged_warned:
                self._merged_warned.add(group)
                logger.warning(
                    "%s.%s: the members' parameters were replaced without merge_linears(); running "
                    "them one by one (call vllm_omni.diffusion.layers.merged_linear.merge_linears)",
                    type(self).__name__,
                    group,
                )
            return None
        return merged

    def _apply(self, fn, recurse=True):
        # .to() / .half() / .cuda() replace each parameter on its own: the members stop being slices
        out = super()._apply(fn, recurse)
        self.merge_linears()
        return out

    def __setstate__(self, state):
        # copy.deepcopy / unpickling: a Parameter's deepcopy clones it alone (the slices become copies)
        super().__setstate__(state)
        self.merge_linears()


def _merge_after_load(module: HasMergedLinears, _incompatible_keys) -> None:
    module.merge_linears()  # load_state_dict(assign=True) replaced the members' parameters


def merge_linears(model: nn.Module) -> int:
    """`merge_linears()` on every module of `model` that has merged projections; returns the number of
    groups merged. The last step of anything that replaces a model's parameters."""
    count = 0
    for module in model.modules():
        if isinstance(module, HasMergedLinears):
            module.merge_linears()
            count += sum(m is not None for m in module._merged.values())
    return count

"""Two linears at the same point of a dual-stream block, their LoRA deltas in ONE kernel launch pair.

A dual-stream block applies, at each of its points, one linear to the image rows and a linear of the
same shape to the text rows (merged q/k/v groups, out projections, MLP up and down). With LoRA on
CUDA each adds its deltas with a shrink and an expand launch (lora/kernels.py); a prompt's few text
rows are one tile, so the text launches are almost all fixed cost. `paired_linear` runs both base
GEMMs, then both deltas as the two segments of one launch pair:

    first(x0), second(x1)          without a delta on both: exactly the two calls (every fused path)
    base0 = first.base_forward(x0) with a delta on both:
    base1 = second.base_forward(x1)
    lora_delta_pair(seg0, seg1)    both give a kernel segment (`kernel_delta`); the kernels check the
                                   stacks match and else launch each segment alone
    first / second.add_lora_delta  else (host path, batch-invariant mode, slots not one group): each
                                   adds its own deltas, as its own call would (a segment already
                                   built for first launches alone)

An `activation` (`linear.ACTIVATIONS`: the MLP up projections' GELU) is applied to both outputs: by
the expand of a kernel segment (no pass of its own), else after the deltas.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from vllm_omni.diffusion.layers.linear import apply_activation

if TYPE_CHECKING:
    from vllm_omni.lora.kernels import KernelDelta


class PairableLinear(Protocol):
    """A linear whose base GEMM and LoRA deltas can run apart (`Linear`, `MergedLinear`)."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    def base_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The GEMM without LoRA deltas."""

    def adds_lora_delta(self, x: torch.Tensor) -> bool:
        """Whether `self(x)` adds LoRA deltas in this forward."""

    def add_lora_delta(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """out += the deltas of x (out: the base GEMM's output)."""

    def kernel_delta(
        self, x: torch.Tensor, out: torch.Tensor, activation: str | None = None
    ) -> KernelDelta | None:
        """`add_lora_delta` as one segment of a kernel launch (then `activation` over out), or None where
        the kernels do not serve it."""


def paired_linear(
    first: PairableLinear,
    first_x: torch.Tensor,
    second: PairableLinear,
    second_x: torch.Tensor,
    activation: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(act(first(first_x)), act(second(second_x))), with both LoRA deltas in one launch pair where
    both layers add deltas through the kernels over matching stacks (see the module docstring).

    Args:
        first, second: layers of the same in / out features (pairing needs equal slot stacks).
        first_x: [..., in] (or an `Fp8Activation` where `first` takes one: then no delta runs);
            second_x likewise, any row count.
        activation: a name of `linear.ACTIVATIONS` applied to both outputs, or None.
    Returns:
        first's [..., out] and second's [..., out], as the two calls give them.
    """
    if not (first.adds_lora_delta(first_x) and second.adds_lora_delta(second_x)):
        return apply_activation(first(first_x), activation), apply_activation(second(second_x), activation)
    from vllm_omni.lora import kernels  # its functions looked up at the call: tests wrap them

    first_out, second_out = first.base_forward(first_x), second.base_forward(second_x)
    first_delta = first.kernel_delta(first_x, first_out, activation)
    if first_delta is None:
        first.add_lora_delta(first_x, first_out)
        second.add_lora_delta(second_x, second_out)
        return apply_activation(first_out, activation), apply_activation(second_out, activation)
    second_delta = second.kernel_delta(second_x, second_out, activation)
    if second_delta is not None:
        kernels.lora_delta_pair(first_delta, second_delta)
    else:  # only first's deltas run through the kernels: its segment alone, second's on its own path
        kernels.lora_delta_segment(first_delta)
        second.add_lora_delta(second_x, second_out)
        second_out = apply_activation(second_out, activation)
    return first_out, second_out

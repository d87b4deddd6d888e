"""FP8 checkpoints: e4m3 transformer weights with their scales (vLLM's and ModelOpt's layout), loaded
as they are.

    in the checkpoint                                      a layer FP8 runs          a layer kept high
    <layer>.weight            [N, K] float8_e4m3fn         W8: the same bits         W8 x scale, in --dtype
    <layer>.weight_scale      [] or [1]: per tensor        sw [N]: it, per channel
                              [N] or [N, 1]: per channel   sw [N]
    <layer>.weight_scale_inv  [ceil(N/b), ceil(K/b)]       dequantised (W8 x block scale, fp32), then
                              block scales                 quantised per channel again (new bits)
    <layer>.input_scale       a static activation scale    not used: activations are quantised per
                                                           token at run time ('dynamic')

"A layer FP8 runs" is one the quantization config selects (`--quantization fp8`: every linear but the
family's kept set or `ignored_layers`); a layer the config keeps in high precision gets the
dequantised weight, so `ignored_layers` means the same for an FP8 checkpoint as for a BF16 one. An FP8
checkpoint without `--quantization fp8` is refused (one line saying to add it), as is a scale of
another shape or an e5m2 weight.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from vllm_omni.diffusion.layers.fp8 import FP8_DTYPE, Fp8LinearMethod, quantize_rows
from vllm_omni.diffusion.layers.linear import Linear

WEIGHT_SCALE = ".weight_scale"
BLOCK_SCALE = ".weight_scale_inv"
INPUT_SCALE = ".input_scale"
SCALE_SUFFIXES = (WEIGHT_SCALE, BLOCK_SCALE, INPUT_SCALE)
"""Names of the scale tensors that travel with an FP8 weight (not parameters of the model)."""


def is_fp8(tensor: torch.Tensor) -> bool:
    """Whether a checkpoint tensor is a one-byte float (an FP8 weight)."""
    return tensor.is_floating_point() and tensor.element_size() == 1


@dataclass(frozen=True)
class Fp8Weight:
    """One linear's FP8 weight as the checkpoint gives it."""

    name: str
    """The weight's tensor name (`<layer>.weight`), for messages."""
    data: torch.Tensor
    """[N, K] float8_e4m3fn."""
    scale: torch.Tensor
    """Its `weight_scale` (per tensor or per output channel) or `weight_scale_inv` (block scales)."""
    block: bool
    """Whether `scale` holds block scales."""

    def __post_init__(self) -> None:
        if self.data.dtype != FP8_DTYPE:
            raise ValueError(
                f"transformer weight {self.name!r} is {self.data.dtype}: FP8 checkpoints must hold "
                "float8_e4m3fn weights"
            )
        if self.data.dim() != 2:
            raise ValueError(f"transformer weight {self.name!r}: an FP8 weight must be [out, in]")

    def channel_scales(self) -> torch.Tensor:
        """sw [N] fp32 for per-tensor or per-channel scales (the weight's bits then stay as they are)."""
        n = self.data.shape[0]
        s = self.scale.float()
        if s.numel() == 1:
            return s.reshape(1).expand(n).clone()
        if tuple(s.shape) in ((n,), (n, 1)):
            return s.reshape(n).clone()
        raise ValueError(
            f"transformer weight {self.name!r}: its scale has shape {tuple(s.shape)}; expected a scalar "
            f"(per tensor) or [{n}] (per output channel)"
        )

    def dequantized(self) -> torch.Tensor:
        """W8 x its scales, fp32 [N, K]."""
        w = self.data.float()
        if not self.block:
            return w * self.channel_scales().view(-1, 1)
        n, k = w.shape
        rows, cols = self.scale.shape if self.scale.dim() == 2 else (0, 0)
        block_n, block_k = (math.ceil(n / rows), math.ceil(k / cols)) if rows and cols else (0, 0)
        if not block_n or math.ceil(n / block_n) != rows or math.ceil(k / block_k) != cols:
            raise ValueError(
                f"transformer weight {self.name!r}: block scales of shape {tuple(self.scale.shape)} do "
                f"not tile a [{n}, {k}] weight"
            )
        s = self.scale.float().repeat_interleave(block_n, 0)[:n].repeat_interleave(block_k, 1)[:, :k]
        return w * s


def load_fp8_weight(layer: Linear, weight: Fp8Weight, device, dtype: torch.dtype) -> bool:
    """Load `weight` into `layer`. A layer selected for FP8 (`quantize_on_load` holds the FP8 method)
    takes W8 and per-channel scales as they are (block scales: quantised per channel again); any other
    gets the dequantised weight in `dtype`. Returns whether the layer now runs FP8."""
    method = layer.quantize_on_load
    if not isinstance(method, Fp8LinearMethod):
        layer.load_weight("weight", weight.dequantized().to(device=device, dtype=dtype))
        return False
    if weight.block:
        data, scale = quantize_rows(weight.dequantized())
        scale = scale.view(-1)
    else:
        data, scale = weight.data, weight.channel_scales()
    layer.quantize_on_load = None
    layer.quant_method = method  # FP8 weights already: nothing left for process_weights_after_loading
    layer.load_weight("weight", data.to(device))
    layer.load_weight("weight_scale", scale.to(device))
    layer.fp8_out_dtype = dtype
    return True


def fp8_weight_scales(weights_dir: Path, tensors: dict, scales: dict, quantization) -> dict[str, str]:
    """The FP8 weights of a checkpoint (weight name -> its scale tensor's name), after checking that
    the quantization config runs FP8 and agrees with what the checkpoint is; ValueError otherwise.

    tensors / scales: the checkpoint's tensor names (-> files) without and with a scale suffix."""
    fp8_weights = {}
    for scale_name in scales:
        for suffix in (WEIGHT_SCALE, BLOCK_SCALE):
            if scale_name.endswith(suffix):
                weight_name = scale_name.removesuffix(suffix) + ".weight"
                if weight_name not in tensors:
                    raise ValueError(f"transformer checkpoint in {weights_dir}: {scale_name!r} has no weight")
                if weight_name in fp8_weights:
                    raise ValueError(f"transformer weight {weight_name!r} has two scales in {weights_dir}")
                fp8_weights[weight_name] = scale_name
    claimed = getattr(quantization, "checkpoint_fp8", None)
    source = getattr(quantization, "source", "quantization")
    if claimed is True and not fp8_weights:
        raise ValueError(
            f"{source}: is_checkpoint_fp8_serialized is true, but the transformer checkpoint in "
            f"{weights_dir} has no FP8 weights (no weight_scale tensors)"
        )
    if not fp8_weights:
        return {}
    if claimed is False:
        raise ValueError(
            f"{source}: is_checkpoint_fp8_serialized is false, but the transformer checkpoint in "
            f"{weights_dir} holds FP8 weights ({next(iter(fp8_weights))!r}, ...)"
        )
    if quantization is None or quantization.method != "fp8":
        raise ValueError(
            f"the transformer checkpoint in {weights_dir} holds FP8 weights ({next(iter(fp8_weights))!r} "
            "with its weight_scale, ...): serve it with --quantization fp8 (they load as they are)"
        )
    return fp8_weights

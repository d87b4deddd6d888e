"""Quantizing a loaded transformer's linears: which layers, the switch, the bytes it will hold, the device.

kept layers    the config's `ignored_layers`, else the family's default (`plans.quant_kept_layers`
               on its transformer class: the embedders, modulation and final projection, see
               docs/quantization.md); every other `Linear` switches to the method
when           as each layer's weight loads from the checkpoint (`mark_for_quantization`: the
               BF16 weight is freed as soon as its FP8 copy exists, so the load's peak is the FP8
               transformer plus one layer); random (`--load-format dummy`) weights, after they are
               drawn (`quantize_transformer`: the peak is then the BF16 transformer). Before
               batch-invariant mode, LoRA and sharding either way.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from vllm_omni.diffusion.layers.fp8 import Fp8LinearMethod
from vllm_omni.diffusion.layers.linear import Linear, LinearMethod, linears
from vllm_omni.diffusion.layers.merged_linear import merge_linears
from vllm_omni.diffusion.layers.quant_config import QuantizationConfig
from vllm_omni.diffusion.models.plans import module_matches

logger = logging.getLogger(__name__)

MIN_FP8_CAPABILITY = (8, 9)
"""CUDA compute capability with FP8 tensor cores (Ada SM89, Hopper SM90 and later)."""


@dataclass(frozen=True)
class QuantizationSummary:
    """What `quantize_transformer` did."""

    method: str
    num_quantized: int
    kept: tuple[str, ...]
    """Module paths of the linears kept in high precision."""


def make_method(config: QuantizationConfig) -> LinearMethod:
    if config.method == "fp8":
        return Fp8LinearMethod()
    raise ValueError(f"{config.source}: no linear method for {config.method!r}")


def kept_layer_patterns(transformer: nn.Module, config: QuantizationConfig) -> tuple[str, ...]:
    """The config's `ignored_layers`, else the family's default; ValueError when neither exists."""
    if config.ignored_layers is not None:
        return config.ignored_layers
    default = transformer.plans.quant_kept_layers
    if default is None:
        raise ValueError(
            f"{config.source}: {type(transformer).__name__} declares no default layers to keep in high "
            "precision (plans.quant_kept_layers); give ignored_layers"
        )
    return tuple(default)


def layers_to_quantize(transformer: nn.Module, config: QuantizationConfig) -> dict[str, Linear]:
    """The `Linear`s of `transformer` that `config` quantizes, by module path.

    ValueError naming the entry when an `ignored_layers` entry matches no linear (a typo would
    otherwise quantize the layer it meant to keep)."""
    patterns = kept_layer_patterns(transformer, config)
    layers = linears(transformer)
    if config.ignored_layers is not None:
        unmatched = [p for p in patterns if not any(module_matches(n, p) for n in layers)]
        if unmatched:
            raise ValueError(
                f"{config.source}: ignored_layers {unmatched} match no linear of "
                f"{type(transformer).__name__} (e.g. {sorted(layers)[:4]})"
            )
    return {n: m for n, m in layers.items() if not any(module_matches(n, p) for p in patterns)}


def mark_for_quantization(transformer: nn.Module, config: QuantizationConfig | None) -> None:
    """Before a checkpoint's weights load (the layers may be on the meta device): each selected
    linear switches to `config`'s method as soon as its weight is set (`Linear.quantize_on_load`)."""
    if config is None or not config.is_enabled:
        return
    for layer in layers_to_quantize(transformer, config).values():
        layer.quantize_on_load = make_method(config)


def quantize_transformer(transformer: nn.Module, config: QuantizationConfig) -> QuantizationSummary:
    """Switch the selected linears of a loaded `transformer` to `config`'s method, in place."""
    selected = layers_to_quantize(transformer, config)
    for layer in selected.values():
        check_device_supports(layer.weight.device, config)
        layer.set_quant_method(make_method(config))
    num_merged = merge_linears(transformer)  # the quantized q, k, v stacked again: one FP8 GEMM
    kept = tuple(n for n in linears(transformer) if n not in selected)
    logger.info(
        "%s: %d linears quantized, %d kept in high precision, %d merged projections (the BF16 GELU "
        "epilogue applies to kept layers only)",
        config.method,
        len(selected),
        len(kept),
        num_merged,
    )
    return QuantizationSummary(config.method, len(selected), kept)


def weight_bytes(transformer: nn.Module, dtype: torch.dtype, config: QuantizationConfig) -> int:
    """Bytes of `transformer`'s parameters once loaded in `dtype` and quantized by `config` (works on
    the meta device): an FP8 weight is 1 byte per element plus a 4-byte scale per output channel."""
    selected = layers_to_quantize(transformer, config) if config.is_enabled else {}
    quantized_weights = {id(m.weight) for m in selected.values()}
    total = 0
    for param in transformer.parameters():
        if id(param) in quantized_weights:
            total += param.numel() + param.shape[0] * 4
        else:
            total += param.numel() * (dtype.itemsize if param.is_floating_point() else param.element_size())
    return total


def check_device_supports(device: torch.device | str, config: QuantizationConfig) -> None:
    """ValueError in one line when `device` cannot run `config`'s method (FP8 needs SM89+ on CUDA)."""
    device = torch.device(device)
    if config.method != "fp8" or device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if tuple(capability) < MIN_FP8_CAPABILITY:
        raise ValueError(
            f"{config.source} fp8 needs FP8 tensor cores (CUDA compute capability 8.9+: Ada, Hopper); "
            f"{torch.cuda.get_device_name(device)} is {capability[0]}.{capability[1]}; serve without it"
        )

"""Reading and checking a Qwen-Image LoRA file (what diffusers' `QwenImagePipeline.load_lora_weights` reads).

Format (diffusers / peft, safetensors), one entry per targeted linear `<module>` of the transformer:

    transformer.<module>.lora_A.weight   [rank, in_features]
    transformer.<module>.lora_B.weight   [out_features, rank]
    transformer.<module>.alpha           optional scalar: scaling = alpha / rank (absent: 1)

`diffusion_model.` or no prefix is accepted in place of `transformer.` (diffusers converts those; it
reads `.alpha` keys only there). Module names are
diffusers' (our transformer's parameter names equal its state dict). A PATH is a `.safetensors` file or a
directory holding `pytorch_lora_weights.safetensors` (diffusers' file name).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from vllm_omni.diffusion.layers.linear import linears as linear_layers
from vllm_omni.lora.layers import LoRAModuleWeights

LORA_WEIGHTS_NAME = "pytorch_lora_weights.safetensors"
"""diffusers' file name inside an adapter directory."""
KEY_PREFIXES = ("transformer.", "diffusion_model.", "")
SUFFIXES = {"lora_A": ".lora_A.weight", "lora_B": ".lora_B.weight", "alpha": ".alpha"}


class LoRAFormatError(ValueError):
    """The adapter file cannot be used with this model; the message names the file and the key."""


@dataclass(frozen=True)
class LoRAAdapter:
    """A checked adapter: per transformer module, its matrices (model dtype and device)."""

    path: str
    """The resolved file the adapter was read from."""
    rank: int
    """The largest rank over its modules."""
    modules: dict[str, LoRAModuleWeights]


def adapter_file(path: str | Path) -> Path:
    """The safetensors file of an adapter PATH (a file, or a directory with diffusers' file name)."""
    path = Path(path)
    if path.is_dir():
        path = path / LORA_WEIGHTS_NAME
        if not path.is_file():
            raise LoRAFormatError(f"{path.parent}: no {LORA_WEIGHTS_NAME} in the adapter directory")
    elif path.suffix != ".safetensors" or not path.is_file():
        raise LoRAFormatError(
            f"{path}: an adapter is a .safetensors file or a directory holding {LORA_WEIGHTS_NAME}"
        )
    return path


def _split_key(file: Path, key: str) -> tuple[str, str]:
    """`transformer.<module>.lora_A.weight` -> (<module>, 'lora_A')."""
    prefix = next(p for p in KEY_PREFIXES if key.startswith(p))
    for kind, suffix in SUFFIXES.items():
        if key.endswith(suffix):
            return key[len(prefix) : -len(suffix)], kind
    raise LoRAFormatError(f"{file}: key {key!r} is not a lora_A / lora_B weight or an alpha")


def read_lora_state_dict(file: Path) -> dict[str, dict[str, torch.Tensor]]:
    """{module: {'lora_A' / 'lora_B' / 'alpha': tensor}} from the file, keys checked."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        state = load_file(str(file), device="cpu")
    except (SafetensorError, OSError) as exc:
        raise LoRAFormatError(f"{file}: not a readable safetensors file ({exc})") from exc
    if not state:
        raise LoRAFormatError(f"{file}: holds no tensors")
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        module, kind = _split_key(file, key)
        modules.setdefault(module, {})[kind] = tensor
    return modules


def _check_module(file: Path, name: str, parts: dict[str, torch.Tensor], linear, max_rank: int) -> int:
    """The module's rank; LoRAFormatError naming the file and key for any mismatch."""
    key = f"transformer.{name}"
    if linear is None:
        raise LoRAFormatError(
            f"{file}: {key}.lora_A.weight targets {name!r}, which is not a linear of the transformer "
            "(keys are transformer.<module>.lora_A.weight with diffusers' module names)"
        )
    for kind in ("lora_A", "lora_B"):
        if kind not in parts:
            raise LoRAFormatError(f"{file}: {key} has no {kind}.weight")
    lora_a, lora_b = parts["lora_A"], parts["lora_B"]
    rank = lora_a.shape[0] if lora_a.dim() == 2 else -1
    if tuple(lora_a.shape) != (rank, linear.in_features) or rank < 1:
        raise LoRAFormatError(
            f"{file}: {key}.lora_A.weight is {list(lora_a.shape)}, expected [rank, {linear.in_features}]"
        )
    if tuple(lora_b.shape) != (linear.out_features, rank):
        raise LoRAFormatError(
            f"{file}: {key}.lora_B.weight is {list(lora_b.shape)}, expected [{linear.out_features}, {rank}]"
        )
    if rank > max_rank:
        raise LoRAFormatError(f"{file}: {key} has rank {rank} > --max-lora-rank {max_rank}")
    alpha = parts.get("alpha")
    if alpha is not None and (alpha.numel() != 1 or not torch.isfinite(alpha).all() or float(alpha) <= 0):
        raise LoRAFormatError(f"{file}: {key}.alpha must be one positive number, got {alpha.tolist()}")
    if not (torch.isfinite(lora_a).all() and torch.isfinite(lora_b).all()):
        raise LoRAFormatError(f"{file}: {key} holds non-finite values")
    return rank


def load_lora_adapter(path: str | Path, transformer: nn.Module, max_rank: int, device=None) -> LoRAAdapter:
    """Read and check the adapter at `path` against `transformer`; matrices in its activation dtype, on
    `device` (default: each linear's)."""
    file = adapter_file(path)
    linears = linear_layers(transformer)
    modules: dict[str, LoRAModuleWeights] = {}
    max_seen = 0
    for name, parts in read_lora_state_dict(file).items():
        linear = linears.get(name)
        rank = _check_module(file, name, parts, linear, max_rank)
        alpha = parts.get("alpha")
        # the activation dtype: a quantized base's weight dtype (FP8) is not what the delta runs in
        to = dict(device=linear.weight.device if device is None else device, dtype=linear.compute_dtype)
        modules[name] = LoRAModuleWeights(
            lora_a=parts["lora_A"].to(**to).contiguous(),
            lora_b=parts["lora_B"].to(**to).contiguous(),
            scaling=1.0 if alpha is None else float(alpha) / rank,
        )
        max_seen = max(max_seen, rank)
    return LoRAAdapter(path=str(file), rank=max_seen, modules=modules)

"""Random LoRA adapters in diffusers' key format (`transformer.<module>.lora_A.weight`), for tests and
benchmarks (no weights needed); targets from the family's LoRA plan."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from vllm_omni.diffusion.models.plans import TransformerPlans
from vllm_omni.lora.weights import LORA_WEIGHTS_NAME


def block_targets(
    plans: TransformerPlans, num_layers: int, suffixes: tuple[str, ...] | None = None
) -> list[str]:
    """Module paths of `suffixes` in each of `num_layers` blocks of a transformer with `plans` (its class's
    `plans`); default suffixes: the family's usual targets (`LoRAPlan.block_targets`: attention, MLP)."""
    if plans.lora is None:
        raise ValueError("the family declares no LoRA plan: it takes no LoRA adapters")
    suffixes = plans.lora.block_targets if suffixes is None else tuple(suffixes)
    return plans.block_paths(num_layers, suffixes)


def random_lora_state_dict(
    transformer: nn.Module,
    targets: list[str],
    rank: int,
    seed: int,
    std: float = 0.05,
    alpha: float | None = None,
    prefix: str = "transformer.",
) -> dict[str, torch.Tensor]:
    """{`<prefix><module>.lora_A.weight` / `lora_B.weight` (/ `.alpha`): fp32 tensor} for `targets`.

    Both matrices are random (peft zero-inits B; a zero B would make every test pass). diffusers 0.42
    reads alphas only from files with the `diffusion_model.` (or no) prefix.
    """
    modules = dict(transformer.named_modules())
    gen = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for name in targets:
        linear = modules[name]
        key = f"{prefix}{name}"
        state[f"{key}.lora_A.weight"] = torch.randn(rank, linear.in_features, generator=gen) * std
        state[f"{key}.lora_B.weight"] = torch.randn(linear.out_features, rank, generator=gen) * std
        if alpha is not None:
            state[f"{key}.alpha"] = torch.tensor(float(alpha))
    return state


def save_lora_dir(directory: str | Path, state: dict[str, torch.Tensor]) -> Path:
    """Write `state` as `<directory>/pytorch_lora_weights.safetensors` (diffusers' layout); the directory."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(directory / LORA_WEIGHTS_NAME))
    return directory


def random_lora_adapter(transformer: nn.Module, targets: list[str], rank: int, seed: int, std: float = 0.02):
    """A `LoRAAdapter` of random matrices made directly on each target's device and dtype (no file:
    a rank-64 adapter on every block of the real model is ~0.9 GB in bf16)."""
    from vllm_omni.lora.layers import LoRAModuleWeights
    from vllm_omni.lora.weights import LoRAAdapter

    modules = dict(transformer.named_modules())
    weights = {}
    for i, name in enumerate(targets):
        linear = modules[name]
        device, dtype = linear.weight.device, linear.compute_dtype  # the activation dtype (FP8 base too)
        gen = torch.Generator(device=device).manual_seed(seed * 100003 + i)
        lora_a, lora_b = (
            (torch.randn(*shape, generator=gen, device=device) * std).to(dtype)
            for shape in ((rank, linear.in_features), (linear.out_features, rank))
        )
        weights[name] = LoRAModuleWeights(lora_a, lora_b, 1.0)
    return LoRAAdapter(path=f"<random seed {seed}>", rank=rank, modules=weights)

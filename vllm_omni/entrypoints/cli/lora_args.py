"""`vllm serve` LoRA flags: --lora-modules, --max-loras, --max-lora-rank (vLLM's), --lora-runtime-dir."""

from __future__ import annotations

import argparse

from vllm_omni.lora.config import DEFAULT_MAX_LORA_RANK, DEFAULT_MAX_LORAS, LoRAConfig, LoRAModulePath


def add_lora_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "lora", "LoRA adapters loaded at start-up or at run time; any of them share one step (docs/lora.md)."
    )
    group.add_argument(
        "--lora-modules",
        nargs="+",
        action="extend",  # given twice, both lists count (the second replaced the first)
        default=None,
        metavar="NAME=PATH",
        help='Adapters to load at start-up: NAME=PATH or JSON {"name": ..., "path": ...} (optional '
        '"default_sampling_params": steps, true_cfg_scale and schedule fields a request naming it gets, '
        "e.g. Qwen-Image-Lightning's); PATH is a .safetensors file or a directory holding "
        "pytorch_lora_weights.safetensors (diffusers' format).",
    )
    group.add_argument(
        "--max-loras",
        type=int,
        default=DEFAULT_MAX_LORAS,
        help=f"Most adapters loaded at once; any of them share one step (default {DEFAULT_MAX_LORAS}).",
    )
    group.add_argument(
        "--max-lora-rank",
        type=int,
        default=DEFAULT_MAX_LORA_RANK,
        help=f"Largest adapter rank accepted (default {DEFAULT_MAX_LORA_RANK}).",
    )
    group.add_argument(
        "--lora-runtime-dir",
        default=None,
        metavar="DIR",
        help="Allow POST /v1/load_lora_adapter, /v1/unload_lora_adapter and a request's lora.path, "
        "for paths inside DIR only (off by default).",
    )


def lora_config_from_args(args: argparse.Namespace) -> LoRAConfig:
    """The `LoRAConfig` of the parsed flags; ValueError naming the flag."""
    modules = tuple(LoRAModulePath.parse(m) for m in (getattr(args, "lora_modules", None) or []))
    return LoRAConfig(
        lora_modules=modules,
        max_loras=getattr(args, "max_loras", DEFAULT_MAX_LORAS),
        max_lora_rank=getattr(args, "max_lora_rank", DEFAULT_MAX_LORA_RANK),
        runtime_dir=getattr(args, "lora_runtime_dir", None),
    )

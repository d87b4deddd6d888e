"""`vllm-omni random-lora --out DIR`: a random LoRA adapter for a model, to try LoRA serving without a
trained adapter (docs/lora.md). It loads the model's transformer on the CPU only to read its linears'
shapes, so it is meant for the tiny models (`tiny-qwen-image`, the default)."""

from __future__ import annotations

import argparse

from vllm_omni.config import TINY_MODEL_NAME


def add_random_lora_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=TINY_MODEL_NAME,
        help=f"Model whose transformer it fits (default {TINY_MODEL_NAME}).",
    )
    parser.add_argument("--out", required=True, metavar="DIR", help="Directory to write the adapter into.")
    parser.add_argument("--rank", type=int, default=4, help="LoRA rank (default 4).")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the random matrices (default 0).")
    parser.add_argument(
        "--std",
        type=float,
        default=0.3,
        help="Standard deviation of both matrices' entries (default 0.3: visible on the tiny model).",
    )


def cmd_random_lora(args: argparse.Namespace) -> int:
    """Write `<out>/pytorch_lora_weights.safetensors` targeting every block's attention and MLP linears."""
    from vllm_omni.config import OmniDiffusionConfig
    from vllm_omni.diffusion.worker.worker import load_pipeline
    from vllm_omni.lora.random_adapter import block_targets, random_lora_state_dict, save_lora_dir

    config = OmniDiffusionConfig(model=args.model, device="cpu", dtype="float32")
    transformer = load_pipeline(config).transformer
    plans = transformer.plans  # the family's usual targets: every block's attention and MLP linears
    targets = block_targets(plans, len(plans.block_list(transformer)))
    state = random_lora_state_dict(transformer, targets, args.rank, args.seed, std=args.std)
    out = save_lora_dir(args.out, state)
    name = out.name or "adapter"
    print(
        f"wrote {out}/pytorch_lora_weights.safetensors: rank {args.rank}, {len(targets)} linears of "
        f"{args.model}; serve it with: vllm-omni serve {args.model} --lora-modules {name}={out}"
    )
    return 0

"""Build a tiny random Qwen-Image-2.1 checkpoint in the released diffusers layout, offline.

    python -m vllm_omni.diffusion.models.qwen_image21.tiny DIR --seed 0

writes

    DIR/model_index.json                  QwenImage21Pipeline, as Qwen/Qwen-Image-2.1
    DIR/transformer/                      diffusers QwenImage21Transformer2DModel (2 blocks, hidden 32)
    DIR/vae/                              diffusers AutoencoderKLQwenImage21 (RGBA, 16x, z_dim 16)
    DIR/text_encoder/                     transformers Qwen3VLForConditionalGeneration (hidden 32)
    DIR/processor/                        Qwen3VLProcessor files: the tiny Qwen tokenizer, its chat
                                          template, preprocessor_config.json, processor_config.json
    DIR/scheduler/scheduler_config.json   FlowMatchEulerDiscreteScheduler

Every component is built from its config (no network); the tokenizer is the tiny Qwen-Image one (a
byte-level BPE trained here, with Qwen's special tokens). The same seed gives the same bytes.
`ensure_tiny_checkpoint()` builds it once into the cache (`tiny-qwen-image-2.1-seed<seed>`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from vllm_omni.diffusion.model_loader import randomize_weights_
from vllm_omni.diffusion.models.qwen_image.tiny import save_tiny_tokenizer
from vllm_omni.diffusion.models.qwen_image21 import configs
from vllm_omni.diffusion.models.tiny_cache import (
    VERSION_FILE,
    empty_output_dir,
    ensure_built,
    run_checkpoint_cli,
    save_scheduler_and_index,
    write_json,
)

TINY_MODEL_NAME = "tiny-qwen-image-2.1"
TINY_CHECKPOINT_VERSION = 2
"""Bumped whenever the tiny checkpoint's content changes, so stale caches are rebuilt."""

QK_NORM_GAIN = 2.0
"""Multiplies the transformer's QK RMSNorm scales after the random draw, so a target row attends to a few
prefix rows instead of averaging them: another prompt then visibly moves the tiny model's output."""


def _build_transformer(generator: torch.Generator):
    from diffusers import QwenImage21Transformer2DModel

    model = QwenImage21Transformer2DModel(**configs.TINY_TRANSFORMER_CONFIG)
    randomize_weights_(model, generator)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("norm_q.weight", "norm_k.weight")):
                param.mul_(QK_NORM_GAIN)
    return model


def _build_vae(generator: torch.Generator):
    from diffusers import AutoencoderKLQwenImage21

    vae = AutoencoderKLQwenImage21(**configs.TINY_VAE_CONFIG)
    randomize_weights_(vae, generator)
    return vae


def _build_text_encoder(generator: torch.Generator):
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    model = Qwen3VLForConditionalGeneration(Qwen3VLConfig(**configs.TINY_TEXT_ENCODER_CONFIG))
    randomize_weights_(model, generator)
    return model


def save_tiny_processor(out_dir: Path) -> None:
    """Qwen3VLProcessor files, written directly (building the processor object needs torchvision)."""
    save_tiny_tokenizer(out_dir)
    (out_dir / "chat_template.jinja").write_text(configs.CHAT_TEMPLATE, encoding="utf-8")
    write_json(out_dir / "preprocessor_config.json", configs.TINY_PREPROCESSOR_CONFIG)
    write_json(
        out_dir / "processor_config.json",
        {"processor_class": "Qwen3VLProcessor", "image_processor": configs.TINY_PREPROCESSOR_CONFIG},
    )


def make_tiny_checkpoint(out_dir: str | Path, seed: int = 0) -> Path:
    """Write the tiny random Qwen-Image-2.1 pipeline to `out_dir` (created; must be empty or absent)."""
    out_dir = empty_output_dir(out_dir, "make_tiny_checkpoint")

    generator = torch.Generator("cpu").manual_seed(seed)
    # Components in a fixed order: each draws from the same generator.
    _build_transformer(generator).save_pretrained(out_dir / "transformer", safe_serialization=True)
    _build_vae(generator).save_pretrained(out_dir / "vae", safe_serialization=True)
    _build_text_encoder(generator).save_pretrained(out_dir / "text_encoder", safe_serialization=True)
    save_tiny_processor(out_dir / "processor")
    save_scheduler_and_index(out_dir, configs.TINY_SCHEDULER_CONFIG, configs.MODEL_INDEX)
    write_json(out_dir / VERSION_FILE, {"version": TINY_CHECKPOINT_VERSION, "seed": seed})
    return out_dir


def ensure_tiny_checkpoint(cache_dir: Path | None = None, seed: int = 0) -> Path:
    """Return `<cache_dir>/tiny-qwen-image-2.1-seed<seed>`, building it first if absent or stale."""
    return ensure_built(TINY_MODEL_NAME, make_tiny_checkpoint, TINY_CHECKPOINT_VERSION, cache_dir, seed)


def main(argv: list[str] | None = None) -> None:
    """CLI entry point: `python -m vllm_omni.diffusion.models.qwen_image21.tiny DIR [--seed N]`."""
    run_checkpoint_cli(make_tiny_checkpoint, "Qwen-Image-2.1", __doc__.split("\n\n")[0], argv)


if __name__ == "__main__":
    main()

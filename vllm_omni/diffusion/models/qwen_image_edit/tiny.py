"""Build a tiny random Qwen-Image-Edit checkpoint in the released diffusers layout, offline.

    python -m vllm_omni.diffusion.models.qwen_image_edit.tiny DIR --seed 0

writes what `make_tiny_checkpoint` writes (transformer, vae, text_encoder with its vision tower,
tokenizer, scheduler), plus

    DIR/model_index.json                  QwenImageEditPipeline, with a `processor` component
    DIR/processor/                        Qwen2VLProcessor files: preprocessor_config.json + tokenizer

The vision tower of the tiny text encoder then sees the input image (at most 112 x 112 pixels after the
processor's resize, i.e. 16 vision tokens), and the VAE encoder turns it into condition latents.
Weights are drawn as in `make_tiny_checkpoint` (the VAE at half width, for speed), then the QK-norm
scales are re-scaled (`_sensitize_`) so the input image and the instruction visibly move the output.
`ensure_tiny_edit_checkpoint()` builds it once into the cache (`tiny-qwen-image-edit-seed<seed>`).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from vllm_omni.config import TINY_EDIT_MODEL_NAME
from vllm_omni.diffusion.model_loader import randomize_weights_
from vllm_omni.diffusion.models.qwen_image import configs
from vllm_omni.diffusion.models.qwen_image.configs import REAL_PREPROCESSOR_CONFIG
from vllm_omni.diffusion.models.qwen_image.tiny import (
    _build_text_encoder,
    _build_transformer,
    save_tiny_tokenizer,
)
from vllm_omni.diffusion.models.tiny_cache import (
    VERSION_FILE,
    empty_output_dir,
    ensure_built,
    run_checkpoint_cli,
    save_scheduler_and_index,
    write_json,
)

TINY_EDIT_CHECKPOINT_VERSION = 1
"""Bumped whenever the tiny edit checkpoint's content changes, so stale caches are rebuilt."""


EDIT_MODEL_INDEX: dict = {
    "_class_name": "QwenImageEditPipeline",
    "processor": ["transformers", "Qwen2VLProcessor"],
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
    "tokenizer": ["transformers", "Qwen2Tokenizer"],
    "transformer": ["diffusers", "QwenImageTransformer2DModel"],
    "vae": ["diffusers", "AutoencoderKLQwenImage"],
}
"""`model_index.json` of Qwen/Qwen-Image-Edit (without `_diffusers_version`)."""

TINY_PREPROCESSOR_CONFIG: dict = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2VLProcessor",
    **REAL_PREPROCESSOR_CONFIG,
    # the released processor allows 3136 .. 12845056 pixels; the tiny one caps the vision tower's
    # input at 112 x 112 (16 vision tokens) to keep the text short
    "size": {"shortest_edge": 3136, "longest_edge": 12544},
}
"""`processor/preprocessor_config.json`: the released values, except a small pixel cap."""


TINY_EDIT_VAE_CONFIG: dict = {**configs.TINY_VAE_CONFIG, "base_dim": 4}
"""The tiny VAE at half width: every edit encodes a ~1024 x 1024 input image (diffusers'
`calculate_dimensions`), which this VAE does in about 1 s on 2 CPU cores (base_dim 8: about 2 s)."""

QK_NORM_GAIN = 2.0
"""Multiplies the transformer's QK RMSNorm scales, so attention logits grow 4x: a target row then
attends to a few condition / text rows instead of averaging ~4000 condition rows into a near constant.
With it, another input image moves the 3-step output by about 1e-2 on average (max about 0.15, floats
in [0, 1]) and another prompt by about 2e-2; without it, by about 3e-4 and 5e-4."""


@torch.no_grad()
def _sensitize_(transformer) -> None:
    """Re-scale the QK-norm scales that decide how strongly the image and text reach the output."""
    for name, param in transformer.named_parameters():
        if name.endswith(("norm_q.weight", "norm_k.weight", "norm_added_q.weight", "norm_added_k.weight")):
            param.mul_(QK_NORM_GAIN)


def _build_edit_vae(generator: torch.Generator):
    from diffusers import AutoencoderKLQwenImage

    vae = AutoencoderKLQwenImage(**{k: v for k, v in TINY_EDIT_VAE_CONFIG.items() if not k.startswith("_")})
    randomize_weights_(vae, generator)
    return vae


def make_tiny_edit_checkpoint(out_dir: str | Path, seed: int = 0) -> Path:
    """Write the tiny random Qwen-Image-Edit pipeline to `out_dir` (created; must be empty or absent)."""
    out_dir = empty_output_dir(out_dir, "make_tiny_edit_checkpoint")

    generator = torch.Generator("cpu").manual_seed(seed)
    transformer, vae = _build_transformer(generator), _build_edit_vae(generator)
    text_encoder = _build_text_encoder(generator)
    _sensitize_(transformer)
    transformer.save_pretrained(out_dir / "transformer", safe_serialization=True)
    vae.save_pretrained(out_dir / "vae", safe_serialization=True)
    text_encoder.save_pretrained(out_dir / "text_encoder", safe_serialization=True)
    save_tiny_tokenizer(out_dir / "tokenizer")
    shutil.copytree(out_dir / "tokenizer", out_dir / "processor")
    write_json(out_dir / "processor" / "preprocessor_config.json", TINY_PREPROCESSOR_CONFIG)
    save_scheduler_and_index(out_dir, configs.TINY_SCHEDULER_CONFIG, EDIT_MODEL_INDEX)
    write_json(out_dir / VERSION_FILE, {"version": TINY_EDIT_CHECKPOINT_VERSION, "seed": seed})
    return out_dir


def ensure_tiny_edit_checkpoint(cache_dir: Path | None = None, seed: int = 0) -> Path:
    """Return `<cache_dir>/tiny-qwen-image-edit-seed<seed>`, building it first if absent or stale."""
    return ensure_built(
        TINY_EDIT_MODEL_NAME, make_tiny_edit_checkpoint, TINY_EDIT_CHECKPOINT_VERSION, cache_dir, seed
    )


def main(argv: list[str] | None = None) -> None:
    """CLI entry point: `python -m vllm_omni.diffusion.models.qwen_image_edit.tiny DIR [--seed N]`."""
    run_checkpoint_cli(make_tiny_edit_checkpoint, "Qwen-Image-Edit", __doc__.split("\n\n")[0], argv)


if __name__ == "__main__":
    main()

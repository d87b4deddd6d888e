"""Load Qwen-Image-2.1's components from a diffusers-layout checkpoint (or build them with random weights).

`diffusers_pipeline(path)` builds diffusers' own `QwenImage21Pipeline` over the same files: the
reference our engine is compared against (tests, peer benchmarks).
"""

from __future__ import annotations

from pathlib import Path


def diffusers_pipeline(path: str | Path, dtype=None):
    """diffusers' `QwenImage21Pipeline` over checkpoint `path`, with our text-only processor (the real
    `Qwen3VLProcessor` needs torchvision for its video half)."""
    import torch
    from diffusers import (
        AutoencoderKLQwenImage21,
        FlowMatchEulerDiscreteScheduler,
        QwenImage21Pipeline,
        QwenImage21Transformer2DModel,
    )
    from transformers import Qwen3VLForConditionalGeneration

    from vllm_omni.diffusion.models.qwen_image21.processor import TextProcessor

    path, dtype = Path(path), dtype or torch.float32
    return QwenImage21Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(path / "scheduler"),
        vae=AutoencoderKLQwenImage21.from_pretrained(path / "vae", torch_dtype=dtype),
        text_encoder=Qwen3VLForConditionalGeneration.from_pretrained(path / "text_encoder", dtype=dtype),
        processor=TextProcessor.from_pretrained(path / "processor"),
        transformer=QwenImage21Transformer2DModel.from_pretrained(path / "transformer", torch_dtype=dtype),
        sample_sigmas=None,
    )

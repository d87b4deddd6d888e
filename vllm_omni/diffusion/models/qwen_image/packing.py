"""Qwen-Image's side of the packed layout: its latent grid, and `build_packed_layout` with its RoPE.

The layout itself is model-neutral (`vllm_omni.diffusion.layout`); this module names the Qwen-Image
position tables (`QwenRope`) for it, so `build_packed_layout(specs, config.axes_dims_rope)` reads as
before for the family's tests and tools.
"""

from __future__ import annotations

import torch

from vllm_omni.diffusion.layout import PackedLayout, SequenceSpec, joint_source
from vllm_omni.diffusion.layout import build_packed_layout as build_layout
from vllm_omni.diffusion.models.qwen_image.rope import QwenRope

__all__ = [
    "LATENT_MULTIPLE",
    "PackedLayout",
    "SequenceSpec",
    "build_packed_layout",
    "joint_source",
    "latent_grid",
]

LATENT_MULTIPLE = 16
"""Pixels per latent token side: VAE downscale 8 x patch size 2."""


def latent_grid(height: int, width: int) -> tuple[int, int, int]:
    """Latent token grid `(1, height // 16, width // 16)` of an image; ValueError unless both sides
    are positive multiples of 16 (VAE factor 8 x patch 2)."""
    for name, side in (("height", height), ("width", width)):
        if not isinstance(side, int) or side <= 0 or side % LATENT_MULTIPLE != 0:
            raise ValueError(
                f"{name} must be a positive multiple of {LATENT_MULTIPLE} (VAE factor 8 x patch 2), "
                f"got {side}"
            )
    return (1, height // LATENT_MULTIPLE, width // LATENT_MULTIPLE)


def build_packed_layout(
    specs: list[SequenceSpec],
    axes_dims_rope: tuple[int, ...],
    theta: float = 10000.0,
    scale_rope: bool = True,
    device: torch.device | str = "cpu",
) -> PackedLayout:
    """`layout.build_packed_layout` with Qwen-Image's RoPE of these settings (`QwenRope`)."""
    return build_layout(specs, QwenRope(tuple(axes_dims_rope), float(theta), scale_rope), device)

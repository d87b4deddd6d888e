"""Qwen-Image-2.1's positions: 3-axis RoPE over (frame, h, w), as diffusers' `QwenImage21Rope`.

A T2I sequence's text row i sits at position i on all three axes; its target image at frame L (the
prefix length) with h / w on a grid centred on zero. Angles are `position * inv_freq` per axis in fp32
(diffusers tabulates the same products), so the tables equal diffusers' to the last bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_omni.diffusion.models.qwen_image.rope import axis_inv_freq


def rope_table(
    positions: torch.Tensor, axes_dims: tuple[int, ...], theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (cos, sin) [N, D/2] of integer `positions [N, 3]` (frame, h, w), axis tables concatenated."""
    angles = [torch.outer(positions[:, i], axis_inv_freq(d, theta)) for i, d in enumerate(axes_dims)]
    angles = torch.cat(angles, dim=-1)  # [N, D/2]
    return torch.cos(angles), torch.sin(angles)


def prefix_positions(num_prefix: int) -> torch.Tensor:
    """long [L, 3]: text row i sits at position i on all three axes."""
    return torch.arange(num_prefix).unsqueeze(1).expand(num_prefix, 3)


def image_positions(num_prefix: int, grid: tuple[int, int, int]) -> torch.Tensor:
    """long [f*h*w, 3]: a target image after `num_prefix` text rows: frame frozen at `num_prefix`,
    h / w on a grid centred on zero (rows -(h - h//2) .. h//2 - 1), as diffusers' `QwenImage21Rope`."""
    frames, h, w = grid
    hh = torch.arange(-(h - h // 2), h // 2).repeat_interleave(w)
    ww = torch.arange(-(w - w // 2), w // 2).repeat(h)
    frame = torch.full((h * w,), num_prefix)
    return torch.stack([frame, hh, ww], dim=1).repeat(frames, 1)


@dataclass(frozen=True)
class Rope21:
    """Qwen-Image-2.1's position tables for a packed layout (`layout.PositionTables`): each sequence's
    image rows after its own prefix length, its text rows at 0 .. L-1."""

    axes_dims: tuple[int, ...]
    theta: float = 10000.0

    def __call__(self, specs) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        """((img cos, sin) [num_img_rows, D/2], (txt cos, sin) [num_txt_rows, D/2]) for `specs`."""
        img = torch.cat([image_positions(s.num_txt_tokens, s.img_shape) for s in specs])
        txt = torch.cat([prefix_positions(s.num_txt_tokens) for s in specs])
        return rope_table(img, self.axes_dims, self.theta), rope_table(txt, self.axes_dims, self.theta)

"""Qwen-Image 3-axis RoPE, per request, from its own latent grid and text length.

Ported from diffusers' `QwenEmbedRope` (transformer_qwenimage.py): same frequencies, same positions,
same fp32 `torch.polar` tables, but computed for one request's shape instead of sliced from a batch's
first item, and as real cos/sin tables instead of complex ones.

Positions of one request with latent grid (frames, h, w) and `num_txt_tokens` text tokens, with
`scale_rope=True` (Qwen-Image) the h/w axes are centred on 0:

    image token (f, y, x):  (f,  y - (h - h//2),  x - (w - w//2))       e.g. h = 3: rows -2, -1, 0
    text token j:           (s + j, s + j, s + j),  s = max(h//2, w//2)  (that request's grid)

Head dim D = sum(axes_dims); axis a owns D_a/2 rotation pairs, pair i of axis a rotates by
`position_a / theta ** (2i / D_a)`. Pairs are adjacent channels (x[2i], x[2i+1]) as in diffusers.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

MAX_POSITION = 4096
"""diffusers precomputes positions -4096..4095; a request beyond that fails there, so we refuse it."""


def axis_inv_freq(dim: int, theta: float) -> torch.Tensor:
    """fp32 `[dim // 2]` inverse frequencies of one axis (diffusers' `rope_params`)."""
    if dim % 2 != 0:
        raise ValueError(f"every axes_dims_rope entry must be even, got {dim}")
    return 1.0 / torch.pow(theta, torch.arange(0, dim, 2).to(torch.float32).div(dim))


def image_positions(
    img_shape: tuple[int, int, int], scale_rope: bool = True, frame_offset: int = 0
) -> torch.Tensor:
    """Int64 `[frames * h * w, 3]` (frame, row, column) positions in row-major token order.

    `frame_offset` shifts the frame axis: grid k of a multi-grid sequence starts at frame k."""
    frames, h, w = img_shape
    if scale_rope:
        rows, cols = torch.arange(-(h - h // 2), h // 2), torch.arange(-(w - w // 2), w // 2)
    else:
        rows, cols = torch.arange(h), torch.arange(w)
    grid = torch.meshgrid(torch.arange(frame_offset, frame_offset + frames), rows, cols, indexing="ij")
    return torch.stack(grid, dim=-1).reshape(-1, 3)


def text_start(img_shape: tuple[int, int, int], scale_rope: bool = True) -> int:
    """First text position: just past the largest image position of this request's grid."""
    _, h, w = img_shape
    return max(h // 2, w // 2) if scale_rope else max(h, w)


def text_positions(
    img_shape: tuple[int, int, int], num_txt_tokens: int, scale_rope: bool = True
) -> torch.Tensor:
    """Int64 `[num_txt_tokens, 3]`: text token j sits at (s + j) on all three axes."""
    start = text_start(img_shape, scale_rope)
    return torch.arange(start, start + num_txt_tokens)[:, None].expand(-1, 3)


def rope_cos_sin(
    positions: torch.Tensor, axes_dims: tuple[int, ...], theta: float = 10000.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos/sin `[N, sum(axes_dims) // 2]` for int64 positions `[N, len(axes_dims)]`."""
    low, high = int(positions.min()), int(positions.max())
    if low < -MAX_POSITION or high >= MAX_POSITION:
        raise ValueError(
            f"RoPE positions must lie in [-{MAX_POSITION}, {MAX_POSITION}), got [{low}, {high}]: "
            "the image grid or text is too long"
        )
    # torch.outer(int64, fp32) then torch.polar, exactly as diffusers builds its tables
    angles = torch.cat(
        [torch.outer(positions[:, a], axis_inv_freq(d, theta)) for a, d in enumerate(axes_dims)], dim=1
    )  # [N, D/2]
    freqs = torch.polar(torch.ones_like(angles), angles)
    return freqs.real.contiguous(), freqs.imag.contiguous()


@functools.lru_cache(maxsize=256)
def image_rope(
    img_shape: tuple[int, int, int],
    axes_dims: tuple[int, ...],
    theta: float = 10000.0,
    scale_rope: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cached CPU fp32 cos/sin `[frames * h * w, D/2]` of one image grid. Do not modify in place."""
    return rope_cos_sin(image_positions(img_shape, scale_rope), axes_dims, theta)


@functools.lru_cache(maxsize=1024)
def text_rope(
    img_shape: tuple[int, int, int],
    num_txt_tokens: int,
    axes_dims: tuple[int, ...],
    theta: float = 10000.0,
    scale_rope: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cached CPU fp32 cos/sin `[num_txt_tokens, D/2]` of one request's text. Do not modify in place."""
    return rope_cos_sin(text_positions(img_shape, num_txt_tokens, scale_rope), axes_dims, theta)


@functools.lru_cache(maxsize=256)
def grids_rope(
    grids: tuple[tuple[int, int, int], ...],
    axes_dims: tuple[int, ...],
    theta: float = 10000.0,
    scale_rope: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cached CPU fp32 cos/sin `[sum of grid tokens, D/2]` of one sequence's image grids, in order.

    An edit sequence's image stream is [target ; condition]: grid k gets frame positions k, k+1, ...
    and its own centred rows / columns, as diffusers' `QwenEmbedRope` does for a list of img_shapes.
    One grid gives `image_rope`'s table. Do not modify in place.
    """
    if len(grids) == 1:
        return image_rope(grids[0], axes_dims, theta, scale_rope)
    positions = torch.cat([image_positions(g, scale_rope, frame_offset=k) for k, g in enumerate(grids)])
    return rope_cos_sin(positions, axes_dims, theta)


@functools.lru_cache(maxsize=1024)
def grids_text_rope(
    grids: tuple[tuple[int, int, int], ...],
    num_txt_tokens: int,
    axes_dims: tuple[int, ...],
    theta: float = 10000.0,
    scale_rope: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cached CPU fp32 cos/sin `[num_txt_tokens, D/2]` of the text of a sequence with several grids.

    Text starts just past the largest image position over all grids (diffusers' `max_vid_index`).
    One grid gives `text_rope`'s table. Do not modify in place.
    """
    if len(grids) == 1:
        return text_rope(grids[0], num_txt_tokens, axes_dims, theta, scale_rope)
    start = max(text_start(g, scale_rope) for g in grids)
    positions = torch.arange(start, start + num_txt_tokens)[:, None].expand(-1, 3)
    return rope_cos_sin(positions, axes_dims, theta)


@dataclass(frozen=True)
class QwenRope:
    """Qwen-Image's position tables for a packed layout (`vllm_omni.diffusion.layout.PositionTables`):
    every sequence's image rows from its own grids (centred h / w with `scale_rope`), its text rows from
    just past its largest image position. Frozen, so two layouts' tables compare by their settings."""

    axes_dims: tuple[int, ...]
    """Rotary dims per axis (frames, h, w); they sum to the head dim."""
    theta: float = 10000.0
    scale_rope: bool = True

    def __call__(self, specs) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        """((img cos, sin) [num_img_rows, D/2], (txt cos, sin) [num_txt_rows, D/2]) for `specs`, in order."""
        axes = tuple(int(d) for d in self.axes_dims)
        img = [grids_rope(s.grids, axes, self.theta, self.scale_rope) for s in specs]
        txt = [
            grids_text_rope(s.grids, int(s.num_txt_tokens), axes, self.theta, self.scale_rope) for s in specs
        ]
        img_cos, img_sin = (torch.cat([t[j] for t in img]) for j in (0, 1))  # [num_img, D/2]
        txt_cos, txt_sin = (torch.cat([t[j] for t in txt]) for j in (0, 1))  # [num_txt, D/2]
        return (img_cos, img_sin), (txt_cos, txt_sin)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent channel pairs of `x [..., T, H, D]` by fp32 `cos/sin [T, D/2]`; computed in fp32.

    Equals diffusers' `apply_rotary_emb_qwen(x, freqs, use_real=False)` (complex multiply).
    """
    x_re, x_im = x.float().unflatten(-1, (-1, 2)).unbind(-1)  # [..., T, H, D/2] each
    cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, D/2]
    out = torch.stack([x_re * cos - x_im * sin, x_re * sin + x_im * cos], dim=-1)  # [..., T, H, D/2, 2]
    return out.flatten(-2).to(x.dtype)

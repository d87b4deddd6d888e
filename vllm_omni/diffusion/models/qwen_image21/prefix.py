"""The layout of an edit prefix: text rows and reference-image blocks, their positions and visibility.

diffusers' `QwenImage21Pipeline` encodes an edit's prompt together with its reference images: Qwen3-VL
reserves one `<|image_pad|>` slot per 2x2 group of an image's latent rows, and the transformer expands
every slot to 4 rows holding that image's VAE latents (row-major), so the prefix is

    | text | image 1 (h1 x w1 rows) | text | image 2 ... | text |   then the target image
    ids:  -1 |  0 0 0 ...  0         |  -1  |  1 1 ...    |  -1  |

Visibility is block-causal: row i sees row j when j <= i or both lie in the same image block. Positions
(frame, h, w): text rows advance one position on all three axes; an image block sits at the next frame
position with h / w on a grid centred on zero, and advances the position by max(h, w); the target image
takes the position after the whole prefix (`target_frame`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_omni.diffusion.models.qwen_image21.processor import ROWS_PER_SLOT
from vllm_omni.diffusion.models.qwen_image21.rope import image_positions


@dataclass(frozen=True)
class PrefixPlan:
    """Where each row of an edit prefix comes from, where it sits, and which block it belongs to."""

    txt_index: torch.Tensor
    """long [num_text_rows]: prefix row of every text row (the encoder rows that are not slots)."""
    img_index: torch.Tensor
    """long [num_cond_rows]: prefix row of every reference-image latent row, images in order."""
    positions: torch.Tensor
    """long [L, 3]: (frame, h, w) of every prefix row."""
    block_ids: torch.Tensor
    """long [L]: -1 for text rows, the image's index for its rows."""
    target_frame: int
    """Frame position of the target image that follows the prefix."""

    @property
    def num_rows(self) -> int:
        return int(self.block_ids.numel())

    def visibility(self) -> torch.Tensor:
        """bool [L, L]: row i may attend to row j (j <= i, or the same image block)."""
        idx = torch.arange(self.num_rows)
        same_block = (self.block_ids[:, None] == self.block_ids[None, :]) & (self.block_ids[:, None] >= 0)
        return (idx[None, :] <= idx[:, None]) | same_block


def plan_prefix(slot_mask: list[bool], cond_grids: list[tuple[int, int, int]]) -> PrefixPlan:
    """The prefix of an encoder sequence whose `slot_mask[r]` marks image slots, for reference images of
    latent grids `cond_grids` (in order; each image's slots contiguous). ValueError on a mismatch."""
    rows_per_block = [f * h * w for f, h, w in cond_grids]
    slots = [r for r, is_slot in enumerate(slot_mask) if is_slot]
    if ROWS_PER_SLOT * len(slots) != sum(rows_per_block):
        raise ValueError(
            f"{len(slots)} image slots hold {ROWS_PER_SLOT * len(slots)} rows, the reference grids "
            f"{cond_grids} hold {sum(rows_per_block)}"
        )
    kinds = []  # per prefix row: -1 text, else block id
    block_of_slot = [b for b, n in enumerate(rows_per_block) for _ in range(n // ROWS_PER_SLOT)]
    slot_iter = iter(block_of_slot)
    for is_slot in slot_mask:
        kinds.extend([next(slot_iter)] * ROWS_PER_SLOT if is_slot else [-1])
    block_ids = torch.tensor(kinds, dtype=torch.long)
    is_text = block_ids < 0

    positions, position, row = [], 0, 0
    for block, grid in enumerate(cond_grids):
        start = kinds.index(block, row)
        text = torch.arange(position, position + start - row)
        positions.append(text.unsqueeze(1).expand(-1, 3))
        position += start - row
        positions.append(image_positions(position, grid))
        position += max(grid[1], grid[2])
        row = start + rows_per_block[block]
    trailing = torch.arange(position, position + len(kinds) - row)
    positions.append(trailing.unsqueeze(1).expand(-1, 3))
    return PrefixPlan(
        txt_index=is_text.nonzero().squeeze(1),
        img_index=(~is_text).nonzero().squeeze(1),
        positions=torch.cat(positions),
        block_ids=block_ids,
        target_frame=position + len(kinds) - row,
    )

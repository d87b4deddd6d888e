"""Packed layout of one transformer forward, model-neutral: which rows go where, and their positions.

A family with a dual-stream (text / image) transformer keeps two flat row buffers, one per stream,
each in sequence order:

    img_rows  [num_img_rows, C]:  | img of seq 0 | img of seq 1 | img of seq 2 |
    txt_rows  [num_txt_rows, C]:  | txt 0 | txt 1 | txt 2 |

and attention runs over one joint buffer where sequence i is [its text ; its image]:

    joint     [total_tokens, H, D]:  | txt 0 | img 0 | txt 1 | img 1 | txt 2 | img 2 |
    cu_seqlens:                      0               ^               ^               ^ total_tokens
    txt_to_joint[r]:  joint position of text row r       (joint[txt_to_joint] = txt rows)
    img_to_joint[r]:  joint position of image row r      (joint[img_to_joint] = img rows)

A CFG request contributes two sequences (positive, then negative text; the image rows repeated).
The row maps, sequence ids and cu_seqlens are the same for every family; the position tables (RoPE)
are the family's: `build_packed_layout` asks its `PositionTables` for them (Qwen-Image's 3-axis RoPE
is the family's `QwenRope`). Everything here depends only on the list of
`SequenceSpec`s, so a runner builds it once per batch composition and reuses it every step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from vllm_omni.diffusion.attention.metadata import AttentionMetadata, build_varlen_metadata


def _is_positive_int(n) -> bool:
    return isinstance(n, (int, np.integer)) and not isinstance(n, bool) and n > 0


@dataclass(frozen=True)
class SequenceSpec:
    """One packed sequence: a request's prompt (or negative prompt) text and its image grid(s).

    An edit sequence's image stream is `[target rows ; condition rows]` (`cond_shapes`); condition rows
    attend and are attended like image rows and the caller keeps only the first `num_target_tokens`
    rows of the output.
    """

    num_txt_tokens: int
    """Real text length of this sequence's prompt (positive or negative)."""
    img_shape: tuple[int, int, int]
    """(frames, h, w) latent token grid, i.e. (1, H // 16, W // 16)."""
    req_id: str = ""
    is_negative: bool = False
    """The negative (CFG) sequence of a request."""
    cond_shapes: tuple[tuple[int, int, int], ...] = ()
    """(frames, h, w) grids of condition images (edit models) after the target; () for text-to-image."""

    @property
    def grids(self) -> tuple[tuple[int, int, int], ...]:
        """Every image grid of the sequence, target first (RoPE positions follow this order)."""
        return (tuple(map(int, self.img_shape)), *(tuple(map(int, g)) for g in self.cond_shapes))

    @property
    def num_target_tokens(self) -> int:
        """Rows of the target grid: the part of the output that is the prediction."""
        frames, h, w = self.img_shape
        return frames * h * w

    @property
    def num_img_tokens(self) -> int:
        """Image-stream rows: the target grid's plus every condition grid's."""
        return sum(f * h * w for f, h, w in self.grids)

    @property
    def seq_len(self) -> int:
        return self.num_txt_tokens + self.num_img_tokens

    def validate(self, index: int) -> None:
        """Raise ValueError naming `specs[index]` and the field when the spec is malformed."""
        if not _is_positive_int(self.num_txt_tokens):
            raise ValueError(
                f"specs[{index}].num_txt_tokens must be a positive int, got {self.num_txt_tokens!r}"
            )
        shape = self.img_shape
        if len(shape) != 3 or not all(_is_positive_int(n) for n in shape):
            raise ValueError(
                f"specs[{index}].img_shape must be 3 positive ints (frames, h, w), got {shape!r}"
            )
        for shape in self.cond_shapes:
            if len(shape) != 3 or not all(_is_positive_int(n) for n in shape):
                raise ValueError(
                    f"specs[{index}].cond_shapes entries must be 3 positive ints (f, h, w), got {shape!r}"
                )


class PositionTables(Protocol):
    """A family's position tables for a layout (Qwen-Image: `QwenRope`, its 3-axis RoPE).

    Called on the host with the layout's specs; returns fp32 ((img cos, img sin), (txt cos, txt sin)),
    [num_img_rows, D/2] and [num_txt_rows, D/2] in the layout's row order. A sequence's positions depend
    only on its own spec, never on its place in the batch. Implementations are frozen dataclasses, so
    `==` says whether two layouts' tables came from the same settings.
    """

    def __call__(
        self, specs: list[SequenceSpec]
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]: ...


def joint_source(txt_to_joint: torch.Tensor, img_to_joint: torch.Tensor) -> torch.Tensor:
    """The inverse of the two join indices: long [num_txt + num_img], joint row -> its row in
    `cat([txt rows, img rows])` (every joint row is a text or an image row)."""
    num_txt, num_img = txt_to_joint.shape[0], img_to_joint.shape[0]
    src = torch.empty(num_txt + num_img, dtype=torch.long, device=txt_to_joint.device)
    src[txt_to_joint] = torch.arange(num_txt, device=src.device)
    src[img_to_joint] = torch.arange(num_txt, num_txt + num_img, device=src.device)
    return src


@dataclass
class PackedLayout:
    """Indices, attention metadata and position tables of one packed forward (see the module docstring).

    Device tensors live on `device`; host lists end in `_offsets`. Treat as immutable.
    """

    specs: tuple[SequenceSpec, ...]
    attn: AttentionMetadata
    """Varlen metadata over the joint buffer: cu_seqlens over [txt_i ; img_i] per sequence."""
    txt_to_joint: torch.Tensor
    """int64 [num_txt_rows]: joint position of every text row."""
    img_to_joint: torch.Tensor
    """int64 [num_img_rows]: joint position of every image row."""
    txt_seq_ids: torch.Tensor
    """int64 [num_txt_rows]: sequence index of every text row (broadcasts per-sequence modulation)."""
    img_seq_ids: torch.Tensor
    """int64 [num_img_rows]: sequence index of every image row."""
    img_rope: tuple[torch.Tensor, torch.Tensor]
    """fp32 (cos, sin) [num_img_rows, D/2]: each row's rotary table from its own request's grid."""
    txt_rope: tuple[torch.Tensor, torch.Tensor]
    """fp32 (cos, sin) [num_txt_rows, D/2]."""
    img_row_offsets: list[int]
    """[num_seqs + 1]: sequence i's image rows are img_rows[off[i]:off[i + 1]]."""
    txt_row_offsets: list[int]
    """[num_seqs + 1]: sequence i's text rows are txt_rows[off[i]:off[i + 1]]."""
    positions: PositionTables
    """The family's position tables that built `img_rope` / `txt_rope` (a model checks they are its own)."""

    @property
    def num_seqs(self) -> int:
        return len(self.specs)

    @property
    def num_img_rows(self) -> int:
        return self.img_row_offsets[-1]

    @property
    def num_txt_rows(self) -> int:
        return self.txt_row_offsets[-1]

    @property
    def total_tokens(self) -> int:
        return self.num_img_rows + self.num_txt_rows

    @property
    def device(self) -> torch.device:
        return self.img_to_joint.device

    def joint_src(self) -> torch.Tensor:
        """long [total_tokens]: joint row -> row of `cat([txt rows, img rows])` (`joint_source`;
        device ops only, so a captured graph recomputes it from its static layout)."""
        return joint_source(self.txt_to_joint, self.img_to_joint)

    def split_img(self, rows: torch.Tensor) -> list[torch.Tensor]:
        """Per-sequence views of `rows [num_img_rows, ...]` (e.g. the forward's output)."""
        if rows.shape[0] != self.num_img_rows:
            raise ValueError(f"rows has {rows.shape[0]} rows, the layout has {self.num_img_rows} image rows")
        sizes = np.diff(self.img_row_offsets).tolist()
        return list(rows.split(sizes, dim=0))

    def to(self, device: torch.device | str) -> PackedLayout:
        """The same layout with its tensors on `device`."""
        device = torch.device(device)
        move = lambda t: t.to(device)  # noqa: E731
        attn = dataclasses.replace(
            self.attn, cu_seqlens_q=move(self.attn.cu_seqlens_q), cu_seqlens_k=move(self.attn.cu_seqlens_k)
        )
        tensors = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        ropes = {name: tuple(map(move, getattr(self, name))) for name in ("img_rope", "txt_rope")}
        return dataclasses.replace(self, attn=attn, **{k: move(t) for k, t in tensors.items()}, **ropes)


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def build_packed_layout(
    specs: list[SequenceSpec], positions: PositionTables, device: torch.device | str = "cpu"
) -> PackedLayout:
    """Build the packing plan for `specs` (in order): indices on the host, one copy per dtype to `device`;
    the position tables come from `positions` (the family's, e.g. `transformer.position_tables`).

    Raises ValueError for an empty batch or a malformed spec (non-positive text length, bad grid).
    """
    if not specs:
        raise ValueError("specs must hold at least one sequence")
    for i, spec in enumerate(specs):
        spec.validate(i)
    device = torch.device(device)
    txt_lens = np.array([s.num_txt_tokens for s in specs], dtype=np.int64)
    img_lens = np.array([s.num_img_tokens for s in specs], dtype=np.int64)
    seq_lens = txt_lens + img_lens
    seq_starts = np.concatenate([[0], np.cumsum(seq_lens)])[:-1]  # joint start of every sequence
    txt_offsets = np.concatenate([[0], np.cumsum(txt_lens)])
    img_offsets = np.concatenate([[0], np.cumsum(img_lens)])
    num_txt, num_img = int(txt_offsets[-1]), int(img_offsets[-1])

    # row r of sequence i sits at joint seq_start_i (+ txt_len_i for images) + (r - row_offset_i)
    txt_to_joint = np.arange(num_txt) + np.repeat(seq_starts - txt_offsets[:-1], txt_lens)
    img_to_joint = np.arange(num_img) + np.repeat(seq_starts + txt_lens - img_offsets[:-1], img_lens)
    seq_index = np.arange(len(specs))
    txt_seq_ids, img_seq_ids = np.repeat(seq_index, txt_lens), np.repeat(seq_index, img_lens)
    index_cpu = torch.from_numpy(np.concatenate([txt_to_joint, img_to_joint, txt_seq_ids, img_seq_ids]))

    (img_cos, img_sin), (txt_cos, txt_sin) = positions(specs)  # [num_img, D/2], [num_txt, D/2]
    rope_cpu = torch.cat([img_cos, img_sin, txt_cos, txt_sin])  # one host->device copy

    attn = build_varlen_metadata(seq_lens.tolist(), "cpu")
    attn.validate(num_txt + num_img)  # on the host: no device sync
    attn.cu_seqlens_q = attn.cu_seqlens_k = attn.cu_seqlens_q.to(device)

    index = _to_device(index_cpu, device).split([num_txt, num_img, num_txt, num_img])
    rope = _to_device(rope_cpu, device).split([num_img, num_img, num_txt, num_txt])
    return PackedLayout(
        specs=tuple(specs),
        attn=attn,
        txt_to_joint=index[0],
        img_to_joint=index[1],
        txt_seq_ids=index[2],
        img_seq_ids=index[3],
        img_rope=(rope[0], rope[1]),
        txt_rope=(rope[2], rope[3]),
        img_row_offsets=img_offsets.tolist(),
        txt_row_offsets=txt_offsets.tolist(),
        positions=positions,
    )

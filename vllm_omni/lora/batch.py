"""Which rows of one forward get which adapter: `LoRAMapping` (per sequence) -> `LoRABatch` (per row stream).

A forward has three row streams, and every linear reads one of them (`layers.row_stream`):

    img   image rows      packed: layout order (each sequence's rows contiguous); dense [B, S_img]: row b*S+s
    txt   text rows       the same, for the text stream
    seq   one row per sequence (modulation, timestep embedding)

A *run* is a range of consecutive rows of one stream that share an adapter slot and a scale;
neighbouring sequences with the same (slot, scale) merge, rows of no adapter (slot 0) are left out:

    img_rows  | seq 0 (slot 1, 1.0) | seq 1 (slot 1, 1.0) | seq 2 (none) | seq 3 (slot 2, 0.5) |
    runs      | (0, 700, 1, 1.0) ------------------------- |              | (900, 1200, 2, 0.5) |
    tiles     | 0-64 | 64-128 | ... | 640-700 |                          | 900-964 | ... |

The CPU path loops over the runs on the host. The CUDA path reads the runs cut into *tiles* of at most
`TILE_ROWS` rows, a device table `[num_tiles, 3]` of (start, end, slot) with a scale per tile: a kernel
program per tile (kernels.py). A CUDA graph keeps one such table per stream at a fixed size
(`LoRABatch.static`), filled by its `load` every step; unused entries are slot 0, whose programs
return at once.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

RowStream = Literal["img", "txt", "seq"]
STREAMS: tuple[RowStream, ...] = ("img", "txt", "seq")

TILE_ROWS = 64
"""Rows per tile of the device tables (the kernels' BLOCK_M). 64, not 32: on Hopper, Triton issues
warpgroup MMAs (wgmma) only for tiles of >= 64 rows, every program re-reads its slot's A (shrink) or
B (expand) from L2 (rank 64: as many bytes as 64 rows of x / output), so 32-row tiles doubled that
traffic and the program count; a sequence's last partial tile wastes at most 63 masked rows."""

Run = tuple[int, int, int, float]
"""(start row, end row, slot, scale) of one run."""


@dataclass(frozen=True)
class SeqLoRA:
    """The adapter of one sequence of a forward."""

    lora_int_id: int
    """The adapter's id (0 = no adapter)."""
    scale: float = 1.0
    """The request's `lora_scale` (multiplies the adapter's own alpha / rank)."""

    @classmethod
    def of(cls, sampling_params) -> SeqLoRA:
        """The adapter of a request's sequences, from its (engine-resolved) sampling params."""
        request = sampling_params.lora_request
        if request is None:
            return cls(0)
        if not request.lora_int_id:
            raise ValueError(f"lora: adapter {request.lora_name!r} reached the model unresolved")
        return cls(request.lora_int_id, float(sampling_params.lora_scale))


@dataclass(frozen=True)
class LoRAMapping:
    """Which adapter every sequence of one forward uses, and where each sequence's rows are.

    `img_row_offsets` / `txt_row_offsets` ([num_seqs + 1], host ints): sequence i's rows of that stream
    are [off[i], off[i + 1]). Hashable: the manager reuses the batch of an unchanged mapping.
    """

    seqs: tuple[SeqLoRA, ...]
    img_row_offsets: tuple[int, ...]
    txt_row_offsets: tuple[int, ...]

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)

    @property
    def has_adapters(self) -> bool:
        return any(s.lora_int_id for s in self.seqs)

    @classmethod
    def for_packed(cls, seqs, layout) -> LoRAMapping:
        """Mapping for `forward_packed(..., layout)`; `seqs[i]` is sequence i's adapter."""
        if len(seqs) != len(layout.specs):
            raise ValueError(f"LoRA mapping has {len(seqs)} sequences, the forward has {len(layout.specs)}")
        return cls(tuple(seqs), tuple(layout.img_row_offsets), tuple(layout.txt_row_offsets))

    @classmethod
    def for_dense(cls, seqs, num_img: int, num_txt: int) -> LoRAMapping:
        """Mapping for the dense forward `[B, S_img, C]` / `[B, S_txt, C]`; `seqs[b]` is item b's adapter."""
        batch = len(seqs)
        return cls(
            tuple(seqs),
            tuple(range(0, batch * num_img + 1, num_img)) if num_img else (0,) * (batch + 1),
            tuple(range(0, batch * num_txt + 1, num_txt)) if num_txt else (0,) * (batch + 1),
        )

    def offsets(self, stream: RowStream) -> tuple[int, ...]:
        if stream == "seq":
            return tuple(range(self.num_seqs + 1))
        return self.img_row_offsets if stream == "img" else self.txt_row_offsets


def merge_runs(slots: list[int], scales: list[float], offsets: tuple[int, ...]) -> tuple[Run, ...]:
    """Runs of one stream: per sequence (slot, scale) over rows [offsets[i], offsets[i + 1])."""
    runs: list[list] = []
    for i, (slot, scale) in enumerate(zip(slots, scales)):
        start, end = offsets[i], offsets[i + 1]
        if not slot or end == start:
            continue
        if runs and runs[-1][2:] == [slot, scale] and runs[-1][1] == start:
            runs[-1][1] = end
        else:
            runs.append([start, end, slot, scale])
    return tuple((s, e, slot, scale) for s, e, slot, scale in runs)


def tile_runs(runs: tuple[Run, ...], tile_rows: int = TILE_ROWS) -> tuple[np.ndarray, np.ndarray]:
    """The runs cut into tiles of at most `tile_rows` rows: (int32 [T, 3] (start, end, slot), fp32 [T])."""
    tiles, scales = [], []
    for start, end, slot, scale in runs:
        for row in range(start, end, tile_rows):
            tiles.append((row, min(row + tile_rows, end), slot))
            scales.append(scale)
    return np.array(tiles, dtype=np.int32).reshape(-1, 3), np.array(scales, dtype=np.float32)


def max_tiles(num_rows: int, max_runs: int) -> int:
    """Most tiles `max_runs` runs over `num_rows` rows can need (each run adds at most one partial tile)."""
    return math.ceil(num_rows / TILE_ROWS) + max_runs


@dataclass
class StreamRuns:
    """The adapted rows of one row stream in one forward, for both delta paths."""

    num_rows: int
    """Rows the stream's linears see (a linear checks its input against it)."""
    runs: tuple[Run, ...]
    """Host runs (the CPU / batch-invariant path)."""
    tiles: torch.Tensor
    """int32 [num_tiles, 3] on the device: (start, end, slot) per tile (the CUDA path)."""
    scales: torch.Tensor
    """fp32 [num_tiles]: each tile's request scale."""


@dataclass
class LoRABatch:
    """The rows every adapter slot adapts in one forward, per row stream (see the module docstring)."""

    streams: dict[RowStream, StreamRuns]

    @classmethod
    def build(cls, mapping: LoRAMapping, slot_of: Mapping[int, int], device) -> LoRABatch:
        """The batch of `mapping`, with `slot_of[lora_int_id]` the slot of each adapter it names."""
        slots = [slot_of[s.lora_int_id] if s.lora_int_id else 0 for s in mapping.seqs]
        scales = [float(s.scale) for s in mapping.seqs]
        runs = {st: merge_runs(slots, scales, mapping.offsets(st)) for st in STREAMS}
        tiled = [tile_runs(runs[st]) for st in STREAMS]
        # one host-to-device copy per table for all three streams
        tiles = torch.from_numpy(np.concatenate([t for t, _ in tiled])).to(device)
        tile_scales = torch.from_numpy(np.concatenate([s for _, s in tiled])).to(device)
        streams, at = {}, 0
        for st, (t, _) in zip(STREAMS, tiled):
            end = at + t.shape[0]
            streams[st] = StreamRuns(mapping.offsets(st)[-1], runs[st], tiles[at:end], tile_scales[at:end])
            at = end
        return cls(streams)

    @classmethod
    def static(cls, num_rows: Mapping[RowStream, int], max_runs: int, device) -> LoRABatch:
        """Fixed-size tables for a CUDA graph over `num_rows` rows per stream and at most `max_runs`
        runs per stream (one per sequence slot): every entry slot 0 until `load`."""
        streams = {}
        for st in STREAMS:
            size = max_tiles(num_rows[st], max_runs)
            streams[st] = StreamRuns(
                num_rows[st],
                (),
                torch.zeros(size, 3, dtype=torch.int32, device=device),
                torch.zeros(size, dtype=torch.float32, device=device),
            )
        return cls(streams)

    def load(self, batch: LoRABatch) -> None:
        """Copy `batch` (a forward's, whose rows are this one's first rows) into these static tables;
        the entries after its tiles become slot 0."""
        for st, dst in self.streams.items():
            src = batch.streams[st]
            num_tiles = src.tiles.shape[0]
            if num_tiles > dst.tiles.shape[0] or src.num_rows > dst.num_rows:
                raise ValueError(
                    f"LoRA: {st} stream of {src.num_rows} rows / {num_tiles} tiles does not fit the "
                    f"graph's {dst.num_rows} rows / {dst.tiles.shape[0]} tiles"
                )
            dst.tiles[:num_tiles].copy_(src.tiles)
            dst.tiles[num_tiles:].zero_()
            dst.scales[:num_tiles].copy_(src.scales)
            dst.runs = src.runs

"""Which rows of one forward get which adapter: `LoRAMapping` (per sequence) -> `LoRABatch` (per row stream).

A forward has three row streams, and every linear reads one of them (its family's `LoRAPlan.row_stream`):

    img   image rows      packed: layout order (each sequence's rows contiguous); dense [B, S_img]: row b*S+s
    txt   text rows       the same, for the text stream
    seq   one row per sequence (modulation, timestep embedding)

A *run* is a range of consecutive rows of one stream that share an adapter slot and a scale;
neighbouring sequences with the same (slot, scale) merge, rows of no adapter (slot 0) are left out:

    img_rows  | seq 0 (slot 1, 1.0) | seq 1 (slot 1, 1.0) | seq 2 (none) | seq 3 (slot 2, 0.5) |
    runs      | (0, 700, 1, 1.0) ------------------------- |              | (900, 1200, 2, 0.5) |
    tiles     | 0-64 | 64-128 | ... | 640-700 |                          | 900-964 | ... |
    all_tiles | 0-64 | 64-128 | ... | 640-700 | 700-764 | ... | 892-900 | 900-964 | ... |
                                                (slot 0)

The CPU path loops over the runs on the host. The CUDA path reads the runs cut into *tiles* of at most
`TILE_ROWS` rows, a device table `[num_tiles, 3]` of (start, end, slot) with a scale per tile: a kernel
program per tile (kernels.py). `all_tiles` also holds the rows of no adapter, as slot 0 tiles
(`cover_runs`): the table of a delta whose expand applies an activation to the whole output
(`KernelDelta.activation`, the MLP up projection's GELU), which every row needs. A CUDA graph keeps
such tables per stream at a fixed size (`LoRABatch.static`), filled by its `load` every step; unused
entries are slot 0 tiles of no rows, whose programs do nothing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from vllm_omni.diffusion.models.plans import RowStream

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


def cover_runs(runs: tuple[Run, ...], num_rows: int) -> tuple[Run, ...]:
    """`runs` (ascending, within [0, num_rows)) with the rows around them as runs of slot 0 (scale 0):
    every row in exactly one run. Runs are whole sequences, so a stream of n sequences has at most n."""
    covered: list[Run] = []
    at = 0
    for run in runs:
        if run[0] > at:
            covered.append((at, run[0], 0, 0.0))
        covered.append(run)
        at = run[1]
    if at < num_rows:
        covered.append((at, num_rows, 0, 0.0))
    return tuple(covered)


def tile_runs(runs: tuple[Run, ...], tile_rows: int = TILE_ROWS) -> tuple[np.ndarray, np.ndarray]:
    """The runs cut into tiles of at most `tile_rows` rows: (int32 [T, 3] (start, end, slot), fp32 [T])."""
    tiles, scales = [], []
    for start, end, slot, scale in runs:
        for row in range(start, end, tile_rows):
            tiles.append((row, min(row + tile_rows, end), slot))
            scales.append(scale)
    return np.array(tiles, dtype=np.int32).reshape(-1, 3), np.array(scales, dtype=np.float32)


def max_tiles(num_rows: int, max_runs: int) -> int:
    """Most tiles `max_runs` disjoint runs over `num_rows` rows can need: ceil(rows / TILE_ROWS) + runs - 1.

    Why: k runs of a_1 .. a_k >= 1 rows (sum <= N) cut into sum ceil(a_i / T) <= (N + k (T - 1)) / T =
    N / T + k - k / T tiles, an integer, whose floor is at most ceil(N / T) + k - 1 for every k >= 1.
    A graph's static table sized so has k - 1 spare entries at most (before: k); their programs return
    at once but still take SM slots (a one-sequence packed bucket: k = 2 runs, the sequence's and the
    padding's)."""
    return max(0, math.ceil(num_rows / TILE_ROWS) + max_runs - 1)


@dataclass
class StreamRuns:
    """The adapted rows of one row stream in one forward, for both delta paths."""

    num_rows: int
    """Rows the stream's linears see (a linear checks its input against it)."""
    runs: tuple[Run, ...]
    """Host runs (the CPU / batch-invariant path)."""
    tiles: torch.Tensor
    """int32 [num_tiles, 3] on the device: (start, end, slot) per tile of the runs (the CUDA path)."""
    scales: torch.Tensor
    """fp32 [num_tiles]: each tile's request scale."""
    all_tiles: torch.Tensor
    """int32 [num_all_tiles, 3]: the tiles of every row (the runs', and slot 0 ones for the others)."""
    all_scales: torch.Tensor
    """fp32 [num_all_tiles] (0 for slot 0 tiles)."""

    def tables(self, every_row: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(tiles, scales) of the adapted rows, or of every row."""
        return (self.all_tiles, self.all_scales) if every_row else (self.tiles, self.scales)


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
        num_rows = {st: mapping.offsets(st)[-1] for st in STREAMS}
        # per stream the runs' tiles, then every row's: one host-to-device copy per kind for all six
        tiled = [tile_runs(runs[st]) for st in STREAMS]
        tiled += [tile_runs(cover_runs(runs[st], num_rows[st])) for st in STREAMS]
        tiles = torch.from_numpy(np.concatenate([t for t, _ in tiled])).to(device)
        tile_scales = torch.from_numpy(np.concatenate([s for _, s in tiled])).to(device)
        tables, at = [], 0
        for t, _ in tiled:
            tables.append((tiles[at : at + t.shape[0]], tile_scales[at : at + t.shape[0]]))
            at += t.shape[0]
        streams = {
            st: StreamRuns(num_rows[st], runs[st], *tables[i], *tables[len(STREAMS) + i])
            for i, st in enumerate(STREAMS)
        }
        return cls(streams)

    @classmethod
    def static(cls, num_rows: Mapping[RowStream, int], max_runs: int, device) -> LoRABatch:
        """Fixed-size tables for a CUDA graph over `num_rows` rows per stream and at most `max_runs`
        runs per stream (one per sequence slot): every entry slot 0 until `load`."""
        streams = {}
        for st in STREAMS:
            size = max_tiles(num_rows[st], max_runs)  # covering runs too: at most one per sequence
            tables = [
                torch.zeros(size, 3, dtype=torch.int32, device=device),
                torch.zeros(size, dtype=torch.float32, device=device),
            ]
            tables += [t.clone() for t in tables]
            streams[st] = StreamRuns(num_rows[st], (), *tables)
        return cls(streams)

    def load(self, batch: LoRABatch) -> None:
        """Copy `batch` (a forward's, whose rows are this one's first rows) into these static tables;
        the entries after its tiles become slot 0."""
        for st, dst in self.streams.items():
            src = batch.streams[st]
            for every_row in (False, True):
                src_tiles, src_scales = src.tables(every_row)
                dst_tiles, dst_scales = dst.tables(every_row)
                num_tiles = src_tiles.shape[0]
                if num_tiles > dst_tiles.shape[0] or src.num_rows > dst.num_rows:
                    raise ValueError(
                        f"LoRA: {st} stream of {src.num_rows} rows / {num_tiles} tiles does not fit the "
                        f"graph's {dst.num_rows} rows / {dst_tiles.shape[0]} tiles"
                    )
                dst_tiles[:num_tiles].copy_(src_tiles)
                dst_tiles[num_tiles:].zero_()
                dst_scales[:num_tiles].copy_(src_scales)
            dst.runs = src.runs

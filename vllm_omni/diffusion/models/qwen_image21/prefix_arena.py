"""A fixed arena for Qwen-Image-2.1's prefix K/V: every cached prefix at a static address.

Two device tensors, allocated once at start-up, hold the prefixes of every admitted sequence:

    key, value   [num_layers, capacity_rows, H, D]
                 | req a (prompt) | req a (negative) | free ... | req b | free ......... |
                 0                ^ a's negative prefix starts                             ^ capacity_rows

A prefix of L rows occupies the contiguous rows [start, start + L) of every layer, so its `PrefixKV`
is a view (`key[:, start:start + L]`) and a CUDA graph can gather any batch's prefixes by row index
(graphs.py: `prefix_src`) instead of copying them into a staging store first.

Rows belong to an owner (a req_id). The engine reserves a request's rows when it admits it (`reserve`,
one contiguous block for all its sequences), so a request that does not fit waits before anything is
computed; the prefill then takes its rows from that reservation (`allocate`), or, without one (tools,
tests), from the free rows, failing with `PrefixArenaFull` before it computes anything. `release`
frees all of an owner's rows when the request ends.

The allocator is first fit over a free list sorted by start, coalescing neighbours on release: the
same sequence of calls always gives the same rows.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch


class PrefixArenaFull(RuntimeError):
    """No contiguous free range of the rows asked for (the arena is full or fragmented)."""


class RowAllocator:
    """Contiguous row ranges of [0, capacity): first fit over a sorted free list, coalesced on free."""

    def __init__(self, capacity: int):
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._free: list[tuple[int, int]] = [(0, capacity)] if capacity else []
        """Free ranges (start, num_rows), sorted by start, never adjacent (coalesced)."""

    @property
    def free_ranges(self) -> list[tuple[int, int]]:
        return list(self._free)

    @property
    def num_free(self) -> int:
        return sum(n for _, n in self._free)

    @property
    def largest_free(self) -> int:
        return max((n for _, n in self._free), default=0)

    def alloc(self, num_rows: int) -> int | None:
        """Start of the first free range of `num_rows` rows (taken from its front); None: none fits."""
        if num_rows <= 0:
            raise ValueError(f"num_rows must be >= 1, got {num_rows}")
        for i, (start, size) in enumerate(self._free):
            if size >= num_rows:
                if size == num_rows:
                    del self._free[i]
                else:
                    self._free[i] = (start + num_rows, size - num_rows)
                return start
        return None

    def free(self, start: int, num_rows: int) -> None:
        """Give [start, start + num_rows) back, merged with the free ranges it touches. ValueError when
        it overlaps a free range or lies outside the capacity (a double free)."""
        end = start + num_rows
        if num_rows <= 0 or start < 0 or end > self.capacity:
            raise ValueError(f"range [{start}, {end}) is not inside [0, {self.capacity})")
        i = 0  # insertion point: the first free range starting after `start`
        while i < len(self._free) and self._free[i][0] < start:
            i += 1
        before = self._free[i - 1] if i > 0 else None
        after = self._free[i] if i < len(self._free) else None
        if (before is not None and before[0] + before[1] > start) or (after is not None and after[0] < end):
            raise ValueError(f"range [{start}, {end}) is already free (in part)")
        if after is not None and after[0] == end:  # merge with the range after
            end += after[1]
            del self._free[i]
        if before is not None and before[0] + before[1] == start:  # merge with the range before
            self._free[i - 1] = (before[0], end - before[0])
        else:
            self._free.insert(i, (start, end - start))


@dataclass
class _Block:
    """A contiguous range an owner holds; `num_used` rows from its start hold prefixes."""

    start: int
    num_rows: int
    num_used: int = 0


@dataclass
class _Owner:
    blocks: list[_Block] = field(default_factory=list)


class PrefixArena:
    """The prefix K/V of every cached sequence, in two fixed tensors (see the module docstring).

    Thread-safe: the engine reserves and releases on its threads, the worker allocates and releases on
    the loop thread."""

    def __init__(self, num_layers: int, capacity_rows: int, num_heads: int, head_dim: int, device, dtype):
        shape = (num_layers, capacity_rows, num_heads, head_dim)
        self.key = torch.zeros(shape, device=device, dtype=dtype)
        """[num_layers, capacity_rows, H, D]: post-norm, post-RoPE prefix keys."""
        self.value = torch.zeros(shape, device=device, dtype=dtype)
        """[num_layers, capacity_rows, H, D]: prefix values."""
        self.rows = RowAllocator(capacity_rows)
        self._owners: dict[str, _Owner] = {}
        self._lock = threading.Lock()

    @property
    def capacity_rows(self) -> int:
        return self.rows.capacity

    @property
    def row_bytes(self) -> int:
        """Bytes of one row over every layer, K and V (the prefix cache's per-row size)."""
        return 2 * self.key[:, :1].numel() * self.key.element_size()

    @property
    def num_bytes(self) -> int:
        """Device bytes of the two tensors (allocated at start-up, outside the request budget)."""
        return self.capacity_rows * self.row_bytes

    @property
    def num_free_rows(self) -> int:
        with self._lock:
            return self.rows.num_free

    def owner_rows(self, owner: str) -> int:
        """Rows `owner` holds (reserved or in use)."""
        with self._lock:
            return sum(b.num_rows for b in self._owners.get(owner, _Owner()).blocks)

    def reserve(self, owner: str, num_rows: int) -> bool:
        """Hold one contiguous block of `num_rows` rows for `owner`'s prefixes (the engine, at admission);
        False when none is free now (the request waits). 0 rows: nothing to hold, True."""
        if num_rows <= 0:
            return True
        with self._lock:
            start = self.rows.alloc(num_rows)
            if start is None:
                return False
            self._owners.setdefault(owner, _Owner()).blocks.append(_Block(start, num_rows))
            return True

    def allocate(self, owner: str, num_rows: int) -> int:
        """Start row of `num_rows` rows for one prefix of `owner`: the front of the unused part of its
        reservation when that is large enough, else a new block. PrefixArenaFull when neither exists
        (raised before the prefill computes anything)."""
        with self._lock:
            blocks = self._owners.setdefault(owner, _Owner()).blocks
            for block in blocks:
                if block.num_rows - block.num_used >= num_rows:
                    start = block.start + block.num_used
                    block.num_used += num_rows
                    return start
            start = self.rows.alloc(num_rows)
            if start is None:
                if not blocks:
                    del self._owners[owner]
                raise PrefixArenaFull(
                    f"prefix KV arena: no {num_rows} contiguous free rows for {owner} "
                    f"({self.rows.num_free} of {self.capacity_rows} rows free, largest range "
                    f"{self.rows.largest_free})"
                )
            blocks.append(_Block(start, num_rows, num_used=num_rows))
            return start

    def release(self, owner: str) -> int:
        """Free every row `owner` holds; the rows freed (0 when it holds none)."""
        with self._lock:
            held = self._owners.pop(owner, None)
            if held is None:
                return 0
            for block in held.blocks:
                self.rows.free(block.start, block.num_rows)
            return sum(b.num_rows for b in held.blocks)


DEFAULT_ARENA_ROWS = 8 * 2 * 4096
"""Rows of the arena when `--kv-cache-memory-bytes` is not given: 8 CFG requests whose prompt and negative
prompt each carry a 1024 x 1024 reference image (4096 latent rows; 32 GiB at the released size, 512 KiB
a row) ..."""
DEFAULT_ARENA_FREE_SHARE = 0.25
"""... or this share of the device memory free when it is made, whichever is smaller (so a smaller GPU
still keeps room for activations, decodes and the graphs' pool)."""


def arena_rows(row_bytes: int, kv_cache_bytes: int | None, free_bytes: int) -> int:
    """Rows of the arena: `kv_cache_bytes` // row_bytes when given, else the smaller of
    `DEFAULT_ARENA_ROWS` and `DEFAULT_ARENA_FREE_SHARE` of `free_bytes`."""
    if kv_cache_bytes is not None:
        return kv_cache_bytes // row_bytes
    return min(DEFAULT_ARENA_ROWS, int(free_bytes * DEFAULT_ARENA_FREE_SHARE) // row_bytes)

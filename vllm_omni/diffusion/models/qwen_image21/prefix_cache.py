"""The per-request prefix KV cache of Qwen-Image-2.1.

A sequence's prefix (its prompt's text rows) is causal and modulated from t = 0, so its keys and values
at every layer are the same at every step: they are computed once when the request is admitted
(`QwenImage21Transformer.prefill`), kept here for the request's whole run (also while it sits out
steps), and dropped when it finishes, fails or is aborted (`release`). A CFG request holds two entries
(its prompt and its negative prompt).

    size of one entry = 2 (K, V) * num_layers * L * num_heads * head_dim * element size
    (released model, bf16: 2 * 32 * 32 * 128 * 2 B = 512 KiB per prefix row; a 100-row prompt 50 MiB)

Where the entries live: by default each is its own pair of tensors (`torch.stack` in the prefill; CPU,
tools, the dense forward). With a `PrefixArena` (CUDA with graphs: the runner attaches one at
start-up) each is a view of the arena's rows `[start, start + L)`, owned by its req_id, and `release`
gives those rows back (prefix_arena.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from vllm_omni.diffusion.models.qwen_image21.prefix_arena import PrefixArena

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefixKV:
    """One sequence's cached prefix: post-norm, post-RoPE keys and values of every layer."""

    key: torch.Tensor
    """[num_layers, L, H, D]"""
    value: torch.Tensor
    """[num_layers, L, H, D]"""
    target_frame: int = -1
    """Frame position of the target image after this prefix (text-to-image: L; an edit: past its
    reference blocks)."""
    arena_start: int | None = None
    """First arena row when key / value are views of a `PrefixArena` (`arena.key[:, start:start + L]`);
    None: they are this prefix's own tensors."""

    @property
    def num_rows(self) -> int:
        return self.key.shape[1]

    @property
    def num_bytes(self) -> int:
        return self.key.numel() * self.key.element_size() + self.value.numel() * self.value.element_size()


def prefix_num_bytes(num_rows: int, num_layers: int, num_heads: int, head_dim: int, dtype) -> int:
    """Bytes one prefix of `num_rows` rows holds (the size counted at admission, before it exists)."""
    element = torch.tensor([], dtype=dtype).element_size()
    return 2 * num_layers * num_rows * num_heads * head_dim * element


class PrefixCache:
    """Prefixes of admitted sequences by (req_id, is_negative), with their total size.

    `arena`: where arena-backed entries live (None: every entry owns its tensors)."""

    def __init__(self, arena: PrefixArena | None = None):
        self._entries: dict[tuple[str, bool], PrefixKV] = {}
        self.arena = arena

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_bytes(self) -> int:
        """Bytes held by every cached prefix."""
        return sum(p.num_bytes for p in self._entries.values())

    def put(self, req_id: str, is_negative: bool, prefix: PrefixKV) -> None:
        """Keep `prefix` for (req_id, is_negative), replacing an earlier one (a replaced arena-backed
        entry keeps its rows until `release(req_id)`: its owner is the request, not the entry)."""
        self._entries[(req_id, is_negative)] = prefix

    def get(self, req_id: str, is_negative: bool) -> PrefixKV | None:
        return self._entries.get((req_id, is_negative))

    def req_bytes(self, req_id: str) -> int:
        """Bytes the prefixes of `req_id` hold (prompt and negative prompt)."""
        return sum(p.num_bytes for (r, _), p in self._entries.items() if r == req_id)

    def release(self, req_ids) -> int:
        """Drop every prefix of `req_ids` and give their arena rows back; return the bytes freed
        (arena: the rows the request held, reserved or filled, times the row size)."""
        freed = 0
        for req_id in req_ids:
            for key in ((req_id, False), (req_id, True)):
                prefix = self._entries.pop(key, None)
                if prefix is not None and prefix.arena_start is None:
                    freed += prefix.num_bytes
            if self.arena is not None:
                freed += self.arena.release(req_id) * self.arena.row_bytes
            if freed:
                logger.debug("prefix cache: freed %s (%d B); %d B held", req_id, freed, self.num_bytes)
        return freed

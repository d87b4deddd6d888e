"""Step caching inside one packed forward: every sequence decides for itself, mid-forward.

    rows of all sequences -> blocks [0, Fn)               (everyone)
                          -> per-sequence decision         (host: one read of all diffs)
                          -> blocks [Fn, N - Bn)           (computing sequences' rows only, packed)
                             cached sequences add their kept middle residual instead
                          -> blocks [N - Bn, N)            (everyone)

Sequences with other Fn / Bn (or TeaCache, which decides before block 0 and skips every block)
split the block range at their own points; between two points the rows that run are packed into
one forward of the family's blocks (`BlockSegments.run_blocks` with a `SeqSubset`).
Model-neutral: the family supplies the blocks and TeaCache's modulated input.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from vllm_omni.diffusion.cache.dbcache import DBCacheBranch
from vllm_omni.diffusion.cache.teacache import TEA_CACHE_EPS, TeaCacheBranch
from vllm_omni.diffusion.layout import PackedLayout, build_packed_layout

Branch = DBCacheBranch | TeaCacheBranch


@dataclass
class SeqSubset:
    """Some sequences of a packed forward that run a block segment together."""

    layout: PackedLayout
    """Their own packed layout (the full layout's specs of these sequences, in order)."""
    seq_index: torch.Tensor
    """long [num_sub_seqs]: their indices in the full layout (per-sequence values, e.g. temb rows)."""
    img_rows: torch.Tensor
    """long [sub img rows]: their rows of the full image stream."""
    txt_rows: torch.Tensor
    """long [sub txt rows]: their rows of the full text stream."""


class BlockSegments(Protocol):
    """What a family's packed forward lends the step cache (its blocks, with this step's conditioning)."""

    num_blocks: int

    def run_blocks(
        self, start: int, end: int, img: torch.Tensor, txt: torch.Tensor, subset: SeqSubset | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks [start, end) over the rows of `subset` (img [sub img rows, C], txt [sub txt rows, C])
        or, with None, of every sequence."""
        ...

    def modulated_input(self, img: torch.Tensor) -> torch.Tensor:
        """TeaCache's signal: the first block's modulated image input [img rows, C] of every row."""
        ...


def _rows(offsets: list[int], seqs: list[int]) -> np.ndarray:
    return np.concatenate([np.arange(offsets[s], offsets[s + 1]) for s in seqs])


@dataclass
class StepCache:
    """One packed forward's caching: the branch of every sequence (None: runs every block)."""

    branches: list[Branch | None]
    """Sequence order of the layout."""
    layout: PackedLayout
    subsets: dict[tuple[int, ...], SeqSubset] = field(default_factory=dict)
    """Layouts of the running subsets, kept while the batch composition lasts (pass the same dict)."""
    subset_scope: Callable[[tuple[int, ...], SeqSubset], AbstractContextManager] | None = None
    """Entered around blocks that run a subset of the sequences (the runner's LoRA mapping of those
    rows); None: nothing to enter."""
    cached: list[bool] = field(default_factory=list)
    """After `run`: which sequences took their cached residual this step."""

    def __post_init__(self) -> None:
        if len(self.branches) != self.layout.num_seqs:
            raise ValueError(f"{len(self.branches)} branches for {self.layout.num_seqs} sequences")

    @property
    def num_cached(self) -> int:
        return sum(self.cached)

    def _slice(self, t: torch.Tensor, seq: int, stream: str) -> torch.Tensor:
        off = self.layout.img_row_offsets if stream == "img" else self.layout.txt_row_offsets
        return t[off[seq] : off[seq + 1]]

    def subset(self, seqs: tuple[int, ...], device: torch.device) -> SeqSubset:
        """The packed layout and row indices of `seqs` (cached per subset)."""
        if seqs not in self.subsets:
            layout = self.layout
            specs = [layout.specs[s] for s in seqs]
            self.subsets[seqs] = SeqSubset(
                layout=build_packed_layout(specs, layout.positions, device=device),
                seq_index=torch.tensor(seqs, dtype=torch.long).to(device),
                img_rows=torch.from_numpy(_rows(layout.img_row_offsets, list(seqs))).to(device),
                txt_rows=torch.from_numpy(_rows(layout.txt_row_offsets, list(seqs))).to(device),
            )
        return self.subsets[seqs]

    def run(
        self, img: torch.Tensor, txt: torch.Tensor, segments: BlockSegments
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every block of the forward with per-sequence caching: img [num_img_rows, C] and txt
        [num_txt_rows, C] in, the last block's streams out."""
        num_blocks, num_seqs = segments.num_blocks, len(self.branches)
        with_branch = [s for s, b in enumerate(self.branches) if b is not None]
        for s in with_branch:
            self.branches[s].begin_step()
        points = sorted(
            {0, num_blocks}
            | {self.branches[s].fn_blocks for s in with_branch}
            | {self.branches[s].middle_end(num_blocks) for s in with_branch}
        )
        self.cached = [False] * num_seqs
        active = set(range(num_seqs))
        img0, middle_in = img, {}
        start = 0
        for point in points:
            if point > start:
                img, txt = self._run_segment(start, point, img, txt, active, segments)
                start = point
            deciders = [s for s in with_branch if self.branches[s].fn_blocks == point]
            if deciders:
                self._decide(deciders, img, img0, segments)
                for s in deciders:
                    if self.cached[s]:
                        active.discard(s)
                    else:
                        middle_in[s] = (img, txt)
            enders = [s for s in with_branch if self.branches[s].middle_end(num_blocks) == point]
            if enders:
                img, txt = self._end_middle(enders, img, txt, middle_in)
                active.update(enders)
        return img, txt

    def _run_segment(self, start, end, img, txt, active: set[int], segments: BlockSegments):
        if len(active) == len(self.branches):
            return segments.run_blocks(start, end, img, txt, None)
        if not active:
            return img, txt
        seqs = tuple(sorted(active))
        sub = self.subset(seqs, img.device)
        scope = contextlib.nullcontext() if self.subset_scope is None else self.subset_scope(seqs, sub)
        with scope:
            sub_img, sub_txt = segments.run_blocks(
                start, end, img.index_select(0, sub.img_rows), txt.index_select(0, sub.txt_rows), sub
            )
        # out of place: the middle blocks' inputs of other sequences may still be read
        return img.index_copy(0, sub.img_rows, sub_img), txt.index_copy(0, sub.txt_rows, sub_txt)

    def _decide(self, deciders: list[int], img, img0, segments: BlockSegments) -> None:
        """Each decider's decision; the diffs that need the device are read in one transfer."""
        signals, pending = {}, []
        modulated = None
        for s in deciders:
            branch = self.branches[s]
            early = branch.needs_diff()
            if isinstance(branch, TeaCacheBranch):  # the next step's reference, cached or not
                if modulated is None:
                    modulated = segments.modulated_input(img)
                signals[s] = self._slice(modulated, s, "img").clone()
            elif early is not True:  # the diff's operand and, computed, the next reference
                signals[s] = self._slice(img, s, "img") - self._slice(img0, s, "img")
            if early is None:
                pending.append(s)
            else:
                self.cached[s] = early
        if pending:
            diffs = torch.stack([self._rel_l1(self.branches[s], signals[s]) for s in pending]).tolist()
            for s, diff in zip(pending, diffs):
                self.cached[s] = self.branches[s].decide(diff)
        for s in deciders:
            branch = self.branches[s]
            if self.cached[s]:
                branch.mark_cached()
            if isinstance(branch, TeaCacheBranch):
                branch.modulated_input = signals[s]
            elif not self.cached[s]:
                branch.fn_residual = signals[s]

    @staticmethod
    def _rel_l1(branch: Branch, current: torch.Tensor) -> torch.Tensor:
        """0-dim relative L1 change, each backend's own formula (its operand order and epsilon)."""
        if isinstance(branch, TeaCacheBranch):
            prev = branch.modulated_input
            return (current - prev).abs().mean() / (prev.abs().mean() + TEA_CACHE_EPS)
        prev = branch.fn_residual
        return (prev - current).abs().mean() / prev.abs().mean()

    def _end_middle(self, enders: list[int], img, txt, middle_in):
        """Cached enders add their kept residuals; computing enders keep their new ones."""
        if any(self.cached[s] for s in enders):
            img, txt = img.clone(), txt.clone()  # in place below; earlier tensors may still be read
        for s in enders:
            branch = self.branches[s]
            img_rows, txt_rows = self._slice(img, s, "img"), self._slice(txt, s, "txt")
            if self.cached[s]:
                img_rows.copy_(branch.img_residual + img_rows)
                txt_rows.copy_(branch.txt_residual + txt_rows)
            else:
                mid_img, mid_txt = middle_in.pop(s)
                branch.img_residual = img_rows - self._slice(mid_img, s, "img")
                branch.txt_residual = txt_rows - self._slice(mid_txt, s, "txt")
        return img, txt

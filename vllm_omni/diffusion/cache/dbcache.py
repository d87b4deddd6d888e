"""cache-dit's DBCache decision for one branch (one packed sequence), step by step.

Mirrors `cache_dit`'s `CachedContext` / `CachedContextManager.can_cache` for one context with
`enable_separate_cfg` (each CFG branch is its own sequence here, so its own branch state):

    begin_step()            step += 1; a computed previous step ends the cached streak
    needs_diff()            warmup / mask / limits decide without the device  -> True / False / None
    decide(diff)            None above: relative L1 `diff` of the Fn residual vs the threshold
    after a computed step   keep the Fn residual (the next diff's reference) and the middle
                            blocks' residuals of both streams (what a cached step adds)

Host-side bookkeeping only; the tensors are per-sequence rows `[rows, hidden]` held for the request.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vllm_omni.diffusion.cache.config import DBCacheParams


@dataclass
class DBCacheBranch:
    """One sequence's DBCache state; lives with the request's runner state (kept while it sits out)."""

    params: DBCacheParams
    step: int = -1
    """The step being decided (cache-dit's `get_current_step()`)."""
    cached_steps: list[int] = field(default_factory=list)
    continuous_cached_steps: int = 0
    accumulated_residual_diff: float = 0.0
    residual_diffs: dict[int, float] = field(default_factory=dict)
    """Measured diff per step (cache-dit records a step's first measurement only)."""
    fn_residual: torch.Tensor | None = None
    """[img rows, hidden]: Fn blocks' output minus input of the last computed step."""
    img_residual: torch.Tensor | None = None
    """[img rows, hidden]: middle blocks' output minus input (image stream), last computed step."""
    txt_residual: torch.Tensor | None = None
    """[txt rows, hidden]: the same for the text stream."""

    @property
    def num_cached_steps(self) -> int:
        return len(self.cached_steps)

    @property
    def fn_blocks(self) -> int:
        return self.params.Fn_compute_blocks

    def middle_end(self, num_blocks: int) -> int:
        """Block index where the always-run Bn blocks start."""
        return num_blocks - self.params.Bn_compute_blocks

    def begin_step(self) -> None:
        """cache-dit's `mark_step_begin` (called after the Fn blocks)."""
        self.step += 1
        if not self.cached_steps or self.cached_steps[-1] != self.step - 1:
            self.continuous_cached_steps = 0

    def _in_warmup(self) -> bool:
        p = self.params
        limit = p.max_warmup_steps
        if p.steps_computation_mask is not None:  # warmup truncated to the mask's leading 1s
            leading = 0
            for m in p.steps_computation_mask:
                if m != 1:
                    break
                leading += 1
            limit = min(limit, leading)
        return self.step in range(0, limit, p.warmup_interval)

    def needs_diff(self) -> bool | None:
        """Decide without the Fn residual where cache-dit does: False = compute, True = cache (a
        static mask or a threshold >= 1), None = the residual diff decides (`decide`)."""
        p = self.params
        if self._in_warmup():
            return False
        mask = p.steps_computation_mask
        if mask is not None:
            if self.step < len(mask) and mask[self.step] == 1:
                return False
            if p.steps_computation_policy == "static":
                return True
        if p.max_cached_steps >= 0 and len(self.cached_steps) >= p.max_cached_steps:
            return False
        if 0 <= p.max_continuous_cached_steps <= self.continuous_cached_steps:
            return False
        limit = p.max_accumulated_residual_diff_threshold
        if limit is not None and limit > 0.0 and self.accumulated_residual_diff >= limit:
            return False
        threshold = p.residual_diff_threshold
        if threshold <= 0.0 or self.fn_residual is None:
            return False
        if threshold >= 1.0:
            self._record_diff(-1.0)
            return True
        return None

    def decide(self, diff: float) -> bool:
        """Record the measured relative L1 `diff`; True = cache this step."""
        self._record_diff(diff)
        return diff < self.params.residual_diff_threshold

    def _record_diff(self, diff: float) -> None:
        if self.step not in self.residual_diffs:
            self.residual_diffs[self.step] = diff
            if diff > 0.0:
                self.accumulated_residual_diff += diff

    def mark_cached(self) -> None:
        self.continuous_cached_steps += 1
        self.cached_steps.append(self.step)

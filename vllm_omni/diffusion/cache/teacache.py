"""TeaCache's decision for one branch (one packed sequence), step by step.

The rule vLLM-Omni's TeaCache hook applies, per CFG branch:

    step 0 (or no previous input)   compute
    else   rel = mean|x - x_prev| / (mean|x_prev| + 1e-8)      x: block 0's modulated image input
           acc += |poly(rel)|                                    poly: the family's coefficients
           acc < rel_l1_thresh and a residual is kept  -> cache: add the kept residual of all blocks
           else                                        -> compute, acc = 0
    x_prev = x after every step (cached or not)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_omni.diffusion.cache.config import TeaCacheParams

TEA_CACHE_EPS = 1e-8
"""Added to the previous input's mean magnitude (as vLLM-Omni's hook does)."""


@dataclass
class TeaCacheBranch:
    """One sequence's TeaCache state; lives with the request's runner state."""

    params: TeaCacheParams
    coefficients: tuple[float, ...]
    """The family's rescaling polynomial, highest power first (numpy's `polyval` order)."""
    step: int = -1
    cached_steps: list[int] = field(default_factory=list)
    accumulated_rel_l1_distance: float = 0.0
    modulated_input: torch.Tensor | None = None
    """[img rows, hidden]: block 0's modulated image input of the previous step."""
    img_residual: torch.Tensor | None = None
    """[img rows, hidden]: all blocks' output minus input (image stream), last computed step."""
    txt_residual: torch.Tensor | None = None
    """[txt rows, hidden]: the same for the text stream."""
    fn_blocks = 0
    """Decided before the first block."""

    @property
    def num_cached_steps(self) -> int:
        return len(self.cached_steps)

    def middle_end(self, num_blocks: int) -> int:
        return num_blocks

    def begin_step(self) -> None:
        self.step += 1

    def needs_diff(self) -> bool | None:
        """False = compute (first step, no previous input); None = the input's change decides."""
        if self.step == 0 or self.modulated_input is None:
            self.accumulated_rel_l1_distance = 0.0
            return False
        return None

    def decide(self, rel: float) -> bool:
        """Accumulate the rescaled change `rel`; True = cache this step."""
        self.accumulated_rel_l1_distance += abs(float(np.polyval(self.coefficients, rel)))
        if self.accumulated_rel_l1_distance < self.params.rel_l1_thresh:
            return self.img_residual is not None
        self.accumulated_rel_l1_distance = 0.0
        return False

    def mark_cached(self) -> None:
        self.cached_steps.append(self.step)

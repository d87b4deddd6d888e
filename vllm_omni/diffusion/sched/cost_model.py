"""`StepCostModel`: how long a denoise step takes as a function of the tokens it packs.

The latency policy ranks requests by remaining work and packs a request into a step only while that
is nearly free; both need the time of a step. A step's time is, to a few percent, a function of its
real tokens (image + text rows, a CFG request counting both of its sequences): on the H200 a
1024x1024 CFG step (8.2k tokens) takes 230 ms, 8 x 256x256 (4.4k) 110 ms, one 256x256 (550) 23 ms.
Below a few thousand tokens the GPU is not saturated (a step costs launch and weight reads, not
FLOPs); beyond that the time grows linearly (and a little faster at 1536x1536, where attention's
quadratic term shows).

The model is a table of points `(tokens, seconds)` on a log-spaced token grid (4 points per
doubling), each an exponential moving average of the steps seen in its bin, interpolated linearly:

    seconds
      |                         .o     o  measured bin (EMA of its steps)
      |                     .o'        -  interpolation; flat below the first point (a step
      |                .o'                never costs less than the smallest one measured), the
      |    o----o--o'                     last segment's slope beyond the last (a single
      |                                   point: proportional)
   ---+--------------------------- tokens
         (launch-bound)  (saturated)

It is seeded at start-up by timing typical layouts' forwards (the runner's `measure_step_costs`, in
their CUDA-graph buckets on the GPU) and refined from every real step's measured time (`observe`).
With no point at all a step costs `DEFAULT_SECONDS_PER_TOKEN` per token, which packs nothing (every
added request costs its own time).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT_SECONDS_PER_TOKEN = 28e-6
"""Prior before any measurement: the H200's saturated rate for Qwen-Image (230 ms / 8.2k tokens)."""
BINS_PER_DOUBLING = 4
EMA_WEIGHT = 0.2
"""Weight of a new step's time in its bin's average (the start-up point counts as one step)."""


@dataclass(frozen=True)
class StepCostSample:
    """One measured step (or forward): its real tokens and its time."""

    num_tokens: int
    seconds: float


@dataclass
class _Bin:
    num_tokens: float
    """EMA of the tokens of the steps in this bin (the point's x)."""
    seconds: float
    """EMA of their times (the point's y)."""
    num_samples: int = 1


class StepCostModel:
    """Step time as a function of packed tokens; see the module docstring."""

    def __init__(self, samples: list[StepCostSample] | None = None):
        self._bins: dict[int, _Bin] = {}
        self._points: list[StepCostSample] | None = None
        """`points()`, kept until the next `observe` (the policy asks for step times many times a step)."""
        for sample in samples or []:
            self.observe(sample.num_tokens, sample.seconds)

    @staticmethod
    def _bin_of(num_tokens: int) -> int:
        return round(math.log2(max(num_tokens, 1)) * BINS_PER_DOUBLING)

    def observe(self, num_tokens: int, seconds: float) -> None:
        """Fold one measured step into its bin (ignored when either number is not positive/finite)."""
        if num_tokens < 1 or not math.isfinite(seconds) or seconds <= 0:
            return
        self._points = None
        key = self._bin_of(num_tokens)
        point = self._bins.get(key)
        if point is None:
            self._bins[key] = _Bin(float(num_tokens), seconds)
            return
        point.num_tokens += EMA_WEIGHT * (num_tokens - point.num_tokens)
        point.seconds += EMA_WEIGHT * (seconds - point.seconds)
        point.num_samples += 1

    @property
    def num_points(self) -> int:
        return len(self._bins)

    def points(self) -> list[StepCostSample]:
        """The table, by tokens, with times made non-decreasing (more work never costs less)."""
        if self._points is None:
            out, floor = [], 0.0
            for point in sorted(self._bins.values(), key=lambda p: p.num_tokens):
                floor = max(floor, point.seconds)
                out.append(StepCostSample(round(point.num_tokens), floor))
            self._points = out
        return list(self._points)

    def step_time(self, num_tokens: int) -> float:
        """Predicted seconds of a step packing `num_tokens` real tokens."""
        if num_tokens <= 0:
            return 0.0
        pts = self.points()
        if not pts:
            return num_tokens * DEFAULT_SECONDS_PER_TOKEN
        if num_tokens <= pts[0].num_tokens:
            return pts[0].seconds
        for lo, hi in zip(pts, pts[1:]):
            if num_tokens <= hi.num_tokens:
                frac = (num_tokens - lo.num_tokens) / max(hi.num_tokens - lo.num_tokens, 1)
                return lo.seconds + frac * (hi.seconds - lo.seconds)
        last = pts[-1]
        if len(pts) == 1:
            return last.seconds * num_tokens / last.num_tokens
        # NOTE(sched): the last segment's slope, even when flat: a launch-bound device (a CPU serving
        # the tiny model) then looks free to pack beyond what it has seen, packs, and the packed
        # step's measured time corrects the table. Proportional here would never try a larger step.
        prev = pts[-2]
        slope = (last.seconds - prev.seconds) / max(last.num_tokens - prev.num_tokens, 1)
        return last.seconds + slope * (num_tokens - last.num_tokens)

    def saturation_tokens(self, marginal_cost: float = 0.5) -> int | None:
        """The smallest measured token count from which doubling a step costs more than
        `1 + marginal_cost` times as much: beyond it, a request added to a step makes the step
        longer by more than `marginal_cost` of its own time (the GPU is busy). None without points."""
        pts = self.points()
        for point in pts:
            if self.step_time(2 * point.num_tokens) > (1 + marginal_cost) * point.seconds:
                return point.num_tokens
        return pts[-1].num_tokens if pts else None

    def describe(self) -> str:
        """One line for the start-up log: the points and the saturation."""
        pts = ", ".join(f"{p.num_tokens}:{p.seconds * 1e3:.1f}ms" for p in self.points()) or "none"
        return f"step cost model (tokens:time) {pts}; saturated from {self.saturation_tokens()} tokens"

"""`StepCostModel`: how long a denoise step takes as a function of the tokens it packs.

The latency policy ranks requests by remaining work and packs a request into a step only while that
is nearly free; both need the time of a step. A step's time is, to a few percent, a function of its
real tokens (image + text rows, a CFG request counting both of its sequences; measured curves in
docs/design/scheduling.md).
Below a few thousand tokens the GPU is not saturated (a step costs launch and weight reads, not
FLOPs); beyond that the time grows linearly (and a little faster at 1536x1536, where attention's
quadratic term shows).

The model is a table of points `(tokens, seconds)` on a log-spaced token grid (4 points per
doubling), each the median of the last `WINDOW` steps seen in its bin, made non-decreasing by pooling
(more tokens never cost less), interpolated linearly:

    seconds
      |                         .o     o  measured bin (median of its recent steps)
      |                     .o'        -  interpolation; flat below the first point (a step
      |                .o'                never costs less than the smallest one measured), the
      |    o----o--o'                     last segment's slope beyond the last (a single
      |                                   point: proportional)
   ---+--------------------------- tokens
         (launch-bound)  (saturated)

It is seeded at start-up by timing typical layouts' forwards (the runner's `measure_step_costs`, in
their CUDA-graph buckets on the GPU, a few small ones on a CPU) and refined from every real step's
measured denoise time (`observe`: the forward and the solver only; a new request's prompt encoding and
a finished one's decode are timed apart, they are not the step's cost for the packing decision). With
no point at all a step costs `DEFAULT_SECONDS_PER_TOKEN` per token, which packs nothing (every added
request costs its own time).

Why medians and pooling: one slow step (a first call that compiles, a hiccup) must not reorder the
queue. With an average per bin and a running maximum to keep the table non-decreasing, one outlier at
a small token count lifted every larger point to its value: a flat table, in which shortest remaining
work first degenerates to fewest remaining steps first. A bin's median ignores a minority of outliers,
and pooling adjacent violators (isotonic regression, weighted by the bins' sample counts) averages a
violating point with its neighbours instead of propagating it.

Why a dead band: the same burst should give the same steps on a quiet machine. Each packing decision
compares two predicted times, and a point that moved by its measurement noise after every step
(a few percent on a GPU, tens of percent on a shared CPU) would flip decisions near the threshold from
one run to the next. A bin's point therefore changes only when its window's median leaves a band of
`DEAD_BAND` around it, and a bin without a point gets one only when its median leaves the band around
what the table already predicts for it: noise leaves the table, hence the decisions, as the start-up
measurement made them; a lasting change of speed, or a shape the table mispredicts, still shows
within a few steps.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

DEFAULT_SECONDS_PER_TOKEN = 28e-6
"""Prior before any measurement: a saturated Qwen-Image step on a large GPU (230 ms / 8.2k tokens)."""
BINS_PER_DOUBLING = 4
WINDOW = 9
"""Steps a bin remembers (its point is their median): a lasting change of the GPU's speed shows after
at most 5 steps, a single outlier never."""
SEED_WEIGHT = 3
"""Steps a start-up point counts as (it is itself the median of 3 timed forwards)."""
DEAD_BAND = 0.2
"""A bin's point moves only when its recent median differs from it by more than this fraction."""
OVERHEAD_WINDOW = 64
"""Steps over which the per-request overhead (`request_overhead_s`) is averaged."""


@dataclass(frozen=True)
class StepCostSample:
    """One measured step (or forward): its real tokens and its time."""

    num_tokens: int
    seconds: float


@dataclass
class _Bin:
    """The last `WINDOW` steps whose token counts fall in one bin."""

    samples: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    """(tokens, seconds) of each step, oldest first."""
    point: StepCostSample | None = None
    """(median tokens, median seconds) of the remembered steps when they last left the dead band; None
    while the table's prediction for the bin was within the band (the bin adds nothing to the table)."""

    def add(self, num_tokens: int, seconds: float, predicted_s: float | None) -> bool:
        """Remember one step; True when the bin's point moved: its median left the dead band around
        its point, or, for a bin without one, around the table's prediction `predicted_s`."""
        self.samples.append((num_tokens, seconds))
        median_s = statistics.median(s for _, s in self.samples)
        reference = self.point.seconds if self.point is not None else predicted_s
        if reference is not None and abs(median_s - reference) <= DEAD_BAND * reference:
            return False
        self.point = StepCostSample(round(statistics.median(n for n, _ in self.samples)), median_s)
        return True


class StepCostModel:
    """Step time as a function of packed tokens; see the module docstring."""

    def __init__(self, samples: list[StepCostSample] | None = None, seed_weight: int = SEED_WEIGHT):
        """`samples`: start-up points, each counted as `seed_weight` steps of its bin."""
        self._bins: dict[int, _Bin] = {}
        self._points: list[StepCostSample] | None = None
        """`points()`, kept until the next `observe` (the policy asks for step times many times a step)."""
        self._overheads: deque[tuple[float, int]] = deque(maxlen=OVERHEAD_WINDOW)
        """(seconds of a step beyond its predicted denoise, requests finished in it), oldest first."""
        for sample in samples or []:  # each a point of its own, whatever the others predict for it
            for _ in range(seed_weight):
                self._bins.setdefault(self._bin_of(sample.num_tokens), _Bin()).add(
                    sample.num_tokens, sample.seconds, None
                )

    @staticmethod
    def _bin_of(num_tokens: int) -> int:
        return round(math.log2(max(num_tokens, 1)) * BINS_PER_DOUBLING)

    def observe(self, num_tokens: int, seconds: float) -> None:
        """Fold one measured step into its bin (ignored when either number is not positive/finite)."""
        if num_tokens < 1 or not math.isfinite(seconds) or seconds <= 0:
            return
        predicted = self.step_time(num_tokens) if self.points() else None
        if self._bins.setdefault(self._bin_of(num_tokens), _Bin()).add(num_tokens, seconds, predicted):
            self._points = None

    def observe_overhead(self, excess_s: float, num_finished: int) -> None:
        """One step's time beyond the denoise predicted for it (its new requests' prompt encoding, its
        finished ones' decode, host work) and the requests that finished in it."""
        if math.isfinite(excess_s):
            self._overheads.append((excess_s, num_finished))

    @property
    def request_overhead_s(self) -> float:
        """Seconds a request costs beyond its denoise steps: the recent steps' excess per finished
        request (0 before any finished)."""
        finished = sum(n for _, n in self._overheads)
        return max(0.0, sum(e for e, _ in self._overheads) / finished) if finished else 0.0

    @property
    def num_points(self) -> int:
        return sum(b.point is not None for b in self._bins.values())

    def points(self) -> list[StepCostSample]:
        """The table, by tokens, with times made non-decreasing (more work never costs less) by pooling
        adjacent violators, each bin weighted by its number of steps."""
        if self._points is None:
            medians = sorted(
                ((b.point, len(b.samples)) for b in self._bins.values() if b.point is not None),
                key=lambda pw: pw[0].num_tokens,
            )
            pools: list[list[float]] = []  # [weighted mean seconds, weight, number of bins]
            for point, weight in medians:
                pools.append([point.seconds, float(weight), 1])
                while len(pools) > 1 and pools[-2][0] > pools[-1][0]:
                    (s1, w1, n1), (s2, w2, n2) = pools.pop(-2), pools.pop()
                    pools.append([(s1 * w1 + s2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
            times = [s for s, _, n in pools for _ in range(n)]
            self._points = [StepCostSample(p.num_tokens, t) for (p, _), t in zip(medians, times, strict=True)]
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

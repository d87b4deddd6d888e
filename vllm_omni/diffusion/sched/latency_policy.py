"""`LatencyPolicy` ('latency', the default with --step-execution): who runs the next step.

A step-level engine can decide at every step which requests run. From 512x512 up one Qwen-Image
request alone keeps a large GPU busy, so packing every request into every step buys a few percent of
throughput and makes every request as slow as the slowest (measured: a mixed Poisson load had 1.5x
the mean latency of one-at-a-time FIFO). This policy spends the decision on latency instead:

1. **Shortest remaining work first.** Each live request (started or waiting) scores
   `remaining_steps x step_time(its tokens)` from the `StepCostModel`; the lowest score runs.
   A started request that is not chosen sits out the step (its latents, schedule, generator and
   prompt embeddings stay in its slot) and resumes where it stopped: preemption costs nothing.
2. **The deadline guard** (the tail; on by default). When the policy first sees a request it gets
   a deadline in step-seconds: `now + deadline_factor x max(fifo, floor)`, where `fifo` is the work
   of every live request (its own included, each with the cost model's per-request overhead) and
   `floor` the 99th percentile of the last 100 requests' `fifo`. The unfinished work at an instant
   does not depend on the order it is served in, so `fifo` is when request mode (one request at a
   time, in arrival order) would finish it, and `floor` is about request mode's recent tail latency.
   Before a step runs, the policy checks what it costs the deadlines: if finishing everything after
   it in deadline order makes a request late, and later than deadline order from now would, the
   step is built in deadline order instead. So no request ends much later than `deadline_factor x`
   the later of its request-mode finish and request mode's recent tail: shortest-first reorders
   freely below the tail (where the mean and median are made) and gives way near it. Requests that
   arrive within one step of each other count one another (a later one's deadline is also the
   earlier one's, if later): the scheduler could not have told them apart, so a burst whose first
   request started a step before the rest arrived is still reordered freely.
3. **Aging** (off by default; for use with the guard off). The score falls by `age / aging_factor`
   (age in step-seconds since arrival), and every request ages at the same rate, so the order of two
   waiting requests changes only through service. Hence the bound (tested): a request is never
   overtaken by a request that arrives more than `aging_factor x its alone time` after it (its score
   has then reached 0, below any newcomer's). Its latency is at most `(aging_factor + 1) x alone
   time` plus the work of the requests that arrived before that point and were ahead of it. With the
   guard on, aging mostly costs mean latency (simulated, 80 % load: 0.79-0.80x request mode's mean
   at aging 4 against 0.71-0.74x without, for a p99 of 0.94-1.04x against 0.94-1.17x).
4. **Priority.** A request's `priority` (vLLM's meaning: lower runs first) comes before the score;
   strict between levels, as vLLM's priority scheduling.
5. **Pack while free.** After the head (best score), the next requests in order join the step while
   the cost model says it stays nearly free: the step grows by at most `max_marginal_cost` of the
   joining request's own step time, and to at most `max_step_slowdown` times the head's own step
   time (a small request is never packed into a step that makes it much slower). Joins also obey
   the batching rules (key, token budget, MixFusion plan: `find_join_blocker`), `max_num_seqs`
   requests per step, and `max_num_resident` started requests.

Scores use the cost model's seconds and a step-time clock (the sum of the steps' predicted times),
not wall time: decisions are deterministic for a given sequence of steps, and testable.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from vllm_omni.diffusion.cache.cost import expected_step_work
from vllm_omni.diffusion.sched.batching import find_join_blocker
from vllm_omni.diffusion.sched.cost_model import StepCostModel
from vllm_omni.diffusion.sched.request_state import SchedulerRequestState

RECENT_ARRIVALS = 100
"""Requests whose request-mode latencies make the deadline guard's floor."""
DEADLINE_FLOOR_QUANTILE = 0.99
"""The floor: this quantile of those latencies (request mode's recent tail; 0.9 made the guard bind
below the tail: 0.78x request mode's mean at 80 % load in the simulation, against 0.71x)."""


@dataclass(frozen=True)
class LatencyPolicyConfig:
    """The latency policy's knobs (config fields of the same names; docs/design/scheduling.md)."""

    max_num_seqs: int
    """Requests in one step."""
    max_num_resident: int
    """Requests started (holding runner state), running or sitting out."""
    max_num_batched_tokens: int | None
    aging_factor: float | None = None
    """Seconds of age that lower a score by one second of work (None: no aging, the default). Larger:
    closer to pure shortest remaining work first (lower mean latency, longer tail); smaller: closer
    to FIFO."""
    deadline_factor: float | None = 1.1
    """Deadlines at this factor x request mode's finish (module docstring, 2.); None = no guard."""
    max_marginal_cost: float = 0.5
    """A request joins a step only if the step grows by at most this fraction of its own step time."""
    max_step_slowdown: float = 2.0
    """...and the step stays within this factor of the head's own step time."""


@dataclass(frozen=True)
class Selection:
    """One step's choice: the requests that run, in order (head first), and why others did not."""

    chosen: list[SchedulerRequestState]
    skipped: dict[str, str]
    """req_id -> reason, for the started and waiting requests that do not run (debug log)."""
    deadline_ordered: bool = False
    """Built in deadline order: shortest-first would have made a request later than its deadline."""


class LatencyPolicy:
    """Chooses each step's requests; see the module docstring."""

    name = "latency"

    def __init__(self, config: LatencyPolicyConfig, cost_model: StepCostModel):
        self.config = config
        self.cost_model = cost_model
        self._recent_fifo_s: deque[float] = deque(maxlen=RECENT_ARRIVALS)
        self._last_cohort: list[SchedulerRequestState] = []
        """The requests given their deadline at the previous step boundary (module docstring, 2.)."""

    def describe(self) -> str:
        """The policy's settings in one line (the engine's start-up log)."""
        cfg = self.config
        guard = (
            "off"
            if cfg.deadline_factor is None
            else f"{cfg.deadline_factor:g}x request mode's finish, floored at the p"
            f"{DEADLINE_FLOOR_QUANTILE * 100:g} of the last {RECENT_ARRIVALS} requests' finishes"
        )
        aging = "off" if cfg.aging_factor is None else f"{cfg.aging_factor:g}"
        packing = (
            f"<= {cfg.max_marginal_cost:g}x a joiner's own step, <= {cfg.max_step_slowdown:g}x the head's"
        )
        return (
            f"shortest remaining work first; deadline guard {guard}; aging {aging}; packing while {packing}"
        )

    def step_time(self, state: SchedulerRequestState) -> float:
        """Predicted seconds of `state`'s next step alone."""
        return self.cost_model.step_time(state.profile.step_tokens(state.num_steps_done))

    def remaining_work(self, state: SchedulerRequestState) -> float:
        """Predicted seconds of the request's remaining denoise steps alone (a static step-cache mask's
        cached steps at the share of the blocks they run; dynamic caching at its cache rate so far)."""
        profile = state.profile
        if profile.cached_step_share is not None:  # decided on the device: the rate so far
            share = expected_step_work(profile.cached_step_share, state.cache_rate)
            tokens = max(1, round(profile.num_step_tokens * share))
            return state.num_steps_left * self.cost_model.step_time(tokens)
        if profile.step_work is None:
            return state.num_steps_left * self.step_time(state)
        done = state.num_steps_done
        return sum(
            self.cost_model.step_time(profile.step_tokens(done + i)) for i in range(state.num_steps_left)
        )

    def time_to_finish(self, state: SchedulerRequestState) -> float:
        """`remaining_work` plus the cost model's per-request overhead (prompt encoding, decode):
        the step clock's seconds it still needs (the deadline guard's unit)."""
        return self.remaining_work(state) + self.cost_model.request_overhead_s

    def score(self, state: SchedulerRequestState, now_s: float) -> tuple[int, float, int]:
        """Shortest-first sort key, lowest first: (priority, aged remaining work, arrival order)."""
        aged = self.remaining_work(state)
        if self.config.aging_factor is not None:
            aged -= (now_s - state.arrival_clock_s) / self.config.aging_factor
        return state.priority, aged, state.arrival_seq

    @staticmethod
    def deadline_order(state: SchedulerRequestState) -> tuple[int, float, int]:
        """Earliest-deadline-first sort key (priority still first)."""
        return state.priority, state.deadline_clock_s, state.arrival_seq

    def assign_deadlines(self, live: Sequence[SchedulerRequestState], now_s: float) -> None:
        """Give every live request without a deadline its deadline (module docstring, 2.): all live
        requests' work is ahead of it or its own, so requests that arrived in the same step count
        one another (a burst may be reordered freely: in arrival order its last request would end
        when all of it ends), and so do those given theirs one step before (arrivals within one step
        of each other are one burst to the scheduler): their deadline rises to the new one."""
        new = [s for s in live if s.deadline_clock_s is None]
        previous, self._last_cohort = self._last_cohort, new
        if not new:
            return
        if self.config.deadline_factor is None:
            for state in new:
                state.deadline_clock_s = math.inf
            return
        fifo_s = sum(self.time_to_finish(s) for s in live)
        floor_s = 0.0
        if self._recent_fifo_s:
            ranked = sorted(self._recent_fifo_s)
            floor_s = ranked[min(len(ranked) - 1, int(DEADLINE_FLOOR_QUANTILE * len(ranked)))]
        deadline_s = now_s + self.config.deadline_factor * max(fifo_s, floor_s)
        for state in new:
            self._recent_fifo_s.append(fifo_s)
            state.deadline_clock_s = deadline_s
        live_ids = {s.req_id for s in live}
        for state in previous:
            if state.req_id in live_ids:
                state.deadline_clock_s = max(state.deadline_clock_s, deadline_s)

    def select(
        self,
        started: Sequence[SchedulerRequestState],
        waiting: Sequence[SchedulerRequestState],
        now_s: float,
    ) -> Selection:
        """The requests that run this step (empty when nothing is live)."""
        live = [*started, *waiting]
        self.assign_deadlines(live, now_s)
        selection = self._build(sorted(live, key=lambda s: self.score(s, now_s)), len(started))
        if self.config.deadline_factor is None or not selection.chosen:
            return selection
        by_deadline = sorted(live, key=self.deadline_order)
        if selection.chosen[0] is by_deadline[0]:
            return selection  # the head is deadline order's own: nothing is put off for it
        guarded = self._build(by_deadline, len(started))
        best = max(0.0, self.max_lateness(guarded.chosen, by_deadline, now_s))
        if self.max_lateness(selection.chosen, by_deadline, now_s) <= best + 1e-9:
            return selection
        return Selection(guarded.chosen, guarded.skipped, deadline_ordered=True)

    def max_lateness(
        self,
        chosen: Sequence[SchedulerRequestState],
        by_deadline: Sequence[SchedulerRequestState],
        now_s: float,
    ) -> float:
        """Seconds past its deadline of the latest request if `chosen` runs this step and then every
        request runs alone in deadline order (negative: all early)."""
        chosen_ids = {s.req_id for s in chosen}
        step_end = now_s + self.cost_model.step_time(sum(s.profile.num_step_tokens for s in chosen))
        end, worst = step_end, -float("inf")
        overhead_s = self.cost_model.request_overhead_s
        for state in by_deadline:
            left_s = self.remaining_work(state)
            if state.req_id in chosen_ids:
                left_s -= self.step_time(state)
            end += max(0.0, left_s) + overhead_s
            worst = max(worst, (end if left_s > 0 else step_end + overhead_s) - state.deadline_clock_s)
        return worst

    def _build(self, order: Sequence[SchedulerRequestState], num_started: int) -> Selection:
        """The step that `order` makes: its first request, then the next ones that may join."""
        cfg = self.config
        free_slots = cfg.max_num_resident - num_started
        chosen: list[SchedulerRequestState] = []
        skipped: dict[str, str] = {}
        num_tokens, head_time = 0, 0.0
        for state in order:
            is_new = state.first_scheduled_time is None
            reason = None
            if len(chosen) >= cfg.max_num_seqs:
                reason = f"step full (max_num_seqs = {cfg.max_num_seqs})"
            elif is_new and free_slots <= 0:
                reason = f"no free slot (max_num_resident = {cfg.max_num_resident})"
            elif chosen:
                reason = self._join_blocker(state, chosen, num_tokens, head_time)
            if reason is not None:
                skipped[state.req_id] = reason
                continue
            if not chosen:
                head_time = self.step_time(state)
            chosen.append(state)
            num_tokens += state.profile.step_tokens(state.num_steps_done)
            free_slots -= is_new
        return Selection(chosen, skipped)

    def _join_blocker(
        self,
        state: SchedulerRequestState,
        chosen: list[SchedulerRequestState],
        num_tokens: int,
        head_time: float,
    ) -> str | None:
        """Why `state` may not join the step being built, or None."""
        profiles = [s.profile for s in chosen]
        blocker = find_join_blocker(
            state.profile, profiles, chosen[0].profile.key, self.config.max_num_batched_tokens
        )
        if blocker is not None:
            return blocker
        before = self.cost_model.step_time(num_tokens)
        after = self.cost_model.step_time(num_tokens + state.profile.step_tokens(state.num_steps_done))
        own = self.step_time(state)
        if after - before > self.config.max_marginal_cost * own:
            grow_ms, own_ms = 1e3 * (after - before), 1e3 * own
            return f"not free: the step would grow {grow_ms:.1f} ms for a {own_ms:.1f} ms request"
        if after > self.config.max_step_slowdown * head_time:
            limit = self.config.max_step_slowdown
            return f"would slow the head: {1e3 * after:.1f} ms > {limit:g} x {1e3 * head_time:.1f} ms"
        return None

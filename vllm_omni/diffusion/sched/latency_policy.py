"""`LatencyPolicy` ('latency', the default with --step-execution): who runs the next step.

A step-level engine can decide at every step which requests run. From 512x512 up one Qwen-Image
request alone keeps the H200 busy, so packing every request into every step buys a few percent of
throughput and makes every request as slow as the slowest (measured: a mixed Poisson load had 1.5x
the mean latency of one-at-a-time FIFO). This policy spends the decision on latency instead:

1. **Shortest remaining work first.** Each live request (started or waiting) scores
   `remaining_steps x step_time(its tokens)` from the `StepCostModel`; the lowest score runs.
   A started request that is not chosen sits out the step (its latents, schedule, generator and
   prompt embeddings stay in its slot) and resumes where it stopped: preemption costs nothing.
2. **Aging.** The score falls by `age / aging_factor` (age in step-seconds since arrival), and every
   request ages at the same rate, so the order of two waiting requests changes only through service.
   Hence the bound (tested): a request is never overtaken by a request that arrives more than
   `aging_factor x its alone time` after it (its score has then reached 0, below any newcomer's).
   Its latency is at most `(aging_factor + 1) x alone time` plus the work of the requests that
   arrived before that point and were ahead of it.
   Optionally (`max_slowdown`, off by default) a harder guard for the tail: a request whose
   denoise, at the current pace, ends later than `max_slowdown x` its own denoise work after its
   arrival (`age + remaining work > max_slowdown x total work`) is overdue, and overdue requests run
   before all others, oldest first. It bounds every request's slowdown near `max_slowdown` when the
   overdue are few, at the price of the mean (measured in docs/design/scheduling.md).
3. **Priority.** A request's `priority` (vLLM's meaning: lower runs first) comes before the score;
   strict between levels, as vLLM's priority scheduling.
4. **Pack while free.** After the head (best score), the next requests in order join the step while
   the cost model says it stays nearly free: the step grows by at most `max_marginal_cost` of the
   joining request's own step time, and to at most `max_step_slowdown` times the head's own step
   time (a small request is never packed into a step that makes it much slower). Joins also obey
   the batching rules (key, token budget, MixFusion plan: `find_join_blocker`), `max_num_seqs`
   requests per step, and `max_num_resident` started requests.

Scores use the cost model's seconds and a step-time clock (the sum of the steps' measured times),
not wall time: decisions are deterministic for a given sequence of steps, and testable.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from vllm_omni.diffusion.sched.batching import find_join_blocker
from vllm_omni.diffusion.sched.cost_model import StepCostModel
from vllm_omni.diffusion.sched.request_state import SchedulerRequestState


@dataclass(frozen=True)
class LatencyPolicyConfig:
    """The latency policy's knobs (config fields of the same names; docs/design/scheduling.md)."""

    max_num_seqs: int
    """Requests in one step."""
    max_num_resident: int
    """Requests started (holding runner state), running or sitting out."""
    max_num_batched_tokens: int | None
    aging_factor: float = 4.0
    """Seconds of age that lower a score by one second of work. Larger: closer to pure shortest
    remaining work first (lower mean latency, longer tail); smaller: closer to FIFO."""
    max_slowdown: float | None = None
    """Overdue above this slowdown (see the module docstring, 2.); None = no guard, aging only."""
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


class LatencyPolicy:
    """Chooses each step's requests; see the module docstring."""

    name = "latency"

    def __init__(self, config: LatencyPolicyConfig, cost_model: StepCostModel):
        self.config = config
        self.cost_model = cost_model

    def step_time(self, state: SchedulerRequestState) -> float:
        """Predicted seconds of one step of `state` alone."""
        return self.cost_model.step_time(state.profile.num_step_tokens)

    def remaining_work(self, state: SchedulerRequestState) -> float:
        """Predicted seconds of the request's remaining denoise steps alone."""
        return state.num_steps_left * self.step_time(state)

    def score(self, state: SchedulerRequestState, now_s: float) -> tuple[int, bool, float, int]:
        """Sort key, lowest first: (priority, not overdue, aged remaining work, arrival order);
        overdue requests (only with `max_slowdown`) compare by arrival alone."""
        age_s = now_s - state.arrival_clock_s
        remaining_s = self.remaining_work(state)
        if self.is_overdue(state, age_s, remaining_s):
            return state.priority, False, 0.0, state.arrival_seq
        aged = remaining_s - age_s / self.config.aging_factor
        return state.priority, True, aged, state.arrival_seq

    def is_overdue(self, state: SchedulerRequestState, age_s: float, remaining_s: float) -> bool:
        """Would the request, finishing at the current pace, exceed `max_slowdown` x its own work?"""
        if self.config.max_slowdown is None:
            return False
        total_s = state.req.sampling_params.num_inference_steps * self.step_time(state)
        return age_s + remaining_s > self.config.max_slowdown * total_s

    def select(
        self,
        started: Sequence[SchedulerRequestState],
        waiting: Sequence[SchedulerRequestState],
        now_s: float,
    ) -> Selection:
        """The requests that run this step (empty when nothing is live)."""
        cfg = self.config
        order = sorted([*started, *waiting], key=lambda s: self.score(s, now_s))
        free_slots = cfg.max_num_resident - len(started)
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
            num_tokens += state.profile.num_step_tokens
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
        after = self.cost_model.step_time(num_tokens + state.profile.num_step_tokens)
        own = self.step_time(state)
        if after - before > self.config.max_marginal_cost * own:
            grow_ms, own_ms = 1e3 * (after - before), 1e3 * own
            return f"not free: the step would grow {grow_ms:.1f} ms for a {own_ms:.1f} ms request"
        if after > self.config.max_step_slowdown * head_time:
            limit = self.config.max_step_slowdown
            return f"would slow the head: {1e3 * after:.1f} ms > {limit:g} x {1e3 * head_time:.1f} ms"
        return None

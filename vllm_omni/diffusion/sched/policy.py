"""Admission policies: may a waiting request be admitted past an older one that cannot join?

The scheduler scans the waiting queue oldest first. When a request cannot join the running batch
(other key, no token budget left, MixFusion plan rejected), the policy decides whether the scan may
go on past it:

- `FifoPolicy` ('fifo'): never. Strict head-of-line order, as upstream vLLM-Omni.
- `SkipAheadPolicy` ('skip-ahead'): yes, until the passed-over request has aged
  `max_waiting_steps` steps since it was first passed over. From then on it is a barrier: nothing
  behind it is admitted, the running batch drains, and it is admitted at the latest when the
  running set is empty. Its wait is bounded by `max_waiting_steps` plus the drain time.
"""

from __future__ import annotations

from collections.abc import Iterable

from vllm_omni.config import OmniDiffusionConfig


class AdmissionPolicy:
    """Decides whether younger requests may be admitted past a blocked one (base: never)."""

    name = "base"

    def may_pass(self, req_id: str, step_id: int) -> bool:
        """True when requests behind the blocked `req_id` may still be admitted in step `step_id`."""
        return False

    def on_passed(self, req_ids: Iterable[str], step_id: int) -> None:
        """A younger request was admitted past `req_ids` (still waiting) in step `step_id`."""

    def forget(self, req_id: str) -> None:
        """`req_id` left the waiting queue (admitted, aborted)."""


class FifoPolicy(AdmissionPolicy):
    """Strict arrival order: the scan stops at the first request that cannot join."""

    name = "fifo"


class SkipAheadPolicy(AdmissionPolicy):
    """Admit compatible requests past an incompatible one, for a bounded number of steps (aging).

    A blocked request may be passed over in the `max_waiting_steps` consecutive steps starting with
    the first step it was passed over; after that it blocks the queue behind it. Steps, not seconds:
    the bound is deterministic, testable and independent of step time (wall clock is roughly
    `max_waiting_steps * step_time`). `max_waiting_steps = 0` makes it FIFO.
    """

    name = "skip-ahead"

    def __init__(self, max_waiting_steps: int):
        if max_waiting_steps < 0:
            raise ValueError(f"max_waiting_steps must be >= 0, got {max_waiting_steps}")
        self.max_waiting_steps = max_waiting_steps
        self._first_passed_step: dict[str, int] = {}
        """req_id -> step in which a younger request was first admitted past it."""

    def may_pass(self, req_id: str, step_id: int) -> bool:
        first = self._first_passed_step.get(req_id, step_id)
        return step_id - first < self.max_waiting_steps

    def on_passed(self, req_ids: Iterable[str], step_id: int) -> None:
        for req_id in req_ids:
            self._first_passed_step.setdefault(req_id, step_id)

    def forget(self, req_id: str) -> None:
        self._first_passed_step.pop(req_id, None)

    def num_steps_aged(self, req_id: str, step_id: int) -> int:
        """Steps since `req_id` was first passed over (0 if never)."""
        return step_id - self._first_passed_step.get(req_id, step_id)


def make_admission_policy(config: OmniDiffusionConfig) -> AdmissionPolicy:
    """The policy named by `config.scheduling_policy`."""
    if config.scheduling_policy == "fifo":
        return FifoPolicy()
    if config.scheduling_policy == "skip-ahead":
        return SkipAheadPolicy(config.max_waiting_steps)
    raise ValueError(f"scheduling_policy must be 'fifo' or 'skip-ahead', got {config.scheduling_policy!r}")

"""The scheduler's records of a request: `SchedulerRequestState` while it is live (waiting or running),
`FinishedRequest` once it has left. Their own module so that policies (`latency_policy.py`) can name
them without importing the scheduler."""

from __future__ import annotations

from dataclasses import dataclass

from vllm_omni.diffusion.outputs import ErrorKind
from vllm_omni.diffusion.request import OmniDiffusionRequest, RequestStatus
from vllm_omni.diffusion.sched.batching import BatchingProfile
from vllm_omni.diffusion.sched.interface import DiffusionOutput


@dataclass
class FinishedRequest:
    """A request that left the scheduler, reported exactly once (see `StepScheduler.pop_finished`)."""

    req_id: str
    req: OmniDiffusionRequest
    status: RequestStatus
    result: DiffusionOutput | None
    error: str | None
    """The runner's message for FINISHED_ERROR, 'Request X aborted.' for FINISHED_ABORTED."""
    error_kind: ErrorKind | None
    num_steps_done: int
    arrival_time: float
    """`time.monotonic()` when the scheduler accepted it."""
    first_scheduled_time: float | None = None
    """`time.monotonic()` when first scheduled; None if it never ran (queue time = this - arrival)."""
    num_steps_sat_out: int = 0
    """Steps it was running (started) but not chosen (latency policy)."""
    num_preemptions: int = 0
    """Times it ran a step and then sat out the next one."""


@dataclass
class SchedulerRequestState:
    """The scheduler's record of one live (waiting or running) request."""

    req_id: str
    """The engine's id (the key everywhere below the engine); `req.request_id` is only a label."""
    req: OmniDiffusionRequest
    profile: BatchingProfile
    arrival_time: float
    arrival_seq: int = 0
    """Arrival order (ties in the latency policy)."""
    arrival_clock_s: float = 0.0
    """The scheduler's step-time clock at arrival (aging in the latency policy)."""
    deadline_clock_s: float | None = None
    """The latency policy's deadline on that clock (its deadline guard; inf when off), set when the
    policy first sees the request."""
    status: RequestStatus = RequestStatus.WAITING
    num_steps_done: int = 0
    first_scheduled_time: float | None = None
    num_steps_sat_out: int = 0
    num_preemptions: int = 0
    ran_last_step: bool = False
    cache_rate: float = 0.0
    """Step caching decided on the device: the share of its sequence-steps so far that were cached."""

    @property
    def priority(self) -> int:
        """Lower runs first (vLLM's meaning)."""
        return self.req.sampling_params.priority

    @property
    def num_steps_left(self) -> int:
        return self.req.sampling_params.num_inference_steps - self.num_steps_done

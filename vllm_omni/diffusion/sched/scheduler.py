"""`StepScheduler`: which requests run each denoise step.

One engine step = `schedule()` -> runner -> `update_from_output()`. Requests are *waiting* (not
started) or *running* (started: their state lives on the runner, in a slot). Two ways to choose:

- 'latency' (the default in step mode, `LatencyPolicy`): at every step, from all running and
  waiting requests, shortest remaining work first with aging and priority, packing more requests
  only while the cost model says it is nearly free. A running request that is not chosen sits out
  the step (preempted between steps, nothing lost) and resumes later.
- 'fifo' / 'skip-ahead' (`AdmissionPolicy`): every running request runs every step; waiting
  requests are admitted oldest first while they fit:

      fits = len(running) < max_num_seqs
             and find_join_blocker(...) is None   # key, token budget, MixFusion plan
      blocked -> AdmissionPolicy decides: stop (fifo) or look further (skip-ahead, with aging)

Request mode (`step_execution=False`) uses the same scheduler ('fifo'); the config clamps
`max_num_seqs` to 1. All methods are called from one thread (the engine loop); there is no locking.
"""

from __future__ import annotations

import logging
import random
import time
from collections import deque

from vllm_omni.config import OmniDiffusionConfig
from vllm_omni.diffusion.errors import QueueFullError
from vllm_omni.diffusion.models.interface import RequestGeometry
from vllm_omni.diffusion.outputs import ErrorKind
from vllm_omni.diffusion.request import OmniDiffusionRequest, RequestStatus
from vllm_omni.diffusion.sched.batching import (
    TextTokenCounter,
    build_batching_profile,
    find_join_blocker,
    make_sampling_params_key,
    mixfusion_plan_ok,
)
from vllm_omni.diffusion.sched.cost_model import StepCostModel
from vllm_omni.diffusion.sched.interface import (
    DiffusionOutput,
    ModelRunnerOutput,
    NewRequestData,
    RunnerOutput,
    SamplingParamsKey,
    SchedulerOutput,
)
from vllm_omni.diffusion.sched.latency_policy import LatencyPolicy, LatencyPolicyConfig
from vllm_omni.diffusion.sched.policy import make_admission_policy
from vllm_omni.diffusion.sched.request_state import FinishedRequest, SchedulerRequestState

logger = logging.getLogger(__name__)

__all__ = [
    "FinishedRequest",
    "SchedulerRequestState",
    "StepScheduler",
    "make_sampling_params_key",
    "mixfusion_plan_ok",
]


class StepScheduler:
    """Admits waiting requests into the running batch step by step; see the module docstring.

    Args:
        config: `max_num_seqs`, `max_num_batched_tokens`, `scheduling_policy`, `max_waiting_steps`,
            `enable_mixfusion`, `mixfusion_min_chunk_tokens`, `mixfusion_max_chunks`, `max_queue_size`.
        supports_mixfusion: whether the pipeline can run mixed shapes in one step.
        text_token_counter: req -> (positive, negative) prompt tokens, for the token budget; None
            uses `estimate_text_tokens` (words + 8, capped at `max_sequence_length`).
        pipeline_name: named in the capability error.
        cost_model: step time by tokens (the latency policy's); None starts an empty one, which
            learns from the steps' measured times.
    """

    def __init__(
        self,
        config: OmniDiffusionConfig,
        supports_mixfusion: bool = True,
        text_token_counter: TextTokenCounter | None = None,
        pipeline_name: str | None = None,
        cost_model: StepCostModel | None = None,
        cache_num_blocks: int = 0,
    ):
        if config.enable_mixfusion and not supports_mixfusion:
            name = pipeline_name or config.model
            raise ValueError(
                f"pipeline {name} does not support MixFusion (mixed-shape batching); drop --enable-mixfusion"
            )
        self.config = config
        self.cache_num_blocks = cache_num_blocks
        """The model's transformer blocks: what a cached step of a static mask costs (step caching)."""
        self.supports_mixfusion = supports_mixfusion
        self.enable_mixfusion = (
            supports_mixfusion if config.enable_mixfusion is None else config.enable_mixfusion
        )
        """Server default for requests without `extra_args['enable_mixfusion']`."""
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_num_resident = config.resident_cap
        self.cost_model = cost_model if cost_model is not None else StepCostModel()
        self.latency_policy: LatencyPolicy | None = None
        """Set for 'latency'; otherwise `policy` (fifo / skip-ahead) admits and all running requests run."""
        self.policy = None
        if config.scheduling_policy == "latency":
            self.latency_policy = LatencyPolicy(
                LatencyPolicyConfig(
                    max_num_seqs=config.max_num_seqs,
                    max_num_resident=self.max_num_resident,
                    max_num_batched_tokens=config.max_num_batched_tokens,
                    aging_factor=config.scheduling_aging_factor,
                    deadline_factor=config.scheduling_deadline_factor,
                    max_marginal_cost=config.packing_max_marginal_cost,
                    max_step_slowdown=config.packing_max_step_slowdown,
                ),
                self.cost_model,
            )
        else:
            self.policy = make_admission_policy(config)
        self._text_token_counter = text_token_counter
        self._seed_rng = random.Random(config.seed) if config.seed is not None else None

        self._requests: dict[str, SchedulerRequestState] = {}
        """Live requests (waiting or running) by id."""
        self._waiting: deque[str] = deque()
        self._running: list[str] = []
        """Admission order; the runner's output order is the SchedulerOutput's, not this."""
        self._running_key: SamplingParamsKey | None = None
        """Key of the first request admitted to an empty running set; None while it is empty."""
        self._finished_for_runner: set[str] = set()
        """Aborted / failed ids the runner has not been told about yet (next SchedulerOutput)."""
        self._unreported: list[FinishedRequest] = []
        """Finished requests not yet returned by update_from_output / pop_finished."""
        self._step_id = 0
        self._num_arrivals = 0
        self.clock_s = 0.0
        """Step-time clock: the summed predicted times of the steps run so far (the cost model's step
        time, plus its per-request overhead for each request that finished)."""

    # ---------------------------------------------------------------- queries

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def running_key(self) -> SamplingParamsKey | None:
        """The key every running request shares (None when nothing runs)."""
        return self._running_key

    def has_requests(self) -> bool:
        """True while anything is waiting or running, or a finished request is still to be reported.

        NOTE(sched): the last case makes the engine loop run one more (empty) step after an abort when
        nothing else is live: that `schedule()` tells the runner to free the aborted request's state,
        and that `update_from_output()` returns its `FinishedRequest`.
        """
        return bool(self._waiting or self._running or self._finished_for_runner or self._unreported)

    def get_request(self, req_id: str) -> OmniDiffusionRequest | None:
        """The live (waiting or running) request with this id, else None."""
        state = self._requests.get(req_id)
        return state.req if state is not None else None

    def get_state(self, req_id: str) -> SchedulerRequestState | None:
        """The scheduler's record of a live request (status, steps done, batching profile)."""
        return self._requests.get(req_id)

    # ---------------------------------------------------------------- requests in / out

    def add_request(
        self,
        req: OmniDiffusionRequest,
        req_id: str | None = None,
        text_tokens: tuple[int, int] | None = None,
        geometry: RequestGeometry | None = None,
    ) -> None:
        """Queue a request (WAITING) and assign its seed if it has none.

        `req_id` is the engine's unique id (default: `req.request_id`, for tools that make their own);
        `text_tokens` the embedded (positive, negative) prompt lengths for the token budget (default:
        the scheduler's `text_token_counter`, else an estimate); `geometry` the family's rows of the
        request (its token cost wins over `text_tokens`).

        Raises:
            ValueError: a live request already has this id.
            QueueFullError: `max_queue_size` requests are already waiting.
        """
        req_id = req.request_id if req_id is None else req_id
        if req_id in self._requests:
            raise ValueError(f"request_id {req_id!r} is already waiting or running")
        if len(self._waiting) >= self.config.max_queue_size:
            raise QueueFullError(
                f"waiting queue is full (max_queue_size = {self.config.max_queue_size}); retry later"
            )
        sp = req.sampling_params
        if sp.seed is None and self._seed_rng is not None:
            sp.seed = self._seed_rng.randrange(0, 2**31 - 1)
        sp.ensure_seed()
        counter = self._text_token_counter if text_tokens is None else (lambda _: text_tokens)
        profile = build_batching_profile(
            req, self.config, self.enable_mixfusion, self.supports_mixfusion, counter, geometry,
            self.cache_num_blocks,
        )  # fmt: skip
        self._requests[req_id] = SchedulerRequestState(
            req_id=req_id,
            req=req,
            profile=profile,
            arrival_time=time.monotonic(),
            arrival_seq=self._num_arrivals,
            arrival_clock_s=self.clock_s,
        )
        self._num_arrivals += 1
        self._waiting.append(req_id)

    def abort_request(self, req_id: str) -> bool:
        """Finish a waiting or running request as FINISHED_ABORTED; False if it is not live.

        It is reported in the next `SchedulerOutput.finished_req_ids` (so the runner frees its state)
        and returned by the next `update_from_output` or `pop_finished`. If it was scheduled in the
        step now running, that step's output for it is ignored.
        """
        state = self._requests.get(req_id)
        if state is None:
            return False
        self._finish(state, RequestStatus.FINISHED_ABORTED, error=f"Request {req_id} aborted.")
        return True

    def pop_finished(self) -> list[FinishedRequest]:
        """Finished requests not returned yet (e.g. aborted while waiting). Each is returned once."""
        finished, self._unreported = self._unreported, []
        return finished

    # ---------------------------------------------------------------- the step

    def schedule(self) -> SchedulerOutput:
        """Plan one step: the latency policy's choice, or every running request plus admissions."""
        step_id = self._step_id
        self._step_id += 1
        deadline_ordered = False
        if self.latency_policy is not None:
            cached_ids, admitted, paused_ids, deadline_ordered = self._select(step_id)
        else:
            cached_ids, admitted, paused_ids = list(self._running), self._admit_waiting(step_id), []
        now = time.monotonic()
        new_reqs = []
        for state in admitted:
            state.first_scheduled_time = now
            req = state.req
            new_reqs.append(
                NewRequestData(
                    req_id=state.req_id,
                    prompt=req.prompt,
                    negative_prompt=req.negative_prompt,
                    sampling_params=req.sampling_params,  # the engine's own copy (input_processor.py)
                    image=req.image,
                    geometry=state.profile.geometry,
                )
            )
        finished_ids, self._finished_for_runner = self._finished_for_runner, set()
        return SchedulerOutput(
            step_id=step_id,
            scheduled_new_reqs=new_reqs,
            scheduled_cached_req_ids=cached_ids,
            finished_req_ids=finished_ids,
            paused_req_ids=paused_ids,
            deadline_ordered=deadline_ordered,
            num_running_reqs=len(self._running),
            num_waiting_reqs=len(self._waiting),
            predicted_step_time_s=self.cost_model.step_time(
                sum(
                    self._requests[r].profile.num_step_tokens
                    for r in [*(s.req_id for s in admitted), *cached_ids]
                )
            ),
        )

    def _select(self, step_id: int) -> tuple[list[str], list[SchedulerRequestState], list[str], bool]:
        """Latency policy: (continuing ids, newly started, running ids that sit this step out, whether
        the step is in deadline order)."""
        started = [self._requests[r] for r in self._running]
        waiting = [self._requests[r] for r in self._waiting]
        selection = self.latency_policy.select(started, waiting, self.clock_s)
        chosen = {s.req_id for s in selection.chosen}
        cached, admitted, paused = [], [], []
        for state in selection.chosen:
            if state.status == RequestStatus.RUNNING:
                cached.append(state.req_id)
            else:
                self._admit(state)
                admitted.append(state)
        for state in started:
            if state.req_id in chosen:
                continue
            paused.append(state.req_id)
            state.num_steps_sat_out += 1
            state.num_preemptions += state.ran_last_step
            state.ran_last_step = False
        for state in selection.chosen:
            state.ran_last_step = True
        if selection.skipped and logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "step %d: run %s%s; sit out / wait %s",
                step_id,
                [s.req_id for s in selection.chosen],
                " (deadline order)" if selection.deadline_ordered else "",
                selection.skipped,
            )
        return cached, admitted, paused, selection.deadline_ordered

    def _admit_waiting(self, step_id: int) -> list[SchedulerRequestState]:
        """Scan the waiting queue oldest first; admit what fits, ask the policy at each blocked one."""
        admitted: list[SchedulerRequestState] = []
        passed_over: list[str] = []
        running = [self._requests[r].profile for r in self._running]
        for req_id in list(self._waiting):
            if len(self._running) >= self.max_num_seqs:
                break
            state = self._requests[req_id]
            blocker = find_join_blocker(
                state.profile, running, self._running_key, self.max_num_batched_tokens
            )
            if blocker is None:
                self._admit(state)
                admitted.append(state)
                running.append(state.profile)
                self.policy.on_passed(passed_over, step_id)
            elif self.policy.may_pass(req_id, step_id):
                passed_over.append(req_id)
            else:
                break
        return admitted

    def _admit(self, state: SchedulerRequestState) -> None:
        req_id = state.req_id
        self._waiting.remove(req_id)
        if self.policy is not None:
            self.policy.forget(req_id)
        if not self._running:
            self._running_key = state.profile.key
        self._running.append(req_id)
        state.status = RequestStatus.RUNNING

    def update_from_output(
        self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput
    ) -> list[FinishedRequest]:
        """Apply one step's runner output; return every request that finished since the last report.

        Per scheduled id: no output -> FINISHED_ERROR ('No output for request X'); `error` ->
        FINISHED_ERROR with the runner's message; `finished` -> FINISHED_COMPLETED with the result;
        otherwise the step count is stored. Ids aborted after `schedule()` are skipped here (their
        abort is what gets reported).
        """
        stats = runner_out.stats
        for sample in stats.cost_samples:
            self.cost_model.observe(sample.num_tokens, sample.seconds)
        if sched_out.num_scheduled_reqs:
            num_finished = sum(o.finished for o in runner_out.outputs)
            # NOTE(sched): the clock runs on the cost model's predictions, not the measured times: the
            # deadlines and ages it makes then depend on the table alone, so a step's measurement noise
            # cannot flip a decision (the same burst gives the same steps on a quiet machine).
            self.clock_s += (
                sched_out.predicted_step_time_s + num_finished * self.cost_model.request_overhead_s
            )
            if stats.step_time_s > 0:
                self.cost_model.observe_overhead(
                    stats.step_time_s - sched_out.predicted_step_time_s, num_finished
                )
        outputs: dict[str, RunnerOutput] = {o.req_id: o for o in runner_out.outputs}
        for req_id in sched_out.scheduled_req_ids:
            state = self._requests.get(req_id)
            if state is None or state.status != RequestStatus.RUNNING:
                continue
            out = outputs.get(req_id)
            if out is None:
                message = f"No output for request {req_id}"
                self._finish(
                    state, RequestStatus.FINISHED_ERROR, error=message, error_kind=ErrorKind.INTERNAL
                )
                continue
            state.num_steps_done = out.step_index
            if out.cache_rate is not None:
                state.cache_rate = out.cache_rate
            if out.error is not None:
                kind = out.error_kind or ErrorKind.INTERNAL
                self._finish(state, RequestStatus.FINISHED_ERROR, error=out.error, error_kind=kind)
            elif out.finished:
                self._finish(state, RequestStatus.FINISHED_COMPLETED, result=out.result)
        return self.pop_finished()

    def _finish(
        self,
        state: SchedulerRequestState,
        status: RequestStatus,
        result: DiffusionOutput | None = None,
        error: str | None = None,
        error_kind: ErrorKind | None = None,
    ) -> None:
        """Remove a live request and queue its `FinishedRequest` report."""
        req_id = state.req_id
        if state.status == RequestStatus.RUNNING:
            self._running.remove(req_id)
            if not self._running:
                self._running_key = None
        else:
            self._waiting.remove(req_id)
            if self.policy is not None:
                self.policy.forget(req_id)
        del self._requests[req_id]
        state.status = status
        if status != RequestStatus.FINISHED_COMPLETED:
            # The runner frees completed requests itself; tell it about the others.
            self._finished_for_runner.add(req_id)
        self._unreported.append(
            FinishedRequest(
                req_id=req_id,
                req=state.req,
                status=status,
                result=result,
                error=error,
                error_kind=error_kind,
                num_steps_done=state.num_steps_done,
                arrival_time=state.arrival_time,
                first_scheduled_time=state.first_scheduled_time,
                num_steps_sat_out=state.num_steps_sat_out,
                num_preemptions=state.num_preemptions,
            )
        )

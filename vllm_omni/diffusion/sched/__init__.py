"""Scheduling: who runs in each denoise step.

- `interface`: the types that cross the scheduler / runner boundary.
- `batching`: the batching key, the MixFusion plan limit, the per-step token cost.
- `policy`: admission policies ('fifo', 'skip-ahead' with aging).
- `scheduler`: `StepScheduler` (step mode; request mode is the same with `max_num_seqs=1`).

See docs/design/scheduling.md.
"""

from vllm_omni.diffusion.sched.interface import (
    DiffusionOutput,
    ModelRunnerOutput,
    NewRequestData,
    RunnerOutput,
    SamplingParamsKey,
    SchedulerOutput,
    StepStats,
)
from vllm_omni.diffusion.sched.scheduler import (
    FinishedRequest,
    StepScheduler,
    make_sampling_params_key,
    mixfusion_plan_ok,
)

__all__ = [
    "DiffusionOutput",
    "FinishedRequest",
    "ModelRunnerOutput",
    "NewRequestData",
    "RunnerOutput",
    "SamplingParamsKey",
    "SchedulerOutput",
    "StepScheduler",
    "StepStats",
    "make_sampling_params_key",
    "mixfusion_plan_ok",
]

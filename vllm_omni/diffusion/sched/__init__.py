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

_LAZY = {"FinishedRequest", "StepScheduler", "make_sampling_params_key", "mixfusion_plan_ok"}


def __getattr__(name: str):
    # NOTE(sched): imported lazily: scheduler imports diffusion.stats, which imports sched.interface,
    # so an eager import here would be circular when diffusion.stats is imported first.
    if name in _LAZY:
        from vllm_omni.diffusion.sched import scheduler

        return getattr(scheduler, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

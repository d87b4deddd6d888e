"""Executors: how the engine reaches its workers. One device: `UniProcExecutor` (the worker in this
process); several: `ParallelExecutor` (one process per device, see distributed/executor.py)."""

from __future__ import annotations

from vllm_omni.config import OmniDiffusionConfig
from vllm_omni.diffusion.sched.interface import ModelRunnerOutput, SchedulerOutput
from vllm_omni.diffusion.worker.worker import Worker


class UniProcExecutor:
    """Drives one `Worker` in the engine's process."""

    def __init__(self, config: OmniDiffusionConfig, pipeline=None):
        self.driver_worker = Worker(config, 0, pipeline=pipeline)
        self.driver_worker.load()
        self.driver_worker.prepare()

    def execute_step(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        return self.driver_worker.execute_step(sched_out)

    def execute_request(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        return self.driver_worker.execute_request(sched_out)

    def free(self, req_ids) -> None:
        self.driver_worker.free(req_ids)

    def shutdown(self) -> None:
        """Nothing to stop: the worker lives in this process."""


def create_executor(config: OmniDiffusionConfig, pipeline=None):
    """`UniProcExecutor` for one device, `ParallelExecutor` when `config.parallel_config` spans several."""
    if not config.parallel_config.is_parallel:
        return UniProcExecutor(config, pipeline=pipeline)
    from vllm_omni.diffusion.distributed.executor import ParallelExecutor

    return ParallelExecutor(config, pipeline=pipeline)

"""Multi-process execution: one process per device, rank 0 inside the engine's process.

    engine process (rank 0)                         worker processes (ranks 1..N-1, spawned)
    DiffusionEngine + StepScheduler                 Worker(config, rank): load, prepare(groups)
    ParallelExecutor: Worker(config, 0), the same   loop:
    execute_step(sched_out):
      broadcast_object_list([WorkerCommand]) ---->     cmd = broadcast_object_list(...)
      worker.execute_step(sched_out) <collectives>     worker.execute_step(cmd.sched_out)
      return rank 0's ModelRunnerOutput                (output dropped)

Every rank keeps the full request state (prompt embeddings, latents, schedules, generators) and runs
the same runner code on the same inputs; only the transformer forward is split (`parallelize`), and
its output is complete on every rank, so every rank takes the same CFG combine and Euler step and
the states never need to be exchanged. Text encoding and VAE decode run on every rank (redundant;
rank 0's result is returned).

`ParallelExecutor` has `UniProcExecutor`'s interface (`execute_step`, `execute_request`, `free`,
`shutdown()`, `driver_worker`); `vllm_omni.diffusion.executor.create_executor(config)` picks one.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import time
import traceback
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from vllm_omni.config import ParallelConfig
from vllm_omni.diffusion.distributed.parallel_state import (
    default_backend,
    find_free_port,
    init_distributed,
    init_parallel_groups,
)
from vllm_omni.diffusion.sched.interface import ModelRunnerOutput, SchedulerOutput
from vllm_omni.diffusion.worker.worker import Worker

logger = logging.getLogger(__name__)

WORKER_READY_TIMEOUT_S = 1800.0
"""How long rank 0 waits for the workers to load their pipelines."""


@dataclass
class WorkerCommand:
    """What rank 0 broadcasts to the workers once per step."""

    kind: str
    """'step' (runner.execute_step), 'request' (runner.execute_request) or 'stop'."""
    sched_out: SchedulerOutput | None = None
    free_req_ids: list[str] = field(default_factory=list)
    """Requests the engine freed since the last command (applied before the step)."""


def check_parallel_support(config, parallel_config: ParallelConfig) -> None:
    """Raise ValueError for engine settings the parallel modes do not support yet."""
    if parallel_config.is_parallel and getattr(config, "batch_invariant", False):
        raise ValueError(
            "batch-invariant mode (VLLM_BATCH_INVARIANT=1) cannot run with tensor/sequence/CFG "
            "parallelism: all-reduces and shard sizes depend on the world size; set the parallel "
            "sizes to 1 or turn batch invariance off"
        )


def rank_config(config, rank: int):
    """The engine config for `rank`: CUDA ranks use one device each (cuda:K+rank for device cuda:K)."""
    device = config.resolve_device()
    if not device.startswith("cuda"):
        return dataclasses.replace(config, device=device)
    base = torch.device(device).index or 0
    return dataclasses.replace(config, device=f"cuda:{base + rank}")


def check_devices(device: torch.device, world_size: int) -> None:
    """Raise ValueError when a CUDA replica would need more GPUs than this host has."""
    if device.type != "cuda":
        return
    needed, available = (device.index or 0) + world_size, torch.cuda.device_count()
    if needed > available:
        raise ValueError(
            f"the parallel sizes need {world_size} GPUs starting at {device} (cuda:0..{needed - 1}), "
            f"this host has {available}; lower the parallel sizes"
        )


def _worker_main(
    rank: int,
    world_size: int,
    init_method: str,
    backend: str,
    config,
    parallel_config: ParallelConfig,
    num_threads: int,
    ready: mp.Queue,
) -> None:
    """Worker process: build its `Worker` like rank 0 does, join the group, run commands until 'stop'."""
    if num_threads > 0:
        torch.set_num_threads(num_threads)
    worker = Worker(config, rank)
    try:
        worker.load()
    except Exception as exc:
        ready.put((rank, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        return
    ready.put((rank, None))
    init_distributed(rank, world_size, init_method, backend)
    control = _control_group(backend)
    worker.prepare(init_parallel_groups(parallel_config))
    try:
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0, group=control)
            cmd: WorkerCommand = box[0]
            worker.free(cmd.free_req_ids)
            if cmd.kind == "stop":
                break
            try:
                if cmd.kind == "step":
                    worker.execute_step(cmd.sched_out)
                else:
                    worker.execute_request(cmd.sched_out)
            except Exception:  # rank 0 sees the same failure; mirror the engine's clean-up
                logger.exception("rank %d: step %d failed", rank, cmd.sched_out.step_id)
                worker.free(cmd.sched_out.scheduled_req_ids)
    finally:
        dist.destroy_process_group()


def _control_group(backend: str) -> dist.ProcessGroup | None:
    """Group for the per-step command broadcast: a CPU (gloo) group when the data backend is NCCL,
    so pickled commands do not go through GPU memory. Collective: call on every rank."""
    return dist.new_group(backend="gloo") if backend == "nccl" else None


class ParallelExecutor:
    """Rank 0 of a parallel replica: builds its own `Worker`, spawns the other ranks' workers,
    broadcasts each step and runs its own share.

    Every rank builds its `Worker` the same way (load, then `prepare` with the parallel groups).
    Same interface as `UniProcExecutor`: `execute_step`, `execute_request`, `free`, `shutdown()`,
    and `driver_worker` (rank 0's worker).
    """

    def __init__(
        self,
        config,
        parallel_config: ParallelConfig | None = None,
        backend: str | None = None,
        num_threads_per_rank: int | None = None,
        pipeline=None,
    ):
        """`backend`: 'nccl' / 'gloo' (default: by device). `num_threads_per_rank`: torch threads of
        each worker on CPU (default cpu_count // world_size); rank 0's are left as they are.
        `pipeline`: rank 0's pipeline, already loaded (tests); the other ranks load their own."""
        parallel_config = parallel_config or config.parallel_config
        check_parallel_support(config, parallel_config)
        self.driver_worker = Worker(rank_config(config, 0), 0, pipeline=pipeline)
        self.driver_worker.load()
        parallel_config.validate_model(self.driver_worker.pipeline.transformer.config.num_attention_heads)
        check_devices(self.driver_worker.device, parallel_config.world_size)
        self.parallel_config = parallel_config
        world_size = parallel_config.world_size
        backend = backend or default_backend(self.driver_worker.device)
        init_method = f"tcp://127.0.0.1:{find_free_port()}"
        if num_threads_per_rank is None:
            num_threads_per_rank = max(1, (os.cpu_count() or 1) // world_size)
        ctx = mp.get_context("spawn")
        ready = ctx.Queue()
        self._procs = []
        for rank in range(1, world_size):
            args = (rank, world_size, init_method, backend, rank_config(config, rank), parallel_config)
            proc = ctx.Process(
                target=_worker_main, args=(*args, num_threads_per_rank, ready), name=f"vllm-omni-rank{rank}"
            )
            proc.daemon = True
            proc.start()
            self._procs.append(proc)
        try:
            self._wait_ready(ready, world_size - 1, config.init_timeout_s or WORKER_READY_TIMEOUT_S)
        except Exception:
            self._kill()
            raise
        init_distributed(0, world_size, init_method, backend)
        self._control = _control_group(backend)
        self.groups = init_parallel_groups(parallel_config)
        self.driver_worker.prepare(self.groups)
        self._pending_free: list[str] = []
        self._closed = False
        logger.info("parallel executor ready: %s, world size %d, %s", parallel_config, world_size, backend)

    def _wait_ready(self, ready: mp.Queue, num_workers: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        pending = set(range(1, num_workers + 1))
        while pending:
            try:
                rank, error = ready.get(timeout=1.0)
            except queue.Empty:
                dead = [p.name for p in self._procs if not p.is_alive()]
                if dead:
                    raise RuntimeError(f"worker process(es) {dead} exited while loading the model") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"workers {sorted(pending)} did not load the model in time") from None
                continue
            if error is not None:
                raise RuntimeError(f"rank {rank} failed to load the model: {error}")
            pending.discard(rank)

    def _broadcast(self, cmd: WorkerCommand) -> None:
        cmd.free_req_ids, self._pending_free = self._pending_free, []
        dist.broadcast_object_list([cmd], src=0, group=self._control)

    def execute_step(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every rank; return rank 0's output."""
        self._broadcast(WorkerCommand("step", sched_out))
        return self.driver_worker.execute_step(sched_out)

    def execute_request(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        """Request mode: whole requests, every rank in lockstep."""
        self._broadcast(WorkerCommand("request", sched_out))
        return self.driver_worker.execute_request(sched_out)

    def free(self, req_ids) -> None:
        """Free request state here now, on the workers with the next command."""
        req_ids = list(req_ids)
        self.driver_worker.free(req_ids)
        self._pending_free += req_ids

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the workers and leave the process group (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._broadcast(WorkerCommand("stop"))
        finally:
            for proc in self._procs:
                proc.join(timeout=timeout_s)
            self._kill()
            if dist.is_initialized():
                dist.destroy_process_group()

    def _kill(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)

"""Start `world_size` local processes that share one torch.distributed group (tests, tools).

    launch_local(fn, world_size, args)   # runs fn(rank, *args) in every rank, rank 0 included

Each process initialises the group (gloo on CPU, NCCL on CUDA) over TCP on 127.0.0.1 at a free port,
runs `fn`, and tears the group down. `fn` must be importable (a module-level function): processes are
started with the `spawn` method. A rank that raises makes `launch_local` raise
(torch.multiprocessing's ProcessRaisedException, with the rank's traceback).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from vllm_omni.diffusion.distributed.parallel_state import find_free_port, init_distributed


def _run_rank(
    rank: int, fn: Callable, world_size: int, init_method: str, backend: str, num_threads: int, args: tuple
) -> None:
    if num_threads > 0:
        torch.set_num_threads(num_threads)
    init_distributed(rank, world_size, init_method, backend)
    try:
        fn(rank, *args)
    finally:
        dist.destroy_process_group()


def launch_local(
    fn: Callable, world_size: int, args: tuple = (), backend: str = "gloo", num_threads: int | None = None
) -> None:
    """Run `fn(rank, *args)` on `world_size` spawned processes joined in one process group; wait.

    `num_threads`: torch intra-op threads per process (default: cpu_count // world_size, at least 1,
    so the ranks do not oversubscribe the CPU).
    """
    if num_threads is None:
        num_threads = max(1, (os.cpu_count() or 1) // world_size)
    init_method = f"tcp://127.0.0.1:{find_free_port()}"
    mp.spawn(
        _run_rank,
        args=(fn, world_size, init_method, backend, num_threads, args),
        nprocs=world_size,
        join=True,
    )

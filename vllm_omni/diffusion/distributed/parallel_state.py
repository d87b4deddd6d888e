"""Process groups of one parallel model replica, and the few collectives the parallel modes share.

`init_parallel_groups(config)` runs on every rank after `torch.distributed.init_process_group` and
returns this rank's `ParallelGroups`: one `GroupInfo` per mode. Ranks follow `ParallelConfig`'s layout
(tensor parallel innermost, CFG parallel outermost). Example, world 8 = cfg 2 x ring 1 x ulysses 2 x tp 2::

    rank      0 1 2 3 | 4 5 6 7
    cfg       0 0 0 0 | 1 1 1 1      cfg groups:     {0,4} {1,5} {2,6} {3,7}
    ulysses   0 0 1 1 | 0 0 1 1      ulysses groups: {0,2} {1,3} {4,6} {5,7}
    tp        0 1 0 1 | 0 1 0 1      tp groups:      {0,1} {2,3} {4,5} {6,7}

The sequence-parallel group is the ring x ulysses grid of ranks that share cfg and tp coordinates,
ordered `sp_rank = ring_rank * ulysses_degree + ulysses_rank` (the order of the row shards).
Groups of size 1 carry `group=None` and every helper here skips their collectives.
"""

from __future__ import annotations

import itertools
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from vllm_omni.config import ParallelConfig


@dataclass(frozen=True)
class GroupInfo:
    """One process group as seen from this rank."""

    group: dist.ProcessGroup | None
    """None when the group has one member (no collective needed)."""
    rank: int
    """This process's index inside the group."""
    ranks: tuple[int, ...]
    """Global ranks of the members, in group order."""

    @property
    def size(self) -> int:
        return len(self.ranks)

    @classmethod
    def single(cls, rank: int = 0) -> GroupInfo:
        return cls(None, 0, (rank,))


@dataclass(frozen=True)
class ParallelGroups:
    """This rank's view of every parallel mode's group."""

    config: ParallelConfig
    rank: int
    """Global rank."""
    tp: GroupInfo
    ulysses: GroupInfo
    ring: GroupInfo
    sp: GroupInfo
    """ring x ulysses: the ranks that split the packed rows, in shard order."""
    cfg: GroupInfo

    @classmethod
    def single(cls) -> ParallelGroups:
        """A one-process replica (no collectives)."""
        one = GroupInfo.single()
        return cls(ParallelConfig(), 0, one, one, one, one, one)


def _member_ranks(config: ParallelConfig, axis: str) -> list[tuple[int, ...]]:
    """Every group of kind `axis`, each as its ordered global ranks; the same list on every rank."""
    sizes = {
        "cfg": config.cfg_parallel_size,
        "ring": config.ring_degree,
        "ulysses": config.ulysses_degree,
        "tp": config.tensor_parallel_size,
    }
    varying = ("ring", "ulysses") if axis == "sp" else (axis,)
    fixed = [a for a in ("cfg", "ring", "ulysses", "tp") if a not in varying]
    groups = []
    for fixed_coords in itertools.product(*(range(sizes[a]) for a in fixed)):
        members = []
        for var_coords in itertools.product(*(range(sizes[a]) for a in varying)):
            coords = dict(zip(fixed, fixed_coords)) | dict(zip(varying, var_coords))
            members.append(config.rank_of(coords["cfg"], coords["ring"], coords["ulysses"], coords["tp"]))
        groups.append(tuple(members))
    return groups


def init_parallel_groups(config: ParallelConfig) -> ParallelGroups:
    """Create every group (collective over all ranks: call on every rank, in the same order).

    Needs `torch.distributed` initialised with `world_size == config.world_size`; a one-process
    config needs nothing and returns `ParallelGroups.single()`.
    """
    if not config.is_parallel:
        return ParallelGroups.single()
    if not dist.is_initialized():
        raise ValueError(
            f"parallel config {config} needs torch.distributed initialised with "
            f"world_size={config.world_size} (see init_distributed)"
        )
    config.validate_world_size(dist.get_world_size())
    rank = dist.get_rank()
    infos = {}
    for axis in ("tp", "ulysses", "ring", "sp", "cfg"):
        mine = GroupInfo.single(rank)
        for members in _member_ranks(config, axis):
            # NOTE(distributed): new_group is collective over the WORLD: every rank creates every group.
            group = dist.new_group(list(members)) if len(members) > 1 else None
            if rank in members:
                mine = GroupInfo(group, members.index(rank), members)
        infos[axis] = mine
    return ParallelGroups(config=config, rank=rank, **infos)


def find_free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for single-host rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_backend(device: torch.device | str) -> str:
    """'nccl' for CUDA devices, 'gloo' otherwise."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_distributed(rank: int, world_size: int, init_method: str, backend: str) -> None:
    """`init_process_group` for one single-host replica (no-op when already initialised)."""
    if dist.is_initialized():
        if dist.get_world_size() != world_size or dist.get_rank() != rank:
            raise ValueError(
                f"torch.distributed is already initialised as rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, asked for rank {rank} of {world_size}"
            )
        return
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)


def all_gather_rows(x: torch.Tensor, info: GroupInfo, counts: list[int]) -> torch.Tensor:
    """Concatenate every member's `x [counts[i], ...]` along dim 0, in group order, on every member.

    Row counts may differ (`counts` is known on every rank, so no size exchange is needed): each
    member pads to the largest count for one `all_gather`, and the padding is dropped.
    """
    if info.group is None:
        return x
    if x.shape[0] != counts[info.rank]:
        raise ValueError(f"rank {info.rank} holds {x.shape[0]} rows, the plan says {counts[info.rank]}")
    max_rows = max(counts)
    padded = x.new_zeros((max_rows, *x.shape[1:]))
    padded[: x.shape[0]] = x
    gathered = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(gathered, padded, group=info.group)
    return torch.cat([g[:n] for g, n in zip(gathered, counts)], dim=0)

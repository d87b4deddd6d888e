"""`ParallelConfig`: how many processes run one model replica, and how the work is split among them.

Torch-free, so `vllm_omni/config.py` and the CLI can import it without paying for torch.

    world_size = cfg_parallel_size * ring_degree * ulysses_degree * tensor_parallel_size

Ranks are laid out with tensor parallel innermost (adjacent ranks share a node's fastest links) and
CFG parallel outermost::

    rank = ((cfg_rank * ring_degree + ring_rank) * ulysses_degree + ulysses_rank) * tp_size + tp_rank

so global rank 0 computes the positive CFG sequences and the first rows / heads of everything.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelConfig:
    """Degrees of every parallel mode; their product is the number of processes (one per device)."""

    tensor_parallel_size: int = 1
    """Shards of every block's attention heads and MLP hidden units (all-reduce after the row-parallel
    linears)."""
    ulysses_degree: int = 1
    """Sequence-parallel shards of the packed rows; attention all-to-alls heads (DeepSpeed-Ulysses)."""
    ring_degree: int = 1
    """Sequence-parallel shards of the packed rows; attention passes K/V around a ring (exact online
    softmax)."""
    cfg_parallel_size: int = 1
    """1, or 2: positive CFG sequences on one half of the ranks, negative ones on the other."""

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "ulysses_degree", "ring_degree", "cfg_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.cfg_parallel_size not in (1, 2):
            raise ValueError(
                f"cfg_parallel_size must be 1 or 2 (positive and negative sequences), "
                f"got {self.cfg_parallel_size}"
            )

    @property
    def world_size(self) -> int:
        """Processes (devices) needed: the product of the four degrees."""
        return self.cfg_parallel_size * self.ring_degree * self.ulysses_degree * self.tensor_parallel_size

    @property
    def sequence_parallel_size(self) -> int:
        """Shards of the packed rows: ulysses_degree * ring_degree."""
        return self.ulysses_degree * self.ring_degree

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1

    def validate_model(self, num_attention_heads: int) -> None:
        """Raise ValueError unless the heads split evenly over tensor_parallel_size * ulysses_degree."""
        split = self.tensor_parallel_size * self.ulysses_degree
        if num_attention_heads % split != 0:
            raise ValueError(
                f"num_attention_heads ({num_attention_heads}) must be divisible by "
                f"tensor_parallel_size * ulysses_degree = {self.tensor_parallel_size} * "
                f"{self.ulysses_degree} = {split}; pick degrees whose product divides the heads"
            )

    def validate_world_size(self, world_size: int) -> None:
        """Raise ValueError unless `world_size` (processes / devices) equals the product of the degrees."""
        if world_size != self.world_size:
            raise ValueError(
                f"world size {world_size} must equal cfg_parallel_size * ring_degree * ulysses_degree * "
                f"tensor_parallel_size = {self.cfg_parallel_size} * {self.ring_degree} * "
                f"{self.ulysses_degree} * {self.tensor_parallel_size} = {self.world_size}"
            )

    def coords(self, rank: int) -> tuple[int, int, int, int]:
        """(cfg_rank, ring_rank, ulysses_rank, tp_rank) of global `rank`."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")
        tp_rank = rank % self.tensor_parallel_size
        rest = rank // self.tensor_parallel_size
        ulysses_rank = rest % self.ulysses_degree
        rest //= self.ulysses_degree
        return rest // self.ring_degree, rest % self.ring_degree, ulysses_rank, tp_rank

    def rank_of(self, cfg_rank: int, ring_rank: int, ulysses_rank: int, tp_rank: int) -> int:
        """Global rank of the given coordinates (inverse of `coords`)."""
        rank = cfg_rank * self.ring_degree + ring_rank
        rank = rank * self.ulysses_degree + ulysses_rank
        return rank * self.tensor_parallel_size + tp_rank

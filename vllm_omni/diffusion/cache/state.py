"""A request's cache branches: one per packed sequence (per image: positive, then negative with CFG)."""

from __future__ import annotations

from vllm_omni.diffusion.cache.config import CacheConfig, DBCacheParams, TeaCacheParams
from vllm_omni.diffusion.cache.dbcache import DBCacheBranch
from vllm_omni.diffusion.cache.step import Branch
from vllm_omni.diffusion.cache.teacache import TeaCacheBranch


def make_branches(
    config: CacheConfig, num_seqs: int, num_blocks: int, tea_cache_coefficients: tuple[float, ...] | None
) -> list[Branch] | None:
    """Fresh decision states for a request's `num_seqs` sequences, or None when it runs uncached.

    Raises CacheConfigError when the setting does not fit the model (Fn + Bn > its blocks)."""
    params = config.params
    if not config.is_enabled:
        return None
    params.check_model(num_blocks)
    if isinstance(params, DBCacheParams):
        return [DBCacheBranch(params) for _ in range(num_seqs)]
    if isinstance(params, TeaCacheParams):
        if tea_cache_coefficients is None:
            raise ValueError("tea_cache needs the model's rescaling coefficients; this model has none")
        return [TeaCacheBranch(params, tuple(tea_cache_coefficients)) for _ in range(num_seqs)]
    raise TypeError(f"no cache branch for {type(params).__name__}")


def num_cached_steps(branches: list[Branch] | None) -> list[int] | None:
    """Cached steps of every branch so far (sequence order), or None when uncached."""
    return None if branches is None else [b.num_cached_steps for b in branches]


def cache_summary(req_id: str, branches: list[Branch], num_steps: int) -> str:
    """One log line on a finished request's caching (`--enable-cache-dit-summary`)."""
    parts = []
    for i, branch in enumerate(branches):
        where = f" at steps {branch.cached_steps}" if branch.cached_steps else ""
        parts.append(f"branch {i}: {branch.num_cached_steps}/{num_steps} cached{where}")
    return f"cache summary {req_id}: " + "; ".join(parts)


def cache_rate(state) -> float | None:
    """The share of a request's sequence-steps so far that reused their residual (`state`: its
    `DiffusionRequestState`); None when it runs uncached."""
    branches = state.cache_branches
    if branches is None or state.step_index == 0:
        return None
    return sum(b.num_cached_steps for b in branches) / (len(branches) * state.step_index)

"""What step caching saves, as the scheduler's cost model sees it: the share of a full step's block
work each step of a request does."""

from __future__ import annotations

from vllm_omni.diffusion.cache.config import CacheConfig, DBCacheParams, TeaCacheParams


def static_step_work(cache: CacheConfig, num_steps: int, num_blocks: int) -> tuple[float, ...] | None:
    """Per step, the share of a full step's blocks the request runs: 1 where it computes and
    (Fn + Bn) / num_blocks on the cached steps of a static `steps_computation_mask` (exact: the mask
    decides before the step runs). None when every step counts as a full one: uncached, or decided
    on the device (dynamic DBCache, TeaCache), whose cached steps are not known ahead."""
    params = cache.params
    if not cache.is_enabled or not isinstance(params, DBCacheParams) or num_blocks <= 0:
        return None
    mask = params.steps_computation_mask
    if mask is None or params.steps_computation_policy != "static":
        return None
    # warmup steps lie inside the mask's leading 1s (cache-dit truncates them there): computed anyway
    cached = min(1.0, (params.Fn_compute_blocks + params.Bn_compute_blocks) / num_blocks)
    return tuple(1.0 if step >= len(mask) or mask[step] == 1 else cached for step in range(num_steps))


def dynamic_cached_share(cache: CacheConfig, num_blocks: int) -> float | None:
    """The share of a full step's blocks a cached step runs when the device decides (dynamic DBCache:
    (Fn + Bn) / num_blocks; TeaCache: 0, every block is skipped); None when the steps are known ahead
    (a static mask: `static_step_work`) or the request runs uncached."""
    params = cache.params
    if not cache.is_enabled or num_blocks <= 0:
        return None
    if isinstance(params, TeaCacheParams):
        return 0.0
    if params.steps_computation_mask is not None and params.steps_computation_policy == "static":
        return None
    return min(1.0, (params.Fn_compute_blocks + params.Bn_compute_blocks) / num_blocks)


def expected_step_work(cached_share: float, cache_rate: float) -> float:
    """A step's expected share of a full step's work when a fraction `cache_rate` of the request's
    sequence-steps so far were cached (the online estimate for dynamic decisions)."""
    return 1.0 - cache_rate * (1.0 - cached_share)

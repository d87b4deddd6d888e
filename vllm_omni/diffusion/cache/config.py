"""Step-caching settings: the backend and its knobs, under the backend's own key names.

    server / offline     CacheConfig.from_user("cache_dit", {"Fn_compute_blocks": 8, ...})
    per request          config.for_request(extra_args)   ("cache_backend": "none" opts out,
                                                            "cache_config": {...} overrides keys)

`cache_dit` is cache-dit's DBCache (`cache_dit.DBCacheConfig`'s names and defaults); `tea_cache` is
TeaCache (`rel_l1_thresh`, vLLM-Omni's name and default). Pure Python: the engine's request check
(`inputs.py`) imports it without torch.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

CACHE_BACKENDS = ("none", "cache_dit", "tea_cache")
"""Backends this engine runs (`--cache-backend`, `Omni(cache_backend=...)`)."""
UNSUPPORTED_BACKENDS = ("mag_cache", "sea_cache", "step_cache")
"""vLLM-Omni backends refused with a message naming the supported ones."""


class CacheConfigError(ValueError):
    """A cache setting refused; `key` names it (`cache_backend`, or a key of the backend's config)."""

    def __init__(self, message: str, key: str):
        super().__init__(message)
        self.key = key


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _check_int(key: str, value: Any, low: int) -> None:
    if not _is_int(value) or value < low:
        raise CacheConfigError(f"{key} must be an integer >= {low}, got {value!r}", key)


def _check_number(key: str, value: Any, low: float) -> None:
    if not _is_number(value) or value < low:
        raise CacheConfigError(f"{key} must be a number >= {low}, got {value!r}", key)


@dataclass(frozen=True)
class DBCacheParams:
    """cache-dit's DBCache knobs (`cache_dit.DBCacheConfig`: same names, defaults and meaning).

    Per sequence (a CFG branch is one): after the first `Fn_compute_blocks` blocks, the relative L1
    distance between this step's and the last computed step's Fn residual decides whether the middle
    blocks run or their last residual is reused; the last `Bn_compute_blocks` blocks always run."""

    Fn_compute_blocks: int = 8
    """Blocks that always run first (>= 1); their output residual drives the decision."""
    Bn_compute_blocks: int = 0
    """Blocks that always run last (>= 0)."""
    residual_diff_threshold: float = 0.08
    """Cache when the Fn residual's relative L1 change is below this (<= 0: never; >= 1: always)."""
    max_warmup_steps: int = 8
    """Steps 0, warmup_interval, ... below this always compute."""
    warmup_interval: int = 1
    max_cached_steps: int = -1
    """Most cached steps per branch (-1: no limit)."""
    max_continuous_cached_steps: int = -1
    """Most cached steps in a row per branch (-1: no limit)."""
    max_accumulated_residual_diff_threshold: float | None = None
    """Stop caching once the branch's measured diffs add up to this (None: no limit)."""
    steps_computation_mask: tuple[int, ...] | None = None
    """One 0/1 per step: 1 computes; 0 caches (policy 'static') or decides ('dynamic')."""
    steps_computation_policy: str = "dynamic"

    def __post_init__(self) -> None:
        _check_int("Fn_compute_blocks", self.Fn_compute_blocks, 1)
        _check_int("Bn_compute_blocks", self.Bn_compute_blocks, 0)
        if not _is_number(self.residual_diff_threshold):
            raise CacheConfigError(
                f"residual_diff_threshold must be a number, got {self.residual_diff_threshold!r}",
                "residual_diff_threshold",
            )
        _check_int("max_warmup_steps", self.max_warmup_steps, 0)
        _check_int("warmup_interval", self.warmup_interval, 1)
        _check_int("max_cached_steps", self.max_cached_steps, -1)
        _check_int("max_continuous_cached_steps", self.max_continuous_cached_steps, -1)
        if self.max_accumulated_residual_diff_threshold is not None:
            _check_number(
                "max_accumulated_residual_diff_threshold", self.max_accumulated_residual_diff_threshold, 0.0
            )
        if self.steps_computation_policy not in ("dynamic", "static"):
            raise CacheConfigError(
                f"steps_computation_policy must be 'dynamic' or 'static', got "
                f"{self.steps_computation_policy!r}",
                "steps_computation_policy",
            )
        mask = self.steps_computation_mask
        if mask is not None:
            if not isinstance(mask, (list, tuple)) or not mask or any(m not in (0, 1) for m in mask):
                raise CacheConfigError(
                    f"steps_computation_mask must be a non-empty list of 0/1 (one per step), got {mask!r}",
                    "steps_computation_mask",
                )
            if mask[0] != 1:
                raise CacheConfigError(
                    "steps_computation_mask must start with 1: the first step has no residual to reuse",
                    "steps_computation_mask",
                )
            object.__setattr__(self, "steps_computation_mask", tuple(int(m) for m in mask))

    def check_model(self, num_blocks: int) -> None:
        """CacheConfigError when Fn + Bn do not fit a transformer of `num_blocks` blocks."""
        if self.Fn_compute_blocks + self.Bn_compute_blocks > num_blocks:
            raise CacheConfigError(
                f"Fn_compute_blocks + Bn_compute_blocks = {self.Fn_compute_blocks} + "
                f"{self.Bn_compute_blocks} exceeds the model's {num_blocks} transformer blocks",
                "Fn_compute_blocks",
            )

    def check_steps(self, num_inference_steps: int) -> None:
        """CacheConfigError when the mask does not give one entry per step of this request."""
        mask = self.steps_computation_mask
        if mask is not None and len(mask) != num_inference_steps:
            raise CacheConfigError(
                f"steps_computation_mask has {len(mask)} entries; the request has "
                f"num_inference_steps={num_inference_steps} (one entry per step)",
                "steps_computation_mask",
            )

    def expected_compute_fraction(self, num_steps: int) -> float | None:
        """Share of steps whose middle blocks run: exact for a static mask, else None (unknown)."""
        mask = self.steps_computation_mask
        if mask is None or self.steps_computation_policy != "static":
            return None
        return sum(mask[:num_steps]) / max(1, min(num_steps, len(mask)))


@dataclass(frozen=True)
class TeaCacheParams:
    """TeaCache: skip every block when the first block's modulated input changed little (vLLM-Omni's
    `rel_l1_thresh`, default 0.2); the polynomial that rescales the change is the model family's."""

    rel_l1_thresh: float = 0.2
    """Recompute once the rescaled relative L1 changes since the last computed step add up to this."""

    def __post_init__(self) -> None:
        if not _is_number(self.rel_l1_thresh) or self.rel_l1_thresh <= 0:
            raise CacheConfigError(
                f"rel_l1_thresh must be a number > 0, got {self.rel_l1_thresh!r}", "rel_l1_thresh"
            )

    def check_model(self, num_blocks: int) -> None:
        """Any block count works."""

    def check_steps(self, num_inference_steps: int) -> None:
        """Any step count works."""

    def expected_compute_fraction(self, num_steps: int) -> float | None:
        return None


_PARAMS = {"cache_dit": DBCacheParams, "tea_cache": TeaCacheParams}


def _build_params(backend: str, values: dict[str, Any], base=None):
    """The backend's params from `base` (or its defaults) with `values` applied, keys checked."""
    cls = _PARAMS[backend]
    known = [f.name for f in dataclasses.fields(cls)]
    if not isinstance(values, dict):
        raise CacheConfigError(f"the cache config must be a JSON object, got {values!r}", "cache_config")
    for key in values:
        if key not in known:
            raise CacheConfigError(
                f"unknown {backend} cache config key {key!r}; accepted keys: {known}", str(key)
            )
    base = cls() if base is None else base
    values = dict(values)
    if isinstance(values.get("steps_computation_mask"), list):
        values["steps_computation_mask"] = tuple(values["steps_computation_mask"])
    try:
        return dataclasses.replace(base, **values)
    except TypeError as exc:  # a wrongly typed value the checks above could not name
        raise CacheConfigError(f"bad {backend} cache config: {exc}", "cache_config") from exc


@dataclass(frozen=True)
class CacheConfig:
    """The server's (or one request's resolved) step-caching setting."""

    backend: str = "none"
    """'none', 'cache_dit' or 'tea_cache'."""
    params: DBCacheParams | TeaCacheParams | None = None
    """The backend's knobs (None for 'none')."""
    enable_summary: bool = False
    """Log one line per finished request with its cached steps per branch (`--enable-cache-dit-summary`)."""

    @property
    def is_enabled(self) -> bool:
        return self.backend != "none"

    @classmethod
    def from_user(
        cls, backend: str | None, config: dict[str, Any] | None = None, enable_summary: bool = False
    ) -> CacheConfig:
        """From `--cache-backend` / `--cache-config` (or `Omni(cache_backend=, cache_config=)`);
        CacheConfigError naming the refused backend or key."""
        backend = "none" if backend in (None, "None") else backend
        if backend in UNSUPPORTED_BACKENDS:
            raise CacheConfigError(
                f"cache_backend {backend!r} is not supported; supported: {list(CACHE_BACKENDS)}",
                "cache_backend",
            )
        if backend not in CACHE_BACKENDS:
            raise CacheConfigError(
                f"cache_backend {backend!r} is unknown; supported: {list(CACHE_BACKENDS)}", "cache_backend"
            )
        if backend == "none":
            if config:
                raise CacheConfigError(
                    "cache_config was given without a cache backend: set the cache backend "
                    f"to one of {list(CACHE_BACKENDS[1:])}",
                    "cache_config",
                )
            return cls(enable_summary=enable_summary)
        return cls(backend, _build_params(backend, config or {}), enable_summary)

    def for_request(self, backend: Any = None, overrides: Any = None, num_steps: int | None = None):
        """One request's setting: `backend` ('none' opts out; None or the server's keeps it) and
        `overrides` (keys of the server's backend config). CacheConfigError naming the field."""
        if backend is not None and backend not in ("none", self.backend):
            raise CacheConfigError(
                f"cache_backend {backend!r} differs from this server's {self.backend!r}; send "
                f"{self.backend!r} or 'none'",
                "cache_backend",
            )
        if backend == "none" or not self.is_enabled:
            if overrides:
                raise CacheConfigError(
                    "cache_config needs step caching on; this request runs without it "
                    f"(server backend {self.backend!r}, request cache_backend {backend!r})",
                    "cache_config",
                )
            return CacheConfig(enable_summary=self.enable_summary)
        params = self.params if not overrides else _build_params(self.backend, overrides, self.params)
        if num_steps is not None:
            params.check_steps(num_steps)
        return dataclasses.replace(self, params=params)

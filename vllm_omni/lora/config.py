"""`LoRAConfig`: which adapters the server registers at start-up, the limits, and runtime loading."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_omni.schedule_overrides import SCHEDULE_FIELDS, ScheduleArgError, ScheduleOverrides

DEFAULT_MAX_LORAS = 8
DEFAULT_MAX_LORA_RANK = 64
MAX_LORA_RANK_LIMIT = 1024


ADAPTER_DEFAULT_FIELDS = ("num_inference_steps", "true_cfg_scale", *SCHEDULE_FIELDS)
"""Sampling params an adapter's `default_sampling_params` may set (the schedule ones go to
`extra_args`, where a request sets them too)."""


@dataclass(frozen=True)
class AdapterDefaults:
    """What a request naming the adapter gets unless it gives the field itself (a distilled adapter such
    as Qwen-Image-Lightning needs its own step count, CFG off and its schedule)."""

    num_inference_steps: int | None = None
    true_cfg_scale: float | None = None
    schedule: ScheduleOverrides = field(default_factory=ScheduleOverrides)

    @classmethod
    def parse(cls, values: Any, where: str) -> AdapterDefaults:
        """A JSON object of `ADAPTER_DEFAULT_FIELDS`; ValueError naming `where` and the field."""
        if not isinstance(values, dict):
            raise ValueError(f"{where} must be a JSON object, got {values!r}")
        unknown = sorted(set(values) - set(ADAPTER_DEFAULT_FIELDS))
        if unknown:
            raise ValueError(f"{where}: unknown keys {unknown}; accepted: {list(ADAPTER_DEFAULT_FIELDS)}")
        steps, scale = values.get("num_inference_steps"), values.get("true_cfg_scale")
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
            raise ValueError(f"{where}.num_inference_steps must be a positive integer, got {steps!r}")
        if scale is not None and (
            isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale < 0
        ):
            raise ValueError(f"{where}.true_cfg_scale must be a number >= 0, got {scale!r}")
        try:
            schedule = ScheduleOverrides.from_mapping(values)
        except ScheduleArgError as exc:
            raise ValueError(f"{where}.{exc}") from None
        return cls(steps, None if scale is None else float(scale), schedule)

    def as_sampling_params(self) -> dict[str, Any]:
        """`OmniDiffusionSamplingParams` fields: the given ones, the schedule under `extra_args`."""
        params: dict[str, Any] = {}
        if self.num_inference_steps is not None:
            params["num_inference_steps"] = self.num_inference_steps
        if self.true_cfg_scale is not None:
            params["true_cfg_scale"] = self.true_cfg_scale
        if not self.schedule.is_empty:
            params["extra_args"] = self.schedule.as_config()
        return params


@dataclass(frozen=True)
class LoRAModulePath:
    """One `--lora-modules` entry (vLLM's name): an adapter name and its PATH."""

    name: str
    path: str
    base_model_name: str | None = None
    """vLLM's optional JSON key: the `parent` shown in `/v1/models` (default: the served model)."""
    default_sampling_params: AdapterDefaults | None = None
    """The JSON form's optional `default_sampling_params`: a request naming the adapter gets them
    unless it gives the field itself."""

    @classmethod
    def parse(cls, text: str) -> LoRAModulePath:
        """`NAME=PATH` or vLLM's JSON form `{"name": ..., "path": ...}`; ValueError naming the flag."""
        text = text.strip()
        defaults = None
        if text.startswith("{"):
            try:
                entry = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--lora-modules: invalid JSON {text!r} ({exc.msg})") from exc
            keys = {"name", "path", "base_model_name", "default_sampling_params"}
            if not isinstance(entry, dict) or set(entry) - keys:
                raise ValueError(
                    f'--lora-modules: JSON entries are {{"name": ..., "path": ...}} (optional '
                    f'"base_model_name", "default_sampling_params"), got {text!r}'
                )
            name, path, base = entry.get("name"), entry.get("path"), entry.get("base_model_name")
            if entry.get("default_sampling_params") is not None:
                defaults = AdapterDefaults.parse(
                    entry["default_sampling_params"], "--lora-modules: default_sampling_params"
                )
            if base is not None and (not isinstance(base, str) or not base.strip()):
                raise ValueError(f"--lora-modules: base_model_name must be a non-empty string, got {text!r}")
        else:
            base = None
            name, sep, path = text.partition("=")
            if not sep:
                raise ValueError(f"--lora-modules: expected NAME=PATH or JSON, got {text!r}")
        if not isinstance(name, str) or not name.strip() or not isinstance(path, str) or not path.strip():
            raise ValueError(f"--lora-modules: name and path must be non-empty strings, got {text!r}")
        return cls(name.strip(), path.strip(), base.strip() if base else None, defaults)


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA serving options (`--lora-modules`, `--max-loras`, `--max-lora-rank`, `--lora-runtime-dir`)."""

    lora_modules: tuple[LoRAModulePath, ...] = ()
    """Adapters registered at start-up; their paths are the operator's and are not confined."""
    max_loras: int = DEFAULT_MAX_LORAS
    """Most adapters loaded at once (any number of them may share one step)."""
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK
    """Largest rank an adapter may have on any module."""
    runtime_dir: str | None = None
    """Enables `/v1/load_lora_adapter`, `/v1/unload_lora_adapter` and a request's `lora.path`, for
    paths inside this directory only (None: runtime loading is off)."""
    enabled: bool = field(default=False)
    """Set True to build the LoRA machinery with no adapter yet (runtime loading, tests)."""

    def __post_init__(self) -> None:
        for name, value, low, high in (
            ("max_loras", self.max_loras, 1, 1 << 16),
            ("max_lora_rank", self.max_lora_rank, 1, MAX_LORA_RANK_LIMIT),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ValueError(
                    f"--{name.replace('_', '-')} must be an integer in [{low}, {high}], got {value!r}"
                )
        names = [m.name for m in self.lora_modules]
        if len(set(names)) != len(names):
            raise ValueError(f"--lora-modules: adapter names must be unique, got {names}")
        if len(names) > self.max_loras:
            raise ValueError(f"--lora-modules lists {len(names)} adapters > --max-loras {self.max_loras}")
        # '' would be the current directory (Path('').is_dir() is True): refuse it
        runtime_dir = self.runtime_dir
        if runtime_dir is not None and (not runtime_dir.strip() or not Path(runtime_dir).is_dir()):
            raise ValueError(f"--lora-runtime-dir {runtime_dir!r} is not a directory")

    @property
    def adapter_defaults(self) -> dict[str, dict[str, Any]]:
        """Adapter name -> the sampling params its `default_sampling_params` set (registered adapters
        that have them)."""
        return {
            m.name: m.default_sampling_params.as_sampling_params()
            for m in self.lora_modules
            if m.default_sampling_params is not None
        }

    @property
    def is_enabled(self) -> bool:
        """Whether the engine builds a `LoRAManager` at all."""
        return self.enabled or bool(self.lora_modules) or self.runtime_dir is not None


def with_adapter_defaults(
    defaults: Mapping[str, Any], lora_request: Any, adapter_defaults: dict[str, dict] | None
) -> dict[str, Any]:
    """`defaults` with the named adapter's sampling defaults on top (`extra_args` merged key by key)."""
    name = getattr(lora_request, "lora_name", None)  # a LoRARequest; anything else is refused later
    adapter = (adapter_defaults or {}).get(name) if name is not None else None
    if not adapter:
        return dict(defaults)
    extra_args = {**defaults.get("extra_args", {}), **adapter.get("extra_args", {})}
    return {**defaults, **adapter, "extra_args": extra_args}


def resolve_runtime_path(runtime_dir: str | None, path: str, field_name: str) -> Path:
    """`path` (absolute, or relative to `runtime_dir`) resolved, if it lies inside `runtime_dir`.

    Symlinks are resolved before the check, so a link pointing outside is refused like `..`.
    ValueError naming `field_name` otherwise (runtime loading off, outside, or missing).
    """
    if runtime_dir is None:
        raise ValueError(
            f"{field_name}: loading adapters from a path is disabled on this server "
            "(start it with --lora-runtime-dir DIR); name a registered adapter instead"
        )
    if not isinstance(path, str) or not path or "\x00" in path:
        raise ValueError(f"{field_name} must be a non-empty path string")
    shown = f"{path[:80]!r}" + (f" ({len(path)} characters)" if len(path) > 80 else "")
    root = Path(runtime_dir).resolve()
    candidate = Path(path)
    try:
        resolved = (candidate if candidate.is_absolute() else root / candidate).resolve()
        if not resolved.is_relative_to(root):
            raise ValueError(f"{field_name} must lie inside the server's LoRA directory; {shown} does not")
        exists = resolved.exists()
    except OSError as exc:  # e.g. a name over the filesystem's 255-byte limit (ENAMETOOLONG), a loop
        raise ValueError(f"{field_name} {shown} is not a usable path: {exc.strerror or exc}") from None
    if not exists:
        raise ValueError(f"{field_name} {shown} does not exist in the server's LoRA directory")
    return resolved

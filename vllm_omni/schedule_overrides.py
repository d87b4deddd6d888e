"""A request's own flow-match schedule settings: the `FlowMatchEulerDiscreteScheduler` config fields a
request may override through `extra_args` (the Qwen-Image-Lightning recipe and others change them).

    extra_args = {"base_shift": math.log(3), "max_shift": math.log(3), "shift_terminal": 0}

gives the schedule of diffusers' pipeline built with
`FlowMatchEulerDiscreteScheduler.from_config(checkpoint_config, base_shift=..., max_shift=...,
shift_terminal=None)`: the dynamic shift `mu` (read from the overridden `base_shift` / `max_shift`, as
diffusers' pipelines read it from their scheduler's config), the time shift and the terminal stretch.
A schedule is per request, so requests with different schedules still share packed steps.

`shift_terminal`: 0 and None both turn the stretch off (diffusers tests it for truth). Over HTTP a JSON
null means "the default" (the checkpoint's value), so send 0 to turn it off. Torch-free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

MAX_ABS_SHIFT = 10.0
"""`base_shift` / `max_shift` are `mu` endpoints (the exponential time shift is `exp(mu)`); beyond
+-10 every sigma is ~0 or ~1."""
MIN_SHIFT, MAX_SHIFT = 1e-3, 100.0
"""Static `shift` range (the same as `flow_shift`'s)."""
TIME_SHIFT_TYPES = ("exponential", "linear")
"""diffusers' `time_shift_type` values."""


class ScheduleArgError(ValueError):
    """An invalid schedule field; `key` names it (`extra_args.<key>` at the edge)."""

    def __init__(self, message: str, key: str):
        super().__init__(message)
        self.key = key


@dataclass(frozen=True)
class ScheduleOverrides:
    """Scheduler config fields one request overrides (None: the checkpoint's value)."""

    shift: float | None = None
    """Static shift (used when `use_dynamic_shifting` is off)."""
    base_shift: float | None = None
    """`mu` at `base_image_seq_len` image tokens."""
    max_shift: float | None = None
    """`mu` at `max_image_seq_len` image tokens."""
    use_dynamic_shifting: bool | None = None
    """Resolution-dependent `mu` (Qwen-Image's default) or the static `shift`."""
    shift_terminal: float | None = None
    """The last sigma before 0 is stretched to this; 0.0 = no stretch (diffusers' `None`)."""
    time_shift_type: str | None = None
    """"exponential" (Qwen-Image) or "linear"."""

    @property
    def is_empty(self) -> bool:
        return not self.as_config()

    def as_config(self) -> dict[str, Any]:
        """The overridden fields, as `FlowMatchEulerDiscreteScheduler.from_config` keyword arguments."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    @classmethod
    def from_mapping(cls, values: dict[str, Any]) -> ScheduleOverrides:
        """The schedule fields of `values` (other keys ignored), each checked: `ScheduleArgError` naming
        the field and its limit. A `shift_terminal` of None is kept as 0.0 (no stretch)."""
        found: dict[str, Any] = {}
        for name in ("shift", "base_shift", "max_shift", "shift_terminal"):
            if name not in values:
                continue
            value = values[name]
            if name == "shift_terminal" and value is None:
                found[name] = 0.0
                continue
            low, high = {
                "shift": (MIN_SHIFT, MAX_SHIFT),
                "shift_terminal": (0.0, 1.0),
            }.get(name, (-MAX_ABS_SHIFT, MAX_ABS_SHIFT))
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ScheduleArgError(f"{name} must be a finite number, got {value!r}", name)
            closed_top = name != "shift_terminal"  # a terminal sigma of 1 divides by zero in the stretch
            if not (low <= value <= high if closed_top else low <= value < high):
                bracket = "]" if closed_top else ")"
                raise ScheduleArgError(f"{name} must be in [{low}, {high}{bracket}, got {value}", name)
            found[name] = float(value)
        if "use_dynamic_shifting" in values:
            value = values["use_dynamic_shifting"]
            if not isinstance(value, bool):
                raise ScheduleArgError(
                    f"use_dynamic_shifting must be a bool, got {value!r}", "use_dynamic_shifting"
                )
            found["use_dynamic_shifting"] = value
        if "time_shift_type" in values:
            value = values["time_shift_type"]
            if value not in TIME_SHIFT_TYPES:
                raise ScheduleArgError(
                    f"time_shift_type must be one of {list(TIME_SHIFT_TYPES)}, got {value!r}",
                    "time_shift_type",
                )
            found["time_shift_type"] = value
        return cls(**found)


SCHEDULE_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(ScheduleOverrides))
"""The `extra_args` keys (and adapter `default_sampling_params` keys) that set a request's schedule."""

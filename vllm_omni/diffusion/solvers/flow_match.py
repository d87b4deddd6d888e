"""Flow-match Euler solver, per request and batched.

The sigma schedule is computed with diffusers' `FlowMatchEulerDiscreteScheduler`
(its `set_timesteps` with Qwen-Image's resolution-dependent `mu`), so every
constant comes from the checkpoint's `scheduler_config.json` exactly as diffusers
reads it. The solver *state* (sigmas, step index) belongs to each request; the
update itself is a pure function.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch

from vllm_omni.schedule_overrides import ScheduleOverrides


def calculate_shift(
    image_seq_len: int, base_seq_len: int, max_seq_len: int, base_shift: float, max_shift: float
) -> float:
    """Qwen-Image's dynamic shift `mu`: linear in the number of image tokens."""
    slope = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return image_seq_len * slope + (base_shift - slope * base_seq_len)


@dataclass
class SigmaSchedule:
    """One request's schedule: `sigmas` [N + 1] (last is 0) and `timesteps` [N] = sigmas[:N] * 1000."""

    sigmas: torch.Tensor
    timesteps: torch.Tensor

    @property
    def num_steps(self) -> int:
        return int(self.timesteps.numel())


class FlowMatchSchedule:
    """Builds per-request sigma schedules from a scheduler config (thread-safe)."""

    def __init__(self, scheduler_config: dict):
        from diffusers import FlowMatchEulerDiscreteScheduler

        self._config = dict(scheduler_config)
        self._scheduler = FlowMatchEulerDiscreteScheduler.from_config(self._config)
        self._static_shift: dict[float, FlowMatchEulerDiscreteScheduler] = {}
        """flow_shift -> the scheduler built with `shift=flow_shift, use_dynamic_shifting=False`."""
        self._lock = threading.Lock()

    def mu_for(self, image_seq_len: int, overrides: ScheduleOverrides | None = None) -> float:
        """diffusers' pipelines' `mu`, from the scheduler config (with a request's overrides)."""
        cfg = {**self._config, **overrides.as_config()} if overrides is not None else self._config
        return calculate_shift(
            image_seq_len,
            cfg.get("base_image_seq_len", 256),
            cfg.get("max_image_seq_len", 4096),
            cfg.get("base_shift", 0.5),
            cfg.get("max_shift", 1.15),
        )

    def _scheduler_for(self, flow_shift: float | None, overrides: ScheduleOverrides | None = None):
        """The dynamic (Qwen-Image) scheduler, or a static-shift one (vLLM-Omni's `flow_shift`); with a
        request's `overrides`, diffusers' scheduler built from the config with them (and `flow_shift`).
        The overridden one is built per call, not kept: clients choose its values."""
        if overrides is not None and not overrides.is_empty:
            from diffusers import FlowMatchEulerDiscreteScheduler

            static = {} if flow_shift is None else {"shift": flow_shift, "use_dynamic_shifting": False}
            return FlowMatchEulerDiscreteScheduler.from_config(
                self._config, **{**overrides.as_config(), **static}
            )
        if flow_shift is None:
            return self._scheduler
        if flow_shift not in self._static_shift:
            from diffusers import FlowMatchEulerDiscreteScheduler

            self._static_shift[flow_shift] = FlowMatchEulerDiscreteScheduler.from_config(
                self._config, shift=flow_shift, use_dynamic_shifting=False
            )
        return self._static_shift[flow_shift]

    def build(
        self,
        num_inference_steps: int,
        image_seq_len: int,
        flow_shift: float | None = None,
        sigmas: list[float] | None = None,
        timesteps: list[float] | None = None,
        overrides: ScheduleOverrides | None = None,
    ) -> SigmaSchedule:
        """The schedule diffusers' QwenImagePipeline uses for this step count and image size.

        With `flow_shift`, the pipeline's scheduler is diffusers' scheduler built with
        `shift=flow_shift, use_dynamic_shifting=False` (the image size then plays no part).
        `sigmas` replace the default `linspace(1, 1/N, N)` (and still go through the shift, Qwen-Image's
        `mu` included, and the `shift_terminal` stretch, as `QwenImagePipeline.__call__(sigmas=...)`).
        `timesteps` are used as given, with sigmas `timesteps / 1000` through the same shift: what
        diffusers' `set_timesteps(timesteps=...)` computes (without its per-call warning).
        `overrides`: the request's scheduler config fields (`FlowMatchEulerDiscreteScheduler.from_config(
        config, **overrides)`, `mu` from the overridden `base_shift` / `max_shift`).
        """
        if timesteps is not None:
            given = np.asarray(timesteps, dtype=np.float32)
            base = given / self._config.get("num_train_timesteps", 1000)
        elif sigmas is not None:
            given, base = None, sigmas
        else:
            given, base = None, np.linspace(1.0, 1 / num_inference_steps, num_inference_steps)
        with self._lock:
            scheduler = self._scheduler_for(flow_shift, overrides)
            with np.errstate(divide="ignore", invalid="ignore"):  # a degenerate one: `schedule_problem`
                scheduler.set_timesteps(sigmas=base, mu=self.mu_for(image_seq_len, overrides))
            schedule = SigmaSchedule(
                sigmas=scheduler.sigmas.detach().clone().float().cpu(),
                timesteps=scheduler.timesteps.detach().clone().float().cpu(),
            )
        if given is not None:
            schedule.timesteps = torch.from_numpy(given)
        return schedule


def schedule_problem(schedule: SigmaSchedule) -> str | None:
    """Why `schedule` cannot give an image (None when it can): a NaN / Inf sigma or timestep.

    Qwen-Image's scheduler stretches the shifted sigmas so the last one is `shift_terminal`, dividing
    by `1 - last sigma`: a schedule whose last sigma is 1 (`num_inference_steps=1`, or sigmas=[1.0])
    becomes NaN there, and diffusers' pipeline then returns a black image.
    """
    for name, values in (("sigmas", schedule.sigmas), ("timesteps", schedule.timesteps)):
        if not bool(torch.isfinite(values).all()):
            return f"the scheduler turns it into non-finite {name} ({values.tolist()!s:.120})"
    return None


def flow_match_euler_step(
    latents: torch.Tensor, velocity: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor
) -> torch.Tensor:
    """One Euler step `x + (sigma_next - sigma) * v`, in fp32, returned in `velocity`'s dtype.

    latents, velocity: [n, S, C]; sigma, sigma_next: 0-d or [n] fp32 (one per row, so rows of
    different requests, at different steps of different schedules, can share one call).
    """
    dt = (sigma_next - sigma).to(torch.float32)
    if dt.dim() == 1:
        dt = dt.view(-1, *([1] * (velocity.dim() - 1)))
    return (latents.to(torch.float32) + dt * velocity.to(torch.float32)).to(velocity.dtype)

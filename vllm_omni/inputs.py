"""Per-request sampling parameters for diffusion generation.

`OmniDiffusionSamplingParams` follows vLLM-Omni's public name and fields. It is
validated once, at the edge (offline `Omni.generate` or the HTTP server), with
errors that name the field and the limit, so nothing deeper has to re-check.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

from vllm_omni.diffusion.cache.config import CacheConfig, CacheConfigError
from vllm_omni.lora.request import LoRARequest
from vllm_omni.schedule_overrides import SCHEDULE_FIELDS, ScheduleArgError, ScheduleOverrides

# NOTE: these are diffusers' QwenImagePipeline limits.
MAX_SEQUENCE_LENGTH_LIMIT = 1024
"""Hard cap on prompt tokens (diffusers' `tokenizer_max_length`)."""

PIXELS_PER_TOKEN_SIDE = 16
"""Image sides are multiples of this (VAE 8x downsampling times the 2x2 patch); other sizes are rounded
down at admission, as diffusers' pipelines do (`snap_to_latent_grid`)."""

MAX_NUM_OUTPUTS_PER_PROMPT = 10
MAX_INFERENCE_STEPS = 1000
MAX_CFG_SCALE = 100.0
MAX_SEED = 2**63 - 1
MIN_FLOW_SHIFT = 1e-3
"""Smallest static sigma shift: below it the shifted schedule collapses to sigma ~ 0 after step one."""
MAX_FLOW_SHIFT = 100.0
MAX_PRIORITY = 2**31 - 1
MAX_PARTIAL_IMAGES = 3
"""OpenAI's limit on `partial_images` (previews streamed before the final image)."""
"""`priority` is in [-MAX_PRIORITY, MAX_PRIORITY] (a 32-bit int, as vLLM's)."""

OUTPUT_TYPES = ("pil", "np", "latent")

KNOWN_EXTRA_ARGS: dict[str, type | tuple[type, ...]] = {
    "enable_mixfusion": bool,
    "mixfusion_min_chunk_tokens": int,
    "mixfusion_max_chunks": int,
    "shift": float,
    "base_shift": float,
    "max_shift": float,
    "use_dynamic_shifting": bool,
    "shift_terminal": float,
    "time_shift_type": str,
    "cache_backend": str,
    "cache_config": dict,
}
"""Per-request toggles accepted in `extra_args`, with their types.

`enable_mixfusion` overrides the server default for heterogeneous (mixed shape)
batching; the two `mixfusion_*` knobs override the server's plan limits (see
docs/design/step_execution_and_batching.md). The schedule fields (`SCHEDULE_FIELDS`) override the
checkpoint's scheduler config for this request (`schedule_overrides`, checked there).
`cache_backend` ("none" opts out) and `cache_config` (keys of the server's backend config) set
this request's step caching (docs/caching.md)."""


@dataclass(frozen=True)
class SamplingLimits:
    """What `OmniDiffusionSamplingParams.validate` checks against: the server's and the model family's
    limits (`diffusion.models.registry` gives the family's; these defaults are Qwen-Image's)."""

    max_generated_image_size: int | None = None
    """Largest height*width in pixels (the server's `--max-generated-image-size`); None = no cap."""
    max_sequence_length: int = MAX_SEQUENCE_LENGTH_LIMIT
    """Most prompt tokens the family's text encoder takes."""
    cache: CacheConfig = CacheConfig()
    """The server's step caching: what `extra_args.cache_backend` / `cache_config` may ask for."""


class InvalidRequestError(ValueError):
    """A request field whose value is refused; `param` names the field (HTTP 400 names it too)."""

    def __init__(self, message: str, param: str | None):
        super().__init__(message)
        self.param = param


def _check_int(name: str, value: Any, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"{name} must be an integer, got {type(value).__name__} ({value!r})", name)
    if not low <= value <= high:
        raise InvalidRequestError(f"{name} must be in [{low}, {high}], got {value}", name)


def _check_float(name: str, value: Any, low: float, high: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequestError(f"{name} must be a number, got {type(value).__name__} ({value!r})", name)
    if not low <= float(value) <= high:
        raise InvalidRequestError(f"{name} must be in [{low}, {high}], got {value}", name)


def _check_schedule(name: str, values: Any, high: float, num_inference_steps: int) -> None:
    """A custom schedule: 1..MAX_INFERENCE_STEPS finite numbers in (0, high], strictly decreasing,
    exactly `num_inference_steps` of them. diffusers' pipelines run `len(values)` steps and ignore
    `num_inference_steps`; a mismatch is refused here instead, so neither field is silently dropped."""
    if not isinstance(values, (list, tuple)) or not values:
        raise InvalidRequestError(f"{name} must be a non-empty list of numbers, got {values!r:.80}", name)
    if len(values) > MAX_INFERENCE_STEPS:
        raise InvalidRequestError(
            f"{name} has {len(values)} values; the limit is {MAX_INFERENCE_STEPS} (one per step)", name
        )
    for i, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise InvalidRequestError(f"{name}[{i}] must be a finite number, got {value!r:.80}", name)
        if not 0.0 < value <= high:
            raise InvalidRequestError(f"{name}[{i}] must be in (0, {high:g}], got {value}", name)
        if i and value >= values[i - 1]:
            raise InvalidRequestError(
                f"{name} must be strictly decreasing (noisiest first), but {name}[{i}] = {value} follows "
                f"{values[i - 1]}",
                name,
            )
    if len(values) != num_inference_steps:
        raise InvalidRequestError(
            f"{name} has {len(values)} values but num_inference_steps is {num_inference_steps}; this "
            f"server runs one step per value and refuses a mismatch rather than ignore either (diffusers' "
            f"pipeline would run {len(values)} steps and ignore num_inference_steps): send "
            f"num_inference_steps={len(values)}, or omit it over HTTP (it then defaults to the list's "
            "length)",
            name,
        )


@dataclass
class OmniDiffusionSamplingParams:
    """What one request asks the diffusion pipeline for.

    Defaults follow diffusers' `QwenImagePipeline.__call__`, except
    `true_cfg_scale`, whose default is Qwen-Image's recommended 4.0 (CFG runs only
    when a negative prompt is also given, as in diffusers).
    """

    height: int = 1024
    """Image height in pixels; rounded down to a multiple of 16 at admission (as diffusers does)."""
    width: int = 1024
    """Image width in pixels; rounded down to a multiple of 16 at admission (as diffusers does)."""
    num_inference_steps: int = 50
    """Number of denoise steps (flow-match Euler)."""
    true_cfg_scale: float = 4.0
    """Classifier-free guidance scale; CFG runs when > 1 and a negative prompt is given."""
    guidance_scale: float | None = None
    """Distilled-guidance input; ignored by Qwen-Image (no guidance embedding), as in diffusers."""
    cfg_normalize: bool = True
    """Rescale the CFG combination to the positive prediction's norm per token (diffusers always does)."""
    seed: int | None = None
    """`torch.Generator("cpu").manual_seed(seed)` draws the noise; None assigns a random seed."""
    num_outputs_per_prompt: int = 1
    """Images per prompt (`n` in the OpenAI API); each gets its own noise from one generator."""
    max_sequence_length: int = 512
    """Prompt embeddings are truncated to this many tokens (<= 1024)."""
    flow_shift: float | None = None
    """Static sigma shift: the schedule of diffusers' `FlowMatchEulerDiscreteScheduler` built with
    `shift=flow_shift, use_dynamic_shifting=False`. None = Qwen-Image's resolution-dependent shift."""
    sigmas: list[float] | None = None
    """A custom schedule, as diffusers' `QwenImagePipeline.__call__(sigmas=...)`: one sigma per step,
    strictly decreasing in (0, 1]. They still go through the scheduler's shift (Qwen-Image's dynamic
    `mu`, or `flow_shift`) and `shift_terminal` stretch, as diffusers does. Length =
    `num_inference_steps`."""
    timesteps: list[float] | None = None
    """Custom timesteps, as diffusers' `FlowMatchEulerDiscreteScheduler.set_timesteps(timesteps=...)`:
    one per step, strictly decreasing in (0, 1000]. The transformer gets them as given (/ 1000); the
    Euler sigmas are `timesteps / 1000` through the scheduler's shift, as in diffusers. Length =
    `num_inference_steps`; not together with `sigmas`."""
    generator_device: str = "cpu"
    """Device of the seeded noise generator. Only 'cpu': the seed means `torch.Generator("cpu")` here."""
    output_type: str = "pil"
    """'pil' (list of PIL images), 'np' (float array [n, H, W, 3] in [0, 1]) or 'latent'."""
    lora_request: LoRARequest | None = None
    """The LoRA adapter this request runs with (None = the base model)."""
    lora_scale: float = 1.0
    """Multiplier of the adapter's delta (`scale * B @ A`, on top of its alpha / rank)."""
    vae_use_slicing: bool | None = None
    """Decode this request's images one at a time (diffusers' `vae.enable_slicing()`; same pixels).
    None = the server's `--vae-use-slicing`."""
    vae_use_tiling: bool | None = None
    """Decode in overlapping tiles (diffusers' `vae.enable_tiling()`; pixels differ near tile seams).
    None = the server's `--vae-use-tiling`."""
    extra_args: dict[str, Any] = field(default_factory=dict)
    """Per-request toggles; keys must be in `KNOWN_EXTRA_ARGS`."""
    priority: int = 0
    """Scheduling priority, vLLM's meaning: lower runs first (the latency policy; FIFO and
    skip-ahead keep arrival order and refuse a non-zero priority)."""
    partial_images: int = 0
    """Previews to stream before the final image (0-3, OpenAI's `partial_images`): each the decode of
    the clean-image estimate after an evenly spaced step (`preview_steps`); only for streamed requests
    (HTTP `stream: true`, offline `Omni.generate(..., stream=True)`)."""

    def validate(self, limits: SamplingLimits | None = None) -> None:
        """Raise `InvalidRequestError` (a `ValueError`) naming the first invalid field and its limit.

        The one semantic check of a request: the HTTP layer checks JSON types only, and the server's
        `default_sampling_params` are checked by this same function at start-up (`OmniDiffusionConfig`).
        """
        limits = limits or SamplingLimits()
        max_generated_image_size = limits.max_generated_image_size
        for name in ("height", "width"):
            value = getattr(self, name)
            _check_int(name, value, PIXELS_PER_TOKEN_SIDE, 1 << 16)
        if max_generated_image_size is not None and self.height * self.width > max_generated_image_size:
            raise InvalidRequestError(
                f"size {self.width}x{self.height} = {self.height * self.width} pixels exceeds this server's "
                f"limit of {max_generated_image_size} pixels (--max-generated-image-size, offline "
                "max_generated_image_size); ask for a smaller size or raise the limit",
                "height*width",
            )
        _check_int("num_inference_steps", self.num_inference_steps, 1, MAX_INFERENCE_STEPS)
        _check_float("true_cfg_scale", self.true_cfg_scale, 0.0, MAX_CFG_SCALE)
        if self.guidance_scale is not None:
            _check_float("guidance_scale", self.guidance_scale, 0.0, MAX_CFG_SCALE)
        if not isinstance(self.cfg_normalize, bool):
            raise InvalidRequestError(
                f"cfg_normalize must be a bool, got {self.cfg_normalize!r}", "cfg_normalize"
            )
        if self.seed is not None:
            _check_int("seed", self.seed, 0, MAX_SEED)
        _check_int("num_outputs_per_prompt", self.num_outputs_per_prompt, 1, MAX_NUM_OUTPUTS_PER_PROMPT)
        _check_int("max_sequence_length", self.max_sequence_length, 1, limits.max_sequence_length)
        if self.flow_shift is not None:
            _check_float("flow_shift", self.flow_shift, MIN_FLOW_SHIFT, MAX_FLOW_SHIFT)
        self._validate_custom_schedule()
        if self.generator_device != "cpu":
            raise InvalidRequestError(
                f"generator_device {self.generator_device!r} is not supported: the seed always seeds "
                "torch.Generator('cpu') (as diffusers' examples do), so one seed gives one image on every "
                "device; a CUDA generator would draw different noise. Send 'cpu' or omit it",
                "generator_device",
            )
        if self.output_type not in OUTPUT_TYPES:
            raise InvalidRequestError(
                f"output_type must be one of {list(OUTPUT_TYPES)}, got {self.output_type!r}", "output_type"
            )
        if self.lora_request is not None and not isinstance(self.lora_request, LoRARequest):
            raise InvalidRequestError(
                f"lora_request must be a LoRARequest, got {type(self.lora_request).__name__}", "lora_request"
            )
        _check_float("lora_scale", self.lora_scale, -MAX_CFG_SCALE, MAX_CFG_SCALE)
        for name in ("vae_use_slicing", "vae_use_tiling"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(f"{name} must be a bool or null, got {getattr(self, name)!r}", name)
        _check_int("priority", self.priority, -MAX_PRIORITY, MAX_PRIORITY)
        _check_int("partial_images", self.partial_images, 0, MAX_PARTIAL_IMAGES)
        self._validate_extra_args()
        self.resolve_cache(limits.cache)

    def resolve_cache(self, server: CacheConfig) -> CacheConfig:
        """This request's step caching: the server's, opted out (`extra_args.cache_backend: "none"`)
        or with keys overridden (`extra_args.cache_config`); `InvalidRequestError` naming the field."""
        extra = self.extra_args
        try:
            return server.for_request(
                extra.get("cache_backend"), extra.get("cache_config"), self.num_inference_steps
            )
        except CacheConfigError as exc:
            field_name = (
                exc.key if exc.key in ("cache_backend", "cache_config") else f"cache_config.{exc.key}"
            )
            raise InvalidRequestError(str(exc), f"extra_args.{field_name}") from None

    def _validate_custom_schedule(self) -> None:
        """`sigmas` / `timesteps`: a list of finite numbers, strictly decreasing, in range, one per step."""
        if self.sigmas is not None and self.timesteps is not None:
            raise InvalidRequestError(
                "give sigmas or timesteps, not both (as diffusers' retrieve_timesteps: only one of them "
                "sets a custom schedule)",
                "sigmas",
            )
        for name, high in (("sigmas", 1.0), ("timesteps", 1000.0)):
            values = getattr(self, name)
            if values is not None:
                _check_schedule(name, values, high, self.num_inference_steps)

    def _validate_extra_args(self) -> None:
        if not isinstance(self.extra_args, dict):
            raise InvalidRequestError(
                f"extra_args must be an object, got {type(self.extra_args).__name__}", "extra_args"
            )
        for key, value in self.extra_args.items():
            if key in SCHEDULE_FIELDS:
                continue  # checked below, as a whole
            if key not in KNOWN_EXTRA_ARGS:
                raise InvalidRequestError(
                    f"extra_args key {key!r} is not supported; accepted keys: {sorted(KNOWN_EXTRA_ARGS)}",
                    f"extra_args.{key}",
                )
            expected = KNOWN_EXTRA_ARGS[key]
            if expected is int:
                _check_int(f"extra_args.{key}", value, 1, 1 << 30)
            elif not isinstance(value, expected):
                raise InvalidRequestError(
                    f"extra_args.{key} must be {expected.__name__}, got {type(value).__name__} ({value!r})",
                    f"extra_args.{key}",
                )
        overrides = self.schedule_overrides()
        if self.flow_shift is not None and {"shift", "use_dynamic_shifting"} & set(overrides.as_config()):
            raise InvalidRequestError(
                "flow_shift sets shift and turns use_dynamic_shifting off; give flow_shift or "
                "extra_args.shift / extra_args.use_dynamic_shifting, not both",
                "flow_shift",
            )

    def schedule_overrides(self) -> ScheduleOverrides:
        """The scheduler config fields `extra_args` overrides for this request (`SCHEDULE_FIELDS`);
        `InvalidRequestError` naming `extra_args.<field>` and its limit."""
        try:
            return ScheduleOverrides.from_mapping(self.extra_args)
        except ScheduleArgError as e:
            raise InvalidRequestError(f"extra_args.{e}", f"extra_args.{e.key}") from None

    def check_latent_grid(self, multiple: int) -> None:
        """`InvalidRequestError` when a side is below `multiple` (the family's
        `RequestGeometry.pixel_multiple`): rounded down to a multiple, it would be 0 pixels."""
        for name in ("height", "width"):
            value = getattr(self, name)
            if value < multiple:
                raise InvalidRequestError(
                    f"size {self.width}x{self.height}: {name} {value} is below this model's multiple of "
                    f"{multiple} pixels (sides are rounded down to multiples of {multiple}); send a {name} "
                    f"of at least {multiple}",
                    name,
                )

    def snap_to_latent_grid(self, multiple: int = PIXELS_PER_TOKEN_SIDE) -> bool:
        """Round `height` and `width` down to multiples of `multiple` (the family's
        `RequestGeometry.pixel_multiple`; Qwen-Image: 16, its latents are `2 * (side // 16)` wide), as
        diffusers' pipelines do; return True when a side changed."""
        snapped = [side - side % multiple for side in (self.height, self.width)]
        changed = snapped != [self.height, self.width]
        self.height, self.width = snapped
        return changed

    def ensure_seed(self) -> int:
        """Assign a random seed when none was given; return the seed in use."""
        if self.seed is None:
            self.seed = random.randrange(0, 2**31 - 1)
        return self.seed


def preview_steps(num_steps: int, partial_images: int) -> tuple[int, ...]:
    """Steps done after which a streaming request's previews are taken: `partial_images` evenly spaced
    points, step `round(num_steps * k / (partial_images + 1))` for k = 1..partial_images (20 steps, 3
    partials: after steps 5, 10 and 15), never the last step (that is the final image) and never step
    0; with few steps, coinciding points give fewer previews."""
    points = (round(num_steps * k / (partial_images + 1)) for k in range(1, partial_images + 1))
    return tuple(sorted({p for p in points if 1 <= p < num_steps}))

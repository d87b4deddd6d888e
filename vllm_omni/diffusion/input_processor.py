"""`InputProcessor`: a caller's request made into the engine's own, before it is queued.

One call (`process`), in this order:

1. check the fields no family needs to see (prompts, the sampling limits, priority, the seed in
   batch-invariant mode, the LoRA adapter): `InvalidRequestError` naming the field and the limit;
2. copy the request once (the engine owns the copy: the scheduler assigns its seed, admission its
   adapter id; the caller's object is never changed);
3. round the size down to the family's pixel multiple, as diffusers does;
4. compute its `RequestGeometry` once, from the snapped size (the family's rows: latent grid, text,
   condition, prefix cache): the token budget's cost, the runner's shapes, the memory charge;
5. refuse what could never fit in memory (`memory.MemoryBudget.check`, from the geometry) and a
   degenerate sigma schedule.

The family's own sampling defaults (Qwen-Image-2.1: 40 steps, scale 1.0) are not applied here: a
request's params arrive complete, built by a front end from `DiffusionEngine.default_sampling_params`
(the family's defaults under the server's `--default-sampling-params`), which is read-only.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from dataclasses import dataclass

from vllm_omni.config import OmniDiffusionConfig
from vllm_omni.diffusion.memory import MemoryBudget
from vllm_omni.diffusion.models.interface import RequestGeometry
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.diffusion.solvers.flow_match import schedule_problem
from vllm_omni.inputs import InvalidRequestError, OmniDiffusionSamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProcessedRequest:
    """A request ready to queue: the engine's own copy and its geometry."""

    request: OmniDiffusionRequest
    """The engine's copy (its params copied once; size snapped to the family's multiple)."""
    geometry: RequestGeometry
    """Its rows, computed once from the snapped size."""
    requested_size: tuple[int, int] | None = None
    """(width, height) the caller asked for when it was rounded down; None when it was not."""


class InputProcessor:
    """Validates, copies, snaps and measures requests for one engine; see the module docstring.

    Args:
        config: the engine's config (sampling limits, scheduling policy, batch-invariant mode).
        family: the model family (`models/interface.ModelFamily`): the request's geometry.
        prompts: the family's prompt counter (the engine's own tokenizer).
        memory: the engine's memory budget (refuses what could never fit).
        lora: the `LoRAManager`, None when LoRA is off.
        sigma_schedule: params -> the request's sigma schedule (the pipeline's).
    """

    def __init__(
        self,
        config: OmniDiffusionConfig,
        family,
        prompts,
        memory: MemoryBudget,
        lora,
        sigma_schedule: Callable[[OmniDiffusionSamplingParams], object],
    ):
        self.config = config
        self.family = family
        self.prompts = prompts
        self.memory = memory
        self.lora = lora
        self.sigma_schedule = sigma_schedule
        self.pixel_multiple: int | None = None
        """The family's pixel multiple, from its first geometry (a constant of the family, declared in
        its `RequestGeometry`): from then on a size is snapped before its one geometry."""

    def process(self, request: OmniDiffusionRequest) -> ProcessedRequest:
        """The engine's copy of `request` and its geometry; InvalidRequestError (a ValueError) naming
        the field and the limit. Tokenises each prompt once: call it off an event loop."""
        self._check_prompts(request)
        request = copy.copy(request)
        request.sampling_params = sp = copy.deepcopy(request.sampling_params)
        self._check_params(sp)
        requested = (sp.width, sp.height)
        if self.pixel_multiple is not None:
            sp.check_latent_grid(self.pixel_multiple)  # a side below it would round down to 0
            sp.snap_to_latent_grid(self.pixel_multiple)
        geometry = self.family.request_geometry(self.prompts, request)
        if self.pixel_multiple is None:  # the first request: the family's multiple is known now
            self.pixel_multiple = geometry.pixel_multiple
            sp.check_latent_grid(geometry.pixel_multiple)
            if sp.snap_to_latent_grid(geometry.pixel_multiple):
                geometry = self.family.request_geometry(self.prompts, request)
        prefix_param = "prompt" if request.image is None else "image"
        self.memory.check(sp, geometry, prefix_param)  # 400 when it could never fit, even on an idle server
        self._check_schedule(sp)
        snapped = requested != (sp.width, sp.height)
        return ProcessedRequest(request, geometry, requested if snapped else None)

    @staticmethod
    def _check_prompts(request: OmniDiffusionRequest) -> None:
        if not isinstance(request.prompt, str) or not request.prompt.strip():
            raise InvalidRequestError("prompt must be a non-empty string", "prompt")
        if request.negative_prompt is not None and not isinstance(request.negative_prompt, str):
            raise InvalidRequestError("negative_prompt must be a string", "negative_prompt")

    def _check_params(self, sp: OmniDiffusionSamplingParams) -> None:
        config = self.config
        sp.validate(config.sampling_limits)
        if sp.priority != 0 and config.scheduling_policy != "latency":
            raise InvalidRequestError(
                f"priority: this server's --scheduling-policy {config.scheduling_policy} keeps arrival "
                "order; start it with --scheduling-policy latency (the default with --step-execution) to "
                "use priority, or send priority 0",
                "priority",
            )
        if config.batch_invariant and sp.seed is None:
            raise InvalidRequestError(
                "seed is required in batch-invariant mode (VLLM_BATCH_INVARIANT=1)", "seed"
            )
        if sp.lora_request is not None and self.lora is None:
            raise InvalidRequestError(
                "lora: LoRA adapters are not loaded on this server (start it with --lora-modules NAME=PATH); "
                "send the request without 'lora'",
                "lora",
            )
        if sp.lora_request is not None:
            self.lora.check(sp.lora_request)  # LoRANotFoundError (a ValueError): unknown name

    def _check_schedule(self, sp: OmniDiffusionSamplingParams) -> None:
        """Refuse a request whose sigma schedule is degenerate (NaN / Inf), before it runs: diffusers'
        pipeline would give it a black image."""
        problem = schedule_problem(self.sigma_schedule(sp))
        if problem is None:
            return
        if sp.sigmas is not None or sp.timesteps is not None:
            name, top = ("sigmas", 1) if sp.sigmas is not None else ("timesteps", 1000)
            raise InvalidRequestError(
                f"{name} give a degenerate schedule: {problem} (diffusers' pipeline would return "
                f"a NaN, black image); a schedule whose last value is below {top} works",
                name,
            )
        raise InvalidRequestError(
            f"num_inference_steps={sp.num_inference_steps} gives a degenerate schedule: {problem} "
            "(diffusers' pipeline returns a NaN, black image for it). Use num_inference_steps >= 2",
            "num_inference_steps",
        )

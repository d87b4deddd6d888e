"""Qwen-Image-2.1 as a step pipeline: encode and prefill once, denoise step by step, decode once.

The stages reproduce diffusers' `QwenImage21Pipeline` for one request (text-to-image): the prompt in
its chat template through Qwen3-VL (the hidden states before the final norm, the system turn dropped),
noise drawn from the request's CPU generator as `[n, 1, C, H/16, W/16]` and flattened to rows, the
flow-match schedule over `linspace(1, 1/steps, steps)` shifted by the image row count, CFG without
renormalisation, and an RGBA decode. At admission `encode_requests` also runs the transformer's
prefill of every new sequence (prompt, and negative prompt with CFG) into its prefix cache; `release`
frees it when the request ends.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, ClassVar

import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from vllm_omni.diffusion.models.qwen_image.pipeline import QwenImageStepPipeline, VaeModes
from vllm_omni.diffusion.models.qwen_image21.configs import PIPELINE_CLASS_NAME
from vllm_omni.diffusion.models.qwen_image21.processor import PROMPT_TEMPLATE_T2I, PromptCounter
from vllm_omni.diffusion.solvers.flow_match import FlowMatchSchedule, SigmaSchedule
from vllm_omni.inputs import OmniDiffusionSamplingParams

logger = logging.getLogger(__name__)

VAE_SCALE_FACTOR = 16
"""Pixels per latent row side (the RGBA VAE's 16x spatial compression, unpatched)."""
PIXEL_MULTIPLE = 32
"""Image sides are multiples of this (diffusers' `vae_scale_factor * 2`)."""

DEFAULT_SAMPLING_PARAMS: dict[str, Any] = {
    "num_inference_steps": 40,
    "true_cfg_scale": 1.0,
    "cfg_normalize": False,
}
"""The model's own sampling defaults (CFG-distilled; true CFG, when asked for, is not renormalised)."""


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """[n, 1, C, h, w] -> [n, h*w, C] (one row per latent pixel, channels last)."""
    n, _, c, h, w = latents.shape
    return latents.view(n, c, h * w).transpose(1, 2)


def unpack_latents(latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """[n, h*w, C] -> [n, C, 1, h, w] for an image of `height` x `width` pixels."""
    n, _, c = latents.shape
    return latents.transpose(1, 2).reshape(n, c, 1, height // VAE_SCALE_FACTOR, width // VAE_SCALE_FACTOR)


class QwenImage21StepPipeline:
    """Qwen-Image-2.1 text-to-image stages around the packed transformer step (`StepPipeline`)."""

    pipeline_class_name: ClassVar[str] = PIPELINE_CLASS_NAME
    supports_mixfusion: ClassVar[bool] = True
    """Packed steps over image rows: requests of any size and prompt length share a step."""
    supports_image_input: ClassVar[bool] = False
    """Reference images (edits) are not served yet."""
    supports_dense_forward: ClassVar[bool] = False
    """Same-shape batches also take the packed forward: the dense one has no request ids, so it
    cannot reach the prefix cache and would re-run every prefix each step."""

    def __init__(self, components: Any, device: torch.device, dtype: torch.dtype):
        from diffusers.image_processor import VaeImageProcessor

        self.transformer = components.transformer
        self.vae = components.vae
        self.text_encoder = components.text_encoder
        self.processor = components.processor
        self.device = torch.device(device)
        self.dtype = dtype
        self.prompts = PromptCounter(self.processor.tokenizer)
        self.schedules = FlowMatchSchedule(components.scheduler_config)
        self.sample_sigmas: list[float] | None = components.sample_sigmas
        """The checkpoint's configured sigma grid (`model_index.json` `sample_sigmas`), or None."""
        self._configured = FlowMatchEulerDiscreteScheduler.from_config(components.scheduler_config)
        self._configured_lock = threading.Lock()
        self.image_processor = VaeImageProcessor(
            vae_scale_factor=VAE_SCALE_FACTOR, vae_latent_channels=self.vae.config.z_dim
        )

    # ---- text and prefix ----------------------------------------------------------------------

    @torch.inference_mode()
    def encode_prompt(self, prompt: str) -> torch.Tensor:
        """One prompt's rows [L, J], as diffusers' `encode_prompt` for a single prompt."""
        inputs = self.processor(
            text=[PROMPT_TEMPLATE_T2I.format(prompt or " ")],
            padding=True,
            padding_side="left",
            return_tensors="pt",
        ).to(self.device)
        model = self.text_encoder.model
        norm = getattr(model, "language_model", model).norm
        handle = norm.register_forward_hook(lambda module, args, output: args[0])  # pre-norm states
        try:
            out = self.text_encoder(
                input_ids=inputs.input_ids, attention_mask=inputs.attention_mask, output_hidden_states=True
            )
        finally:
            handle.remove()
        hidden = out.hidden_states[-1][0][inputs.attention_mask[0].bool()]  # [T, J]
        return hidden[self.prompts.num_dropped :].to(self.dtype).contiguous()

    def encode_requests(self, reqs: list, one_by_one: bool = False) -> dict[str, tuple]:
        """{req_id: (prompt rows, negative rows or None, None)} of newly admitted requests, each prompt
        encoded alone (as diffusers encodes one request); each sequence's prefix is prefilled into the
        transformer's prefix cache here, once for the request's whole run."""
        out = {}
        for req in reqs:
            pos = self.encode_prompt(req.prompt)
            do_cfg = req.sampling_params.true_cfg_scale > 1.0 and req.negative_prompt is not None
            neg = self.encode_prompt(req.negative_prompt) if do_cfg else None
            self.admit(req.req_id, pos, neg)
            out[req.req_id] = (pos, neg, None)
        return out

    def admit(self, req_id: str, prompt_rows: torch.Tensor, neg_rows: torch.Tensor | None) -> int:
        """Prefill the request's sequences into the prefix cache; return (and log) the bytes they hold."""
        cache = self.transformer.prefix_cache
        for is_negative, rows in ((False, prompt_rows), (True, neg_rows)):
            if rows is not None:
                cache.put(req_id, is_negative, self.transformer.prefill(rows))
        num_bytes = cache.req_bytes(req_id)
        logger.info(
            "prefix cache: %s admitted, %d + %d prefix rows, %.3f MiB (%.3f MiB held by %d sequences)",
            req_id,
            prompt_rows.shape[0],
            0 if neg_rows is None else neg_rows.shape[0],
            num_bytes / 2**20,
            cache.num_bytes / 2**20,
            len(cache),
        )
        return num_bytes

    def release(self, req_ids) -> int:
        """Free the prefix cache of requests that ended (finished, failed, aborted); bytes freed."""
        return self.transformer.prefix_cache.release(req_ids)

    # ---- noise and schedule -------------------------------------------------------------------

    def prepare_latents(
        self, params: OmniDiffusionSamplingParams, generator: torch.Generator
    ) -> torch.Tensor:
        """Initial noise, drawn as diffusers draws it: [n, (H/16)*(W/16), C] on the device."""
        channels = self.transformer.config.in_channels
        shape = (params.num_outputs_per_prompt, 1, channels, *self.latent_grid(params)[1:])
        noise = torch.randn(shape, generator=generator, device=generator.device, dtype=self.dtype)
        return pack_latents(noise).to(self.device)

    def latent_grid(self, params: OmniDiffusionSamplingParams) -> tuple[int, int, int]:
        """(1, H / 16, W / 16): one row per latent pixel."""
        return (1, params.height // VAE_SCALE_FACTOR, params.width // VAE_SCALE_FACTOR)

    def sigma_schedule(self, params: OmniDiffusionSamplingParams) -> SigmaSchedule:
        """This request's own schedule (its step count and image row count, or its `flow_shift`)."""
        _, h, w = self.latent_grid(params)
        grid = self.sample_sigmas
        if grid is None or params.flow_shift is not None or params.num_inference_steps != len(grid):
            return self.schedules.build(params.num_inference_steps, h * w, params.flow_shift)
        # NOTE(qwen21): diffusers runs the configured grid whatever `num_inference_steps` says; we run
        # it when the request's step count is its length (the scheduler counts the request's steps).
        with self._configured_lock:
            self._configured.set_timesteps(sigmas=list(grid), mu=self.schedules.mu_for(h * w))
            return SigmaSchedule(
                sigmas=self._configured.sigmas.detach().clone().float().cpu(),
                timesteps=self._configured.timesteps.detach().clone().float().cpu(),
            )

    # ---- decode -------------------------------------------------------------------------------

    configure_vae = QwenImageStepPipeline.configure_vae
    vae_modes = QwenImageStepPipeline.vae_modes
    _set_vae_modes = QwenImageStepPipeline._set_vae_modes
    _vae_modes_applied = QwenImageStepPipeline._vae_modes_applied

    @torch.inference_mode()
    def decode(
        self, latents: torch.Tensor, height: int, width: int, output_type: str, modes: VaeModes | None = None
    ) -> Any:
        """Rows [n, S, C] of one image size -> RGBA images: PIL list, float array [n, H, W, 4] or latents."""
        if output_type == "latent":
            return latents.detach().cpu()
        with self._vae_modes_applied(modes):
            vae = self.vae
            x = unpack_latents(latents, height, width).to(vae.dtype)
            shape = (1, vae.config.z_dim, 1, 1, 1)
            std = torch.tensor(vae.config.latents_std).view(shape).to(x.device, x.dtype)
            mean = torch.tensor(vae.config.latents_mean).view(shape).to(x.device, x.dtype)
            image = vae.decode(x * std + mean, return_dict=False)[0][:, :, 0]  # [n, 4, H, W]
            return self.image_processor.postprocess(image, output_type=output_type)

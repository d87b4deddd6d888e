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
from dataclasses import dataclass
from typing import Any, ClassVar

import PIL.Image
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from vllm_omni.diffusion.models.qwen_image.pipeline import QwenImageStepPipeline, VaeModes
from vllm_omni.diffusion.models.qwen_image21 import prefill_attention
from vllm_omni.diffusion.models.qwen_image21.configs import PIPELINE_CLASS_NAME
from vllm_omni.diffusion.models.qwen_image21.prefix_cache import prefix_num_bytes
from vllm_omni.diffusion.models.qwen_image21.processor import (
    IMAGE_TOKEN,
    PROMPT_TEMPLATE_T2I,
    PromptCounter,
    reference_size,
    ti2i_template,
)
from vllm_omni.diffusion.models.qwen_image21.transformer import LoRAScope
from vllm_omni.diffusion.solvers.flow_match import FlowMatchSchedule, SigmaSchedule
from vllm_omni.inputs import OmniDiffusionSamplingParams
from vllm_omni.lora.batch import LoRAMapping, SeqLoRA
from vllm_omni.lora.manager import LoRAManager

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


def reference_images(image) -> list:
    """A request's reference images in order: `request.image` is None (text-to-image), one PIL image or
    a list of them."""
    if image is None:
        return []
    return list(image) if isinstance(image, (list, tuple)) else [image]


@dataclass(frozen=True)
class Reference:
    """One reference image of a request, prepared once at admission."""

    vlm_image: Any
    """The resized image over white (RGB PIL), as the text encoder sees it."""
    cond_rows: torch.Tensor
    """[h * w, z] its normalised VAE latents as rows (row-major)."""
    grid: tuple[int, int, int]
    """(1, h, w) its latent grid."""


class QwenImage21StepPipeline:
    """Qwen-Image-2.1 text-to-image stages around the packed transformer step (`StepPipeline`)."""

    pipeline_class_name: ClassVar[str] = PIPELINE_CLASS_NAME
    supports_mixfusion: ClassVar[bool] = True
    """Packed steps over image rows: requests of any size and prompt length share a step."""
    supports_image_input: ClassVar[bool] = True
    """A request may carry reference images (an edit, up to `MAX_REFERENCE_IMAGES`); without one it is
    text-to-image."""
    cuda_graphs_off_reason: ClassVar[str | None] = None
    """Its step is captured (its own static step: graphs.py)."""

    def __init__(self, components: Any, device: torch.device, dtype: torch.dtype):
        from diffusers.image_processor import VaeImageProcessor

        self.transformer = components.transformer
        self.vae = components.vae
        self.text_encoder = components.text_encoder
        self.processor = components.processor
        self.device = torch.device(device)
        self.dtype = dtype
        self.prompts = PromptCounter(self.processor.tokenizer)
        self.image_token_id = self.processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
        self.schedules = FlowMatchSchedule(components.scheduler_config)
        self.sample_sigmas: list[float] | None = components.sample_sigmas
        """The checkpoint's configured sigma grid (`model_index.json` `sample_sigmas`), or None."""
        self._configured = FlowMatchEulerDiscreteScheduler.from_config(components.scheduler_config)
        self._configured_lock = threading.Lock()
        self.image_processor = VaeImageProcessor(
            vae_scale_factor=VAE_SCALE_FACTOR, vae_latent_channels=self.vae.config.z_dim
        )
        config = self.transformer.config
        self.prefix_row_bytes = prefix_num_bytes(
            1, config.num_layers, config.num_attention_heads, config.attention_head_dim, dtype
        )
        """Bytes one prefix row holds in the prefix KV cache (K and V of every layer): what the engine
        charges a request at admission (`memory.MemoryBudget`)."""
        self.lora: LoRAManager | None = None
        """The transformer's adapters (set by the worker when LoRA is on): a request's adapter also
        applies to its prefix, prefilled here at admission (`prefill_lora`)."""

    def prefill_peak_bytes(self, num_prefix_rows: int) -> int:
        """Bytes prefilling `num_prefix_rows` rows holds for a moment beyond the prefix cache itself (the
        engine charges it at admission, like a decode slice): one layer's activations per row (x, its
        norm, q / k / v, the attention output, the residuals, SwiGLU's three [L, mlp_ratio * dim]),
        without a prefix arena the stacked copy of the K/V, and the chunked attention's scores and
        softmax (`PREFILL_SCORE_BYTES` each) with the chunk's mask."""
        config = self.transformer.config
        element = torch.empty((), dtype=self.dtype).element_size()
        per_row = (8 + 3 * config.mlp_ratio) * config.inner_dim * element
        stacked = 0 if getattr(self.transformer, "prefix_arena", None) is not None else self.prefix_row_bytes
        heads = config.num_attention_heads
        mask = prefill_attention.rows_per_chunk(num_prefix_rows, heads) * num_prefix_rows  # bool [rows, L]
        return num_prefix_rows * (per_row + stacked) + 2 * prefill_attention.PREFILL_SCORE_BYTES + mask

    # ---- text and prefix ----------------------------------------------------------------------

    @torch.inference_mode()
    def encode_prompt(self, prompt: str, references: list[Reference] = ()) -> tuple[torch.Tensor, list[bool]]:
        """One prompt's encoder rows [T, J] and which of them are image slots, as diffusers'
        `encode_prompt` for a single prompt (with its references' RGB images in its template, in order)."""
        template = ti2i_template(len(references)) if references else PROMPT_TEMPLATE_T2I
        images = [r.vlm_image for r in references] or None
        inputs = self.processor(
            text=[template.format(prompt or " ")],
            images=images,
            padding=True,
            padding_side="left",
            return_tensors="pt",
        ).to(self.device)
        vision = {"mm_token_type_ids": inputs["mm_token_type_ids"]}
        if references:
            vision.update(pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"])
        model = self.text_encoder.model
        norm = getattr(model, "language_model", model).norm
        handle = norm.register_forward_hook(lambda module, args, output: args[0])  # pre-norm states
        try:
            out = self.text_encoder(
                input_ids=inputs.input_ids,
                attention_mask=inputs.attention_mask,
                output_hidden_states=True,
                **vision,
            )
        finally:
            handle.remove()
        real = inputs.attention_mask[0].bool()
        hidden = out.hidden_states[-1][0][real][self.prompts.num_dropped :]  # [T, J]
        slots = inputs.input_ids[0][real][self.prompts.num_dropped :] == self.image_token_id
        return hidden.to(self.dtype).contiguous(), slots.tolist()

    @torch.inference_mode()
    def encode_reference(self, image) -> Reference:
        """A reference image as diffusers prepares it: resized (RGBA) to its aspect at 1024^2 area; the
        encoder sees it over white, the VAE its RGBA pixels (argmax latents, normalised, as rows)."""
        width, height = reference_size(image)
        rgba = image if image.mode == "RGBA" else image.convert("RGBA")
        resized = self.image_processor.resize(rgba, width=width, height=height)
        vlm_image = PIL.Image.new("RGB", resized.size, (255, 255, 255))
        vlm_image.paste(resized, mask=resized.getchannel("A"))
        vae = self.vae
        pixels = self.image_processor.preprocess(rgba, width=width, height=height).unsqueeze(2)
        latents = vae.encode(pixels.to(self.device, vae.dtype)).latent_dist.mode()  # [1, z, 1, h, w]
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents.device, latents.dtype)
        std = torch.tensor(vae.config.latents_std).view(shape).to(latents.device, latents.dtype)
        latents = ((latents - mean) / std).to(self.dtype)
        rows = latents[0, :, 0].flatten(1).transpose(0, 1)  # [z, 1, h, w] -> [h * w, z]
        grid = (1, height // VAE_SCALE_FACTOR, width // VAE_SCALE_FACTOR)
        return Reference(vlm_image=vlm_image, cond_rows=rows.to(self.device), grid=grid)

    def encode_requests(self, reqs: list, one_by_one: bool = False) -> dict[str, tuple]:
        """{req_id: (prompt rows, negative rows or None, None)} of newly admitted requests, each prompt
        encoded alone (as diffusers encodes one request) with the request's reference images; each
        sequence's prefix is prefilled into the transformer's prefix cache here, once for the whole run."""
        out = {}
        for req in reqs:
            references = [self.encode_reference(image) for image in reference_images(req.image)]
            pos, pos_slots = self.encode_prompt(req.prompt, references)
            do_cfg = req.sampling_params.true_cfg_scale > 1.0 and req.negative_prompt is not None
            neg, neg_slots = self.encode_prompt(req.negative_prompt, references) if do_cfg else (None, None)
            negative = None if neg is None else (neg, neg_slots)
            self.admit(req.req_id, (pos, pos_slots), negative, references, self.prefill_lora(req))
            out[req.req_id] = (pos, neg, None)
        return out

    def prefill_lora(self, req) -> LoRAScope | None:
        """The scope in which the transformer's prefill applies `req`'s adapter (at its `lora_scale`),
        as diffusers applies an adapter to every row, prefix included; None without one."""
        seq = SeqLoRA.of(req.sampling_params) if self.lora is not None else SeqLoRA(0)
        if not seq.lora_int_id:
            return None
        manager, device = self.lora, self.device

        def scope(num_img_rows: int, num_txt_rows: int):
            return manager.activate(LoRAMapping.for_dense([seq], num_img_rows, num_txt_rows), device)

        return scope

    def admit(
        self,
        req_id: str,
        prompt: tuple,
        negative: tuple | None,
        references: list[Reference] = (),
        lora: LoRAScope | None = None,
    ) -> int:
        """Prefill the request's sequences ((encoder rows, slot mask) each) into the prefix cache, each
        reference image's latent rows at its slots; return (and log) the bytes they hold. With a prefix
        arena their K/V go into the rows the engine reserved for `req_id` at admission (or free rows;
        `PrefixArenaFull` before any compute when none fit: this request fails, no other)."""
        cache = self.transformer.prefix_cache
        cond_rows = torch.cat([r.cond_rows for r in references]) if references else None
        grids = [r.grid for r in references]
        for is_negative, encoded in ((False, prompt), (True, negative)):
            if encoded is None:
                continue
            rows, slots = encoded
            if not references:
                prefix = self.transformer.prefill(rows, owner=req_id, lora=lora)
            else:
                prefix = self.transformer.prefill(rows, slots, cond_rows, grids, owner=req_id, lora=lora)
            cache.put(req_id, is_negative, prefix)
        num_rows = [p.num_rows for p in (cache.get(req_id, False), cache.get(req_id, True)) if p is not None]
        num_bytes = cache.req_bytes(req_id)
        logger.info(
            "prefix cache: %s admitted, %s prefix rows, %d bytes (%.3f MiB held by %d sequences)",
            req_id,
            " + ".join(map(str, num_rows)),
            num_bytes,
            cache.num_bytes / 2**20,
            len(cache),
        )
        return num_bytes

    @property
    def prefix_arena(self):
        """The transformer's `PrefixArena` when the runner made one (the engine reserves its rows at
        admission: `interface.PrefixRowReservations`), else None."""
        return self.transformer.prefix_arena

    def release(self, req_ids) -> int:
        """Free the prefix cache of requests that ended (finished, failed, aborted), their arena rows
        included; bytes freed."""
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
        """This request's own schedule (its step count and image row count, or its `flow_shift`; its
        scheduler config overrides in `extra_args`)."""
        _, h, w = self.latent_grid(params)
        grid = self.sample_sigmas
        overrides = params.schedule_overrides()
        if grid is None or params.flow_shift is not None or params.num_inference_steps != len(grid):
            return self.schedules.build(
                params.num_inference_steps, h * w, params.flow_shift, overrides=overrides
            )
        if not overrides.is_empty:  # the configured grid through the request's own scheduler config
            return self.schedules.build(len(grid), h * w, sigmas=list(grid), overrides=overrides)
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

"""Qwen-Image as a step pipeline: encode once, denoise step by step, decode once.

The stages around the transformer (prompt encoding, noise, sigma schedule,
decode) reproduce diffusers' `QwenImagePipeline` exactly for one request, so a
request's seed gives the same image here and there. The packed denoise step
lives in the model runner; this class only holds what is Qwen-Image specific.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from vllm_omni.diffusion.memory import DEFAULT_MAX_DECODE_PIXELS, decode_slices
from vllm_omni.diffusion.solvers.flow_match import FlowMatchSchedule, SigmaSchedule
from vllm_omni.inputs import MAX_SEQUENCE_LENGTH_LIMIT, InvalidRequestError, OmniDiffusionSamplingParams

PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
PROMPT_TEMPLATE_DROP = 34
"""Template tokens dropped from the encoder output (diffusers' `prompt_template_encode_start_idx`)."""

VAE_SCALE_FACTOR = 8
LATENT_CHANNELS = 16


@dataclass(frozen=True)
class VaeModes:
    """diffusers' VAE memory modes one decode runs with."""

    slicing: bool
    """One image at a time (same pixels)."""
    tiling: bool
    """Overlapping tiles for large images (pixels differ near the seams)."""


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """[n, 1, C, 2h, 2w] noise -> [n, h*w, 4C] rows of 2x2 patches (channels last)."""
    n, _, c, height, width = latents.shape
    latents = latents.view(n, c, height // 2, 2, width // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return latents.reshape(n, (height // 2) * (width // 2), c * 4)


def unpack_latents(latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """[n, h*w, 4C] -> [n, C, 1, 2h, 2w] for an image of `height` x `width` pixels."""
    n, _, channels = latents.shape
    grid_h, grid_w = height // 16, width // 16
    latents = latents.view(n, grid_h, grid_w, channels // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return latents.reshape(n, channels // 4, 1, grid_h * 2, grid_w * 2)


@dataclass(frozen=True)
class PromptTokens:
    """Token counts of one prompt, from one tokenisation of its chat-templated text."""

    num_embedded_tokens: int
    """Encoder rows the prompt keeps after the template drop (user text + template tail), before
    `max_sequence_length` truncation: what the prompt costs in every forward."""
    num_user_tokens: int
    """Tokens of the user text (the embedded rows minus the template tail): what the 1024 limit counts."""


class QwenImagePromptProcessor:
    """Counts and checks prompts with the tokenizer alone (the engine's side; no text encoder)."""

    template: ClassVar[str] = PROMPT_TEMPLATE
    """The chat template the text encoder sees the prompt in ..."""
    template_drop: ClassVar[int] = PROMPT_TEMPLATE_DROP
    """... and the leading template tokens dropped from its output."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._lock = threading.Lock()
        """Fast tokenizers are not safe to call from several threads at once ("Already borrowed")."""
        self._tail = self._num_embedded("")
        """Template tokens after the user text (`<|im_end|>\n<|im_start|>assistant\n`)."""

    def _num_embedded(self, text: str) -> int:
        with self._lock:
            ids = self.tokenizer(self.template.format(text), add_special_tokens=False).input_ids
        return len(ids) - self.template_drop

    def count(self, name: str, text: str) -> PromptTokens:
        """Count `text`; ValueError naming `name` when it exceeds the hard limit or encodes to nothing.

        NOTE(prompt): user tokens are embedded rows minus the template tail; a BPE merge across the
        text's boundary can shift that by a token, which only moves where the 1024 limit bites.
        """
        num_embedded = self._num_embedded(text)
        num_user = num_embedded - self._tail
        if num_user > MAX_SEQUENCE_LENGTH_LIMIT:
            raise InvalidRequestError(
                f"{name} is {num_user} tokens long; the limit is {MAX_SEQUENCE_LENGTH_LIMIT} tokens", name
            )
        if num_embedded <= 0:
            raise InvalidRequestError(f"{name} encodes to no tokens after the chat template", name)
        return PromptTokens(num_embedded_tokens=num_embedded, num_user_tokens=num_user)


def encode_prompt_pairs(reqs: list, encode, one_by_one: bool) -> dict[str, tuple]:
    """{req_id: (prompt rows, negative rows or None)}: each request's prompt, and its negative prompt
    when CFG runs, through `encode` (a list of (request, text) -> one embedding each), all in one call
    or (`one_by_one`) one call per text."""
    items, owners = [], []
    for r in reqs:
        items.append((r, r.prompt))
        owners.append((r.req_id, 0))
        if r.sampling_params.true_cfg_scale > 1.0 and r.negative_prompt is not None:
            items.append((r, r.negative_prompt))
            owners.append((r.req_id, 1))
    embeds = [encode([item])[0] for item in items] if one_by_one else encode(items)
    out: dict[str, list] = {r.req_id: [None, None] for r in reqs}
    for (req_id, slot), emb in zip(owners, embeds, strict=True):
        out[req_id][slot] = emb
    return {req_id: (pos, neg) for req_id, (pos, neg) in out.items()}


class QwenImageStepPipeline:
    """Qwen-Image text-to-image stages around the packed transformer step."""

    pipeline_class_name: ClassVar[str] = "QwenImagePipeline"
    """`model_index.json`'s `_class_name` of this pipeline (`registry.family_of` reads it)."""
    supports_mixfusion: ClassVar[bool] = True
    """The transformer has a packed varlen forward, so mixed shapes can share a step."""
    supports_image_input: ClassVar[bool] = False
    """Text-to-image: requests carry no input image."""
    lora: Any = None
    """The transformer's `LoRAManager` (the worker sets it); unread: encoding runs no transformer."""
    prefix_row_bytes: ClassVar[int] = 0
    """No prefix KV cache."""
    prefix_arena: ClassVar[None] = None
    cuda_graphs_off_reason: ClassVar[str | None] = None
    """Its step is captured."""

    def release(self, req_ids) -> int:
        """Nothing per request outside the runner's slots: 0 bytes freed."""
        return 0

    def prefill_peak_bytes(self, num_prefix_rows: int) -> int:
        """No prefix to fill: 0."""
        return 0

    def __init__(self, components: Any, device: torch.device, dtype: torch.dtype):
        from diffusers.image_processor import VaeImageProcessor

        self.transformer = components.transformer
        self.vae = components.vae
        self.text_encoder = components.text_encoder
        self.tokenizer = components.tokenizer
        self.device = torch.device(device)
        self.dtype = dtype
        self.schedules = FlowMatchSchedule(components.scheduler_config)
        self.image_processor = VaeImageProcessor(vae_scale_factor=VAE_SCALE_FACTOR * 2)
        self.max_decode_pixels = DEFAULT_MAX_DECODE_PIXELS
        """Most pixels one VAE call decodes (`OmniDiffusionConfig.max_decode_pixels`, set by the worker)."""

    # ---- text -------------------------------------------------------------------------------

    @torch.inference_mode()
    def encode_prompts(self, prompts: list[str], max_sequence_lengths: list[int]) -> list[torch.Tensor]:
        """Encode prompts together; return each one's embeddings at its real length, [L_i, J].

        Same as diffusers' `_get_qwen_prompt_embeds` + `encode_prompt`: chat template,
        last hidden state, padding dropped with the mask, first 34 template tokens
        dropped, truncated to `max_sequence_length`.
        """
        texts = [PROMPT_TEMPLATE.format(p) for p in prompts]
        tokens = self.tokenizer(
            texts,
            max_length=MAX_SEQUENCE_LENGTH_LIMIT + PROMPT_TEMPLATE_DROP,
            padding=True,
            truncation=True,
            return_tensors="pt",
        ).to(self.device)
        out = self.text_encoder(
            input_ids=tokens.input_ids, attention_mask=tokens.attention_mask, output_hidden_states=True
        )
        hidden = out.hidden_states[-1]  # [B, T, J]
        lengths = tokens.attention_mask.sum(dim=1).tolist()
        embeds = []
        for i, (length, max_len) in enumerate(zip(lengths, max_sequence_lengths)):
            real = hidden[i][tokens.attention_mask[i].bool()]  # [length, J]
            real = real[PROMPT_TEMPLATE_DROP:][:max_len]
            if real.shape[0] == 0:
                raise ValueError(f"prompt {i} encodes to no tokens after the template ({length} tokens)")
            embeds.append(real.to(self.dtype).contiguous())
        return embeds

    def encode_requests(self, reqs: list, one_by_one: bool = False) -> dict[str, tuple]:
        """{req_id: (prompt rows, negative rows or None, None)} for newly admitted requests.

        `reqs` are the scheduler's `NewRequestData`. Prompts (and negative prompts, when CFG runs) are
        encoded in one text-encoder call; `one_by_one` (batch-invariant mode) encodes each alone, so
        its embedding cannot depend on what it was padded with. The last slot is an edit pipeline's
        condition.
        """

        def encode(items: list[tuple[Any, str]]) -> list[torch.Tensor]:
            return self.encode_prompts(
                [t for _, t in items], [r.sampling_params.max_sequence_length for r, _ in items]
            )

        return {
            k: (pos, neg, None) for k, (pos, neg) in encode_prompt_pairs(reqs, encode, one_by_one).items()
        }

    # ---- noise and schedule -----------------------------------------------------------------

    def prepare_latents(
        self, params: OmniDiffusionSamplingParams, generator: torch.Generator
    ) -> torch.Tensor:
        """Initial noise, drawn exactly as diffusers does: [n, (H/16)*(W/16), 64] on the device."""
        shape = (
            params.num_outputs_per_prompt,
            1,
            LATENT_CHANNELS,
            2 * (params.height // 16),
            2 * (params.width // 16),
        )
        noise = torch.randn(shape, generator=generator, device=generator.device, dtype=self.dtype)
        return pack_latents(noise).to(self.device)

    def latent_grid(self, params: OmniDiffusionSamplingParams) -> tuple[int, int, int]:
        """(1, H // 16, W // 16): the latent token grid of one image of `params` (as RoPE takes it)."""
        return (1, params.height // 16, params.width // 16)

    def sigma_schedule(self, params: OmniDiffusionSamplingParams) -> SigmaSchedule:
        """This request's own schedule (its step count and image token count, its `flow_shift`, its
        custom `sigmas` / `timesteps`, its scheduler config overrides in `extra_args`)."""
        image_seq_len = (params.height // 16) * (params.width // 16)
        return self.schedules.build(
            params.num_inference_steps,
            image_seq_len,
            params.flow_shift,
            sigmas=params.sigmas,
            timesteps=params.timesteps,
            overrides=params.schedule_overrides(),
        )

    # ---- decode -----------------------------------------------------------------------------

    def configure_vae(self, use_slicing: bool, use_tiling: bool) -> None:
        """The server's VAE memory modes (diffusers'): slicing decodes a request's images one at a
        time (same pixels); tiling decodes large images in overlapping tiles (pixels differ near seams).
        A request may override either for its own decode (`vae_modes`)."""
        self._set_vae_modes(VaeModes(slicing=use_slicing, tiling=use_tiling))

    def vae_modes(self, params: OmniDiffusionSamplingParams) -> VaeModes:
        """The VAE modes `params` decodes with: its own where given, else the server's."""
        vae = self.vae
        slicing, tiling = params.vae_use_slicing, params.vae_use_tiling
        return VaeModes(
            slicing=vae.use_slicing if slicing is None else slicing,
            tiling=vae.use_tiling if tiling is None else tiling,
        )

    def _set_vae_modes(self, modes: VaeModes) -> None:
        vae = self.vae
        vae.enable_slicing() if modes.slicing else vae.disable_slicing()
        vae.enable_tiling() if modes.tiling else vae.disable_tiling()

    @contextlib.contextmanager
    def _vae_modes_applied(self, modes: VaeModes | None):
        """`modes` for the VAE calls inside, the server's again after (None: the server's)."""
        server = VaeModes(slicing=self.vae.use_slicing, tiling=self.vae.use_tiling)
        if modes is None or modes == server:
            yield
            return
        self._set_vae_modes(modes)
        try:
            yield
        finally:
            self._set_vae_modes(server)

    @torch.inference_mode()
    def decode(
        self, latents: torch.Tensor, height: int, width: int, output_type: str, modes: VaeModes | None = None
    ) -> Any:
        """Packed latents [n, S, 64] of one image size -> PIL list, float array [n, H, W, 3], or latents.

        `modes`: the VAE slicing / tiling of this decode (`vae_modes(params)`); None = the server's."""
        if output_type == "latent":
            return latents.detach().cpu()
        parts, start = [], 0
        with self._vae_modes_applied(modes):
            # n images in slices of whole images: the VAE's activations grow with the pixels of a call
            for count in decode_slices(latents.shape[0], height, width, self.max_decode_pixels):
                parts.append(self._decode_pixels(latents[start : start + count], height, width, output_type))
                start += count
        if output_type == "pil":
            return [image for part in parts for image in part]
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def _decode_pixels(self, latents: torch.Tensor, height: int, width: int, output_type: str) -> Any:
        vae = self.vae
        x = unpack_latents(latents, height, width).to(vae.dtype)
        mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1).to(x.device, x.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1)
        x = x / inv_std.to(x.device, x.dtype) + mean
        image = vae.decode(x, return_dict=False)[0][:, :, 0]  # [n, 3, H, W]
        if not bool(torch.isfinite(image).all()):
            raise ValueError("the VAE decode produced non-finite pixels (NaN/Inf); no image is returned")
        return self.image_processor.postprocess(image, output_type=output_type)

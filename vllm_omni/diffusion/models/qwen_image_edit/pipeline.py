"""Qwen-Image-Edit as a step pipeline: the Qwen-Image stages plus an input image.

Reproduces diffusers' `QwenImageEditPipeline` (pipelines/qwenimage/pipeline_qwenimage_edit.py, 0.42.1)
for one request, stage by stage:

    input image (w, h) --calculate_dimensions(1024*1024, w/h)--> condition size (cw, ch), multiples of 32
    resized image      --processor (vision tower input) + edit template--> text encoder --> prompt rows
                       (the template's first 64 tokens dropped; no truncation)
    resized image      --[-1, 1], VAE encode, mode (argmax), (z - mean) / std, 2x2 pack--> condition rows
                          [(ch / 16) * (cw / 16), 64]
    noise, sigmas, mu  as text-to-image, from the TARGET size (height x width)

Each step the transformer's image stream of a sequence is `[noise rows ; condition rows]` with grids
(target, condition); only the target rows of the output are the velocity (see packing.SequenceSpec).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from PIL import Image

from vllm_omni.diffusion.models.interface import TEXT_TO_IMAGE_REFUSAL
from vllm_omni.diffusion.models.qwen_image.pipeline import (
    LATENT_CHANNELS,
    QwenImagePromptProcessor,
    QwenImageStepPipeline,
    encode_prompt_pairs,
    pack_latents,
)
from vllm_omni.inputs import InvalidRequestError

EDIT_PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the image. Generate a "
    "new image that meets the user's requirements while maintaining consistency with the original input "
    "where appropriate.<|im_end|>\n<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{}"
    "<|im_end|>\n<|im_start|>assistant\n"
)
"""diffusers' `QwenImageEditPipeline.prompt_template_encode`."""

EDIT_PROMPT_TEMPLATE_DROP = 64
"""Leading tokens dropped from the encoder output (`prompt_template_encode_start_idx`)."""

CONDITION_AREA = 1024 * 1024
"""The input image is resized to about this many pixels at its own aspect ratio."""


def calculate_dimensions(target_area: int, ratio: float) -> tuple[int, int]:
    """(width, height), multiples of 32, of about `target_area` pixels at aspect `ratio` = w / h.

    diffusers' `calculate_dimensions` (Python's round: halves go to even)."""
    width = math.sqrt(target_area * ratio)
    height = width / ratio
    return round(width / 32) * 32, round(height / 32) * 32


def edit_output_size(image: Image.Image) -> tuple[int, int]:
    """(height, width) diffusers edits to when none is given: the condition size of `image`."""
    width, height = calculate_dimensions(CONDITION_AREA, image.size[0] / image.size[1])
    return height, width


MAX_CONDITION_ASPECT = 200
"""Qwen2-VL's image processor refuses images whose sides differ by more than this factor."""


def check_condition_size(image: Image.Image) -> None:
    """`InvalidRequestError` naming `image` when its condition size (about 1024 x 1024 at its own
    aspect) has a side of 0 or is too elongated for the vision encoder (diffusers fails on both)."""
    if min(image.size) == 0:
        raise InvalidRequestError(f"image is {image.size[0]}x{image.size[1]}: it has no pixels", "image")
    height, width = edit_output_size(image)
    if min(height, width) == 0 or max(height, width) / min(height, width) > MAX_CONDITION_ASPECT:
        w, h = image.size
        raise InvalidRequestError(
            f"image is {w}x{h}; edit models take images up to a {MAX_CONDITION_ASPECT}:1 aspect ratio at "
            f"their condition size (about 1024 x 1024 at the image's aspect: {width}x{height} here); "
            "crop or pad the image",
            "image",
        )


class QwenImageEditPromptProcessor(QwenImagePromptProcessor):
    """Counts edit prompts on the engine side: the edit template, 64 tokens dropped, plus the vision
    tokens the processor will put in place of `<|image_pad|>` for the request's image."""

    template: ClassVar[str] = EDIT_PROMPT_TEMPLATE
    template_drop: ClassVar[int] = EDIT_PROMPT_TEMPLATE_DROP

    def __init__(self, tokenizer, image_processor):
        self.image_processor = image_processor
        super().__init__(tokenizer)

    def num_vision_tokens(self, image: Image.Image) -> int:
        """Text rows the image adds beyond its one placeholder token (at its condition size)."""
        return self._num_vision_tokens(*edit_output_size(image))

    def _num_vision_tokens(self, height: int, width: int) -> int:
        num_patches = self.image_processor.get_number_of_image_patches(height, width, {})
        return num_patches // self.image_processor.merge_size**2 - 1

    def num_image_rows(self, image: Image.Image) -> int:
        """Rows the input image adds to each sequence: its vision tokens and its condition rows."""
        height, width = edit_output_size(image)
        return self._num_vision_tokens(height, width) + (height // 16) * (width // 16)


@dataclass
class EditCondition:
    """What one input image contributes to a request (built once, when it is admitted)."""

    prompt_image: Image.Image
    """The RGB input resized to the condition size: the vision tower's and the VAE's input."""
    cond_latents: torch.Tensor
    """[(ch / 16) * (cw / 16), 64] packed, normalised VAE latents, in the transformer dtype."""
    cond_shape: tuple[int, int, int]
    """(1, ch / 16, cw / 16) latent token grid of the condition image."""

    @property
    def cond_shapes(self) -> tuple[tuple[int, int, int], ...]:
        """The condition grids after the target in each sequence (one here)."""
        return (self.cond_shape,)


class QwenImageEditStepPipeline(QwenImageStepPipeline):
    """Qwen-Image-Edit stages around the packed transformer step (one input image per request)."""

    pipeline_class_name: ClassVar[str] = "QwenImageEditPipeline"
    supports_image_input: ClassVar[bool] = True
    """Requests must carry an input image; text-only requests are refused."""
    max_input_images: ClassVar[int] = 1

    def __init__(self, components: Any, device: torch.device, dtype: torch.dtype):
        super().__init__(components, device, dtype)
        if components.processor is None:
            raise ValueError("Qwen-Image-Edit needs its processor/ component (preprocessor_config.json)")
        self.processor = components.processor

    # ---- image ------------------------------------------------------------------------------

    @torch.inference_mode()
    def prepare_condition(self, image: Image.Image) -> EditCondition:
        """Resize `image` to its condition size and VAE-encode it (diffusers' `_encode_vae_image`)."""
        rgb = image if image.mode == "RGB" else image.convert("RGB")
        cond_h, cond_w = edit_output_size(rgb)
        prompt_image = self.image_processor.resize(rgb, cond_h, cond_w)
        pixels = self.image_processor.preprocess(prompt_image, cond_h, cond_w).unsqueeze(2)  # [1, 3, 1, H, W]
        vae = self.vae
        pixels = pixels.to(device=vae.device, dtype=vae.dtype)
        z = vae.encode(pixels).latent_dist.mode()  # [1, 16, 1, H / 8, W / 8]
        view = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(view).to(z.device, z.dtype)
        std = torch.tensor(vae.config.latents_std).view(view).to(z.device, z.dtype)
        z = ((z - mean) / std).to(self.dtype)
        packed = pack_latents(z.squeeze(2).unsqueeze(1))[0]  # [1, 1, 16, H/8, W/8] -> [S_cond, 64]
        grid = (1, cond_h // 16, cond_w // 16)
        if z.shape[1] != LATENT_CHANNELS or packed.shape[0] != grid[1] * grid[2]:
            raise ValueError(f"VAE latents {tuple(z.shape)} do not match the condition grid {grid}")
        return EditCondition(prompt_image, packed.to(self.device).contiguous(), grid)

    # ---- text -------------------------------------------------------------------------------

    @torch.inference_mode()
    def encode_edit_prompts(self, prompts: list[str], images: list[Image.Image]) -> list[torch.Tensor]:
        """Encode prompts, each with its (resized) input image; each one's rows at real length, [L_i, J].

        Same as diffusers' edit `_get_qwen_prompt_embeds`: edit template with the image placeholder
        expanded by the processor, vision tower + language model, last hidden state, padding dropped
        with the mask, first 64 tokens dropped, no truncation.
        """
        return self.encode_templated([EDIT_PROMPT_TEMPLATE.format(p) for p in prompts], images)

    @torch.inference_mode()
    def encode_templated(self, texts: list[str], images: list[Image.Image]) -> list[torch.Tensor]:
        """Encode template-filled `texts` with their `images` (in `<|image_pad|>` order across texts):
        the processor expands each placeholder, vision tower + language model, last hidden state,
        padding dropped with the mask, the template's first tokens dropped; each one's rows [L_i, J]."""
        inputs = self.processor(text=texts, images=images, padding=True, return_tensors="pt").to(self.device)
        out = self.text_encoder(
            input_ids=inputs["input_ids"],
            attention_mask=inputs["attention_mask"],
            pixel_values=inputs["pixel_values"].to(self.text_encoder.dtype),
            image_grid_thw=inputs["image_grid_thw"],
            output_hidden_states=True,
        )
        hidden = out.hidden_states[-1]  # [B, T, J]
        embeds = []
        for i in range(len(texts)):
            real = hidden[i][inputs["attention_mask"][i].bool()][EDIT_PROMPT_TEMPLATE_DROP:]  # [L_i, J]
            if real.shape[0] == 0:
                raise ValueError(f"edit prompt {i} encodes to no tokens after the template")
            embeds.append(real.to(self.dtype).contiguous())
        return embeds

    # ---- admission --------------------------------------------------------------------------

    def encode_requests(
        self, reqs: list, one_by_one: bool = False
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor | None, EditCondition]]:
        """{req_id: (prompt rows, negative rows or None, condition)} for newly admitted requests.

        `reqs` are the scheduler's `NewRequestData` (each with an `image`). Prompts (and negative
        prompts, when CFG runs) are encoded in one text-encoder call, each with its own request's
        image; `one_by_one` (batch-invariant mode) encodes each alone instead.
        """
        conditions = {}
        for r in reqs:
            if r.image is None:
                raise ValueError(f"request {r.req_id}: an edit model needs an input image")
            conditions[r.req_id] = self.prepare_condition(r.image)

        def encode(items: list[tuple[Any, str]]) -> list[torch.Tensor]:
            # each prompt (positive or negative) with its own request's image
            return self.encode_edit_prompts(
                [t for _, t in items], [conditions[r.req_id].prompt_image for r, _ in items]
            )

        pairs = encode_prompt_pairs(reqs, encode, one_by_one)
        return {req_id: (pos, neg, conditions[req_id]) for req_id, (pos, neg) in pairs.items()}


IMAGE_REQUIRED = (
    "image: this model is an image-edit model (Qwen-Image-Edit) and needs an input image "
    "(POST /v1/images/edits, or Omni.generate with multi_modal_data={'image': ...})"
)


def check_image_input(supports_image_input: bool, image, params, prompt, negative_prompt=None) -> None:
    """Raise ValueError (naming `image`) when a request's input image does not suit the model.

    A text-to-image model refuses an image; an edit model needs one decoded PIL image and prompts
    (`PromptTokens` counts) that fit `max_sequence_length`, since edit prompts are never truncated.
    """
    if not supports_image_input:
        if image is not None:
            raise InvalidRequestError(TEXT_TO_IMAGE_REFUSAL, "image")
        return
    if image is None:
        raise InvalidRequestError(IMAGE_REQUIRED, "image")
    if not isinstance(image, Image.Image):
        raise InvalidRequestError(f"image must be a decoded PIL image, got {type(image).__name__}", "image")
    check_condition_size(image)
    for name, tokens in (("prompt", prompt), ("negative_prompt", negative_prompt)):
        if tokens is not None and tokens.num_user_tokens > params.max_sequence_length:
            raise InvalidRequestError(
                f"{name} is {tokens.num_user_tokens} tokens long; edit models do not truncate prompts, so "
                f"it must fit max_sequence_length = {params.max_sequence_length} (raise it, up to 1024)",
                name,
            )

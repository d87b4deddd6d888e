"""Qwen-Image-Edit-2509 as a step pipeline: Qwen-Image-Edit with 1 to `MAX_INPUT_IMAGES` input images.

Reproduces diffusers' `QwenImageEditPlusPipeline` (pipelines/qwenimage/pipeline_qwenimage_edit_plus.py,
0.42.1) for one request, stage by stage. Each input image k (of its own size) is used twice:

    image k --calculate_dimensions(384*384)--> vision size  --resize--> the text encoder's "Picture k"
    image k --calculate_dimensions(1024*1024)--> VAE size   --[-1, 1], VAE encode, mode, (z - mean) / std,
                                                              2x2 pack--> condition rows of image k
    prompt  "Picture 1: <|vision_start|><|image_pad|><|vision_end|>Picture 2: ...{prompt}" in the edit
            template (64 leading tokens dropped, no truncation)
    noise, sigmas, mu  as text-to-image, from the TARGET size (default: the last image's aspect at 1024^2)

Each step the image stream of a sequence is `[target rows ; image 1 rows ; image 2 rows ; ...]` with
grids (target, image 1, image 2, ...): RoPE gives grid k frame position k, as diffusers' `img_shapes`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from PIL import Image

from vllm_omni.diffusion.models.qwen_image.pipeline import LATENT_CHANNELS, encode_prompt_pairs, pack_latents
from vllm_omni.diffusion.models.qwen_image_edit.pipeline import (
    EDIT_PROMPT_TEMPLATE_DROP,
    MAX_CONDITION_ASPECT,
    QwenImageEditPromptProcessor,
    QwenImageEditStepPipeline,
    calculate_dimensions,
)
from vllm_omni.inputs import InvalidRequestError

PIPELINE_CLASS_NAME = "QwenImageEditPlusPipeline"

EDIT_PLUS_PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the image. Generate a "
    "new image that meets the user's requirements while maintaining consistency with the original input "
    "where appropriate.<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)
"""diffusers' `QwenImageEditPlusPipeline.prompt_template_encode` (the pictures go into the user turn)."""

PICTURE_TEMPLATE = "Picture {}: <|vision_start|><|image_pad|><|vision_end|>"
"""One input image's block before the prompt (diffusers' `img_prompt_template`)."""

VISION_AREA = 384 * 384
"""Each input image reaches the vision tower at about this many pixels (diffusers' `CONDITION_IMAGE_SIZE`)."""
VAE_AREA = 1024 * 1024
"""... and the VAE at about this many (diffusers' `VAE_IMAGE_SIZE`): its condition rows."""

MAX_INPUT_IMAGES = 4
"""Input images one request may carry. The model card shows 1 to 3; diffusers sets no limit. Each image
adds about 4096 condition rows (1024 x 1024 / 256) to every sequence of the request and about 144 vision
tokens to its prompt, so 4 images make a ~1024 x 1024 edit's sequence about 5x a text-to-image one's."""


def picture_prompt(prompt: str, num_images: int) -> str:
    """The user text diffusers encodes: one "Picture k" block per input image, then the prompt."""
    return "".join(PICTURE_TEMPLATE.format(k) for k in range(1, num_images + 1)) + prompt


def vision_size(image: Image.Image) -> tuple[int, int]:
    """(height, width), multiples of 32, image k is resized to for the vision tower."""
    width, height = calculate_dimensions(VISION_AREA, image.size[0] / image.size[1])
    return height, width


def vae_size(image: Image.Image) -> tuple[int, int]:
    """(height, width), multiples of 32, image k is VAE-encoded at (its condition rows' grid x 16)."""
    width, height = calculate_dimensions(VAE_AREA, image.size[0] / image.size[1])
    return height, width


def as_image_list(image: Any) -> list:
    """A request's input images (one PIL image or a list) as a list."""
    return list(image) if isinstance(image, (list, tuple)) else [image]


def check_input_images(image: Any) -> list[Image.Image]:
    """The request's input images, each checked: `InvalidRequestError` naming `image` for none, more than
    `MAX_INPUT_IMAGES`, a non-image, or one too small or elongated at either of its sizes."""
    if image is None:
        raise InvalidRequestError(
            "image: Qwen-Image-Edit-2509 needs 1 to "
            f"{MAX_INPUT_IMAGES} input images (POST /v1/images/edits, or Omni.generate with "
            "multi_modal_data={'image': ...})",
            "image",
        )
    images = as_image_list(image)
    if not 1 <= len(images) <= MAX_INPUT_IMAGES:
        raise InvalidRequestError(
            f"image: Qwen-Image-Edit-2509 takes at most {MAX_INPUT_IMAGES} input images, got {len(images)}",
            "image",
        )
    for item in images:
        if not isinstance(item, Image.Image):
            raise InvalidRequestError(
                f"image must be a decoded PIL image (or a list of them), got {type(item).__name__}", "image"
            )
        check_image(item)
    return images


def check_image(image: Image.Image) -> None:
    """`InvalidRequestError` naming `image` when one of its two sizes has a side of 0 or is too elongated
    for the vision encoder (diffusers fails on both)."""
    w, h = image.size
    if min(w, h) == 0:
        raise InvalidRequestError(f"image is {w}x{h}: it has no pixels", "image")
    for height, width in (vision_size(image), vae_size(image)):
        if min(height, width) == 0 or max(height, width) / min(height, width) > MAX_CONDITION_ASPECT:
            raise InvalidRequestError(
                f"image is {w}x{h}; Qwen-Image-Edit-2509 resizes it to {width}x{height}, beyond what it "
                f"takes (both sides > 0, at most {MAX_CONDITION_ASPECT}:1); crop or pad the image",
                "image",
            )


class EditPlusPromptProcessor(QwenImageEditPromptProcessor):
    """Counts EditPlus prompts on the engine side: the pictures' blocks and the prompt in the edit
    template, 64 tokens dropped, each `<|image_pad|>` expanded to its image's vision tokens."""

    template: ClassVar[str] = EDIT_PLUS_PROMPT_TEMPLATE
    template_drop: ClassVar[int] = EDIT_PROMPT_TEMPLATE_DROP

    def num_embedded_rows(self, text: str, images: list[Image.Image]) -> int:
        """Encoder rows of `text` with `images` (what the text stream of each sequence holds)."""
        rows = self._num_embedded(picture_prompt(text, len(images)))
        return rows + sum(self._num_vision_tokens(*vision_size(image)) for image in images)

    def num_cond_rows(self, images: list[Image.Image]) -> int:
        """Condition rows all input images add after the target in each sequence."""
        return sum((h // 16) * (w // 16) for h, w in map(vae_size, images))


@dataclass
class EditPlusCondition:
    """What a request's input images contribute (built once, when it is admitted)."""

    vision_images: list[Image.Image]
    """Each RGB input resized to its vision size: the text encoder's pictures, in order."""
    cond_latents: torch.Tensor
    """[sum of (h_k / 16) * (w_k / 16), 64]: every image's packed, normalised VAE latents, in order."""
    cond_shapes: tuple[tuple[int, int, int], ...]
    """(1, h_k / 16, w_k / 16) latent token grid of each image's condition rows, in order."""


class QwenImageEditPlusStepPipeline(QwenImageEditStepPipeline):
    """Qwen-Image-Edit-2509 stages around the packed transformer step (1 to `MAX_INPUT_IMAGES` input
    images per request)."""

    pipeline_class_name: ClassVar[str] = PIPELINE_CLASS_NAME
    max_input_images: ClassVar[int] = MAX_INPUT_IMAGES

    # ---- images -----------------------------------------------------------------------------

    @torch.inference_mode()
    def encode_image(self, image: Image.Image) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """VAE-encode one input image at its VAE size (diffusers' `_encode_vae_image`): its packed rows
        [(h / 16) * (w / 16), 64] and their grid (1, h / 16, w / 16)."""
        vae_h, vae_w = vae_size(image)
        pixels = self.image_processor.preprocess(image, vae_h, vae_w).unsqueeze(2)  # [1, 3, 1, H, W]
        vae = self.vae
        z = vae.encode(pixels.to(device=vae.device, dtype=vae.dtype)).latent_dist.mode()  # [1, 16, 1, h, w]
        view = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(view).to(z.device, z.dtype)
        std = torch.tensor(vae.config.latents_std).view(view).to(z.device, z.dtype)
        z = ((z - mean) / std).to(self.dtype)
        packed = pack_latents(z.squeeze(2).unsqueeze(1))[0]  # [1, 1, 16, H/8, W/8] -> [S_k, 64]
        grid = (1, vae_h // 16, vae_w // 16)
        if z.shape[1] != LATENT_CHANNELS or packed.shape[0] != grid[1] * grid[2]:
            raise ValueError(f"VAE latents {tuple(z.shape)} do not match the condition grid {grid}")
        return packed, grid

    def prepare_images(self, images: list[Image.Image]) -> EditPlusCondition:
        """Every input image's vision picture and condition rows, in order."""
        rgb = [image if image.mode == "RGB" else image.convert("RGB") for image in images]
        vision = [self.image_processor.resize(image, *vision_size(image)) for image in rgb]
        encoded = [self.encode_image(image) for image in rgb]
        cond_latents = torch.cat([rows for rows, _ in encoded]).to(self.device).contiguous()
        return EditPlusCondition(vision, cond_latents, tuple(grid for _, grid in encoded))

    # ---- text -------------------------------------------------------------------------------

    @torch.inference_mode()
    def encode_plus_prompts(
        self, prompts: list[str], pictures: list[list[Image.Image]]
    ) -> list[torch.Tensor]:
        """Encode prompts, each with its own request's pictures; each one's rows at real length, [L_i, J].

        Same as diffusers' `_get_qwen_prompt_embeds` of the EditPlus pipeline: "Picture k" blocks before
        the prompt, the processor expanding each `<|image_pad|>` (images in text order), vision tower +
        language model, last hidden state, padding dropped with the mask, first 64 tokens dropped.
        """
        texts = [
            EDIT_PLUS_PROMPT_TEMPLATE.format(picture_prompt(p, len(imgs)))
            for p, imgs in zip(prompts, pictures)
        ]
        return self.encode_templated(texts, [image for imgs in pictures for image in imgs])

    # ---- admission --------------------------------------------------------------------------

    def encode_requests(
        self, reqs: list, one_by_one: bool = False
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor | None, EditPlusCondition]]:
        """{req_id: (prompt rows, negative rows or None, condition)} for newly admitted requests (each
        with 1 to `MAX_INPUT_IMAGES` images); prompts of all requests in one text-encoder call, each with
        its own request's pictures (`one_by_one`: each alone, batch-invariant mode)."""
        conditions = {r.req_id: self.prepare_images(check_input_images(r.image)) for r in reqs}

        def encode(items: list[tuple[Any, str]]) -> list[torch.Tensor]:
            return self.encode_plus_prompts(
                [t for _, t in items], [conditions[r.req_id].vision_images for r, _ in items]
            )

        pairs = encode_prompt_pairs(reqs, encode, one_by_one)
        return {req_id: (pos, neg, conditions[req_id]) for req_id, (pos, neg) in pairs.items()}

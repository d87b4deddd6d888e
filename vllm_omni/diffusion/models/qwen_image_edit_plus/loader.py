"""Load Qwen-Image-Edit-2509 (`QwenImageEditPlusPipeline`): the Qwen-Image-Edit components as they are.

An EditPlus checkpoint has Qwen-Image-Edit's layout (transformer, vae, text_encoder, tokenizer,
processor/, scheduler), so `qwen_image_edit.loader.load_qwen_image_edit` loads it; this family differs in
what a request carries (1 to `MAX_INPUT_IMAGES` images) and in how they are encoded
(`QwenImageEditPlusStepPipeline`). `QWEN_IMAGE_EDIT_PLUS` is the family object `models/registry.py` names.

Qwen-Image-Edit-2511 is the same pipeline with `zero_cond_t` in its transformer config (condition rows
modulated at timestep 0): not implemented by our transformer yet, so it is refused at start-up naming
the flag (a local 2511 checkpoint by its config, `--load-format dummy` of the repo id here).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from vllm_omni.diffusion.models.interface import FamilyCapabilities, RequestGeometry
from vllm_omni.diffusion.models.qwen_image.loader import count_prompts
from vllm_omni.diffusion.models.qwen_image_edit.loader import (
    QwenImageEditFamily,
    load_edit_processor_for,
    load_qwen_image_edit,
)
from vllm_omni.diffusion.models.qwen_image_edit_plus.pipeline import (
    MAX_INPUT_IMAGES,
    PIPELINE_CLASS_NAME,
    EditPlusPromptProcessor,
    check_image,
    check_input_images,
)
from vllm_omni.inputs import InvalidRequestError

ZERO_COND_T_REPOS = ("Qwen/Qwen-Image-Edit-2511",)
"""Released EditPlus repos whose transformer sets `zero_cond_t` (refused until it is implemented)."""


def refuse_zero_cond_t(model: str) -> None:
    """ValueError for a released repo whose transformer needs `zero_cond_t` (Qwen-Image-Edit-2511); a
    local 2511 checkpoint is refused by its transformer config (`QwenImageTransformerConfig.from_dict`)."""
    if model in ZERO_COND_T_REPOS:
        raise ValueError(
            f"{model}: its transformer sets zero_cond_t (condition rows modulated at timestep 0), which "
            "this engine does not implement yet; serve Qwen/Qwen-Image-Edit-2509"
        )


class EditPlusImageInput:
    """Qwen-Image-Edit-2509's image-input capability (`interface.ImageInput`)."""

    max_input_images: ClassVar[int] = MAX_INPUT_IMAGES

    def default_size(self, image) -> tuple[int, int]:
        """(height, width): diffusers' default, the (last) input's aspect at about 1024 x 1024."""
        from vllm_omni.diffusion.models.qwen_image_edit_plus.pipeline import vae_size

        return vae_size(image)

    def check_image(self, image) -> None:
        check_image(image)


class QwenImageEditPlusFamily(QwenImageEditFamily):
    """Qwen-Image-Edit-2509 (`QwenImageEditPlusPipeline`): Qwen-Image plus 1 to `MAX_INPUT_IMAGES` input
    images of any sizes per request."""

    pipeline_class_name: ClassVar[str] = PIPELINE_CLASS_NAME
    image_input: ClassVar[Any] = EditPlusImageInput()

    capabilities: ClassVar[FamilyCapabilities] = dataclasses.replace(
        QwenImageEditFamily.capabilities, display_name="Qwen-Image-Edit-2509"
    )
    """Qwen-Image-Edit's (the same transformer)."""

    def load_components(self, model, device, dtype, load_format="auto"):
        """`load_qwen_image_edit` (device 'meta' with 'dummy': shapes only); 2511 refused."""
        refuse_zero_cond_t(model)
        return load_qwen_image_edit(model, device, dtype, load_format)

    def load_pipeline(
        self, model, device, dtype, load_format="auto", seed=None, attn_backend=None, quantization=None
    ):
        """`QwenImageEditPlusStepPipeline` over `load_qwen_image_edit`'s components; 2511 refused."""
        from vllm_omni.diffusion.models.qwen_image_edit_plus.pipeline import QwenImageEditPlusStepPipeline

        refuse_zero_cond_t(model)
        components = load_qwen_image_edit(model, device, dtype, load_format, seed, attn_backend, quantization)
        return QwenImageEditPlusStepPipeline(components, device=device, dtype=dtype)

    def load_prompt_counter(self, model: str, load_format: str = "auto") -> EditPlusPromptProcessor:
        """`EditPlusPromptProcessor`: the pictures' blocks and vision tokens, the edit template."""
        processor = load_edit_processor_for(model, load_format)
        return EditPlusPromptProcessor(processor.tokenizer, processor.image_processor)

    def request_geometry(self, prompts: EditPlusPromptProcessor, request) -> RequestGeometry:
        """Prompt rows with every image's picture block and vision tokens (not truncated) in the text
        stream of every sequence; every image's condition rows after the target in the image stream."""
        images = check_input_images(request.image)
        pos, neg, _, _ = count_prompts(prompts, request)  # each prompt alone: the 1024-token limit
        sp = request.sampling_params
        for name, tokens in (("prompt", pos), ("negative_prompt", neg)):
            if tokens is not None and tokens.num_user_tokens > sp.max_sequence_length:
                raise InvalidRequestError(
                    f"{name} is {tokens.num_user_tokens} tokens long; edit models do not truncate prompts, "
                    f"so it must fit max_sequence_length = {sp.max_sequence_length} (raise it, up to 1024)",
                    name,
                )
        num_pos = prompts.num_embedded_rows(request.prompt, images)
        cfg = neg is not None and request.do_classifier_free_guidance
        num_neg = prompts.num_embedded_rows(request.negative_prompt, images) if cfg else 0
        return self._geometry(sp, num_pos, num_neg, prompts.num_cond_rows(images))


QWEN_IMAGE_EDIT_PLUS = QwenImageEditPlusFamily()
"""The family object `registry.PIPELINES["QwenImageEditPlusPipeline"]` names."""

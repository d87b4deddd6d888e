"""Load Qwen-Image-Edit: the Qwen-Image components plus the checkpoint's `processor/`.

An edit checkpoint (`model_index.json` `_class_name` `QwenImageEditPipeline`) has the text-to-image
components plus `processor/` (Qwen2-VL image processor + tokenizer files), loaded here; everything else
goes through `qwen_image.loader.load_qwen_image`. `QWEN_IMAGE_EDIT` is the family object
`models/registry.py` names.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, ClassVar

import torch

from vllm_omni.diffusion.models import registry
from vllm_omni.diffusion.models.interface import FamilyCapabilities, RequestGeometry
from vllm_omni.diffusion.models.qwen_image.configs import REAL_PREPROCESSOR_CONFIG
from vllm_omni.diffusion.models.qwen_image.loader import (
    QwenImageComponents,
    QwenImageFamily,
    count_prompts,
    load_qwen_image,
    tokenizer_dir,
)
from vllm_omni.diffusion.models.qwen_image.packing import LATENT_MULTIPLE

TEXT_TO_IMAGE = "QwenImagePipeline"
IMAGE_EDIT = "QwenImageEditPipeline"


def load_qwen_image_edit(
    model: str,
    device: str | torch.device,
    dtype: torch.dtype,
    load_format: str = "auto",
    seed: int | None = None,
    attn_backend: Any = None,
    quantization: Any = None,
) -> QwenImageComponents:
    """`load_qwen_image` plus the processor (same arguments; `tiny-qwen-image-edit` accepted)."""
    model = registry.resolve_model(model)
    base = load_qwen_image(
        model,
        device,
        dtype,
        load_format=load_format,
        seed=seed,
        attn_backend=attn_backend,
        quantization=quantization,
    )
    processor = load_edit_processor_for(model, load_format, model_tokenizer=base.tokenizer)
    return dataclasses.replace(base, processor=processor)


def has_image_processor_config(processor_dir: Path) -> bool:
    """Whether `processor_dir` holds an image processor config in either layout transformers reads:
    `preprocessor_config.json` (the released checkpoints), or `processor_config.json` with the image
    processor nested under `image_processor` (what transformers 5's `save_pretrained` writes)."""
    if (processor_dir / "preprocessor_config.json").is_file():
        return True
    nested = processor_dir / "processor_config.json"
    if not nested.is_file():
        return False
    with open(nested, encoding="utf-8") as f:
        config = json.load(f)
    return isinstance(config, dict) and isinstance(config.get("image_processor"), dict)


def _processor_source(model: str, load_format: str):
    """(processor dir, tokenizer dir) of an edit checkpoint; (None, tiny tokenizer) for a dummy repo id.
    The tokenizer dir is processor/ when it has tokenizer files, else the model's tokenizer/ folder."""
    model = registry.resolve_model(model)
    local = Path(model).expanduser()
    if load_format == "dummy" and not local.is_dir():
        return None, tokenizer_dir(model, load_format)  # the tiny tokenizer stands in
    root = local if local.is_dir() else registry.resolve_model_path(model)
    processor_dir = root / "processor"
    if not has_image_processor_config(processor_dir):
        raise ValueError(
            f"model {model!r}: an edit checkpoint needs processor/preprocessor_config.json, or "
            "processor/processor_config.json with an 'image_processor' entry (transformers' save_pretrained)"
        )
    has_tokenizer = (processor_dir / "tokenizer_config.json").is_file()
    return processor_dir, processor_dir if has_tokenizer else tokenizer_dir(model, load_format)


def load_edit_processor_for(model: str, load_format: str = "auto", model_tokenizer=None):
    """The `QwenImageEditProcessor` of `model` (released values + tiny tokenizer for a dummy repo id).

    `model_tokenizer`: the model's text tokenizer, already loaded from its tokenizer/ folder; reused
    (not loaded again) when processor/ has no tokenizer files of its own."""
    from vllm_omni.diffusion.models.qwen_image_edit.processor import build_edit_processor, load_edit_processor

    processor_dir, tok_dir = _processor_source(model, load_format)
    if model_tokenizer is not None and tok_dir != processor_dir:
        tok_dir = model_tokenizer  # the same tokenizer/ folder load_qwen_image read
    if processor_dir is None:
        return build_edit_processor(REAL_PREPROCESSOR_CONFIG, tok_dir)
    return load_edit_processor(processor_dir, tok_dir)


def load_edit_prompt_processor(model: str, load_format: str = "auto"):
    """The engine-side prompt counter of an edit model (tokenizer + image processor, no weights)."""
    from vllm_omni.diffusion.models.qwen_image_edit.pipeline import QwenImageEditPromptProcessor

    processor = load_edit_processor_for(model, load_format)
    return QwenImageEditPromptProcessor(processor.tokenizer, processor.image_processor)


class EditImageInput:
    """Qwen-Image-Edit's image-input capability (`interface.ImageInput`): one image per request."""

    max_input_images: ClassVar[int] = 1

    def default_size(self, image) -> tuple[int, int]:
        """(height, width): diffusers' edit default, the input's aspect at about 1024 x 1024."""
        from vllm_omni.diffusion.models.qwen_image_edit.pipeline import edit_output_size

        return edit_output_size(image)

    def check_image(self, image) -> None:
        """`InvalidRequestError` for an image without pixels or too elongated for the vision encoder."""
        from vllm_omni.diffusion.models.qwen_image_edit.pipeline import check_condition_size

        check_condition_size(image)


class QwenImageEditFamily(QwenImageFamily):
    """Qwen-Image-Edit (`QwenImageEditPipeline`): Qwen-Image plus one input image per request."""

    pipeline_class_name: ClassVar[str] = IMAGE_EDIT
    image_input: ClassVar[Any] = EditImageInput()
    capabilities: ClassVar[FamilyCapabilities] = dataclasses.replace(
        QwenImageFamily.capabilities, display_name="Qwen-Image-Edit", prompt_embed_cache=False
    )
    """Qwen-Image's (the same transformer), but its prompt embedding reads the input image."""

    def load_components(self, model, device, dtype, load_format="auto") -> QwenImageComponents:
        """`load_qwen_image_edit` (device 'meta' with 'dummy': shapes only)."""
        return load_qwen_image_edit(model, device, dtype, load_format)

    def load_pipeline(
        self, model, device, dtype, load_format="auto", seed=None, attn_backend=None, quantization=None
    ):
        """`QwenImageEditStepPipeline` over `load_qwen_image_edit`'s components."""
        from vllm_omni.diffusion.models.qwen_image_edit.pipeline import QwenImageEditStepPipeline

        components = load_qwen_image_edit(model, device, dtype, load_format, seed, attn_backend, quantization)
        return QwenImageEditStepPipeline(components, device=device, dtype=dtype)

    def load_prompt_counter(self, model: str, load_format: str = "auto"):
        """`QwenImageEditPromptProcessor`: the edit template and the image's vision tokens."""
        return load_edit_prompt_processor(model, load_format)

    def request_geometry(self, prompts, request) -> RequestGeometry:
        """Prompt rows (edit prompts are not truncated) plus the input image's vision tokens in the text
        stream of every sequence, and its condition rows after the target in the image stream."""
        from vllm_omni.diffusion.models.qwen_image_edit.pipeline import check_image_input, edit_output_size

        pos, neg, num_pos, num_neg = count_prompts(prompts, request)
        check_image_input(True, request.image, request.sampling_params, pos, neg)
        num_vision = prompts.num_vision_tokens(request.image)
        cond_h, cond_w = edit_output_size(request.image)
        multiple = LATENT_MULTIPLE
        num_cond = (cond_h // multiple) * (cond_w // multiple)
        num_neg_txt = num_neg + num_vision if num_neg else 0
        return self._geometry(request.sampling_params, num_pos + num_vision, num_neg_txt, num_cond)


QWEN_IMAGE_EDIT = QwenImageEditFamily()
"""The family object `registry.PIPELINES["QwenImageEditPipeline"]` names."""

"""Pick and load the step pipeline a checkpoint needs: Qwen-Image or Qwen-Image-Edit.

The pipeline follows `model_index.json`'s `_class_name` (`QwenImagePipeline` / `QwenImageEditPipeline`),
as diffusers' `DiffusionPipeline.from_pretrained` does. An edit checkpoint has the text-to-image
components plus `processor/` (Qwen2-VL image processor + tokenizer files), loaded here; everything else
goes through `model_loader.load_qwen_image`.

    model                       class name from
    "tiny-qwen-image-edit"  ->  the tiny edit checkpoint (built once into the cache)
    local directory          ->  its model_index.json
    "Org/Name" repo id       ->  the Hub snapshot's model_index.json; with --load-format dummy (no I/O)
                                 `KNOWN_REPOS`, else text-to-image
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from vllm_omni.diffusion.model_loader import QwenImageComponents, load_qwen_image, resolve_model_path

TEXT_TO_IMAGE = "QwenImagePipeline"
IMAGE_EDIT = "QwenImageEditPipeline"
SUPPORTED_PIPELINES = (TEXT_TO_IMAGE, IMAGE_EDIT)

KNOWN_REPOS = {"Qwen/Qwen-Image": TEXT_TO_IMAGE, "Qwen/Qwen-Image-Edit": IMAGE_EDIT}
"""Pipeline of released repo ids, for `--load-format dummy` without a local copy."""

REAL_PREPROCESSOR_CONFIG: dict = {
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "merge_size": 2,
    "patch_size": 14,
    "resample": 3,
    "rescale_factor": 0.00392156862745098,
    "temporal_patch_size": 2,
    "size": {"shortest_edge": 3136, "longest_edge": 12845056},
}
"""`processor/preprocessor_config.json` of Qwen/Qwen-Image-Edit (min / max pixels 3136 / 12845056)."""


def _resolve(model: str) -> str:
    """`tiny-qwen-image-edit` -> its cached directory; anything else unchanged."""
    from vllm_omni.tools.make_tiny_edit_checkpoint import TINY_EDIT_MODEL_NAME, ensure_tiny_edit_checkpoint

    return str(ensure_tiny_edit_checkpoint()) if model == TINY_EDIT_MODEL_NAME else model


def pipeline_class_name(model: str, load_format: str = "auto") -> str:
    """`model_index.json`'s `_class_name` for `model`; ValueError for a pipeline we do not serve."""
    model = _resolve(model)
    local = Path(model).expanduser()
    if load_format == "dummy" and not local.is_dir():
        return KNOWN_REPOS.get(model, TEXT_TO_IMAGE)
    path = local if local.is_dir() else resolve_model_path(model)
    with open(path / "model_index.json", encoding="utf-8") as f:
        name = json.load(f).get("_class_name")
    if name not in SUPPORTED_PIPELINES:
        raise ValueError(
            f"model {model!r} is a {name!r} checkpoint; supported pipelines: {', '.join(SUPPORTED_PIPELINES)}"
        )
    return name


def load_qwen_image_edit(
    model: str,
    device: str | torch.device,
    dtype: torch.dtype,
    load_format: str = "auto",
    seed: int | None = None,
    attn_backend: Any = None,
) -> QwenImageComponents:
    """`load_qwen_image` plus the processor (same arguments; `tiny-qwen-image-edit` accepted)."""
    model = _resolve(model)
    base = load_qwen_image(
        model, device, dtype, load_format=load_format, seed=seed, attn_backend=attn_backend
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
    from vllm_omni.diffusion.model_loader import tokenizer_dir
    from vllm_omni.tools.make_tiny_checkpoint import ensure_tiny_checkpoint

    model = _resolve(model)
    local = Path(model).expanduser()
    if load_format == "dummy" and not local.is_dir():
        return None, ensure_tiny_checkpoint() / "tokenizer"
    root = local if local.is_dir() else resolve_model_path(model)
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


def load_step_pipeline(
    model: str,
    device: torch.device,
    dtype: torch.dtype,
    load_format: str = "auto",
    seed: int | None = None,
    attn_backend: Any = None,
):
    """The step pipeline for `model`: `QwenImageStepPipeline` or `QwenImageEditStepPipeline`."""
    if pipeline_class_name(model, load_format) == IMAGE_EDIT:
        from vllm_omni.diffusion.models.qwen_image_edit.pipeline import QwenImageEditStepPipeline

        components = load_qwen_image_edit(model, device, dtype, load_format, seed, attn_backend)
        return QwenImageEditStepPipeline(components, device=device, dtype=dtype)
    from vllm_omni.diffusion.models.qwen_image.pipeline import QwenImageStepPipeline

    components = load_qwen_image(
        model, device, dtype, load_format=load_format, seed=seed, attn_backend=attn_backend
    )
    return QwenImageStepPipeline(components, device=device, dtype=dtype)

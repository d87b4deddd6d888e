"""The one table of the model families this engine serves, their released repos and built-in tiny models.

Families are named by module string and imported on first use, so nothing here (and nothing that
imports only this module) depends on a family at import time:

    model                       pipeline class from
    "tiny-qwen-image[-edit[-plus]]" -> the tiny checkpoint (built once into the cache: `TINY_MODELS`)
    local directory          -> its model_index.json `_class_name`
    "Org/Name" repo id       -> the Hub snapshot's model_index.json; with --load-format dummy (no I/O)
                                `KNOWN_REPOS`, else `DEFAULT_PIPELINE`

Adding a family: its folder (see `interface.py`) and one line in `PIPELINES`. Torch-free at import
(the CLI reads `supported_pipelines()` before anything loads torch).
"""

from __future__ import annotations

import functools
import importlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm_omni.config import TINY_EDIT_MODEL_NAME, TINY_MODEL_NAME

if TYPE_CHECKING:
    from vllm_omni.diffusion.models.interface import ModelFamily, StepPipeline

PIPELINES: dict[str, str] = {
    "QwenImagePipeline": "vllm_omni.diffusion.models.qwen_image.loader:QWEN_IMAGE",
    "QwenImageEditPipeline": "vllm_omni.diffusion.models.qwen_image_edit.loader:QWEN_IMAGE_EDIT",
    "QwenImage21Pipeline": "vllm_omni.diffusion.models.qwen_image21.loader:QWEN_IMAGE21",
    "QwenImageEditPlusPipeline": (
        "vllm_omni.diffusion.models.qwen_image_edit_plus.loader:QWEN_IMAGE_EDIT_PLUS"
    ),
}
"""`model_index.json` `_class_name` -> the family object (`interface.ModelFamily`) that serves it."""

DEFAULT_PIPELINE = "QwenImagePipeline"
"""The pipeline of a dummy model named by an unknown repo id (nothing to read its class from)."""

KNOWN_REPOS = {
    "Qwen/Qwen-Image": "QwenImagePipeline",
    "Qwen/Qwen-Image-Edit": "QwenImageEditPipeline",
    "Qwen/Qwen-Image-2.1": "QwenImage21Pipeline",
    "Qwen/Qwen-Image-Edit-2509": "QwenImageEditPlusPipeline",
    "Qwen/Qwen-Image-Edit-2511": "QwenImageEditPlusPipeline",
}
"""Pipeline of released repo ids, for `--load-format dummy` without a local copy."""

TINY_MODELS: dict[str, str] = {
    TINY_MODEL_NAME: "vllm_omni.diffusion.models.qwen_image.tiny:ensure_tiny_checkpoint",
    TINY_EDIT_MODEL_NAME: "vllm_omni.diffusion.models.qwen_image_edit.tiny:ensure_tiny_edit_checkpoint",
    "tiny-qwen-image-2.1": "vllm_omni.diffusion.models.qwen_image21.tiny:ensure_tiny_checkpoint",
    "tiny-qwen-image-edit-plus": (
        "vllm_omni.diffusion.models.qwen_image_edit_plus.tiny:ensure_tiny_checkpoint"
    ),
}
"""Built-in model names -> the builder that makes (once) and returns their checkpoint directory."""


def _resolve_ref(ref: str) -> Any:
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


def supported_pipelines() -> tuple[str, ...]:
    """Every `_class_name` this engine serves (`--model-class-name` accepts these)."""
    return tuple(PIPELINES)


def ensure_tiny(name: str, cache_dir: Path | None = None, seed: int = 0) -> Path:
    """The checkpoint directory of the built-in tiny model `name`, built first if absent or stale."""
    return _resolve_ref(TINY_MODELS[name])(cache_dir, seed)


def resolve_model(model: str) -> str:
    """A built-in tiny name -> its checkpoint directory; anything else unchanged."""
    return str(ensure_tiny(model)) if model in TINY_MODELS else model


def resolve_model_path(model: str) -> Path:
    """The checkpoint directory of `model`: a built-in tiny model's (built once), else
    `model_loader.resolve_model_path` (a local directory or a Hub snapshot)."""
    from vllm_omni.diffusion import model_loader  # imports torch: only when a path is resolved

    if model in TINY_MODELS:
        return ensure_tiny(model)
    return model_loader.resolve_model_path(model)


def pipeline_class_name(model: str, load_format: str = "auto") -> str:
    """`model_index.json`'s `_class_name` for `model`; ValueError for a pipeline we do not serve."""
    model = resolve_model(model)
    local = Path(model).expanduser()
    if load_format == "dummy" and not local.is_dir():
        return KNOWN_REPOS.get(model, DEFAULT_PIPELINE)
    path = local if local.is_dir() else resolve_model_path(model)
    with open(path / "model_index.json", encoding="utf-8") as f:
        name = json.load(f).get("_class_name")
    if name not in PIPELINES:
        raise ValueError(
            f"model {model!r} is a {name!r} checkpoint; supported pipelines: {', '.join(PIPELINES)}"
        )
    return name


@functools.cache
def family(class_name: str) -> ModelFamily:
    """The family serving pipeline class `class_name`; ValueError naming the supported ones."""
    if class_name not in PIPELINES:
        raise ValueError(f"pipeline {class_name!r} is not supported; supported: {', '.join(PIPELINES)}")
    return _resolve_ref(PIPELINES[class_name])


def family_for(model: str, load_format: str = "auto") -> ModelFamily:
    """The family of checkpoint `model` (its model_index.json, or `KNOWN_REPOS` for a dummy repo id)."""
    return family(pipeline_class_name(model, load_format))


def family_of(pipeline: StepPipeline) -> ModelFamily:
    """The family of an already-built step pipeline (its `pipeline_class_name`)."""
    return family(pipeline.pipeline_class_name)


def check_config(family: ModelFamily, config: Any) -> None:
    """ValueError naming every setting of `config` the family's capabilities do not declare (before
    anything loads; `FamilyCapabilities.refusals`)."""
    errors = family.capabilities.refusals(config)
    if errors:
        raise ValueError("; ".join(errors))


def check_plans(family: ModelFamily, pipeline: StepPipeline) -> None:
    """TypeError when the family declares a capability its transformer's plans do not back (LoRA
    without `plans.lora`, parallelism without `plans.tensor_parallel`, batch invariance without
    `plans.invariant_norms`): checked once, when the pipeline loads."""
    caps, plans = family.capabilities, pipeline.transformer.plans
    missing = [
        what
        for what, declared, planned in (
            ("lora", caps.lora, plans.lora is not None),
            ("parallel", caps.parallel, plans.tensor_parallel is not None),
            ("batch_invariant", caps.batch_invariant, bool(plans.invariant_norms)),
        )
        if declared and not planned
    ]
    if missing:
        raise TypeError(
            f"{family.pipeline_class_name} declares {missing} in its capabilities, but "
            f"{type(pipeline.transformer).__name__}.plans has no plan for them"
        )


def load_step_pipeline(
    model: str,
    device,
    dtype,
    load_format: str = "auto",
    seed: int | None = None,
    attn_backend: Any = None,
    quantization: Any = None,
) -> StepPipeline:
    """The step pipeline of `model`, by the family its model_index.json names."""
    family = family_for(model, load_format)
    pipeline = family.load_pipeline(model, device, dtype, load_format, seed, attn_backend, quantization)
    check_plans(family, pipeline)
    return pipeline

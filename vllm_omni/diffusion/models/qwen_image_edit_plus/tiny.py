"""Build a tiny random Qwen-Image-Edit-2509 checkpoint in the released diffusers layout, offline.

    python -m vllm_omni.diffusion.models.qwen_image_edit_plus.tiny DIR --seed 0

writes the tiny Qwen-Image-Edit checkpoint (`qwen_image_edit.tiny`: the same components, drawn the same
way; the released 2509 checkpoint has Qwen-Image-Edit's layout and sizes) with `model_index.json` naming
`QwenImageEditPlusPipeline`. `ensure_tiny_checkpoint()` builds it once into the cache
(`tiny-qwen-image-edit-plus-seed<seed>`).
"""

from __future__ import annotations

from pathlib import Path

from vllm_omni.diffusion.models.qwen_image import configs
from vllm_omni.diffusion.models.qwen_image_edit.tiny import EDIT_MODEL_INDEX, make_tiny_edit_checkpoint
from vllm_omni.diffusion.models.qwen_image_edit_plus.pipeline import PIPELINE_CLASS_NAME
from vllm_omni.diffusion.models.tiny_cache import (
    VERSION_FILE,
    ensure_built,
    run_checkpoint_cli,
    save_scheduler_and_index,
    write_json,
)

TINY_MODEL_NAME = "tiny-qwen-image-edit-plus"
TINY_CHECKPOINT_VERSION = 1
"""Bumped whenever the tiny checkpoint's content changes, so stale caches are rebuilt."""

EDIT_PLUS_MODEL_INDEX: dict = {**EDIT_MODEL_INDEX, "_class_name": PIPELINE_CLASS_NAME}
"""`model_index.json` of Qwen/Qwen-Image-Edit-2509 (without `_diffusers_version`)."""


def make_tiny_checkpoint(out_dir: str | Path, seed: int = 0) -> Path:
    """Write the tiny random Qwen-Image-Edit-2509 pipeline to `out_dir` (created; must be empty or absent)."""
    out_dir = make_tiny_edit_checkpoint(out_dir, seed)
    save_scheduler_and_index(out_dir, configs.TINY_SCHEDULER_CONFIG, EDIT_PLUS_MODEL_INDEX)
    write_json(out_dir / VERSION_FILE, {"version": TINY_CHECKPOINT_VERSION, "seed": seed})
    return out_dir


def ensure_tiny_checkpoint(cache_dir: Path | None = None, seed: int = 0) -> Path:
    """Return `<cache_dir>/tiny-qwen-image-edit-plus-seed<seed>`, building it first if absent or stale."""
    return ensure_built(TINY_MODEL_NAME, make_tiny_checkpoint, TINY_CHECKPOINT_VERSION, cache_dir, seed)


def main(argv: list[str] | None = None) -> None:
    """CLI entry point: `python -m vllm_omni.diffusion.models.qwen_image_edit_plus.tiny DIR [--seed N]`."""
    run_checkpoint_cli(make_tiny_checkpoint, "Qwen-Image-Edit-2509", __doc__.split("\n\n")[0], argv)


if __name__ == "__main__":
    main()

"""The tiny Qwen-Image-Edit checkpoint and the loader that picks the pipeline from model_index.json."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from PIL import Image

from vllm_omni.diffusion.models.qwen_image_edit.loader import (
    IMAGE_EDIT,
    TEXT_TO_IMAGE,
    load_edit_processor_for,
    load_qwen_image_edit,
)
from vllm_omni.diffusion.models.qwen_image_edit.pipeline import (
    EDIT_PROMPT_TEMPLATE,
    calculate_dimensions,
    edit_output_size,
)
from vllm_omni.diffusion.models.qwen_image_edit.processor import QwenImageEditProcessor, load_edit_processor
from vllm_omni.diffusion.models.qwen_image_edit.tiny import TINY_EDIT_MODEL_NAME, make_tiny_edit_checkpoint
from vllm_omni.diffusion.models.registry import pipeline_class_name


def _digest(path) -> dict[str, str]:
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in path.rglob("*")
        if p.is_file()
    }


def test_layout_and_same_seed_same_bytes(tiny_edit_model_dir, tmp_path):
    index = json.loads((tiny_edit_model_dir / "model_index.json").read_text())
    assert index["_class_name"] == IMAGE_EDIT and index["processor"] == ["transformers", "Qwen2VLProcessor"]
    for folder in ("transformer", "vae", "text_encoder", "tokenizer", "processor", "scheduler"):
        assert (tiny_edit_model_dir / folder).is_dir()
    total = sum(p.stat().st_size for p in tiny_edit_model_dir.rglob("*") if p.is_file())
    assert total < 8 * 2**20
    again = make_tiny_edit_checkpoint(tmp_path / "again", seed=0)
    assert _digest(again) == _digest(tiny_edit_model_dir)
    with pytest.raises(ValueError, match="not empty"):
        make_tiny_edit_checkpoint(again)


def test_processor_without_video_half_expands_the_image(tiny_edit_model_dir):
    processor = load_edit_processor(tiny_edit_model_dir / "processor")
    assert isinstance(processor, QwenImageEditProcessor) and not hasattr(processor, "video_processor")
    image = Image.new("RGB", (300, 200), (10, 200, 30))
    inputs = processor(
        text=[EDIT_PROMPT_TEMPLATE.format("make it blue")], images=[image], return_tensors="pt"
    )
    t, h, w = inputs["image_grid_thw"][0].tolist()
    num_pads = int((inputs["input_ids"] == processor.image_token_id).sum())
    assert num_pads == t * h * w // 4 and 1 <= num_pads <= 16  # the tiny 112 x 112 pixel cap


def test_processor_reuses_the_model_tokenizer_only_when_it_has_none(tiny_edit_model_dir, tmp_path):
    """processor/ with tokenizer files: its own tokenizer; without: the model's, not loaded again."""
    import shutil

    from transformers import AutoTokenizer

    model_tokenizer = AutoTokenizer.from_pretrained(tiny_edit_model_dir / "tokenizer")
    own = load_edit_processor_for(str(tiny_edit_model_dir), model_tokenizer=model_tokenizer)
    assert own.tokenizer is not model_tokenizer
    bare = tmp_path / "edit"
    shutil.copytree(tiny_edit_model_dir, bare)
    for f in (bare / "processor").iterdir():
        if f.name != "preprocessor_config.json":
            f.unlink()
    reused = load_edit_processor_for(str(bare), model_tokenizer=model_tokenizer)
    assert reused.tokenizer is model_tokenizer
    loaded = load_edit_processor_for(str(bare))  # no tokenizer given: the tokenizer/ folder's
    prompt = EDIT_PROMPT_TEMPLATE.format("make it blue")
    assert (
        loaded.tokenizer(prompt).input_ids
        == reused.tokenizer(prompt).input_ids
        == own.tokenizer(prompt).input_ids
    )


def test_calculate_dimensions_matches_diffusers():
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions as reference

    for w, h in ((80, 48), (40, 72), (64, 64), (1920, 1080), (333, 1000)):
        assert calculate_dimensions(1024 * 1024, w / h) == reference(1024 * 1024, w / h)[:2]
    assert edit_output_size(Image.new("RGB", (80, 48))) == (800, 1312)


def test_pipeline_class_from_model_index(tiny_edit_model_dir, tiny_model_dir, tmp_path):
    assert pipeline_class_name(str(tiny_edit_model_dir)) == IMAGE_EDIT
    assert pipeline_class_name(TINY_EDIT_MODEL_NAME) == IMAGE_EDIT
    assert pipeline_class_name(str(tiny_model_dir)) == TEXT_TO_IMAGE
    assert pipeline_class_name("Qwen/Qwen-Image-Edit", load_format="dummy") == IMAGE_EDIT
    other = tmp_path / "other"
    other.mkdir()
    (other / "model_index.json").write_text(json.dumps({"_class_name": "QwenImageEditPlusPipeline"}))
    assert pipeline_class_name(str(other)) == "QwenImageEditPlusPipeline"  # Edit-2509: served
    (other / "model_index.json").write_text(json.dumps({"_class_name": "QwenImageLayeredPipeline"}))
    with pytest.raises(ValueError, match="QwenImageLayeredPipeline"):
        pipeline_class_name(str(other))


def test_dummy_real_size_edit_model_on_meta():
    components = load_qwen_image_edit("Qwen/Qwen-Image-Edit", "meta", torch.bfloat16, load_format="dummy")
    size = components.processor.image_processor.size
    assert (size.shortest_edge, size.longest_edge) == (3136, 12845056)
    assert components.transformer.config.num_layers == 60


def test_startup_checks_pass_the_tiny_edit_model(tiny_edit_model_dir):
    """`vllm serve tiny-qwen-image-edit` (docs/image_edit.md) passes the start-up checks: its name is the
    tiny checkpoint, not a hub id whose real-size configs need 105 GiB (found by fuzzing the CLI)."""
    from vllm_omni.config import OmniDiffusionConfig
    from vllm_omni.entrypoints.cli.startup_checks import estimate_weights, startup_errors

    config = OmniDiffusionConfig(model=TINY_EDIT_MODEL_NAME, device="cpu", step_execution=True)
    assert startup_errors(config) == []
    assert estimate_weights(config, torch.device("cpu")).num_transformer_params < 10**6

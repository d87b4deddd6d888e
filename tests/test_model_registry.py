"""The model registry: one table of pipeline classes, released repos and built-in tiny models."""

from __future__ import annotations

import argparse

import pytest

from vllm_omni.diffusion.models import registry
from vllm_omni.entrypoints.cli.serve import unsupported_flag_errors


def _args(**kwargs) -> argparse.Namespace:
    return argparse.Namespace(model="tiny-qwen-image", **kwargs)


@pytest.mark.parametrize("class_name", ["QwenImagePipeline", "QwenImageEditPipeline"])
def test_cli_accepts_every_pipeline_the_server_serves(class_name):
    """The CLI's list was a stale copy that refused --model-class-name QwenImageEditPipeline."""
    assert unsupported_flag_errors(_args(model_class_name=class_name)) == []


def test_cli_refuses_a_pipeline_no_family_serves():
    (error,) = unsupported_flag_errors(_args(model_class_name="WanPipeline"))
    assert "WanPipeline is not supported" in error and "QwenImageEditPipeline" in error


def test_each_class_name_has_its_family(tiny_model_dir, tiny_edit_model_dir):
    assert registry.supported_pipelines() == (
        "QwenImagePipeline",
        "QwenImageEditPipeline",
        "QwenImage21Pipeline",
        "QwenImageEditPlusPipeline",
    )
    for name in registry.supported_pipelines():
        family = registry.family(name)
        assert family.pipeline_class_name == name
    assert registry.family_for(str(tiny_model_dir)).image_input is None
    edit = registry.family_for(str(tiny_edit_model_dir)).image_input
    assert edit.max_input_images == 1
    assert registry.family_for("Qwen/Qwen-Image-Edit", "dummy").pipeline_class_name == "QwenImageEditPipeline"
    for repo in ("Qwen/Qwen-Image-Edit-2509", "Qwen/Qwen-Image-Edit-2511"):
        plus = registry.family_for(repo, "dummy")
        assert (
            plus.pipeline_class_name == "QwenImageEditPlusPipeline" and plus.image_input.max_input_images > 1
        )
    assert registry.family_for("Org/Unknown", "dummy").pipeline_class_name == registry.DEFAULT_PIPELINE
    with pytest.raises(ValueError, match="supported"):
        registry.family("WanPipeline")


def test_tiny_names_resolve_to_their_checkpoints(tiny_model_dir, tiny_edit_model_dir):
    assert registry.resolve_model_path("tiny-qwen-image") == tiny_model_dir
    assert registry.resolve_model("tiny-qwen-image-edit") == str(tiny_edit_model_dir)
    assert registry.resolve_model("/some/dir") == "/some/dir"


def test_dummy_2509_builds_the_20b_transformer_on_meta_with_its_prompt_counter():
    """`vllm serve Qwen/Qwen-Image-Edit-2509 --load-format dummy` needs no download."""
    import torch

    family = registry.family_for("Qwen/Qwen-Image-Edit-2509", "dummy")
    found = family.load_components("Qwen/Qwen-Image-Edit-2509", "meta", torch.bfloat16, "dummy")
    assert 20.3 < sum(p.numel() for p in found.transformer.parameters()) / 1e9 < 20.5
    assert found.processor is not None
    assert type(family.load_prompt_counter("Qwen/Qwen-Image-Edit-2509", "dummy")).__name__ == (
        "EditPlusPromptProcessor"
    )

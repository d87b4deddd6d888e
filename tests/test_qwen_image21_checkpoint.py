"""The tiny Qwen-Image-2.1 checkpoint: the released diffusers layout, determinism, and that diffusers'
`QwenImage21Pipeline` loads and runs it (CPU)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from vllm_omni.diffusion.models import registry
from vllm_omni.diffusion.models.qwen_image21 import configs, tiny
from vllm_omni.diffusion.models.qwen_image21.processor import PromptCounter, TextProcessor

MODEL = tiny.TINY_MODEL_NAME


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return registry.resolve_model_path(MODEL)


def _file_hashes(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_layout_is_the_released_one(model_dir):
    index = json.loads((model_dir / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImage21Pipeline"
    for name in ("transformer", "vae", "text_encoder", "processor", "scheduler"):
        assert index[name] == configs.MODEL_INDEX[name]
        assert (model_dir / name).is_dir()
    assert (model_dir / "processor" / "chat_template.jinja").is_file()
    transformer = json.loads((model_dir / "transformer" / "config.json").read_text())
    assert transformer["_class_name"] == "QwenImage21Transformer2DModel"
    assert transformer["causal_condition"] is True
    total = sum(p.stat().st_size for p in model_dir.rglob("*") if p.is_file())
    assert total < 8 * 2**20


def test_same_seed_same_bytes(model_dir, tmp_path):
    tiny.main([str(tmp_path / "again"), "--seed", "0"])
    assert _file_hashes(tmp_path / "again") == _file_hashes(model_dir)


def test_prompt_counter_matches_the_pipeline_drop(model_dir):
    from vllm_omni.diffusion.models.qwen_image21.loader import diffusers_pipeline

    pipe = diffusers_pipeline(model_dir)
    counter = PromptCounter(TextProcessor.from_pretrained(model_dir / "processor").tokenizer)
    assert counter.num_dropped == pipe._drop_idx
    embeds, mask, _ = pipe.encode_prompt("a red cube on a table", device=torch.device("cpu"))
    assert mask is None
    assert embeds.shape[1] == counter.count("prompt", "a red cube on a table").num_embedded_tokens


def test_diffusers_runs_it_with_and_without_its_kv_cache(model_dir):
    from vllm_omni.diffusion.models.qwen_image21.loader import diffusers_pipeline

    pipe = diffusers_pipeline(model_dir)
    images = {}
    for use_kv_cache in (True, False):
        images[use_kv_cache] = pipe(
            "a red cube",
            height=64,
            width=32,
            num_inference_steps=2,
            generator=torch.Generator().manual_seed(1),
            output_type="np",
            use_kv_cache=use_kv_cache,
        ).images
    assert images[True].shape == (1, 64, 32, 4)  # RGBA
    np.testing.assert_allclose(images[True], images[False], atol=1e-5)
    assert images[True].std() > 0.05


def test_dummy_of_the_released_repo_builds_real_size_components_without_files():
    """`vllm serve Qwen/Qwen-Image-2.1 --load-format dummy` needs no download: the released sizes come from
    `configs.REAL_*` (built here on the meta device: no memory), checked against diffusers' own classes and
    the public parameter counts (a 7.1B transformer, an 8.8B Qwen3-VL-8B text encoder)."""
    from diffusers import AutoencoderKLQwenImage21, QwenImage21Transformer2DModel

    from vllm_omni.diffusion.models.qwen_image21.loader import QWEN_IMAGE21, load_qwen_image21

    model = "Qwen/Qwen-Image-2.1"
    assert registry.pipeline_class_name(model, "dummy") == configs.PIPELINE_CLASS_NAME
    found = load_qwen_image21(model, "meta", torch.bfloat16, load_format="dummy")
    billions = [sum(p.numel() for p in m.parameters()) / 1e9 for m in (found.transformer, found.text_encoder)]
    assert 7.0 < billions[0] < 7.2 and 8.7 < billions[1] < 8.9, billions
    with torch.device("meta"):
        reference = QwenImage21Transformer2DModel(**configs.REAL_TRANSFORMER_CONFIG)
        vae = AutoencoderKLQwenImage21(**configs.REAL_VAE_CONFIG)
    assert {n: p.shape for n, p in found.transformer.named_parameters()} == {
        n: p.shape for n, p in reference.named_parameters()
    }
    assert {n: p.shape for n, p in found.vae.named_parameters()} == {
        n: p.shape for n, p in vae.named_parameters()
    }
    assert found.model_path is None and found.transformer_config["context_in_dim"] == 4096
    prompts = QWEN_IMAGE21.load_prompt_counter(model, "dummy")  # the tiny tokenizer stands in
    assert isinstance(prompts, PromptCounter)
    with pytest.raises(ValueError, match="pass one of those"):
        load_qwen_image21("Org/Unknown", "meta", torch.bfloat16, load_format="dummy")

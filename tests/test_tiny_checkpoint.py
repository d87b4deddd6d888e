"""The tiny random Qwen-Image checkpoint: layout, determinism, and that diffusers / transformers load it."""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from vllm_omni.diffusion.models import tiny_cache
from vllm_omni.diffusion.models.qwen_image import configs
from vllm_omni.diffusion.models.qwen_image import tiny as mtc
from vllm_omni.diffusion.models.qwen_image.pipeline import PROMPT_TEMPLATE


def _file_hashes(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_same_seed_same_bytes_other_seed_other_weights(tiny_model_dir, tmp_path):
    again = tmp_path / "again"
    mtc.main([str(again), "--seed", "0"])  # through the CLI
    assert _file_hashes(again) == _file_hashes(tiny_model_dir)

    other = mtc.make_tiny_checkpoint(tmp_path / "seed1", seed=1)
    name = "transformer/diffusion_pytorch_model.safetensors"
    a, b = load_file(tiny_model_dir / name), load_file(other / name)
    assert a.keys() == b.keys()
    assert not any(torch.equal(a[k], b[k]) for k in a)
    total = sum(p.stat().st_size for p in tiny_model_dir.rglob("*") if p.is_file())
    assert total < 8 * 2**20, f"tiny checkpoint is {total / 2**20:.1f} MiB"


def test_make_refuses_non_empty_dir(tmp_path):
    (tmp_path / "x").write_text("keep me")
    with pytest.raises(ValueError, match="not empty"):
        mtc.make_tiny_checkpoint(tmp_path)


def test_diffusers_layout(tiny_model_dir):
    index = json.loads((tiny_model_dir / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImagePipeline"
    assert {k: tuple(v) for k, v in index.items() if not k.startswith("_")} == {
        "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
        "text_encoder": ("transformers", "Qwen2_5_VLForConditionalGeneration"),
        "tokenizer": ("transformers", "Qwen2Tokenizer"),
        "transformer": ("diffusers", "QwenImageTransformer2DModel"),
        "vae": ("diffusers", "AutoencoderKLQwenImage"),
    }
    for rel in [
        "transformer/config.json",
        "transformer/diffusion_pytorch_model.safetensors",
        "vae/config.json",
        "vae/diffusion_pytorch_model.safetensors",
        "text_encoder/config.json",
        "text_encoder/model.safetensors",
        "tokenizer/tokenizer.json",
        "tokenizer/tokenizer_config.json",
        "tokenizer/vocab.json",
        "tokenizer/merges.txt",
        "scheduler/scheduler_config.json",
    ]:
        assert (tiny_model_dir / rel).is_file(), rel
    scheduler = json.loads((tiny_model_dir / "scheduler/scheduler_config.json").read_text())
    for key, value in configs.REAL_SCHEDULER_CONFIG.items():
        assert scheduler[key] == value, key
    vae = json.loads((tiny_model_dir / "vae/config.json").read_text())
    assert vae["z_dim"] == 16 and len(vae["temperal_downsample"]) == 3
    assert vae["latents_mean"] == configs.LATENTS_MEAN and vae["latents_std"] == configs.LATENTS_STD
    transformer = json.loads((tiny_model_dir / "transformer/config.json").read_text())
    text = json.loads((tiny_model_dir / "text_encoder/config.json").read_text())
    assert transformer["joint_attention_dim"] == text["text_config"]["hidden_size"]
    assert transformer["in_channels"] == vae["z_dim"] * transformer["patch_size"] ** 2


def test_every_transformer_weight_has_signal(tiny_model_dir):
    weights = load_file(tiny_model_dir / "transformer/diffusion_pytorch_model.safetensors")
    assert len(weights) > 50
    for name, tensor in weights.items():
        assert tensor.count_nonzero() > 0, f"{name} is all zero"
        assert tensor.unique().numel() > 1, f"{name} is constant"


def test_tokenizer_drops_exactly_the_template(tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir / "tokenizer")
    text = json.loads((tiny_model_dir / "text_encoder/config.json").read_text())
    vocab_size = text["text_config"]["vocab_size"]
    for token in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):
        ids = tokenizer(token, add_special_tokens=False).input_ids
        assert len(ids) == 1 and ids[0] < vocab_size, token
    assert tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.convert_tokens_to_ids("<|image_pad|>") == text["image_token_id"]
    assert max(tokenizer.get_vocab().values()) < vocab_size

    prefix = PROMPT_TEMPLATE.split("{}")[0]
    # As with the released Qwen2 tokenizer, the template prefix is the 34 tokens diffusers drops.
    assert len(tokenizer(prefix).input_ids) == 34
    prompt = "a red cube on a table, 3 cats"
    ids = tokenizer(PROMPT_TEMPLATE.format(prompt)).input_ids
    assert tokenizer.decode(ids[34:]).startswith(prompt)


def test_diffusers_pipeline_loads_offline_and_runs(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(tiny_model_dir, dtype=torch.float32)
    prompt = "a red cube on a table"
    embeds, mask = pipe.encode_prompt(prompt, device=torch.device("cpu"))
    suffix_ids = pipe.tokenizer(prompt + "<|im_end|>\n<|im_start|>assistant\n").input_ids
    assert embeds.shape == (1, len(suffix_ids), 32)  # 34 template tokens dropped, nothing else
    assert mask is None or int(mask.sum()) == len(suffix_ids)

    out = pipe(
        prompt=prompt,
        height=32,
        width=32,
        num_inference_steps=2,
        output_type="np",
        generator=torch.Generator("cpu").manual_seed(0),
    )
    image = out.images
    assert image.shape == (1, 32, 32, 3)
    assert np.isfinite(image).all()
    assert image.std() > 0.02, "decoded image is (nearly) constant"


def _fake_make(calls: list, barrier: threading.Barrier | None = None):
    """Stand-in for make_tiny_checkpoint: writes a complete-looking checkpoint quickly."""

    def make(out_dir, seed=0):
        calls.append(seed)
        if barrier is not None:
            barrier.wait(timeout=30)  # every caller builds at once, then they race to rename
        out_dir = Path(out_dir)
        (out_dir / "model_index.json").write_text("{}")
        (out_dir / mtc.VERSION_FILE).write_text(
            json.dumps({"version": mtc.TINY_CHECKPOINT_VERSION, "seed": seed})
        )
        return out_dir

    return make


def test_ensure_builds_once_and_rebuilds_stale(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(mtc, "make_tiny_checkpoint", _fake_make(calls))
    path = mtc.ensure_tiny_checkpoint(tmp_path)
    assert path == tmp_path / "tiny-qwen-image-seed0" and (path / "model_index.json").is_file()
    assert mtc.ensure_tiny_checkpoint(tmp_path) == path and len(calls) == 1

    (path / mtc.VERSION_FILE).write_text(json.dumps({"version": -1, "seed": 0}))
    assert mtc.ensure_tiny_checkpoint(tmp_path) == path and len(calls) == 2
    assert json.loads((path / mtc.VERSION_FILE).read_text())["version"] == mtc.TINY_CHECKPOINT_VERSION

    monkeypatch.setenv(tiny_cache.CACHE_ENV, str(tmp_path / "env"))
    assert mtc.ensure_tiny_checkpoint() == tmp_path / "env" / "tiny-qwen-image-seed0"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp leftovers


def test_ensure_concurrent_callers_agree(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(mtc, "make_tiny_checkpoint", _fake_make(calls, threading.Barrier(3)))
    results, errors = [], []

    def call():
        try:
            results.append(mtc.ensure_tiny_checkpoint(tmp_path))
        except Exception as exc:  # reported by the assert below
            errors.append(exc)

    threads = [threading.Thread(target=call) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(calls) == 3, "the callers did not race"
    assert errors == [] and len(results) == 3 and len(set(results)) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-qwen-image-seed0"]

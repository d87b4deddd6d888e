"""Model loader: our transformer gets exactly diffusers' weights; sharded files; errors; dummy weights."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from vllm_omni.config import TINY_MODEL_NAME
from vllm_omni.diffusion.model_loader import load_transformer_weights
from vllm_omni.diffusion.models.qwen_image import configs
from vllm_omni.diffusion.models.qwen_image.loader import load_qwen_image
from vllm_omni.diffusion.models.qwen_image.transformer import QwenImageTransformer
from vllm_omni.diffusion.models.registry import resolve_model_path

WEIGHTS = "transformer/diffusion_pytorch_model.safetensors"


@pytest.fixture(scope="module")
def diffusers_state(tiny_model_dir) -> dict[str, torch.Tensor]:
    from diffusers import QwenImageTransformer2DModel

    return QwenImageTransformer2DModel.from_pretrained(tiny_model_dir, subfolder="transformer").state_dict()


def _assert_same_state(model: torch.nn.Module, reference: dict[str, torch.Tensor], dtype=torch.float32):
    state = model.state_dict()
    assert sorted(state) == sorted(reference)
    for name, tensor in reference.items():
        assert state[name].dtype == dtype, name
        assert torch.equal(state[name], tensor.to(dtype)), name


def test_auto_load_matches_diffusers(tiny_model_dir, diffusers_state):
    components = load_qwen_image(str(tiny_model_dir), "cpu", torch.float32, attn_backend="SDPA")
    transformer = components.transformer
    assert isinstance(transformer, QwenImageTransformer) and transformer.attn_backend == "SDPA"
    _assert_same_state(transformer, diffusers_state)
    for module in (transformer, components.vae, components.text_encoder):
        assert not module.training
        assert not any(p.requires_grad for p in module.parameters())
    assert components.vae.dtype == torch.float32 and components.text_encoder.dtype == torch.float32
    assert type(components.tokenizer).__name__ == "Qwen2Tokenizer"
    assert components.model_path == tiny_model_dir
    assert components.scheduler_config == json.loads(
        (tiny_model_dir / "scheduler/scheduler_config.json").read_text()
    )
    assert components.transformer_config["num_layers"] == 2


def test_auto_load_bf16_keeps_cpu_vae_fp32(tiny_model_dir, diffusers_state):
    components = load_qwen_image(str(tiny_model_dir), "cpu", torch.bfloat16)
    _assert_same_state(components.transformer, diffusers_state, dtype=torch.bfloat16)
    assert components.text_encoder.dtype == torch.bfloat16
    assert components.vae.dtype == torch.float32


def _sharded_copy(tiny_model_dir, dest, drop: str | None = None, extra: str | None = None):
    shutil.copytree(tiny_model_dir, dest)
    weights = load_file(dest / WEIGHTS)
    (dest / WEIGHTS).unlink()
    if drop:
        del weights[drop]
    if extra:
        weights[extra] = torch.zeros(3)
    names = sorted(weights)
    weight_map = {}
    for i in range(3):
        file = f"diffusion_pytorch_model-{i + 1:05d}-of-00003.safetensors"
        shard = {n: weights[n].contiguous() for n in names[i::3]}
        save_file(shard, dest / "transformer" / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (dest / "transformer/diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index))
    return dest


def test_sharded_checkpoint_loads_identically(tiny_model_dir, diffusers_state, tmp_path):
    sharded = _sharded_copy(tiny_model_dir, tmp_path / "sharded")
    components = load_qwen_image(str(sharded), "cpu", torch.float32)
    _assert_same_state(components.transformer, diffusers_state)


def test_missing_unexpected_and_misshapen_weights_are_named(tiny_model_dir, tmp_path):
    bad = _sharded_copy(tiny_model_dir, tmp_path / "bad", drop="proj_out.bias", extra="bogus.weight")
    with pytest.raises(ValueError, match=r"missing \['proj_out.bias'\].*unexpected \['bogus.weight'\]"):
        load_qwen_image(str(bad), "cpu", torch.float32)

    from vllm_omni.diffusion.models.qwen_image.transformer import QwenImageTransformerConfig

    config = dict(configs.TINY_TRANSFORMER_CONFIG, in_channels=16)  # img_in expects [32, 16]
    model = QwenImageTransformer(QwenImageTransformerConfig.from_dict(config))
    with pytest.raises(ValueError, match=r"'img_in.weight'.*\(32, 64\).*\(32, 16\)"):
        load_transformer_weights(model, tiny_model_dir / "transformer", "cpu", torch.float32)


def test_model_name_resolution(tiny_model_dir, tmp_path, monkeypatch):
    assert resolve_model_path(TINY_MODEL_NAME) == tiny_model_dir  # conftest's session cache
    assert resolve_model_path(str(tiny_model_dir)) == tiny_model_dir
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="model_index.json"):
        resolve_model_path(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="not a directory"):
        resolve_model_path(str(tmp_path / "missing"))

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ValueError) as info:
        load_qwen_image("no-such-org/no-such-model", "cpu", torch.float32)
    message = str(info.value)
    assert "'no-such-org/no-such-model'" in message and "offline" in message
    assert "local diffusers-format directory" in message and TINY_MODEL_NAME in message

    import huggingface_hub.constants

    monkeypatch.delenv("HF_HUB_OFFLINE")  # offline set only in huggingface_hub (env read at import)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError, match="no-such-org/no-such-model.*offline"):
        resolve_model_path("no-such-org/no-such-model")


def test_bad_load_format():
    with pytest.raises(ValueError, match="load_format"):
        load_qwen_image(TINY_MODEL_NAME, "cpu", torch.float32, load_format="pt")


def test_dummy_uses_dir_configs_dtype_and_seed(tiny_model_dir, diffusers_state):
    a = load_qwen_image(str(tiny_model_dir), "cpu", torch.bfloat16, load_format="dummy", seed=1)
    b = load_qwen_image(str(tiny_model_dir), "cpu", torch.bfloat16, load_format="dummy", seed=1)
    c = load_qwen_image(str(tiny_model_dir), "cpu", torch.bfloat16, load_format="dummy", seed=2)
    state_a, state_b, state_c = (m.transformer.state_dict() for m in (a, b, c))
    assert sorted(state_a) == sorted(diffusers_state)
    for name, tensor in state_a.items():
        assert tensor.dtype == torch.bfloat16 and tensor.shape == diffusers_state[name].shape
        assert torch.equal(tensor, state_b[name]) and not torch.equal(tensor, state_c[name]), name
        assert not torch.equal(tensor.float(), diffusers_state[name]), name  # random, not the file
    assert {p.dtype for p in a.text_encoder.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in a.vae.parameters()} == {torch.float32}  # CPU VAE stays fp32
    assert a.text_encoder.config.text_config.hidden_size == 32

    # Buffers (rotary tables) were built for real, not left on the meta device: the encoder runs.
    tokens = a.tokenizer(["a red cube"], return_tensors="pt")
    with torch.no_grad():
        hidden = a.text_encoder(**tokens, output_hidden_states=True).hidden_states[-1]
    assert hidden.shape[-1] == 32 and torch.isfinite(hidden.float()).all()


def test_dummy_real_size_builds_without_host_memory(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # dummy never touches the Hub
    components = load_qwen_image("Qwen/Qwen-Image", "meta", torch.bfloat16, load_format="dummy")
    transformer, text_encoder = components.transformer, components.text_encoder
    assert components.model_path is None
    assert components.transformer_config == configs.REAL_TRANSFORMER_CONFIG
    assert components.scheduler_config == configs.REAL_SCHEDULER_CONFIG
    for module in (transformer, components.vae, text_encoder):
        assert {p.device.type for p in module.parameters()} == {"meta"}
        assert {p.dtype for p in module.parameters()} == {torch.bfloat16}
    num_params = sum(p.numel() for p in transformer.parameters())
    assert 20.3e9 < num_params < 20.5e9, num_params  # Qwen-Image's 20B MMDiT
    assert transformer.state_dict()["transformer_blocks.59.attn.to_q.weight"].shape == (3072, 3072)
    text = text_encoder.config.text_config
    assert (text.hidden_size, text.num_hidden_layers, text.num_key_value_heads) == (3584, 28, 4)
    assert text_encoder.get_input_embeddings().weight.shape == (152064, 3584)
    assert max(components.tokenizer.get_vocab().values()) < text.vocab_size

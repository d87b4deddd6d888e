"""FP8 checkpoints (e4m3 weights with `weight_scale`, vLLM's / ModelOpt's layout) load as they are.

The checkpoints are made here from the tiny Qwen-Image checkpoint: its linear weights quantised per
channel (with the engine's own quantiser, so loading them must give the engine that quantises the
BF16 checkpoint at load, bit for bit), per tensor, or in 2x2 blocks (DeepSeek's `weight_scale_inv`).
"""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from utils import final_latent, quantized_engine, rel_err

from vllm_omni.diffusion.layers.fp8 import FP8_DTYPE, FP8_MAX, Fp8LinearMethod, quantize_rows
from vllm_omni.diffusion.layers.linear import UnquantizedLinearMethod
from vllm_omni.diffusion.layers.quant_config import QuantizationConfig
from vllm_omni.diffusion.layers.quantization import layers_to_quantize
from vllm_omni.diffusion.models.qwen_image.transformer import QwenImageTransformer, QwenImageTransformerConfig

WEIGHTS = "diffusion_pytorch_model.safetensors"


def _default_fp8_layers(tiny_model_dir) -> set[str]:
    """Module paths `--quantization fp8` runs in FP8 on the tiny model (the family's default set)."""
    config = json.loads((tiny_model_dir / "transformer" / "config.json").read_text())
    with torch.device("meta"):
        model = QwenImageTransformer(QwenImageTransformerConfig.from_dict(config))
    return set(layers_to_quantize(model, QuantizationConfig("fp8")))


def _quantize(w: torch.Tensor, scales: str) -> dict[str, torch.Tensor]:
    """{"weight", and "weight_scale" or "weight_scale_inv"} of one linear weight [N, K]."""
    w = w.float()
    if scales == "channel":
        q, s = quantize_rows(w)
        return {"weight": q, "weight_scale": s.view(-1)}
    if scales == "tensor":
        s = (w.abs().amax() / FP8_MAX).reshape(())
        return {"weight": (w / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), "weight_scale": s}
    n, k = w.shape  # scales == "block": 2 x 2 blocks
    blocks = w.reshape(n // 2, 2, k // 2, 2).abs().amax(dim=(1, 3)) / FP8_MAX  # [N/2, K/2]
    full = blocks.repeat_interleave(2, 0).repeat_interleave(2, 1)
    return {"weight": (w / full).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), "weight_scale_inv": blocks}


def fp8_checkpoint(tiny_model_dir, out_dir, layers, scales="channel", extra=None):
    """A copy of the tiny checkpoint whose `layers`' weights are FP8 with `scales`; `extra` tensors added."""
    shutil.copytree(tiny_model_dir, out_dir, symlinks=True)
    path = out_dir / "transformer" / WEIGHTS
    state = load_file(str(path))
    for layer in layers:
        for key, value in _quantize(state[f"{layer}.weight"], scales).items():
            state[f"{layer}.{key}"] = value.contiguous()
    state.update(extra or {})
    path.unlink()
    save_file(state, str(path))
    return out_dir, state


def _transformer(engine):
    return engine.executor.driver_worker.pipeline.transformer


def test_per_channel_checkpoint_equals_quantizing_the_bf16_checkpoint_at_load(tiny_model_dir, tmp_path):
    """The layers `--quantization fp8` runs in FP8, stored as the engine's own quantiser would store
    them: the FP8 checkpoint's engine gives the BF16 checkpoint's engine's final latent bit for bit."""
    layers = _default_fp8_layers(tiny_model_dir)
    model_dir, _ = fp8_checkpoint(tiny_model_dir, tmp_path / "fp8", layers)
    from_fp8, from_bf16 = quantized_engine(model_dir, "fp8"), quantized_engine(tiny_model_dir, "fp8")
    try:
        got, want = final_latent(from_fp8, 3), final_latent(from_bf16, 3)
        assert torch.equal(got, want)
    finally:
        from_fp8.shutdown()
        from_bf16.shutdown()


def test_per_tensor_scales_keep_the_bits_and_kept_layers_are_dequantized(tiny_model_dir, tmp_path, caplog):
    """Every linear FP8 with one scale each: a layer FP8 runs holds the checkpoint's bits and its scale
    for every channel; a layer the default keeps in high precision holds W8 x scale; the static
    input_scale tensors are reported unused; the final latent stays near the unquantized one."""
    config = json.loads((tiny_model_dir / "transformer" / "config.json").read_text())
    state = load_file(str(tiny_model_dir / "transformer" / WEIGHTS))
    every = {k.removesuffix(".weight") for k, v in state.items() if k.endswith(".weight") and v.dim() == 2}
    inputs = {f"{layer}.input_scale": torch.tensor(0.02) for layer in every}
    model_dir, fp8_state = fp8_checkpoint(tiny_model_dir, tmp_path / "fp8", every, "tensor", inputs)
    kept = sorted(every - _default_fp8_layers(tiny_model_dir))
    assert kept and config["num_layers"] >= 1
    caplog.set_level(logging.INFO, logger="vllm_omni.diffusion.model_loader")
    engine, plain = quantized_engine(model_dir, "fp8"), quantized_engine(tiny_model_dir, None)
    try:
        transformer = _transformer(engine)
        out = transformer.get_submodule("proj_out")  # kept by default: dequantized
        assert isinstance(out.quant_method, UnquantizedLinearMethod)
        want = fp8_state["proj_out.weight"].float() * fp8_state["proj_out.weight_scale"]
        assert torch.equal(out.weight, want)
        down = transformer.get_submodule("transformer_blocks.0.txt_mlp.net.2")  # runs FP8
        assert isinstance(down.quant_method, Fp8LinearMethod)
        assert torch.equal(
            down.weight.view(torch.uint8),
            fp8_state["transformer_blocks.0.txt_mlp.net.2.weight"].view(torch.uint8),
        )
        scale = fp8_state["transformer_blocks.0.txt_mlp.net.2.weight_scale"]
        assert torch.equal(down.weight_scale, scale.expand(down.out_features))
        assert f"{len(every)} static input_scale tensors not used" in caplog.text
        err = rel_err(final_latent(engine, 4), final_latent(plain, 4))
        assert 1e-5 < err < 0.1
    finally:
        engine.shutdown()
        plain.shutdown()


def test_block_scales_are_dequantized_then_quantized_per_channel(tiny_model_dir, tmp_path):
    """`weight_scale_inv` (2x2 block scales): a layer FP8 runs holds `quantize_rows` of W8 x its block
    scales (fp32)."""
    name = "transformer_blocks.0.txt_mlp.net.2"
    model_dir, fp8_state = fp8_checkpoint(tiny_model_dir, tmp_path / "fp8", [name], "block")
    engine = quantized_engine(model_dir, "fp8")
    try:
        layer = _transformer(engine).get_submodule(name)
        blocks = fp8_state[f"{name}.weight_scale_inv"]
        full = blocks.repeat_interleave(2, 0).repeat_interleave(2, 1)
        q, s = quantize_rows(fp8_state[f"{name}.weight"].float() * full)
        assert torch.equal(layer.weight.view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(layer.weight_scale, s.view(-1))
        assert final_latent(engine, 1).isfinite().all()
    finally:
        engine.shutdown()


def test_refusals_name_the_fix(tiny_model_dir, tmp_path):
    name = "transformer_blocks.0.img_mlp.net.2"
    model_dir, state = fp8_checkpoint(tiny_model_dir, tmp_path / "fp8", [name])
    with pytest.raises(ValueError, match=r"holds FP8 weights .*serve it with --quantization fp8"):
        quantized_engine(model_dir, None)
    not_serialized = {"method": "fp8", "is_checkpoint_fp8_serialized": False}
    with pytest.raises(ValueError, match="is_checkpoint_fp8_serialized is false, but"):
        quantized_engine(model_dir, QuantizationConfig.from_value(not_serialized))
    serialized = {"method": "fp8", "is_checkpoint_fp8_serialized": True}
    with pytest.raises(ValueError, match="is_checkpoint_fp8_serialized is true, but .* has no FP8 weights"):
        quantized_engine(tiny_model_dir, QuantizationConfig.from_value(serialized))
    engine = quantized_engine(model_dir, QuantizationConfig.from_value(serialized))  # what it says: accepted
    engine.shutdown()
    # an FP8 weight without its scale, and an e5m2 weight, are refused naming the tensor
    path = model_dir / "transformer" / WEIGHTS
    save_file({k: v for k, v in state.items() if not k.endswith("weight_scale")}, str(path))
    with pytest.raises(ValueError, match=rf"'{name}.weight' .* without a weight_scale"):
        quantized_engine(model_dir, "fp8")
    save_file(dict(state, **{f"{name}.weight": state[f"{name}.weight"].to(torch.float8_e5m2)}), str(path))
    with pytest.raises(ValueError, match=rf"'{name}.weight' is torch.float8_e5m2: FP8 checkpoints must"):
        quantized_engine(model_dir, "fp8")


@pytest.mark.parametrize(
    "value, message",
    [
        ({"method": "fp8", "activation_scheme": "static"}, "activation_scheme 'static' is not supported"),
        ({"method": "fp8", "is_checkpoint_fp8_serialized": "yes"}, "must be true or false"),
        ({"method": "modelopt"}, "method 'modelopt': give 'fp8'; FP8 checkpoints"),
    ],
)
def test_config_keys_of_fp8_checkpoints(value, message):
    with pytest.raises(ValueError, match=message):
        QuantizationConfig.from_value(value, "--diffusion-quantization-config")
    dynamic = QuantizationConfig.from_value({"method": "fp8", "activation_scheme": "dynamic"})
    assert dynamic.method == "fp8" and dynamic.checkpoint_fp8 is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the H200's GPU test stage)")
def test_cuda_per_channel_checkpoint_equals_quantizing_at_load(tiny_model_dir, tmp_path):
    """On CUDA in bf16: the per-channel FP8 copy (quantised from the bf16-rounded weights, as the engine
    quantises what it loaded) gives the BF16 checkpoint's FP8 engine's final latent bit for bit."""
    from vllm_omni.config import OmniDiffusionConfig
    from vllm_omni.diffusion.engine import DiffusionEngine

    layers = _default_fp8_layers(tiny_model_dir)
    shutil.copytree(tiny_model_dir, tmp_path / "fp8", symlinks=True)
    path = tmp_path / "fp8" / "transformer" / WEIGHTS
    state = load_file(str(path))
    for layer in layers:
        for key, value in _quantize(state[f"{layer}.weight"].to(torch.bfloat16), "channel").items():
            state[f"{layer}.{key}"] = value.contiguous()
    path.unlink()
    save_file(state, str(path))

    def engine(model_dir):
        config = OmniDiffusionConfig(
            model=str(model_dir), dtype="bfloat16", device="cuda", quantization="fp8", log_stats=False
        )
        return DiffusionEngine(config, autostart=False)

    from_fp8, from_bf16 = engine(tmp_path / "fp8"), engine(tiny_model_dir)
    try:
        assert torch.equal(final_latent(from_fp8, 3), final_latent(from_bf16, 3))
    finally:
        from_fp8.shutdown()
        from_bf16.shutdown()

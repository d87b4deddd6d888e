"""The Qwen-Image transformer at real or tiny size with random weights, the inputs of one packed step,
its useful FLOPs and the GEMM rate: what the transformer-level benchmarks share.

FLOPs (useful work only: real tokens, no padding; elementwise ops such as norms, RoPE, GELU, gates
and biases are not counted). With d = heads * head_dim (3072), J = joint_attention_dim (3584),
n = num layers, and per sequence s with T_s text tokens, I_s image tokens, L_s = T_s + I_s:

    linear      2 * 12 d^2 * L_s * n         per-token linears of both streams: q, k, v, out (4 d^2)
                                             and the 4x GELU MLP (8 d^2); image rows use the image
                                             stream's weights, text rows the text stream's
    attention   4 * L_s^2 * d * n            QK^T and PV, 2 L^2 d each (joint text+image sequence)
    modulation  2 * 12 d^2 * n + 2 * (256 d + d^2) + 2 * 2 d^2     once per sequence: img_mod and
                                             txt_mod (d -> 6d each), timestep MLP, norm_out (d -> 2d)
    embed       2 * (64 d + 64 d) * I_s + 2 * J d * T_s            img_in, proj_out, txt_in
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.diffusion.common import sync, timed

# ---- model --------------------------------------------------------------------------------------


def transformer_config_dict(model: str) -> dict:
    """transformer/config.json contents: tiny for `tiny-qwen-image`, a local dir's, else the real size."""
    from vllm_omni.config import TINY_MODEL_NAME
    from vllm_omni.diffusion.models.qwen_image import configs

    if model == TINY_MODEL_NAME:
        return dict(configs.TINY_TRANSFORMER_CONFIG)
    path = Path(model).expanduser() / "transformer" / "config.json"
    if path.is_file():
        import json

        return json.loads(path.read_text())
    return dict(configs.REAL_TRANSFORMER_CONFIG)


def build_transformer(config_dict: dict, num_layers: int | None, device, dtype, seed: int):
    """`QwenImageTransformer` with `num_layers` blocks (None: the config's), seeded random weights made
    directly on `device` in `dtype` (the model loader's dummy path: no host copy)."""
    import torch

    from vllm_omni.diffusion.model_loader import build_empty, randomize_weights_
    from vllm_omni.diffusion.models.qwen_image.transformer import (
        QwenImageTransformer,
        QwenImageTransformerConfig,
    )

    if num_layers is not None:
        config_dict = {**config_dict, "num_layers": num_layers}
    config = QwenImageTransformerConfig.from_dict(config_dict)
    model = build_empty(lambda: QwenImageTransformer(config), device)
    randomize_weights_(model, torch.Generator(device=device).manual_seed(seed), device=device, dtype=dtype)
    return model.eval().requires_grad_(False)


# ---- FLOPs --------------------------------------------------------------------------------------


def count_flops(config, specs: list) -> dict[str, float]:
    """Useful FLOPs of one forward over `specs` (formula in the module docstring)."""
    d, n = config.inner_dim, config.num_layers
    c_in, c_out = config.in_channels, config.patch_size**2 * config.out_channels
    linear = attention = modulation = embed = 0.0
    for s in specs:
        num_txt, num_img = s.num_txt_tokens, s.num_img_tokens
        length = num_txt + num_img
        linear += 2 * 12 * d * d * length * n
        attention += 4 * length * length * d * n
        modulation += 2 * 12 * d * d * n + 2 * (256 * d + d * d) + 2 * 2 * d * d
        embed += 2 * (c_in * d + d * c_out) * num_img + 2 * config.joint_attention_dim * d * num_txt
    total = linear + attention + modulation + embed
    return {
        "linear": linear,
        "attention": attention,
        "modulation": modulation,
        "embed": embed,
        "total": total,
    }


# ---- timing -------------------------------------------------------------------------------------


def median_time(fn: Callable[[], Any], device, warmup: int, iters: int) -> float:
    """Median device-synchronised seconds of `fn()` over `iters` calls after `warmup` calls."""
    for _ in range(warmup):
        timed(fn, device)
    return statistics.median(timed(fn, device)[1] for _ in range(iters))


def gemm_tflops(device, dtype, size: int, iters: int = 10) -> float:
    """TFLOP/s of a size^3 matmul in `dtype` (CUDA events on CUDA, perf_counter elsewhere)."""
    import torch

    a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
    out = torch.empty(size, size, device=device, dtype=dtype)
    for _ in range(3):
        torch.mm(a, b, out=out)
    sync(device)
    if torch.device(device).type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            torch.mm(a, b, out=out)
        end.record()
        torch.cuda.synchronize(device)
        seconds = start.elapsed_time(end) / 1e3 / iters
    else:
        seconds = median_time(lambda: torch.mm(a, b, out=out), device, 0, iters)
    return 2 * size**3 / seconds / 1e12

"""What the Qwen-Image-2.1 tests share: the tiny 2.1 engine (CPU, fp32, 8 requests a step, no MixFusion
chunk limit: every mix packs; built without its engine thread, tests drive `engine.step()`), the cases
against diffusers' `QwenImage21Pipeline`, and a mixed batch of the tiny 2.1 transformer with cached
prefixes. Test files import from here and from utils.py, never from each other."""

from __future__ import annotations

import numpy as np
import torch
from utils import tiny_engine

from vllm_omni.diffusion.attention import SDPABackend
from vllm_omni.diffusion.engine import DiffusionEngine
from vllm_omni.diffusion.layout import SequenceSpec, build_packed_layout
from vllm_omni.diffusion.models import registry
from vllm_omni.diffusion.models.qwen_image21.loader import diffusers_pipeline
from vllm_omni.diffusion.models.qwen_image21.tiny import TINY_MODEL_NAME
from vllm_omni.diffusion.models.qwen_image21.transformer import (
    QwenImage21TransformerConfig,
)
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.inputs import OmniDiffusionSamplingParams


def tiny21_engine(**config) -> DiffusionEngine:
    """`config` adds to or overrides the shared settings (e.g. `scheduling_policy="skip-ahead"`)."""
    return tiny_engine(config.pop("model", TINY_MODEL_NAME), **{"mixfusion_min_chunk_tokens": 1, **config})


# ---- The tiny 2.1 engine against diffusers' `QwenImage21Pipeline` (test_qwen_image21_engine.py)


ATOL = 1e-4


LONG_PROMPT = (
    "a very detailed oil painting of a lighthouse on a rocky coast at dusk, waves crashing, seagulls, "
    "warm light from the windows, dramatic clouds"
)


CASES = [
    # (prompt, negative_prompt, height, width, steps, true_cfg_scale, seed)
    (LONG_PROMPT, "blurry, low quality", 64, 32, 3, 4.0, 12),  # CFG on, tall
    ("a red fox", None, 32, 32, 2, 1.0, 11),  # CFG off, square, short prompt
    ("a bowl of fruit on a wooden table", "dark", 32, 64, 2, 2.5, 15),  # CFG on, wide, other scale
    ("mountains", "ugly", 64, 64, 3, 1.0, 14),  # CFG off: scale 1 with a negative prompt
]


def diffusers_images_21():
    """case [, **pipeline kwargs] -> the images diffusers' `QwenImage21Pipeline` gives for it (np RGBA)."""
    pipe = diffusers_pipeline(registry.resolve_model_path(TINY_MODEL_NAME))
    pipe.set_progress_bar_config(disable=True)

    def run(case, **kwargs) -> np.ndarray:
        prompt, negative, h, w, steps, scale, seed = case
        generator = torch.Generator("cpu").manual_seed(seed)
        return pipe(
            prompt=prompt,
            negative_prompt=negative,
            true_cfg_scale=scale,
            height=h,
            width=w,
            num_inference_steps=steps,
            generator=generator,
            output_type="np",
            **kwargs,
        ).images

    return run


def make_request(engine, i: int, case) -> OmniDiffusionRequest:
    prompt, negative, h, w, steps, scale, seed = case
    params = OmniDiffusionSamplingParams(
        **{
            **engine.default_sampling_params,
            "height": h,
            "width": w,
            "num_inference_steps": steps,
            "true_cfg_scale": scale,
            "seed": seed,
            "output_type": "np",
        }
    )
    return OmniDiffusionRequest(f"req-{i}", prompt=prompt, negative_prompt=negative, sampling_params=params)


def assert_matches(images, reference_images):
    worst = 0.0
    for i, (got, want) in enumerate(zip(images, reference_images, strict=True)):
        assert got.shape == want.shape, f"case {i}: shape {got.shape} != {want.shape}"
        assert got.shape[-1] == 4, "RGBA"
        worst = max(worst, float(np.abs(got - want).max()))
    print(f"max abs vs diffusers: {worst:.2e}")
    assert worst <= ATOL


# ---- The tiny 2.1 transformer: a mixed batch with cached prefixes (test_qwen_image21_graphs.py)


TINY = QwenImage21TransformerConfig(
    in_channels=16,
    out_channels=16,
    num_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    context_in_dim=32,
    axes_dims_rope=(4, 6, 6),
)


# An edit prefix: text, reference A (2 slots = 1x2x4 rows), text, reference B (4 slots = 1x4x4), text.
EDIT_SLOTS = [False] * 3 + [True] * 2 + [False] * 4 + [True] * 4 + [False] * 2


EDIT_GRIDS = [(1, 2, 4), (1, 4, 4)]


def admit(model, device="cpu", dtype=torch.float32, seed=0, owned=False):
    """A mixed batch: a CFG text-to-image request (two prompt lengths), an edit with two references,
    another size, and one sequence without a cached prefix (prefilled in the step). Returns the
    forward's inputs; the cached prefixes are in `model.prefix_cache` (`owned`: prefilled as the
    pipeline does, owner=req_id, so into the model's prefix arena when it has one)."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(device, dtype)  # noqa: E731
    edit_txt, cond = rand(len(EDIT_SLOTS), 32), rand(8 + 16, 16)
    txts = {
        ("a", False): rand(7, 32),
        ("a", True): rand(3, 32),
        ("e", False): edit_txt,
        ("x", False): rand(5, 32),
    }
    owner = (lambda req_id: req_id) if owned else (lambda req_id: None)  # noqa: E731
    model.prefix_cache.put("a", False, model.prefill(txts["a", False], owner=owner("a")))
    model.prefix_cache.put("a", True, model.prefill(txts["a", True], owner=owner("a")))
    edit = model.prefill(edit_txt, EDIT_SLOTS, cond, EDIT_GRIDS, owner=owner("e"))
    model.prefix_cache.put("e", False, edit)
    specs = [
        SequenceSpec(7, (1, 4, 2), req_id="a"),
        SequenceSpec(3, (1, 4, 2), req_id="a", is_negative=True),
        SequenceSpec(len(EDIT_SLOTS), (1, 2, 6), req_id="e"),
        SequenceSpec(5, (1, 3, 3), req_id="x"),  # not cached
    ]
    layout = build_packed_layout(specs, model.position_tables, device=device)
    img = rand(layout.num_img_rows, 16)
    txt = torch.cat([txts[s.req_id, s.is_negative] for s in specs])
    t = torch.tensor([0.9, 0.9, 0.4, 0.6]).to(device, dtype)
    return img, txt, t, layout


def eager(model, *inputs, backend=None):
    """The unpadded eager forward, with per-sequence SDPA (the reference) unless told."""
    keep, model.attn_backend = model.attn_backend, backend or SDPABackend("per_seq")
    try:
        return model.forward_packed(*inputs)
    finally:
        model.attn_backend = keep


def max_rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Max abs error over the reference's max abs."""
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())

"""Step caching on Qwen-Image-Edit (condition rows in every sequence's image stream) against diffusers'
QwenImageEditPipeline with cache-dit, and the refusal on a model without the hook (Qwen-Image-2.1)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_image_edit_engine import _image, reference_pipeline
from tiny21 import tiny21_engine

from vllm_omni.config import OmniDiffusionConfig
from vllm_omni.diffusion.engine import DiffusionEngine
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.inputs import OmniDiffusionSamplingParams

cache_dit = pytest.importorskip("cache_dit")

CONFIG = {
    "Fn_compute_blocks": 1,
    "Bn_compute_blocks": 0,
    "residual_diff_threshold": 1.0,
    "max_warmup_steps": 2,
}
CASES = [
    # (input image (seed, w, h), prompt, negative, out height, out width, steps, cfg scale, seed)
    ((1, 80, 48), "make the sky red", "blurry", 48, 64, 4, 4.0, 11),
    ((2, 40, 72), "add a small boat on the water", None, 64, 32, 4, 4.0, 12),
]


@pytest.fixture(scope="module")
def reference(tiny_edit_model_dir):
    from cache_dit import DBCacheConfig

    pipe = reference_pipeline(tiny_edit_model_dir)
    results = []
    for (img_seed, w, h), prompt, negative, height, width, steps, scale, seed in CASES:
        do_cfg = negative is not None
        config = DBCacheConfig(**CONFIG, enable_separate_cfg=do_cfg, num_inference_steps=steps)
        cache_dit.enable_cache(pipe, cache_config=config)
        image = pipe(
            image=_image(img_seed, w, h), prompt=prompt, negative_prompt=negative, true_cfg_scale=scale,
            height=height, width=width, num_inference_steps=steps,
            generator=torch.Generator("cpu").manual_seed(seed), output_type="np",
        ).images  # fmt: skip
        stat = cache_dit.summary(pipe, logging=False)[0]
        counts = [len(stat.cached_steps or []), len(stat.cfg_cached_steps or [])][: 2 if do_cfg else 1]
        cache_dit.disable_cache(pipe)
        results.append((image, counts))
    return results


def test_cached_edits_packed_match_cache_dit(tiny_edit_model_dir, reference):
    config = OmniDiffusionConfig(
        model=str(tiny_edit_model_dir), dtype="float32", device="cpu", max_num_seqs=8,
        scheduling_policy="skip-ahead", cache_backend="cache_dit", cache_config=CONFIG,
    )  # fmt: skip
    engine = DiffusionEngine(config, autostart=False)

    def request(i, case):
        (img_seed, w, h), prompt, negative, height, width, steps, scale, seed = case
        params = OmniDiffusionSamplingParams(
            height=height, width=width, num_inference_steps=steps, true_cfg_scale=scale, seed=seed,
            output_type="np", extra_args={"mixfusion_min_chunk_tokens": 1},
        )  # fmt: skip
        return OmniDiffusionRequest(
            f"e{i}", prompt, negative_prompt=negative, sampling_params=params, image=_image(img_seed, w, h)
        )

    def run(handles):
        while not all(h.done() for h in handles):
            engine.step()
        return [h.result() for h in handles]

    # packed together (each equals its run alone: the other step-cache tests check alone and packed)
    packed = run([engine.add_request(request(i, c)) for i, c in enumerate(CASES)])
    for i, (out, (image, counts)) in enumerate(zip(packed, reference)):
        assert out.timings.num_cached_steps == counts, f"case {i}"
        assert float(np.abs(out.images - image).max()) <= 1e-4, f"case {i}"


def test_a_model_without_the_hook_is_refused():
    with pytest.raises(ValueError, match="--cache-backend tea_cache is not supported for Qwen-Image-2.1"):
        tiny21_engine(cache_backend="tea_cache")

"""Step caching against cache-dit itself (fp32, CPU, a 5-block tiny Qwen-Image).

The contract: with `--cache-backend cache_dit`, each request's image and cached-step counts are those
of diffusers' `QwenImagePipeline` with `cache_dit.enable_cache(pipe, cache_config=DBCacheConfig(...))`
run for that request alone (`enable_separate_cfg` True with CFG: each branch its own state; False
without), whether it runs alone or packed with uncached and differently configured requests.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from vllm_omni.config import OmniDiffusionConfig
from vllm_omni.diffusion.engine import DiffusionEngine
from vllm_omni.diffusion.model_loader import randomize_weights_
from vllm_omni.diffusion.models.qwen_image import configs
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.inputs import OmniDiffusionSamplingParams

cache_dit = pytest.importorskip("cache_dit")

NUM_LAYERS = 5
SERVER = {
    "Fn_compute_blocks": 2,
    "Bn_compute_blocks": 1,
    "residual_diff_threshold": 0.5,
    "max_warmup_steps": 1,
}
"""The server's cache_dit config; the cases override keys per request."""

CASES = [
    # (prompt, negative, height, width, steps, cfg scale, seed, cache_config overrides or "none")
    ("a red fox in the snow", "blurry", 48, 64, 6, 4.0, 1, {}),  # server config, CFG
    (
        "a lighthouse at dusk",
        None,
        32,
        32,
        6,
        1.0,
        2,
        {"Fn_compute_blocks": 1, "Bn_compute_blocks": 0, "residual_diff_threshold": 0.9},
    ),
    ("a bowl of fruit", "dark", 32, 48, 5, 3.0, 3, {"max_cached_steps": 1, "residual_diff_threshold": 0.9}),
    (
        "mountains",
        "ugly",
        48,
        48,
        6,
        2.5,
        4,
        {"steps_computation_mask": [1, 1, 0, 1, 0, 1], "steps_computation_policy": "static"},
    ),
    ("a cat on a sofa", None, 32, 48, 5, 1.0, 5, "none"),  # opted out: runs every block
    (
        "a boat",
        "noise",
        32,
        32,
        6,
        4.0,
        6,
        {
            "max_continuous_cached_steps": 1,
            "warmup_interval": 2,
            "max_warmup_steps": 3,
            "residual_diff_threshold": 0.75,
        },
    ),
]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny checkpoint with a 5-block transformer (2 blocks leave no middle for Fn=1, Bn=1)."""
    from diffusers import QwenImageTransformer2DModel

    out = tmp_path_factory.mktemp("tiny5")
    for part in tiny_model_dir.iterdir():
        if part.name != "transformer":
            (shutil.copytree if part.is_dir() else shutil.copy)(part, out / part.name)
    kwargs = {k: v for k, v in configs.TINY_TRANSFORMER_CONFIG.items() if not k.startswith("_")}
    model = QwenImageTransformer2DModel(**{**kwargs, "num_layers": NUM_LAYERS})
    randomize_weights_(model, torch.Generator("cpu").manual_seed(5))
    model.save_pretrained(out / "transformer", safe_serialization=True)
    return out


def _cache_dit_config(case):
    overrides, do_cfg = case[7], case[1] is not None and case[5] > 1
    if overrides == "none":
        return None
    from cache_dit import DBCacheConfig

    return DBCacheConfig(**{**SERVER, **overrides}, enable_separate_cfg=do_cfg, num_inference_steps=case[4])


def _cache_dit_stats(pipe):
    stats = cache_dit.summary(pipe, logging=False)
    stat = stats[0]
    return [len(stat.cached_steps or []), len(stat.cfg_cached_steps or [])]


@pytest.fixture(scope="module")
def reference(model_dir):
    """(image, cached steps per branch) of every case from diffusers + cache-dit, each run alone."""
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(model_dir, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    results = []
    for case in CASES:
        prompt, negative, h, w, steps, scale, seed, _ = case
        config = _cache_dit_config(case)
        if config is not None:
            cache_dit.enable_cache(pipe, cache_config=config)
        image = pipe(
            prompt=prompt, negative_prompt=negative, true_cfg_scale=scale, height=h, width=w,
            num_inference_steps=steps, generator=torch.Generator("cpu").manual_seed(seed),
            output_type="np",
        ).images  # fmt: skip
        counts = None
        if config is not None:
            counts = _cache_dit_stats(pipe)
            counts = counts if config.enable_separate_cfg else counts[:1]
            cache_dit.disable_cache(pipe)
        results.append((image, counts))
    return results


@pytest.fixture(scope="module")
def engine(model_dir):
    config = OmniDiffusionConfig(
        model=str(model_dir),
        dtype="float32",
        device="cpu",
        max_num_seqs=8,
        mixfusion_min_chunk_tokens=1,
        scheduling_policy="skip-ahead",  # every request in every step: the packed-step identity
        cache_backend="cache_dit",
        cache_config=SERVER,
    )
    return DiffusionEngine(config, autostart=False)


def _request(i, case):
    prompt, negative, h, w, steps, scale, seed, overrides = case
    extra = (
        {"cache_backend": "none"} if overrides == "none" else {"cache_config": overrides} if overrides else {}
    )
    params = OmniDiffusionSamplingParams(
        height=h, width=w, num_inference_steps=steps, true_cfg_scale=scale, seed=seed, output_type="np",
        extra_args=extra,
    )  # fmt: skip
    return OmniDiffusionRequest(f"c{i}", prompt=prompt, negative_prompt=negative, sampling_params=params)


def _run(engine, futures, log=None):
    while not all(f.done() for f in futures):
        stats = engine.step()
        if log is not None and stats is not None:
            log.append(stats)
    return [f.result() for f in futures]


def _check(outputs, reference):
    for i, (out, (image, counts)) in enumerate(zip(outputs, reference)):
        assert out.timings.num_cached_steps == counts, f"case {i}: cached steps per branch"
        diff = float(np.abs(out.images - image).max())
        assert diff <= 1e-4, f"case {i}: max abs diff {diff} vs diffusers + cache-dit"


def test_reference_caches_something(reference):
    """The cases exercise caching (else the equality below would prove nothing): every cached case
    caches, and one CFG case's branches decide differently."""
    counts = [c for _, c in reference if c is not None]
    assert all(sum(c) > 0 for c in counts), counts
    assert any(len(c) == 2 and c[0] != c[1] for c in counts), counts


def test_each_request_alone_matches_cache_dit(engine, reference):
    outputs = [_run(engine, [engine.add_request(_request(i, case))])[0] for i, case in enumerate(CASES)]
    _check(outputs, reference)


def test_packed_together_matches_cache_dit(engine, reference):
    log = []
    futures = [engine.add_request(_request(10 + i, case)) for i, case in enumerate(CASES)]
    _check(_run(engine, futures, log), reference)
    assert log[0].num_reqs == len(CASES) and log[0].path == "packed"
    assert any(0 < s.num_cached_seqs < s.num_seqs for s in log), "cached and computing sequences share steps"

"""The prompt-embedding cache (diffusion/prompt_cache.py): a hit is the miss bit for bit, a cached
prompt's embedding does not depend on what else arrived with it, LRU order, the engine's default
(only the empty and single-space negative prompts), the flags and the offline kwargs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_omni.config import OmniDiffusionConfig
from vllm_omni.diffusion.engine import DiffusionEngine
from vllm_omni.diffusion.prompt_cache import PromptEmbedCache
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.inputs import OmniDiffusionSamplingParams


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    config = OmniDiffusionConfig(model=str(tiny_model_dir), dtype="float32", device="cpu", log_stats=False)
    return DiffusionEngine(config, autostart=False)


@pytest.fixture(scope="module")
def encode(engine):
    """The pipeline's own encoder, unwrapped (the cache's `_encode`)."""
    return engine.executor.driver_worker.prompt_cache._encode


def test_a_hit_is_the_encoder_alone_bit_for_bit_whatever_arrived_with_it(encode):
    cache = PromptEmbedCache(encode, size=4)
    alone = encode([" "], [512])[0]  # diffusers encodes a negative prompt alone too
    with_others = cache(["a red cat on a mat", " ", "a blue dog"], [512, 512, 512])
    assert torch.equal(with_others[1], alone) and cache.num_misses == 1
    again = cache([" ", "something else entirely, longer than the rest of them"], [512, 512])
    assert torch.equal(again[0], alone) and cache.num_hits == 1
    # prompts outside the cache are still encoded together, exactly as without the cache
    batched = encode(["a red cat on a mat", "a blue dog"], [512, 512])
    assert torch.equal(with_others[0], batched[0]) and torch.equal(with_others[2], batched[1])
    assert len(cache) == 1, "only the default negative prompts are cached"


def test_least_recently_used_out_and_the_key_holds_the_max_length(encode):
    cache = PromptEmbedCache(encode, size=2, cache_all=True)
    cache(["a", "b"], [512, 512])
    cache(["a"], [512])  # a is now the most recent
    cache(["c"], [512])  # b goes
    assert set(cache._entries) == {("a", 512), ("c", 512)}
    short = cache(["a"], [2])[0]
    assert short.shape[0] <= 2 and ("a", 2) in cache._entries
    with pytest.raises(ValueError, match="prompt_embed_cache_size"):
        PromptEmbedCache(encode, size=0)


def _request(negative: str, seed: int) -> OmniDiffusionRequest:
    params = OmniDiffusionSamplingParams(
        height=32, width=32, num_inference_steps=2, seed=seed, true_cfg_scale=4.0, output_type="np"
    )
    return OmniDiffusionRequest("r", prompt="a red cat", negative_prompt=negative, sampling_params=params)


def _run(engine, request) -> np.ndarray:
    handle = engine.add_request(request)
    while not handle.done():
        engine.step()
    return handle.result().images


def test_the_engine_caches_the_default_negative_prompt_and_the_image_is_unchanged(engine):
    cache = engine.executor.driver_worker.prompt_cache
    hits = cache.num_hits
    first = _run(engine, _request(" ", 7))
    second = _run(engine, _request(" ", 7))  # a hit now
    assert cache.num_hits > hits
    np.testing.assert_array_equal(first, second)
    assert (" ", 512) in cache._entries and ("a red cat", 512) not in cache._entries


def test_size_zero_turns_it_off(tiny_model_dir):
    config = OmniDiffusionConfig(
        model=str(tiny_model_dir), dtype="float32", device="cpu", prompt_embed_cache_size=0
    )
    off = DiffusionEngine(config, autostart=False)
    assert off.executor.driver_worker.prompt_cache is None
    assert not isinstance(off.executor.driver_worker.pipeline.encode_prompts, PromptEmbedCache)
    with pytest.raises(ValueError, match="prompt_embed_cache_size"):
        OmniDiffusionConfig(model=str(tiny_model_dir), prompt_embed_cache_size=-1)


def test_the_flags_reach_the_config():
    import argparse

    from vllm_omni.entrypoints.cli.serve import engine_config_from_args
    from vllm_omni.entrypoints.cli.serve_args import add_serve_arguments

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    default = engine_config_from_args(parser.parse_args(["tiny-qwen-image"]))
    assert (default.enable_prompt_embed_cache, default.prompt_embed_cache_size) == (False, 32)
    args = parser.parse_args(
        ["tiny-qwen-image", "--enable-prompt-embed-cache", "--prompt-embed-cache-size", "8"]
    )
    config = engine_config_from_args(args)
    assert (config.enable_prompt_embed_cache, config.prompt_embed_cache_size) == (True, 8)

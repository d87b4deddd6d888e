"""Step caching with per-request LoRA: the deltas run on the rows that run each block segment.

Each request's image and cached steps equal diffusers' QwenImagePipeline with its adapter (peft,
`load_lora_weights` + `set_adapters`) and `cache_dit.enable_cache(...)`, run alone, while the engine
packs requests of two adapters and none, cached and not, in the same steps (a cached step's middle
blocks run only the others' rows, with only their deltas).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_lora_engine import adapter_dirs  # noqa: F401 - the fixture

from vllm_omni.config import OmniDiffusionConfig
from vllm_omni.diffusion.engine import DiffusionEngine
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.inputs import OmniDiffusionSamplingParams
from vllm_omni.lora import LoRAConfig, LoRAModulePath, LoRARequest

cache_dit = pytest.importorskip("cache_dit")

CONFIG = {
    "Fn_compute_blocks": 1,
    "Bn_compute_blocks": 0,
    "residual_diff_threshold": 1.0,
    "max_warmup_steps": 2,
}
CASES = [
    # (prompt, negative, side, steps, cfg scale, seed, adapter, lora scale, cached)
    ("a red fox", "blurry", 48, 5, 4.0, 1, "ink", 1.0, True),
    ("a lighthouse", None, 32, 4, 1.0, 2, "neon", 0.6, True),
    ("a bowl of fruit", "dark", 32, 4, 3.0, 3, "neon", -0.8, False),  # its rows run every block alone
    ("a cat on a sofa", None, 32, 4, 1.0, 4, None, 1.0, True),
]


@pytest.fixture(scope="module")
def reference(tiny_model_dir, adapter_dirs):  # noqa: F811
    from cache_dit import DBCacheConfig
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(tiny_model_dir, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    for name, path in adapter_dirs.items():
        pipe.load_lora_weights(path, adapter_name=name)
    results = []
    for prompt, negative, side, steps, scale, seed, name, lora_scale, cached in CASES:
        if name is None:
            pipe.disable_lora()
        else:
            pipe.enable_lora()
            pipe.set_adapters([name], [lora_scale])
        do_cfg = negative is not None and scale > 1
        if cached:
            config = DBCacheConfig(**CONFIG, enable_separate_cfg=do_cfg, num_inference_steps=steps)
            cache_dit.enable_cache(pipe, cache_config=config)
        image = pipe(
            prompt=prompt, negative_prompt=negative, true_cfg_scale=scale, height=side, width=side,
            num_inference_steps=steps, generator=torch.Generator("cpu").manual_seed(seed), output_type="np",
        ).images  # fmt: skip
        counts = None
        if cached:
            stat = cache_dit.summary(pipe, logging=False)[0]
            counts = [len(stat.cached_steps or []), len(stat.cfg_cached_steps or [])][: 2 if do_cfg else 1]
            cache_dit.disable_cache(pipe)
        results.append((image, counts))
    return results


def test_cached_lora_requests_packed_match_diffusers_peft_and_cache_dit(
    tiny_model_dir,
    adapter_dirs,  # noqa: F811
    reference,
):
    lora = LoRAConfig(lora_modules=tuple(LoRAModulePath(n, p) for n, p in adapter_dirs.items()))
    config = OmniDiffusionConfig(
        model=str(tiny_model_dir), dtype="float32", device="cpu", max_num_seqs=8,
        mixfusion_min_chunk_tokens=1, scheduling_policy="skip-ahead", lora=lora,
        cache_backend="cache_dit", cache_config=CONFIG,
    )  # fmt: skip
    engine = DiffusionEngine(config, autostart=False)
    handles = []
    for i, (prompt, negative, side, steps, scale, seed, name, lora_scale, cached) in enumerate(CASES):
        params = OmniDiffusionSamplingParams(
            height=side, width=side, num_inference_steps=steps, true_cfg_scale=scale, seed=seed,
            output_type="np", lora_request=None if name is None else LoRARequest(name),
            lora_scale=lora_scale, extra_args={} if cached else {"cache_backend": "none"},
        )  # fmt: skip
        request = OmniDiffusionRequest(
            f"l{i}", prompt=prompt, negative_prompt=negative, sampling_params=params
        )
        handles.append(engine.add_request(request))
    log = []
    while not all(h.done() for h in handles):
        log.append(engine.step())
    assert any(s is not None and 0 < s.num_cached_seqs < s.num_seqs for s in log)
    for i, (handle, (image, counts)) in enumerate(zip(handles, reference)):
        out = handle.result()
        assert out.timings.num_cached_steps == counts, f"case {i}"
        assert float(np.abs(out.images - image).max()) <= 1e-4, f"case {i}"

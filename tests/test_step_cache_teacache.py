"""TeaCache against its formula applied to diffusers' own transformer (fp32, CPU, tiny Qwen-Image).

The reference replaces diffusers' block loop with one TeaCache step: block 0's modulated image input
(`img_norm1` + `_modulate`, diffusers' own modules), its relative L1 change rescaled by the family's
polynomial and accumulated per CFG branch, then every block or the kept residual of both streams.
Each request's image and cached-step counts must match it, alone and packed with others.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from vllm_omni.config import OmniDiffusionConfig
from vllm_omni.diffusion.engine import DiffusionEngine
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.inputs import OmniDiffusionSamplingParams

COEFFICIENTS = [-4.5e02, 2.8e02, -4.5e01, 3.2e00, -2.0e-02]
"""vLLM-Omni's TeaCache coefficients for QwenImageTransformer2DModel (from ComfyUI-TeaCache)."""
SERVER_THRESH = 0.75

CASES = [
    # (prompt, negative, height, width, steps, cfg scale, seed, extra_args)
    ("a red fox in the snow", "blurry", 48, 64, 6, 4.0, 1, {}),
    ("a lighthouse at dusk", None, 32, 32, 6, 1.0, 2, {"cache_config": {"rel_l1_thresh": 0.85}}),
    ("a bowl of fruit", "dark", 32, 48, 5, 3.0, 3, {"cache_config": {"rel_l1_thresh": 0.65}}),
    ("a cat on a sofa", None, 32, 48, 5, 1.0, 5, {"cache_backend": "none"}),
]


class _TeaCacheBlocks(nn.ModuleList):
    """diffusers' blocks, iterated by its forward as ONE callable that applies TeaCache to all."""

    def __init__(self, blocks: nn.ModuleList, thresh: float, do_cfg: bool):
        super().__init__(blocks)
        self.thresh, self.do_cfg, self.calls = thresh, do_cfg, 0
        self.branches = [dict(acc=0.0, prev=None, res=None, cnt=0, cached=0) for _ in range(2)]

    def __iter__(self):
        yield self._all_blocks

    def _all_blocks(self, hidden_states, encoder_hidden_states, temb, **kwargs):
        branch = self.branches[self.calls % 2 if self.do_cfg else 0]
        self.calls += 1
        block0 = self[0]
        img_mod1 = block0.img_mod(temb).chunk(2, dim=-1)[0]
        modulated, _ = block0._modulate(block0.img_norm1(hidden_states), img_mod1)
        compute = True
        if branch["cnt"] > 0 and branch["prev"] is not None:
            prev = branch["prev"]
            rel = ((modulated - prev).abs().mean() / (prev.abs().mean() + 1e-8)).item()
            branch["acc"] += abs(float(np.poly1d(COEFFICIENTS)(rel)))
            if branch["acc"] < self.thresh:
                compute = branch["res"] is None
            else:
                branch["acc"] = 0.0
        if compute:
            img, txt = hidden_states, encoder_hidden_states
            for block in nn.ModuleList.__iter__(self):
                txt, img = block(hidden_states=img, encoder_hidden_states=txt, temb=temb, **kwargs)
            branch["res"] = (img - hidden_states, txt - encoder_hidden_states)
        else:
            img, txt = hidden_states + branch["res"][0], encoder_hidden_states + branch["res"][1]
            branch["cached"] += 1
        branch["prev"], branch["cnt"] = modulated, branch["cnt"] + 1
        return txt, img


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(tiny_model_dir, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    blocks, results = pipe.transformer.transformer_blocks, []
    for prompt, negative, h, w, steps, scale, seed, extra in CASES:
        do_cfg = negative is not None and scale > 1
        cached = extra.get("cache_backend") != "none"
        thresh = extra.get("cache_config", {}).get("rel_l1_thresh", SERVER_THRESH)
        if cached:
            pipe.transformer.transformer_blocks = _TeaCacheBlocks(blocks, thresh, do_cfg)
        image = pipe(
            prompt=prompt, negative_prompt=negative, true_cfg_scale=scale, height=h, width=w,
            num_inference_steps=steps, generator=torch.Generator("cpu").manual_seed(seed), output_type="np",
        ).images  # fmt: skip
        counts = None
        if cached:
            tea = pipe.transformer.transformer_blocks
            counts = [b["cached"] for b in tea.branches[: 2 if do_cfg else 1]]
            pipe.transformer.transformer_blocks = blocks
        results.append((image, counts))
    return results


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    config = OmniDiffusionConfig(
        model=str(tiny_model_dir), dtype="float32", device="cpu", max_num_seqs=8,
        mixfusion_min_chunk_tokens=1, scheduling_policy="skip-ahead", cache_backend="tea_cache",
        cache_config={"rel_l1_thresh": SERVER_THRESH},
    )  # fmt: skip
    return DiffusionEngine(config, autostart=False)


def _request(i, case):
    prompt, negative, h, w, steps, scale, seed, extra = case
    params = OmniDiffusionSamplingParams(
        height=h, width=w, num_inference_steps=steps, true_cfg_scale=scale, seed=seed, output_type="np",
        extra_args=extra,
    )  # fmt: skip
    return OmniDiffusionRequest(f"t{i}", prompt=prompt, negative_prompt=negative, sampling_params=params)


def _run(engine, futures):
    while not all(f.done() for f in futures):
        engine.step()
    return [f.result() for f in futures]


def _check(outputs, reference):
    for i, (out, (image, counts)) in enumerate(zip(outputs, reference)):
        assert out.timings.num_cached_steps == counts, f"case {i}: cached steps per branch"
        diff = float(np.abs(out.images - image).max())
        assert diff <= 1e-4, f"case {i}: max abs diff {diff} vs TeaCache on diffusers' transformer"


def test_reference_caches_something(reference):
    counts = [c for _, c in reference if c is not None]
    assert all(sum(c) > 0 for c in counts), counts


def test_each_request_alone_matches_reference(engine, reference):
    _check([_run(engine, [engine.add_request(_request(i, c))])[0] for i, c in enumerate(CASES)], reference)


def test_packed_together_matches_reference(engine, reference):
    _check(_run(engine, [engine.add_request(_request(10 + i, c)) for i, c in enumerate(CASES)]), reference)

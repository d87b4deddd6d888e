"""Qwen-Image-2.1's prefix KV cache charged at admission (tiny checkpoint, CPU, fp32).

A request's cached prefix (every layer's K and V of its prompt, and of its negative prompt with CFG,
reference-image rows included) is counted from its geometry when it is admitted, logged in bytes, and
held against the memory budget and `--kv-cache-memory-bytes`: a request that could never fit is refused
(400 naming the limit), two that fit only one at a time run one after the other, each with the image
diffusers gives it alone.
"""

from __future__ import annotations

import logging
import re

import numpy as np
import pytest
import torch
from PIL import Image
from tiny21 import tiny21_engine
from utils import run_to_completion

from vllm_omni.config import OmniDiffusionConfig
from vllm_omni.diffusion.engine import DiffusionEngine
from vllm_omni.diffusion.models import registry
from vllm_omni.diffusion.models.qwen_image21.loader import diffusers_pipeline
from vllm_omni.diffusion.models.qwen_image21.pipeline import DEFAULT_SAMPLING_PARAMS
from vllm_omni.diffusion.models.qwen_image21.tiny import TINY_MODEL_NAME
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.entrypoints.openai import errors
from vllm_omni.inputs import InvalidRequestError, OmniDiffusionSamplingParams

ATOL = 1e-4
ENGINE_LOG = "vllm_omni.diffusion.engine"
CASES = [
    # (prompt, negative_prompt, height, width, steps, true_cfg_scale, seed)
    ("a lighthouse on a rocky coast at dusk, waves, gulls", "blurry", 32, 64, 2, 3.0, 31),  # CFG on
    ("a red fox", None, 32, 32, 2, 1.0, 32),
]


def _engine(**kwargs) -> DiffusionEngine:
    return tiny21_engine(**kwargs)


def _request(i: int, case, image=None) -> OmniDiffusionRequest:
    prompt, negative, h, w, steps, scale, seed = case
    params = OmniDiffusionSamplingParams(
        **{
            **DEFAULT_SAMPLING_PARAMS,  # the model's (CFG not renormalised), as the engine's defaults
            **dict(height=h, width=w, num_inference_steps=steps, true_cfg_scale=scale, seed=seed),
            "output_type": "np",
        }
    )
    return OmniDiffusionRequest(
        f"mem-{i}", prompt=prompt, negative_prompt=negative, sampling_params=params, image=image
    )


def _reference() -> Image.Image:
    return Image.fromarray((np.arange(32 * 40 * 3).reshape(32, 40, 3) % 251).astype(np.uint8))


def _prefix_cache(engine):
    return engine.executor.driver_worker.pipeline.transformer.prefix_cache


@pytest.fixture(scope="module")
def engine():
    return _engine()


@pytest.fixture(scope="module")
def diffusers_images():
    pipe = diffusers_pipeline(registry.resolve_model_path(TINY_MODEL_NAME))
    pipe.set_progress_bar_config(disable=True)
    out = []
    for prompt, negative, h, w, steps, scale, seed in CASES:
        generator = torch.Generator("cpu").manual_seed(seed)
        kwargs = dict(
            negative_prompt=negative, true_cfg_scale=scale, height=h, width=w, num_inference_steps=steps
        )
        out.append(pipe(prompt=prompt, generator=generator, output_type="np", **kwargs).images)
    return out


@pytest.mark.parametrize("with_reference", [False, True])
def test_admission_logs_the_prefix_bytes_within_5_percent_of_the_cached_tensors(
    engine, caplog, with_reference
):
    request = _request(0, CASES[0], _reference() if with_reference else None)
    with caplog.at_level(logging.INFO, logger=ENGINE_LOG):
        handle = engine.add_request(request)
    (line,) = [r.getMessage() for r in caplog.records if "prefix KV cache" in r.getMessage()]
    logged = int(re.search(r"(\d+) bytes charged at admission", line).group(1))
    engine.step()  # encodes and prefills the prompt and the negative prompt
    cache = _prefix_cache(engine)
    prefixes = [cache.get(handle.req_id, False), cache.get(handle.req_id, True)]
    actual = sum(t.numel() * t.element_size() for p in prefixes for t in (p.key, p.value))
    print(f"logged {logged} B, cached tensors {actual} B")
    assert abs(logged - actual) <= 0.05 * actual
    assert engine.memory.reserved_prefix_bytes == logged
    engine.abort(handle.req_id)
    for _ in range(2):
        engine.step()
    assert len(cache) == 0 and engine.memory.reserved_prefix_bytes == 0


def test_a_prefix_over_the_limit_alone_is_refused_naming_it(engine):
    request = _request(1, CASES[0], _reference())
    need = engine.memory.prefix_bytes(engine.validate_request(request).num_prefix_cache_rows)
    small = _engine(kv_cache_memory_bytes=need - 1)
    with pytest.raises(InvalidRequestError, match="--kv-cache-memory-bytes") as info:
        small.add_request(request)
    assert f"more than the limit of {need - 1} bytes" in str(info.value)
    answer = errors.from_engine_error(info.value, retry_after_s=1)
    assert answer.status == 400 and answer.param == "image"
    assert small.num_waiting == 0 and len(_prefix_cache(small)) == 0


def test_http_edit_over_the_limit_is_a_400_naming_it(engine):
    """`/v1/images/edits` on a server whose `--kv-cache-memory-bytes` is below one reference's prefix."""
    import asyncio
    import io

    import httpx

    from vllm_omni.entrypoints.openai.api_server import ServerArgs, build_app

    small = _engine(kv_cache_memory_bytes=1 << 20)  # 1 MiB; a reference's ~1000 slots need about 2 MiB
    png = io.BytesIO()
    _reference().save(png, format="PNG")

    async def go():
        app = build_app(small, ServerArgs(model="tiny", api_key=None))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            files = {"image": ("in.png", png.getvalue(), "image/png")}
            data = {"prompt": "make it red", "size": "32x32", "num_inference_steps": "2"}
            return await client.post("/v1/images/edits", data=data, files=files)

    resp = asyncio.run(go())
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "image" and "--kv-cache-memory-bytes" in error["message"]
    assert "more than the limit of 1048576 bytes" in error["message"]


def test_a_flag_for_a_family_without_a_prefix_cache_is_refused():
    with pytest.raises(ValueError, match="--kv-cache-memory-bytes: .* keeps no prefix KV cache"):
        DiffusionEngine(
            OmniDiffusionConfig(
                model="tiny-qwen-image", dtype="float32", device="cpu", kv_cache_memory_bytes=1 << 20
            ),
            autostart=False,
        )


def test_two_requests_over_the_limit_together_run_one_after_the_other(engine, diffusers_images, caplog):
    needs = [
        engine.memory.prefix_bytes(engine.validate_request(_request(i, c)).num_prefix_cache_rows)
        for i, c in enumerate(CASES)
    ]
    limited = _engine(kv_cache_memory_bytes=max(needs) + min(needs) // 2)  # one at a time, never both
    with caplog.at_level(logging.INFO, logger=ENGINE_LOG):
        futures = [limited.add_request(_request(i, c)).future for i, c in enumerate(CASES)]
    assert limited.num_waiting == 2 and len(limited._memory_waiting) == 1, "the second waits for memory"
    assert any("waits for memory" in r.getMessage() for r in caplog.records)
    steps = []
    images = run_to_completion(limited, futures, steps)
    assert max(s.num_reqs for s in steps) == 1, "never both at once"
    for got, want in zip(images, diffusers_images, strict=True):
        assert got.shape == want.shape
        assert float(np.abs(got - want).max()) <= ATOL
    assert len(_prefix_cache(limited)) == 0 and limited.memory.reserved_prefix_bytes == 0

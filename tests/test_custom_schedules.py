"""Custom `sigmas` / `timesteps` and degenerate schedules (issue 26, items 1 and 4).

References we did not write: diffusers' `QwenImagePipeline.__call__(sigmas=...)` on the tiny
checkpoint (fp32 CPU), diffusers' `FlowMatchEulerDiscreteScheduler.set_timesteps(timesteps=...)` for
timesteps (the pipeline takes no `timesteps` argument), and each request run alone for packed steps.
"""

from __future__ import annotations

import asyncio
import base64
import io
import math

import httpx
import numpy as np
import pytest
import torch
from PIL import Image
from utils import run_to_completion, tiny_engine

from vllm_omni.config import OmniDiffusionConfig
from vllm_omni.diffusion.engine import DiffusionEngine
from vllm_omni.diffusion.errors import RequestFailedError
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.entrypoints.omni import sampling_params_from_kwargs
from vllm_omni.entrypoints.openai.api_server import ServerArgs, build_app
from vllm_omni.inputs import InvalidRequestError, OmniDiffusionSamplingParams

SIGMAS = [1.0, 0.8, 0.45, 0.2]
TIMESTEPS = [980.0, 700.0, 300.0]

# (prompt, negative, height, width, steps, cfg, seed, schedule kwargs)
CASES = [
    ("a red fox", "blurry", 48, 32, 4, 4.0, 3, {"sigmas": SIGMAS}),
    ("a bowl of fruit", None, 32, 32, 3, 4.0, 4, {}),
    ("mountains at dawn", "dark", 32, 48, 3, 2.5, 5, {"timesteps": TIMESTEPS}),
]


def _params(case) -> OmniDiffusionSamplingParams:
    _, _, h, w, steps, scale, seed, schedule = case
    return OmniDiffusionSamplingParams(
        height=h,
        width=w,
        num_inference_steps=steps,
        true_cfg_scale=scale,
        seed=seed,
        output_type="np",
        **schedule,
    )


def _request(i: int, case) -> OmniDiffusionRequest:
    return OmniDiffusionRequest(
        f"sched-{i}", prompt=case[0], negative_prompt=case[1], sampling_params=_params(case)
    )


class _TimestepsScheduler:
    """Wraps diffusers' scheduler so the pipeline's `set_timesteps(sigmas=..., mu=...)` call becomes
    `set_timesteps(timesteps=TIMESTEPS, mu=...)`: diffusers' own math for custom timesteps."""

    def __init__(self, scheduler, timesteps):
        self._scheduler, self._timesteps = scheduler, timesteps

    def set_timesteps(self, num_inference_steps=None, device=None, sigmas=None, mu=None, timesteps=None):
        self._scheduler.set_timesteps(device=device, mu=mu, timesteps=self._timesteps)

    def __getattr__(self, name):
        return getattr(self._scheduler, name)


@pytest.fixture(scope="module")
def diffusers_pipe(tiny_model_dir):
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _diffusers(pipe, case, output_type="np"):
    prompt, negative, h, w, steps, scale, seed, schedule = case
    original = pipe.scheduler
    if "timesteps" in schedule:
        pipe.scheduler = _TimestepsScheduler(original, schedule["timesteps"])
    try:
        return pipe(
            prompt=prompt,
            negative_prompt=negative,
            true_cfg_scale=scale,
            height=h,
            width=w,
            num_inference_steps=steps,
            sigmas=schedule.get("sigmas"),
            generator=torch.Generator("cpu").manual_seed(seed),
            output_type=output_type,
        ).images
    finally:
        pipe.scheduler = original


@pytest.fixture(scope="module")
def reference_images(diffusers_pipe):
    return [_diffusers(diffusers_pipe, case) for case in CASES]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    # The tiny images have 4..12 tokens: no MixFusion plan limit, so they may share a step; skip-ahead
    # puts every request in every step (the packed-step identity).
    return tiny_engine(tiny_model_dir, mixfusion_min_chunk_tokens=1, scheduling_policy="skip-ahead")


def _close(got, want, tol=1e-4):
    assert got.shape == want.shape
    diff = float(np.abs(got - want).max())
    assert diff <= tol, f"max abs diff {diff}"


def test_custom_schedules_alone_match_diffusers(engine, reference_images):
    for i, case in enumerate(CASES):
        (got,) = run_to_completion(engine, [engine.add_request(_request(i, case))])
        _close(got, reference_images[i])


def test_custom_schedules_packed_with_default_ones_match_each_alone(engine, reference_images):
    steps = []
    futures = [engine.add_request(_request(10 + i, case)) for i, case in enumerate(CASES)]
    images = run_to_completion(engine, futures, steps)
    assert steps[0].num_reqs == len(CASES) and steps[0].path == "packed"
    for got, want in zip(images, reference_images):
        _close(got, want)


def test_sigmas_still_go_through_the_dynamic_shift(engine):
    """As diffusers: custom sigmas are shifted by Qwen-Image's `mu` and stretched to shift_terminal;
    custom timesteps reach the transformer as given."""
    pipeline = engine.executor.driver_worker.pipeline
    params = _params(CASES[0])
    schedule = pipeline.sigma_schedule(params)
    assert not np.allclose(schedule.sigmas[:-1].numpy(), SIGMAS)
    assert schedule.sigmas[-1] == 0 and math.isclose(float(schedule.sigmas[-2]), 0.02, rel_tol=1e-5)
    schedule = pipeline.sigma_schedule(_params(CASES[2]))
    assert schedule.timesteps.tolist() == TIMESTEPS


@pytest.mark.parametrize(
    "fields, param, needle",
    [
        ({"sigmas": [1.0, 0.5], "timesteps": [900.0, 500.0]}, "sigmas", "not both"),
        ({"sigmas": [0.5, 0.8]}, "sigmas", "strictly decreasing"),
        ({"sigmas": [1.0, float("nan")]}, "sigmas", "finite"),
        ({"sigmas": [1.5, 0.5]}, "sigmas", "(0, 1]"),
        ({"sigmas": [1.0, 0.0]}, "sigmas", "(0, 1]"),
        ({"timesteps": [2000.0, 10.0]}, "timesteps", "(0, 1000]"),
        ({"sigmas": []}, "sigmas", "non-empty"),
        ({"sigmas": [1.0, 0.5, 0.2], "num_inference_steps": 2}, "sigmas", "num_inference_steps=3"),
        ({"sigmas": [1.0, "x"]}, "sigmas", "finite number"),
    ],
)
def test_schedule_validation_names_the_field(fields, param, needle):
    fields = {"num_inference_steps": len(fields.get("sigmas") or fields.get("timesteps") or [1]), **fields}
    with pytest.raises(InvalidRequestError, match=None) as info:
        OmniDiffusionSamplingParams(**fields).validate()
    assert info.value.param == param and needle in str(info.value)


def test_offline_keywords_take_the_step_count_from_the_schedule():
    params = sampling_params_from_kwargs({"num_inference_steps": 30}, {"sigmas": [1.0, 0.5]})
    assert params.num_inference_steps == 2 and params.sigmas == [1.0, 0.5]
    params.validate()


@pytest.mark.parametrize("schedule", [{}, {"sigmas": [1.0]}, {"timesteps": [1000.0]}])
def test_degenerate_one_step_schedules_are_refused_at_admission(engine, schedule):
    params = OmniDiffusionSamplingParams(height=32, width=32, num_inference_steps=1, **schedule)
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request(OmniDiffusionRequest("one", prompt="a cat", sampling_params=params))
    name = next(iter(schedule), "num_inference_steps")
    assert info.value.param == name
    assert "degenerate" in str(info.value) and "NaN" in str(info.value)
    assert engine.num_waiting == 0


def test_diffusers_gives_a_nan_image_for_one_step(diffusers_pipe):
    """Why one step is refused: diffusers' reference itself is NaN (black) there."""
    with np.errstate(invalid="ignore"):
        case = ("a cat", None, 32, 32, 1, 4.0, 0, {})
        image = _diffusers(diffusers_pipe, case, output_type="pt")
    assert torch.isnan(image).all()


def test_non_finite_latents_fail_that_request_alone(engine, reference_images, monkeypatch):
    """A request whose latents turn NaN fails with a clear error; its batch-mates finish correctly."""
    pipeline = engine.executor.driver_worker.pipeline
    original = pipeline.prepare_latents

    def poisoned(params, generator):
        latents = original(params, generator)
        return latents * float("nan") if params.seed == 99 else latents

    monkeypatch.setattr(pipeline, "prepare_latents", poisoned)
    bad = OmniDiffusionSamplingParams(height=32, width=32, num_inference_steps=2, seed=99, output_type="np")
    futures = [engine.add_request(OmniDiffusionRequest("bad", prompt="a cat", sampling_params=bad))]
    futures += [engine.add_request(_request(20 + i, case)) for i, case in enumerate(CASES)]
    while not all(f.done() for f in futures):
        engine.step()
    with pytest.raises(RequestFailedError, match="non-finite latents"):
        futures[0].result()
    for future, want in zip(futures[1:], reference_images):
        _close(future.result().images, want)


def _post(engine, path, body):
    async def go():
        app = build_app(engine, ServerArgs(model="tiny", api_key=None))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=120) as client:
            return await client.post(path, json=body)

    return asyncio.run(go())


@pytest.fixture(scope="module")
def live_engine(tiny_model_dir):
    engine = DiffusionEngine(OmniDiffusionConfig(model=str(tiny_model_dir), dtype="float32", device="cpu"))
    yield engine
    engine.shutdown()


def _png(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB")).astype(int)


def test_http_sigmas_on_images_and_chat_match_diffusers(live_engine, diffusers_pipe):
    case = CASES[0]
    want = np.asarray(_diffusers(diffusers_pipe, case, output_type="pil")[0]).astype(int)
    body = {"prompt": case[0], "negative_prompt": case[1], "size": "32x48", "seed": case[6], "sigmas": SIGMAS}
    resp = _post(live_engine, "/v1/images/generations", body)
    assert resp.status_code == 200, resp.text
    assert np.abs(_png(resp.json()["data"][0]["b64_json"]) - want).max() <= 1
    chat = {
        "messages": [{"role": "user", "content": case[0]}],
        "extra_body": {"height": 48, "width": 32, "seed": case[6], "negative_prompt": case[1]},
        "extra_args": {"sigmas": SIGMAS},
    }
    resp = _post(live_engine, "/v1/chat/completions", chat)
    assert resp.status_code == 200, resp.text
    url = resp.json()["choices"][0]["message"]["content"][0]["image_url"]["url"]
    assert np.abs(_png(url.split(",", 1)[1]) - want).max() <= 1


@pytest.mark.parametrize(
    "extra, param, needle",
    [
        ({"num_inference_steps": 1}, "num_inference_steps", "num_inference_steps >= 2"),
        ({"sigmas": [0.2, 0.5]}, "sigmas", "strictly decreasing"),
        ({"sigmas": [1.0, 0.5], "num_inference_steps": 4}, "sigmas", "num_inference_steps=2"),
        ({"sigmas": [1.0, 0.5], "timesteps": [900, 500]}, "sigmas", "not both"),
    ],
)
def test_http_refuses_degenerate_and_invalid_schedules_with_400(live_engine, extra, param, needle):
    resp = _post(live_engine, "/v1/images/generations", {"prompt": "a cat", "size": "32x32", **extra})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and needle in error["message"], error

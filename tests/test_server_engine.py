"""The HTTP app in front of the real engine on the tiny checkpoint (in process, fp32 CPU).

Each image that comes back is compared with something we did not write: the same
request sent alone, or diffusers' `QwenImagePipeline` for the same seed. Covers
request identity (a reused `X-Request-Id` never mixes requests up), chat
completions with image output, per-request `flow_shift`, and a burst of
Qwen-Image's own aspect ratios sharing steps under the default flags.
"""

from __future__ import annotations

import asyncio
import base64
import io
import time

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from vllm_omni.config import OmniDiffusionConfig
from vllm_omni.diffusion.engine import DiffusionEngine
from vllm_omni.diffusion.sched.cost_model import StepCostModel, StepCostSample
from vllm_omni.entrypoints.openai.api_server import ServerArgs, build_app

MODEL = "tiny"

# Qwen-Image's recommended sizes (width x height) scaled to the tiny model as token grids (16 px per
# token), keeping each aspect ratio: 1328x1328, 1664x928, 928x1664, 1472x1140, 1140x1472, 1584x1056,
# 1056x1584 -> image token counts 16, 28, 28, 20, 20, 24, 24 (gcd 4: MixFusion's chunk limits of
# 256 tokens / 128 chunks would reject every mixed pair).
QWEN_IMAGE_ASPECTS = [(64, 64), (112, 64), (64, 112), (80, 64), (64, 80), (96, 64), (64, 96)]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    """The engine with the default flags (step mode, skip-ahead, no MixFusion plan limits)."""
    config = OmniDiffusionConfig(model=str(tiny_model_dir), dtype="float32", device="cpu")
    engine = DiffusionEngine(config)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def diffusers_pipe(tiny_model_dir):
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def diffusers_image(pipe, body: dict, flow_shift: float | None = None) -> np.ndarray:
    """diffusers' uint8 image [H, W, 3] for an images-API body (`size`, seed, CFG fields)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    width, height = (int(v) for v in body["size"].split("x"))
    original = pipe.scheduler
    if flow_shift is not None:
        pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_config(
            original.config, shift=flow_shift, use_dynamic_shifting=False
        )
    try:
        out = pipe(
            prompt=body["prompt"],
            negative_prompt=body.get("negative_prompt"),
            true_cfg_scale=body.get("true_cfg_scale", 4.0),
            height=height,
            width=width,
            num_inference_steps=body["num_inference_steps"],
            generator=torch.Generator("cpu").manual_seed(body["seed"]),
            output_type="pil",
        )
    finally:
        pipe.scheduler = original
    return np.asarray(out.images[0])


def decode(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


def max_diff(a: np.ndarray, b: np.ndarray) -> int:
    assert a.shape == b.shape, (a.shape, b.shape)
    return int(np.abs(a.astype(int) - b.astype(int)).max())


async def _post_all(engine, requests: list[tuple[str, dict, dict]]) -> list[httpx.Response]:
    """Send (path, body, headers) requests concurrently to a fresh app over the engine."""
    app = build_app(engine, ServerArgs(model=MODEL, api_key=None))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=120) as client:
        return await asyncio.gather(*(client.post(p, json=b, headers=h) for p, b, h in requests))


def post(engine, body: dict, headers: dict | None = None, path: str = "/v1/images/generations"):
    (resp,) = asyncio.run(_post_all(engine, [(path, body, headers or {})]))
    assert resp.status_code == 200, resp.text
    return resp


def image_of(resp: httpx.Response) -> np.ndarray:
    body = resp.json()
    if body.get("object") == "chat.completion":
        url = body["choices"][0]["message"]["content"][0]["image_url"]["url"]
        return decode(url.removeprefix("data:image/png;base64,"))
    return decode(body["data"][0]["b64_json"])


CFG_A = {"prompt": "a red cat", "negative_prompt": "blurry", "true_cfg_scale": 4.0, "seed": 1}
CFG_B = {"prompt": "a lighthouse at dusk, waves", "negative_prompt": "dark", "true_cfg_scale": 2.5, "seed": 2}


@pytest.mark.parametrize("concurrent", [False, True], ids=["in-a-row", "concurrent"])
def test_reused_request_id_never_mixes_requests(engine, concurrent):
    """Same X-Request-Id, same size, both CFG: each client gets its own image (issue 11's bug)."""
    bodies = [{**b, "size": "48x48", "num_inference_steps": 3} for b in (CFG_A, CFG_B)]
    alone = [image_of(post(engine, b)) for b in bodies]
    assert max_diff(*alone) > 10, "the two requests must give visibly different images"
    headers = {"X-Request-Id": "same-id"}
    if concurrent:
        path = "/v1/images/generations"
        resps = asyncio.run(_post_all(engine, [(path, b, headers) for b in bodies]))
    else:
        resps = [post(engine, b, headers) for b in bodies]
    for resp, want in zip(resps, alone):
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-request-id"] == "same-id"
        assert resp.json()["id"].startswith("img-")
        assert max_diff(image_of(resp), want) <= (1 if concurrent else 0)
    assert len({r.json()["id"] for r in resps}) == 2


def test_chat_completions_image_equals_diffusers_and_images_route(engine, diffusers_pipe):
    body = {**CFG_B, "size": "64x32", "num_inference_steps": 3}
    want = diffusers_image(diffusers_pipe, body)
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": [{"type": "text", "text": body["prompt"]}]}],
        "extra_body": {"height": 32, "width": 64, "num_inference_steps": 3, "seed": body["seed"]},
        "negative_prompt": body["negative_prompt"],
        "true_cfg_scale": body["true_cfg_scale"],
    }
    resp = post(engine, chat, path="/v1/chat/completions")
    answer = resp.json()
    assert answer["object"] == "chat.completion" and answer["id"].startswith("chatcmpl-")
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["role"] == "assistant"
    assert choice["message"]["content"][0]["type"] == "image_url"
    assert max_diff(image_of(resp), want) <= 1
    assert max_diff(image_of(post(engine, body)), image_of(resp)) == 0


@pytest.mark.parametrize("flow_shift", [3.0, 0.5])
def test_flow_shift_matches_diffusers_static_shift(engine, diffusers_pipe, flow_shift):
    body = {**CFG_A, "size": "32x48", "num_inference_steps": 4}
    want = diffusers_image(diffusers_pipe, body, flow_shift=flow_shift)
    got = image_of(post(engine, {**body, "extra_args": {"flow_shift": flow_shift}}))
    assert max_diff(got, want) <= 1
    assert max_diff(image_of(post(engine, body)), want) > 1, "flow_shift must change the image"


def test_qwen_image_aspect_ratio_burst_shares_steps_by_default(engine, diffusers_pipe, monkeypatch):
    """Seven aspect ratios (CFG on and off) sent at once share steps under the default flags, on a
    device where packing them is free (a launch-bound step: the latency policy's cost model is flat
    here, instead of learning this CPU's noisy times)."""
    flat = StepCostModel([StepCostSample(16, 0.01), StepCostSample(4096, 0.01)])
    monkeypatch.setattr(flat, "observe", lambda num_tokens, seconds: None)
    monkeypatch.setattr(engine.scheduler.latency_policy, "cost_model", flat)
    bodies = []
    for i, (width, height) in enumerate(QWEN_IMAGE_ASPECTS):
        body = {"prompt": f"a mountain lake, view {i}", "size": f"{width}x{height}", "seed": 20 + i}
        body["num_inference_steps"] = 2
        if i % 2 == 0:
            body.update(negative_prompt="low quality", true_cfg_scale=3.0)
        bodies.append(body)
    num_steps_before = len(engine.recent_steps())
    path = "/v1/images/generations"
    resps = asyncio.run(_post_all(engine, [(path, b, {}) for b in bodies]))
    steps = engine.recent_steps()[num_steps_before:]
    assert max(s.num_reqs for s in steps) >= 4, [s.shapes for s in steps]
    assert max(len(set(s.shapes)) for s in steps) >= 4, "mixed aspect ratios share a step"
    for resp, body in zip(resps, bodies):
        assert resp.status_code == 200, resp.text
        assert max_diff(image_of(resp), diffusers_image(diffusers_pipe, body)) <= 1, body["size"]


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (
            {"lora": {"name": "style", "path": "/adapters/style"}},
            "LoRA adapters are not loaded on this server",
        ),
        ({"lora_name": "style", "lora_int_id": 2}, "LoRA adapters are not loaded on this server"),
        ({"generator_device": "cuda"}, "torch.Generator('cpu')"),
    ],
)
def test_refused_fields_on_the_real_engine(engine, extra, needle):
    """LoRA is parsed, then refused by the engine until adapters load (never silently ignored)."""
    body = {"prompt": "p", "size": "32x32", "num_inference_steps": 1, **extra}
    (resp,) = asyncio.run(_post_all(engine, [("/v1/images/generations", body, {})]))
    assert resp.status_code == 400, resp.text
    assert needle in resp.json()["error"]["message"]


def test_offline_vllm_omni_call_form(tiny_model_dir, diffusers_pipe):
    """`Omni.generate(prompt, height=..., generator=...)` as vLLM-Omni's examples call it."""
    from vllm_omni import Omni

    body = {**CFG_A, "size": "48x32", "num_inference_steps": 2}
    want = diffusers_image(diffusers_pipe, body)
    with Omni(model=str(tiny_model_dir), dtype="float32", device="cpu", vae_use_slicing=True) as omni:
        assert omni.engine.executor.driver_worker.pipeline.vae.use_slicing
        outputs = omni.generate(
            body["prompt"],
            height=32,
            width=48,
            num_inference_steps=2,
            negative_prompt=body["negative_prompt"],
            true_cfg_scale=body["true_cfg_scale"],
            generator=torch.Generator().manual_seed(body["seed"]),
            num_outputs_per_prompt=2,
            use_tqdm=False,
        )
        (out,) = outputs
        assert out.final_output_type == "image" and out.seed == body["seed"]
        images = out.request_output[0].images
        assert len(images) == 2 and max_diff(np.asarray(images[0]), want) <= 1
        used = torch.Generator().manual_seed(5)
        torch.randn(1, generator=used)
        with pytest.raises(ValueError, match="freshly seeded"):
            omni.generate("p", generator=used, use_tqdm=False)
        with pytest.raises(TypeError, match="unknown sampling arguments"):
            omni.generate("p", num_steps=3, use_tqdm=False)


def test_offline_hostile_calls_name_the_argument_and_leave_nothing_running(tiny_model_dir):
    """Found by fuzzing the offline API: bad prompt / sampling_params types raised from deep inside
    (or, for a set, gave outputs in no order); a bad prompt after a good one left the good one running
    unseen; `generate` after `close` silently restarted the engine."""
    from vllm_omni import Omni
    from vllm_omni.inputs import OmniDiffusionSamplingParams

    for bad, needle in (({"device": "cuda:7"}, "--device cuda:7"), ({"device": "junk"}, "not a device")):
        with pytest.raises(ValueError, match=needle):  # an AttributeError / RuntimeError from torch before
            Omni(model=str(tiny_model_dir), dtype="float32", **bad)
    omni = Omni(model=str(tiny_model_dir), dtype="float32", device="cpu")
    for prompts in (None, 5, {"a", "b"}):
        with pytest.raises(TypeError, match="prompts must be"):
            omni.generate(prompts, use_tqdm=False)
    for params in ([1], {"height": 64}, 5, "abc"):
        with pytest.raises(TypeError, match="sampling_params must be"):
            omni.generate("p", params, use_tqdm=False)
    sp = OmniDiffusionSamplingParams(height=32, width=32, num_inference_steps=500, seed=1)  # ~10 s alone
    with pytest.raises(ValueError, match="prompt"):
        omni.generate(["a cat", None], sp, use_tqdm=False)
    deadline = time.monotonic() + 5
    while omni.engine.scheduler.has_requests():  # the good one was aborted with the call
        assert time.monotonic() < deadline, "the first prompt kept running"
        time.sleep(0.05)
    (ok,) = omni.generate("a cat", OmniDiffusionSamplingParams(height=32, width=32, num_inference_steps=2))
    assert ok.request_output[0].images is not None
    omni.close()
    with pytest.raises(RuntimeError, match="closed"):
        omni.generate("a cat", use_tqdm=False)


def test_a_small_request_sent_after_a_large_one_finishes_long_before_it(engine):
    """The latency policy (the default): a 2-step 32x32 request sent while a 12-step 128x128 one runs
    does not wait for it (request mode and FIFO would): it finishes first, and the large one reports
    the steps it sat out (or the small one shared its steps)."""
    large = {"prompt": "a large slow request", "size": "128x128", "num_inference_steps": 12, "seed": 3}
    small = {
        "prompt": "a small quick one",
        "size": "32x32",
        "num_inference_steps": 2,
        "seed": 4,
        "priority": 0,
    }
    done: dict[str, float] = {}

    async def run() -> list[httpx.Response]:
        app = build_app(engine, ServerArgs(model=MODEL, api_key=None))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=120) as client:

            async def send(name: str, body: dict) -> httpx.Response:
                resp = await client.post("/v1/images/generations", json=body)
                done[name] = time.monotonic()
                return resp

            large_task = asyncio.ensure_future(send("large", large))
            while engine.num_running == 0:  # the large request has started
                await asyncio.sleep(0.01)
            return [await send("small", small), await large_task]

    small_resp, large_resp = asyncio.run(run())
    assert small_resp.status_code == 200 and large_resp.status_code == 200, (small_resp.text, large_resp.text)
    assert done["small"] < done["large"]
    timings = large_resp.json()["timings"]
    assert {"num_steps_sat_out", "num_preemptions"} <= set(timings)
    steps = engine.recent_steps()
    assert any(s.num_paused for s in steps) or any(s.num_reqs == 2 for s in steps)

"""Streaming partial images (docs/streaming.md) with the openai SDK against a real HTTP server (uvicorn,
in a thread) over the tiny model: event order and fields, the final image equal to the non-streamed
one and to diffusers', partials decodable and not final, n > 1, a plain request packed beside a
stream, edits, partial_images 0 and 4, a disconnect mid-stream; the offline iterator."""

from __future__ import annotations

import base64
import io
import json
import threading
import time

import httpx
import numpy as np
import openai
import pytest
import torch
import uvicorn
from PIL import Image

from tests.server_process import free_port
from vllm_omni.config import OmniDiffusionConfig
from vllm_omni.diffusion.engine import DiffusionEngine
from vllm_omni.diffusion.outputs import FinishReason
from vllm_omni.entrypoints.openai.api_server import ServerArgs, build_app
from vllm_omni.inputs import preview_steps

MODEL = "tiny"
BODY = {"prompt": "a red cat", "size": "48x48"}
EXTRA = {"negative_prompt": " ", "true_cfg_scale": 4.0, "num_inference_steps": 8, "seed": 3}


class Finished:
    """A stat logger that keeps every finished request's output (finish reason, steps done)."""

    def __init__(self):
        self.outputs = []

    def on_step(self, *args) -> None:
        pass

    def on_request_finished(self, output) -> None:
        self.outputs.append(output)


def _serve(engine) -> tuple[uvicorn.Server, str]:
    port = free_port()
    app = build_app(engine, ServerArgs(model=MODEL, api_key=None))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    return server, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    config = OmniDiffusionConfig(
        model=str(tiny_model_dir),
        dtype="float32",
        device="cpu",
        scheduling_policy="skip-ahead",  # every request in every step: packing is certain
        mixfusion_min_chunk_tokens=1,
    )
    engine = DiffusionEngine(config)
    finished = Finished()
    engine.stat_loggers.append(finished)
    server, url = _serve(engine)
    yield engine, openai.OpenAI(base_url=f"{url}/v1", api_key="none"), url, finished
    server.should_exit = True
    engine.shutdown()


@pytest.fixture
def paced(served, monkeypatch):
    """Steps slow enough for the CPU's VAE: every preview is decoded before its request's final image
    is queued (else the decode worker may skip it, as docs/streaming.md says), so counts are exact."""
    _pace(served[0], monkeypatch)


def _pace(engine, monkeypatch, seconds: float = 0.15) -> None:
    runner = engine.executor.driver_worker.runner
    denoise = runner._denoise

    def paced_denoise(plan):
        time.sleep(seconds)
        return denoise(plan)

    monkeypatch.setattr(runner, "_denoise", paced_denoise)


def decode(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


def test_events_in_order_with_openai_fields_and_the_final_image_is_the_non_streamed_one(served, paced):
    _, client, _, _ = served
    plain = client.images.generate(**BODY, extra_body=EXTRA)
    events = list(client.images.generate(**BODY, stream=True, partial_images=2, extra_body=EXTRA))
    assert [e.type for e in events] == ["image_generation.partial_image"] * 2 + ["image_generation.completed"]
    assert [e.partial_image_index for e in events[:2]] == [0, 1]
    for event in events:
        assert (event.size, event.quality, event.background, event.output_format) == (
            "48x48",
            "auto",
            "auto",
            "png",
        )
        assert abs(event.created_at - time.time()) < 120
    final = events[-1]
    assert final.b64_json == plain.data[0].b64_json, "the streamed image is the non-streamed one, bit for bit"
    usage = final.usage
    assert usage.output_tokens == 9 and usage.input_tokens_details.image_tokens == 0  # (48/16)^2
    assert usage.input_tokens == usage.input_tokens_details.text_tokens > 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    partials = [decode(e.b64_json) for e in events[:2]]
    want = decode(plain.data[0].b64_json)
    for partial in partials:
        assert partial.shape == want.shape and not np.array_equal(partial, want)
    # the later preview is closer to the final image than the earlier one
    errors = [np.abs(p.astype(int) - want.astype(int)).mean() for p in partials]
    assert errors[1] < errors[0]


def test_partial_images_zero_streams_only_the_completed_event_and_n_gives_one_series_per_image(served, paced):
    _, client, _, _ = served
    events = list(client.images.generate(**BODY, stream=True, partial_images=0, extra_body=EXTRA))
    assert [e.type for e in events] == ["image_generation.completed"]
    events = list(client.images.generate(**BODY, n=2, stream=True, partial_images=1, extra_body=EXTRA))
    assert [(e.type, e.model_extra["index"]) for e in events] == [
        ("image_generation.partial_image", 0),
        ("image_generation.partial_image", 1),
        ("image_generation.completed", 0),
        ("image_generation.completed", 1),
    ]
    plain = client.images.generate(**BODY, n=2, extra_body=EXTRA)
    assert [e.b64_json for e in events[2:]] == [d.b64_json for d in plain.data]


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"stream": True, "partial_images": 4}, "partial_images must be in [0, 3]"),
        ({"partial_images": 1}, "partial_images needs stream=true"),
    ],
)
def test_bad_partial_images_is_a_400_naming_the_field(served, fields, message):
    _, _, url, _ = served
    resp = httpx.post(f"{url}/v1/images/generations", json={**BODY, **EXTRA, **fields}, timeout=60)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "partial_images" and message in error["message"]


def test_a_plain_request_packs_beside_a_stream_and_keeps_its_image(served, paced):
    engine, client, _, _ = served
    plain_body, plain_extra = {"prompt": "a lighthouse", "size": "32x32"}, {**EXTRA, "seed": 9}
    alone = client.images.generate(**plain_body, extra_body=plain_extra).data[0].b64_json
    num_steps = len(engine.recent_steps())
    got = {}

    def plain() -> None:
        got["plain"] = client.images.generate(**plain_body, extra_body=plain_extra).data[0].b64_json

    thread = threading.Thread(target=plain)
    extra = {**EXTRA, "num_inference_steps": 12}
    stream = client.images.generate(**BODY, stream=True, partial_images=3, extra_body=extra)
    thread.start()
    events = list(stream)
    thread.join(60)
    assert [e.type for e in events][-1] == "image_generation.completed" and len(events) == 4
    steps = engine.recent_steps()[num_steps:]
    assert any(s.num_reqs == 2 for s in steps), "the two requests shared steps"
    # packed vs alone: fp32 on CPU agrees to rounding (test_engine_identity.py); PNG pixels within 1
    assert np.abs(decode(got["plain"]).astype(int) - decode(alone).astype(int)).max() <= 1


def test_a_client_that_disconnects_mid_stream_aborts_its_request(served):
    engine, _, url, finished = served
    body = {**BODY, **EXTRA, "num_inference_steps": 400, "stream": True, "partial_images": 3}
    with httpx.stream("POST", f"{url}/v1/images/generations", json=body, timeout=60) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        lines = resp.iter_lines()
        assert next(lines) == "event: image_generation.partial_image"
        assert json.loads(next(lines).removeprefix("data: "))["partial_image_index"] == 0
    deadline = time.monotonic() + 30
    while not any(o.num_steps_done and o.finish_reason is FinishReason.ABORTED for o in finished.outputs):
        assert time.monotonic() < deadline, "the request was not aborted"
        time.sleep(0.05)
    aborted = [o for o in finished.outputs if o.finish_reason is FinishReason.ABORTED][-1]
    assert aborted.num_steps_done < 400
    assert engine.num_running == 0


def test_offline_stream_yields_previews_then_the_final_image(served, paced):
    from vllm_omni.entrypoints.omni import Omni, OmniPartialOutput, OmniRequestOutput

    engine = served[0]
    omni = Omni.__new__(Omni)  # the module's engine: no second model load
    omni.engine, omni.config, omni._closed, omni._max_input_images = engine, engine.config, False, 1
    kwargs = dict(height=32, width=32, num_inference_steps=6, seed=4, output_type="np")
    items = list(omni.generate(["a", "b"], negative_prompt=" ", partial_images=2, stream=True, **kwargs))
    for prompt in ("a", "b"):
        mine = [i for i in items if i.prompt == prompt]
        assert [type(i) for i in mine] == [OmniPartialOutput, OmniPartialOutput, OmniRequestOutput]
        assert [i.num_steps_done for i in mine[:2]] == list(preview_steps(6, 2)) == [2, 4]
        (want,) = omni.generate(prompt, negative_prompt=" ", use_tqdm=False, **kwargs)
        assert mine[-1].images.shape == want.images.shape
    with pytest.raises(ValueError, match="partial_images needs stream=True"):
        omni.generate("a", partial_images=1, use_tqdm=False, **kwargs)


@pytest.mark.slow
def test_an_edit_streams_image_edit_events(tiny_edit_model_dir, monkeypatch):
    config = OmniDiffusionConfig(model=str(tiny_edit_model_dir), dtype="float32", device="cpu")
    engine = DiffusionEngine(config)
    _pace(engine, monkeypatch)
    server, url = _serve(engine)
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        buf = io.BytesIO()
        Image.fromarray((np.random.default_rng(0).random((48, 48, 3)) * 255).astype(np.uint8)).save(
            buf, "PNG"
        )
        image = ("in.png", buf.getvalue(), "image/png")
        extra = {"num_inference_steps": 4, "seed": 1}
        plain = client.images.edit(image=image, prompt="make it blue", size="48x48", extra_body=extra)
        events = list(
            client.images.edit(
                image=image,
                prompt="make it blue",
                size="48x48",
                stream=True,
                partial_images=1,
                extra_body=extra,
            )
        )
        assert [e.type for e in events] == ["image_edit.partial_image", "image_edit.completed"]
        assert events[-1].b64_json == plain.data[0].b64_json
    finally:
        server.should_exit = True
        engine.shutdown()


def test_the_preview_is_the_x0_estimate(tiny_model_dir):
    """The preview after step 1 of 2 decodes x0 = x_0 - sigma_0 * v_0. With the Euler step
    x_1 = x_0 + (sigma_1 - sigma_0) * v_0, v_0 follows from the noise and the latents after step 1,
    both read from the engine: the preview ('latent' output) must be that estimate."""
    from vllm_omni.diffusion.request import OmniDiffusionRequest
    from vllm_omni.inputs import OmniDiffusionSamplingParams

    config = OmniDiffusionConfig(model=str(tiny_model_dir), dtype="float32", device="cpu", log_stats=False)
    engine = DiffusionEngine(config, autostart=False)
    previews = []
    params = OmniDiffusionSamplingParams(
        height=32, width=32, num_inference_steps=2, seed=5, output_type="latent", partial_images=1
    )
    request = OmniDiffusionRequest("x0", prompt="a red cat", negative_prompt=" ", sampling_params=params)
    handle = engine.add_request(request, on_partial=previews.append)
    engine.step()
    engine.executor.driver_worker.runner.decoder.drain(60)  # the preview, before the final is queued
    state = engine.executor.driver_worker.runner.batch.get(handle.req_id)
    x1 = state.latents.clone()
    pipeline = engine.executor.driver_worker.pipeline
    x0 = pipeline.prepare_latents(state.params, torch.Generator("cpu").manual_seed(5))
    sigmas = state.schedule.sigmas
    while not handle.done():
        engine.step()
    v0 = (x1 - x0) / float(sigmas[1] - sigmas[0])
    want = x0 - float(sigmas[0]) * v0
    assert len(previews) == 1 and previews[0].step_index == 1 and previews[0].partial_image_index == 0
    torch.testing.assert_close(previews[0].images, want, rtol=1e-4, atol=1e-4)
    assert not torch.equal(previews[0].images, handle.result().images)


def test_shutdown_ends_an_open_stream_with_an_error_event(tiny_model_dir):
    config = OmniDiffusionConfig(model=str(tiny_model_dir), dtype="float32", device="cpu", log_stats=False)
    engine = DiffusionEngine(config)
    server, url = _serve(engine)
    try:
        body = {**BODY, **EXTRA, "num_inference_steps": 400, "stream": True, "partial_images": 3}
        with httpx.stream("POST", f"{url}/v1/images/generations", json=body, timeout=60) as resp:
            lines = resp.iter_lines()
            assert next(lines) == "event: image_generation.partial_image"
            threading.Thread(target=engine.shutdown).start()
            rest = list(lines)
        events = [line for line in rest if line.startswith("event: ")]
        data = [line for line in rest if line.startswith("data: ")]
        assert events[-1] == "event: error", events
        assert json.loads(data[-1].removeprefix("data: "))["error"]["code"] == "request_aborted"
    finally:
        server.should_exit = True

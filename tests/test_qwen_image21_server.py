"""`vllm serve tiny-qwen-image-2.1 --omni --step-execution` as a real subprocess: the model's default
sampling, RGBA PNGs, and the image diffusers' `QwenImage21Pipeline` gives for the same inputs."""

from __future__ import annotations

import base64
import io
import sys

import httpx
import numpy as np
import pytest
import server_process
import torch
from PIL import Image

from vllm_omni.diffusion.models import registry
from vllm_omni.diffusion.models.qwen_image21.loader import diffusers_pipeline
from vllm_omni.diffusion.models.qwen_image21.tiny import TINY_MODEL_NAME

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    registry.resolve_model_path(TINY_MODEL_NAME)  # built once here, not by the server's start-up

    def command(port: int) -> list[str]:
        serve = [sys.executable, "-m", "vllm_omni.entrypoints.cli.main", "serve", TINY_MODEL_NAME, "--omni"]
        return [*serve, "--port", str(port), "--step-execution", "--dtype", "float32", "--device", "cpu"]

    proc = server_process.ServerProcess(command, tmp_path_factory.mktemp("logs") / "server.log")
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def _decode(b64: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(b64)))


def _assert_equals_diffusers(b64: str, prompt: str, seed: int, **kwargs) -> None:
    """The PNG `b64` is RGBA and within 1/255 of diffusers' 64x32 image for the same inputs (2 steps)."""
    image = _decode(b64)
    assert image.mode == "RGBA" and image.size == (64, 32)
    pipe = diffusers_pipeline(registry.resolve_model_path(TINY_MODEL_NAME))
    pipe.set_progress_bar_config(disable=True)
    generator = torch.Generator("cpu").manual_seed(seed)
    want = pipe(
        prompt, height=32, width=64, num_inference_steps=2, generator=generator, output_type="np", **kwargs
    )
    want = (want.images[0] * 255).round().astype(np.int16)
    diff = np.abs(np.asarray(image).astype(np.int16) - want).max()
    assert diff <= 1, f"max pixel difference {diff} > 1/255"


def test_generation_is_an_rgba_png_equal_to_diffusers(server):
    body = {"prompt": "a red fox in the snow", "size": "64x32", "num_inference_steps": 2, "seed": 7}
    resp = httpx.post(f"{server.base_url}/v1/images/generations", json=body, timeout=300)
    assert resp.status_code == 200, resp.text
    _assert_equals_diffusers(resp.json()["data"][0]["b64_json"], "a red fox in the snow", 7)


def test_an_edit_with_a_reference_image_equals_diffusers(server):
    reference = Image.fromarray((np.arange(32 * 48 * 3).reshape(32, 48, 3) % 251).astype(np.uint8))
    png = io.BytesIO()
    reference.save(png, format="PNG")
    files = {"image": ("in.png", png.getvalue(), "image/png")}
    data = {"prompt": "make it red", "size": "64x32", "num_inference_steps": "2", "seed": "3"}
    resp = httpx.post(f"{server.base_url}/v1/images/edits", data=data, files=files, timeout=300)
    assert resp.status_code == 200, resp.text
    image = Image.open(io.BytesIO(png.getvalue()))
    _assert_equals_diffusers(resp.json()["data"][0]["b64_json"], "make it red", 3, image=image)


def test_an_rgba_reference_keeps_its_alpha_through_http(server):
    """An uploaded RGBA reference reaches the model with its alpha (2.1 encodes RGBA references): the
    image equals diffusers' for the same RGBA input, and differs from the one for its RGB pixels."""
    h, w = 32, 48
    rgb = (np.arange(h * w * 3).reshape(h, w, 3) % 251).astype(np.uint8)
    alpha = np.where(np.arange(w)[None, :] < w // 2, 255, 0).repeat(h, axis=0).astype(np.uint8)
    reference = Image.fromarray(np.dstack([rgb, alpha]), mode="RGBA")
    png = io.BytesIO()
    reference.save(png, format="PNG")
    files = {"image": ("in.png", png.getvalue(), "image/png")}
    data = {"prompt": "cut it out", "size": "64x32", "num_inference_steps": "2", "seed": "5"}
    resp = httpx.post(f"{server.base_url}/v1/images/edits", data=data, files=files, timeout=300)
    assert resp.status_code == 200, resp.text
    b64 = resp.json()["data"][0]["b64_json"]
    _assert_equals_diffusers(b64, "cut it out", 5, image=reference)
    with pytest.raises(AssertionError, match="max pixel difference"):  # the alpha mattered
        _assert_equals_diffusers(b64, "cut it out", 5, image=reference.convert("RGB"))


@pytest.mark.parametrize(
    ("background", "output_format", "mode"),
    [
        ("transparent", "png", "RGBA"),
        ("transparent", "webp", "RGBA"),
        ("opaque", "png", "RGB"),
        (None, "jpeg", "RGB"),
    ],
)
def test_background(server, background, output_format, mode):
    body = {
        "prompt": "a glass",
        "size": "32x32",
        "num_inference_steps": 2,  # one step is refused: its schedule is degenerate
        "seed": 1,
        "output_format": output_format,
    }
    if background is not None:
        body["background"] = background
    resp = httpx.post(f"{server.base_url}/v1/images/generations", json=body, timeout=300)
    assert resp.status_code == 200, resp.text
    assert _decode(resp.json()["data"][0]["b64_json"]).mode == mode


def test_transparent_jpeg_is_refused(server):
    body = {"prompt": "a glass", "size": "32x32", "background": "transparent", "output_format": "jpeg"}
    resp = httpx.post(f"{server.base_url}/v1/images/generations", json=body, timeout=60)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "background"


def _png(i: int) -> bytes:
    """A distinct PNG reference image (its size varies with `i`)."""
    h, w = 32 + 8 * (i % 2), 48 - 8 * (i % 3)
    image = Image.fromarray(((np.arange(h * w * 3).reshape(h, w, 3) * (i + 2)) % 251).astype(np.uint8))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def test_an_edit_with_three_image_parts_equals_diffusers(server):
    """Three repeated `image` parts (OpenAI's multipart list) are three references, in order."""
    pngs = [_png(i) for i in range(3)]
    files = [("image[]" if i else "image", (f"in{i}.png", png, "image/png")) for i, png in enumerate(pngs)]
    data = {"prompt": "put them together", "size": "64x32", "num_inference_steps": "2", "seed": "4"}
    resp = httpx.post(f"{server.base_url}/v1/images/edits", data=data, files=files, timeout=300)
    assert resp.status_code == 200, resp.text
    images = [Image.open(io.BytesIO(png)) for png in pngs]
    _assert_equals_diffusers(resp.json()["data"][0]["b64_json"], "put them together", 4, image=images)


def test_chat_with_two_image_parts_equals_diffusers(server):
    pngs = [_png(i) for i in range(2)]
    parts = [{"type": "text", "text": "mix them"}] + [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(p).decode()}}
        for p in pngs
    ]
    body = {
        "messages": [{"role": "user", "content": parts}],
        "size": "64x32",
        "num_inference_steps": 2,
        "seed": 6,
    }
    resp = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=300)
    assert resp.status_code == 200, resp.text
    url = resp.json()["choices"][0]["message"]["content"][0]["image_url"]["url"]
    images = [Image.open(io.BytesIO(png)) for png in pngs]
    _assert_equals_diffusers(url.split(",", 1)[1], "mix them", 6, image=images)


def test_eleven_images_are_refused_naming_the_limit(server):
    files = [("image", (f"in{i}.png", _png(i), "image/png")) for i in range(11)]
    data = {"prompt": "too many", "size": "32x32", "num_inference_steps": "2"}
    resp = httpx.post(f"{server.base_url}/v1/images/edits", data=data, files=files, timeout=60)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "image" and error["code"] == "too_many_images"
    assert "at most 10 input images, got 11" in error["message"]
    parts = [{"type": "text", "text": "too many"}] + [
        {
            "type": "image_url",
            "image_url": {"url": "data:image/png;base64," + base64.b64encode(_png(i)).decode()},
        }
        for i in range(11)
    ]
    resp = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": parts}]},
        timeout=60,
    )
    assert resp.status_code == 400, resp.text
    assert "at most 10 input images, got 11" in resp.json()["error"]["message"]


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("generations", {"size": "16x64"}, "size"),
        ("generations", {"size": "31x31"}, "size"),
        ("edits-multipart", {"size": "16x16"}, "size"),
        ("chat", {"height": 16, "width": 64}, "size"),
    ],
)
def test_a_side_below_32_is_a_400_naming_the_size_and_the_multiple(server, route, body, param):
    """2.1's sides round down to multiples of 32: 16-31 pixels would be 0. Every route answers 400, and
    the connection serves the next request."""
    url = f"{server.base_url}/v1/images/generations"
    reference = "data:image/png;base64," + base64.b64encode(_png(0)).decode()
    if route == "generations":
        resp = httpx.post(url, json={"prompt": "p", **body}, timeout=60)
    elif route == "edits-multipart":
        files = [("image", ("in.png", _png(0), "image/png"))]
        resp = httpx.post(f"{server.base_url}/v1/images/edits", data={"prompt": "p", **body}, files=files)
    else:
        parts = [{"type": "text", "text": "p"}, {"type": "image_url", "image_url": {"url": reference}}]
        chat = {"messages": [{"role": "user", "content": parts}], **body}
        resp = httpx.post(f"{server.base_url}/v1/chat/completions", json=chat, timeout=60)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert param in error["param"], error
    size = body.get("size") or f"{body['width']}x{body['height']}"
    assert "multiple of 32" in error["message"] and f"size {size}" in error["message"], error
    ok = httpx.post(url, json={"prompt": "p", "size": "32x32", "num_inference_steps": 2}, timeout=300)
    assert ok.status_code == 200, ok.text

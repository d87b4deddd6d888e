"""What a vLLM-Omni user tripped on (issue 26): rotated photos, edit form numbers, /health, the size
limit's message.

References we did not write: diffusers' `load_image` (EXIF orientation), vLLM-Omni's `/health` body.
"""

from __future__ import annotations

import base64
import io
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image
from utils import AUTH, MODEL, edit, make_client

from vllm_omni.entrypoints.omni import Omni

ORIENTATION = 274
"""EXIF tag of the orientation."""


def rotated_jpeg() -> bytes:
    """A JPEG stored 128x64 (landscape) with EXIF Orientation 6: a phone photo shot portrait."""
    rng = np.random.default_rng(0)
    pixels = np.repeat(np.repeat(rng.integers(0, 256, (8, 16, 3), dtype=np.uint8), 8, 0), 8, 1)
    exif = Image.Exif()
    exif[ORIENTATION] = 6
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", exif=exif.tobytes(), quality=95)
    return buf.getvalue()


def diffusers_loaded(data: bytes) -> Image.Image:
    from diffusers.utils import load_image

    return load_image(Image.open(io.BytesIO(data)))


@pytest.fixture()
def client():
    client, engine = make_client()
    with client:
        yield client, engine


def test_edits_route_applies_exif_orientation_like_diffusers_load_image(client):
    client, engine = client
    data = rotated_jpeg()
    resp = edit(client, files={"image": ("p.jpg", data, "image/jpeg")}, data={"prompt": "p", "size": "64x64"})
    assert resp.status_code == 200, resp.text
    got = engine.generated[0].image
    want = diffusers_loaded(data)
    assert got.size == want.size == (64, 128), "portrait, as the photo was shot"
    assert np.array_equal(np.asarray(got), np.asarray(want))


def test_chat_data_url_applies_exif_orientation(client):
    client, engine = client
    data = rotated_jpeg()
    url = "data:image/jpeg;base64," + base64.b64encode(data).decode()
    content = [{"type": "text", "text": "p"}, {"type": "image_url", "image_url": {"url": url}}]
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "size": "64x64"}
    resp = client.post("/v1/chat/completions", json=body, headers=AUTH)
    assert resp.status_code == 200, resp.text
    got = engine.generated[0].image
    assert np.array_equal(np.asarray(got), np.asarray(diffusers_loaded(data)))


def test_offline_image_applies_exif_orientation():
    omni = Omni.__new__(Omni)  # no engine: only the request building is under test
    omni.config = SimpleNamespace(default_sampling_params={})
    data = rotated_jpeg()
    image = Image.open(io.BytesIO(data))
    (req,) = omni._make_requests({"prompt": "p", "multi_modal_data": {"image": image}}, None)
    assert req.image.size == (64, 128)
    assert np.array_equal(np.asarray(req.image), np.asarray(diffusers_loaded(data)))


def test_edit_form_numbers_are_numbers(client):
    """Form values are strings: height / width / flow_shift / sigmas arrive typed, as JSON fields would."""
    client, engine = client
    data = {"prompt": "p", "height": "64", "width": "48", "flow_shift": "3.0", "sigmas": "[1.0, 0.5]"}
    resp = edit(client, data=data)
    assert resp.status_code == 200, resp.text
    sp = engine.generated[0].sampling_params
    assert (sp.height, sp.width, sp.flow_shift, sp.sigmas, sp.num_inference_steps) == (
        64,
        48,
        3.0,
        [1.0, 0.5],
        2,
    )
    resp = edit(client, data={"prompt": "p", "height": "tall"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "height"


def test_health_answers_like_vllm_omni(client):
    client, _ = client
    resp = client.get("/health")
    assert resp.status_code == 200 and resp.json() == {"status": "healthy"}


def test_size_limit_over_http_names_the_size_and_the_flag(client):
    client, _ = client
    resp = client.post("/v1/images/generations", json={"prompt": "p", "size": "8192x4096"}, headers=AUTH)
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["param"] == "size" and "8192x4096" in error["message"]
    assert "--max-generated-image-size" in error["message"] and "16777216" in error["message"]


@pytest.mark.parametrize(
    ("body", "param", "start"),
    [
        ({"n": 100}, "n", "n (num_outputs_per_prompt) must be in [1, "),
        ({"size": "100000x100000"}, "size", "size (height) must be in ["),
    ],
)
def test_range_errors_name_the_field_the_client_sent(client, body, param, start):
    """The engine checks its own fields (num_outputs_per_prompt, height); the message starts with the
    API field the client sent, as `param` does."""
    client, _ = client
    resp = client.post("/v1/images/generations", json={"prompt": "p", **body}, headers=AUTH)
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["param"] == param and error["message"].startswith(start), error


def test_coming_from_vllm_omni_table_is_current():
    """vLLM-Omni answers a model mismatch with 400 now and bounds steps to 1..200, guidance to 0..20."""
    from pathlib import Path

    docs = (Path(__file__).resolve().parents[1] / "docs" / "serving.md").read_text()
    section = docs[docs.index("## Coming from vLLM-Omni") : docs.index("## Errors and limits")]
    assert "only warns" not in section
    assert "`model` not served: 400" in section and "1..200" in section and "0..20" in section

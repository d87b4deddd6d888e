"""Hostile input found by a new user's tries (issue 48, item 7): each case answered with a 400 that
names what is wrong, never a misleading message or a silently dropped value. LoRA alias conflicts are
in test_lora_server.py (they need the real adapter manager)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from utils import AUTH, assert_error_shape, make_app, make_client, png_bytes, post

from vllm_omni.inputs import MAX_PRIORITY, OmniDiffusionSamplingParams

PLACES = ("top", "extra_body", "extra_args", "extra_params", "extra_body.extra_args")


def _body_with(place: str, fields: dict) -> dict:
    body = {"prompt": "p", "size": "32x32"}
    if place == "top":
        return {**body, **fields}
    if place == "extra_body.extra_args":
        return {**body, "extra_body": {"extra_args": fields}}
    return {**body, place: fields}


@pytest.fixture()
def server():
    app, engine = make_app()
    with TestClient(app) as client:
        yield client, engine


def test_priority_has_one_rule_in_every_place(server):
    """docs/serving.md: extension fields are accepted at the top level and in every container alike."""
    client, engine = server
    for i, place in enumerate(PLACES):
        resp = post(client, _body_with(place, {"priority": -i}))
        assert resp.status_code == 200, (place, resp.text)
        error = assert_error_shape(post(client, _body_with(place, {"priority": MAX_PRIORITY + 1})), 400)
        assert error["param"] == "priority" and str(MAX_PRIORITY) in error["message"], (place, error)
    assert [r.sampling_params.priority for r in engine.generated] == [0, -1, -2, -3, -4]
    error = assert_error_shape(post(client, _body_with("extra_args", {"priority": 1}) | {"priority": 2}), 400)
    assert "given twice" in error["message"]


@pytest.fixture()
def edit_server():
    client, engine = make_client()
    with client:
        yield client, engine


def _multipart(boundary: str, image: bytes) -> bytes:
    return (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="prompt"\r\n\r\nmake it red\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="image"; filename="a.png"\r\n'
            f"Content-Type: image/png\r\n\r\n"
        ).encode()
        + image
        + f"\r\n--{boundary}--\r\n".encode()
    )


@pytest.mark.parametrize("cut", [0, 4, 9, 200])
def test_a_multipart_body_without_its_closing_boundary_is_malformed(edit_server, cut):
    client, engine = edit_server
    headers = {**AUTH, "Content-Type": "multipart/form-data; boundary=XyZ"}
    whole = _multipart("XyZ", png_bytes())
    resp = client.post("/v1/images/edits", content=whole, headers=headers)
    assert resp.status_code == 200, resp.text
    if cut:
        error = assert_error_shape(
            client.post("/v1/images/edits", content=whole[:-cut], headers=headers), 400
        )
        assert error["code"] == "invalid_multipart" and "closing boundary" in error["message"], error
        assert "image is required" not in error["message"]
    assert len(engine.generated) == 1


def test_form_priority_out_of_range_names_the_range(edit_server):
    client, engine = edit_server
    files = {"image": ("in.png", png_bytes(), "image/png")}
    resp = client.post("/v1/images/edits", files=files, data={"prompt": "p", "priority": "2"}, headers=AUTH)
    assert resp.status_code == 200, resp.text
    assert engine.generated[-1].sampling_params.priority == 2
    data = {"prompt": "p", "priority": str(MAX_PRIORITY + 1)}
    error = assert_error_shape(client.post("/v1/images/edits", files=files, data=data, headers=AUTH), 400)
    assert error["param"] == "priority" and str(MAX_PRIORITY) in error["message"], error
    assert "valid integer" not in error["message"]


def test_the_sigmas_length_message_says_what_diffusers_runs():
    """diffusers' pipeline runs len(sigmas) steps and ignores num_inference_steps; ours refuses the mix
    and the message says both numbers truthfully."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import retrieve_timesteps

    sigmas = [1.0, 0.75, 0.5, 0.25]
    _, diffusers_steps = retrieve_timesteps(FlowMatchEulerDiscreteScheduler(), 10, "cpu", sigmas=sigmas)
    params = OmniDiffusionSamplingParams(height=64, width=64, num_inference_steps=10, sigmas=sigmas)
    with pytest.raises(ValueError) as exc:
        params.validate()
    message = str(exc.value)
    assert f"would run {diffusers_steps} steps and ignore num_inference_steps" in message, message
    assert f"send num_inference_steps={diffusers_steps}" in message

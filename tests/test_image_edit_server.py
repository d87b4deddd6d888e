"""`POST /v1/images/edits` (multipart) and offline edits.

Against a stub engine whose pipeline says it is an edit model: the form reaches the engine as an
`OmniDiffusionRequest` with the decoded image, and every bad image (not an image, too many bytes or
pixels, an unsupported format, two images, a mask) is a 4xx in OpenAI's error shape naming the limit,
with nothing reaching the engine. Through the OpenAI SDK against the real engine on the tiny edit
checkpoint, the answer equals the same request run offline; a text-to-image model refuses edits and
an edit model refuses text-only requests, both with a 400.
"""

from __future__ import annotations

import base64
import io

import pytest
from PIL import Image
from utils import AUTH, MODEL, assert_error_shape, edit, make_client, png_bytes

from vllm_omni.entrypoints.openai.image_input import ImageInputLimits, decode_data_url

BROKEN_PNG_CHUNK = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAgAAAAICAIAAABLbSncAAAACklEQVR4nGNgYGRiZmFlxCHZdQAAAAX//v38anVua2p1bms="
)
"""An 8x8 PNG whose truncated IDAT is followed by a chunk of type b"\\xff\\xfe\\xfd\\xfc": Pillow's
`load()` raises SyntaxError("broken PNG file")."""


@pytest.fixture()
def client():
    client, engine = make_client()
    with client:
        yield client, engine


def test_form_reaches_engine_with_decoded_image(client):
    client, engine = client
    data = {
        "prompt": "make it red",
        "n": "2",
        "size": "64x32",
        "negative_prompt": " ",
        "num_inference_steps": "3",
        "true_cfg_scale": "2.5",
        "seed": "7",
        "user": "u1",
        "output_format": "jpeg",
        "extra_args[enable_mixfusion]": "true",
    }
    resp = edit(client, data=data)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["size"] == "64x32" and body["output_format"] == "jpeg" and len(body["data"]) == 2
    Image.open(io.BytesIO(base64.b64decode(body["data"][0]["b64_json"]))).verify()
    (req,) = engine.generated
    sp = req.sampling_params
    assert (sp.height, sp.width, sp.num_outputs_per_prompt, sp.num_inference_steps) == (32, 64, 2, 3)
    assert (sp.true_cfg_scale, sp.seed, req.negative_prompt) == (2.5, 7, " ")
    assert sp.extra_args == {"enable_mixfusion": True}
    assert req.image.mode == "RGB" and req.image.size == (40, 24)


def test_auto_size_follows_the_input_aspect_like_diffusers(client):
    client, engine = client
    assert edit(client, files={"image[]": ("a.png", png_bytes(80, 48), "image/png")}).status_code == 200
    sp = engine.generated[0].sampling_params
    assert (sp.width, sp.height) == (1312, 800)  # calculate_dimensions(1024 * 1024, 80 / 48)


@pytest.mark.parametrize("size", [None, "auto"])
def test_chat_edit_without_size_follows_the_input_aspect_like_the_edits_route(client, size):
    """An edit through chat/completions gets the edits route's size, not the text-to-image default."""
    client, engine = client
    data_url = "data:image/png;base64," + base64.b64encode(png_bytes(80, 48)).decode()
    content = [{"type": "text", "text": "make it red"}, {"type": "image_url", "image_url": {"url": data_url}}]
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}]}
    if size is not None:
        body["size"] = size
    resp = client.post("/v1/chat/completions", json=body, headers=AUTH)
    assert resp.status_code == 200, resp.text
    sp = engine.generated[0].sampling_params
    assert (sp.width, sp.height) == (1312, 800)


@pytest.mark.parametrize(
    "files, data, status, param, needle",
    [
        ({"image": ("a.png", b"not an image", "image/png")}, None, 400, "image", "not an image"),
        (
            {"image": ("a.gif", png_bytes(fmt="GIF", mode="P"), "image/gif")},
            None,
            400,
            "image",
            "PNG, JPEG, WEBP",
        ),
        ({"image": ("a.png", png_bytes(5000, 4000), "image/png")}, None, 400, "image", "16777216 pixels"),
        (
            [("image", ("a.png", png_bytes(), "image/png")), ("image", ("b.png", png_bytes(), "image/png"))],
            None,
            400,
            "image",
            "takes 1 input image, got 2",
        ),
        ({}, None, 400, "image", "image is required"),
        (
            {"image": ("a.png", png_bytes(), "image/png"), "mask": ("m.png", png_bytes(), "image/png")},
            None,
            400,
            "mask",
            "mask",
        ),
        (None, {"prompt": "p", "seed": "one"}, 400, "seed", "integer"),
        (None, {"prompt": "p", "size": "8x8"}, 400, "size", "must be in"),
        (None, {"prompt": "p", "bogus": "1"}, 400, "bogus", "unknown field"),
        (None, {"prompt": "p", "response_format": "url"}, 400, "response_format", "b64_json"),
        # found by fuzzing: each of these was a 500
        ({"image": ("a.png", BROKEN_PNG_CHUNK, "image/png")}, None, 400, "image", "could not be decoded"),
        ({"image": ("a.png", png_bytes(4096, 1), "image/png")}, None, 400, "image", "200:1 aspect ratio"),
        (
            {"image": ("a.png", png_bytes(8192, 2), "image/png")},
            {"prompt": "p", "size": "64x64"},
            400,
            "image",
            "200:1 aspect ratio",
        ),
        (None, {"prompt": "p", "extra_args": '{"seed": 1' + "0" * 5000 + "}"}, 400, "extra_args", "digits"),
        (None, {"prompt": "p", "extra_args[seed]": "1" + "0" * 5000}, 400, "extra_args[seed]", "digits"),
        (None, {"prompt": "p", "extra_args": "[" * 2000 + "]" * 2000}, 400, "extra_args", "nested deeper"),
        (None, {"prompt": "p", "extra_args": '{"a": NaN}'}, 400, "extra_args", "NaN is not JSON"),
        (None, {"prompt": "p", "n": "1_000"}, 400, "n", "integer"),
        (None, {"prompt": "p", "seed": "\uff11"}, 400, "seed", "integer"),  # a fullwidth digit
        (None, {"prompt": "p", "true_cfg_scale": "nan"}, 400, "true_cfg_scale", "number"),
        (None, {"prompt": "p", "stream": "maybe"}, 400, "stream", "true or false"),
    ],
)
def test_bad_edit_requests_are_4xx_and_never_reach_the_engine(client, files, data, status, param, needle):
    client, engine = client
    if files == {}:  # a multipart form without any file
        resp = client.post(
            "/v1/images/edits",
            data={"prompt": "p"},
            headers={**AUTH, "Content-Type": "multipart/form-data; boundary=x"},
            content=b'--x\r\nContent-Disposition: form-data; name="prompt"\r\n\r\np\r\n--x--\r\n',
        )
    else:
        resp = edit(client, files=files, data=data)
    error = assert_error_shape(resp, status)
    assert error["param"] == param and needle in error["message"], error
    assert engine.generated == []


def test_too_many_bytes_is_413_naming_the_limit():
    from vllm_omni.entrypoints.openai import image_edit

    client, engine = make_client()
    with client:
        resp = edit(client, files={"image": ("a.png", png_bytes(400, 400), "image/png")})
        assert resp.status_code == 200  # under the default 20 MiB
        big = b"\x89PNG" + b"0" * (21 * 2**20)
        resp = edit(client, files={"image": ("a.png", big, "image/png")})
        error = assert_error_shape(resp, 413)
        assert str(ImageInputLimits().max_bytes + image_edit.FORM_OVERHEAD_BYTES) in error["message"]
    assert len(engine.generated) == 1


def test_json_body_and_text_to_image_model_are_400():
    client, engine = make_client(edit_model=False)
    with client:
        error = assert_error_shape(edit(client), 400)
        assert error["param"] == "image" and "text-to-image" in error["message"]
        resp = client.post("/v1/images/edits", json={"prompt": "p"}, headers=AUTH)
        assert "multipart/form-data" in assert_error_shape(resp, 400)["message"]
        assert assert_error_shape(client.post("/v1/images/edits", data={"prompt": "p"}), 401)
    assert engine.generated == []


def test_data_url_decoding_refuses_other_urls():
    limits = ImageInputLimits()
    url = "data:image/png;base64," + base64.b64encode(png_bytes()).decode()
    assert decode_data_url(url, limits, "image_url").size == (40, 24)
    for bad in ("https://example.com/a.png", "file:///etc/passwd", "data:image/png,raw"):
        with pytest.raises(ValueError, match="data URL"):
            decode_data_url(bad, limits, "image_url")


def test_per_image_byte_limit_is_413_naming_it():
    from vllm_omni.entrypoints.openai.image_input import ImageInputError, decode_input_image

    with pytest.raises(ImageInputError, match="the limit is 1000 bytes") as info:
        decode_input_image(png_bytes(400, 400), ImageInputLimits(max_bytes=1000))
    assert info.value.status == 413
    # alpha is kept for the family (2.1 encodes it; Qwen-Image-Edit's pipeline drops it, as diffusers)
    assert decode_input_image(png_bytes(8, 8, mode="RGBA"), ImageInputLimits()).mode == "RGBA"
    assert decode_input_image(png_bytes(8, 8), ImageInputLimits()).mode == "RGB"


def test_a_header_past_pillows_bomb_bound_is_400_naming_the_limit():
    """A 100-byte PNG declaring 20000x20000 pixels: Pillow's own check raises while opening (before
    ours reads the size); it must still be the client's error, not a 500."""
    import struct
    import zlib

    from vllm_omni.entrypoints.openai.image_input import ImageInputError, decode_input_image

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", 20000, 20000, 8, 2, 0, 0, 0)
    data = (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(b"\0"))
        + chunk(b"IEND", b"")
    )
    limits = ImageInputLimits()
    with pytest.raises(ImageInputError, match=f"the limit is {limits.max_pixels} pixels") as info:
        decode_input_image(data, limits)
    assert info.value.status == 400 and info.value.code == "image_too_large"


def test_camera_jpeg_with_a_second_frame_is_a_jpeg(client):
    """Pillow opens a JPEG with an MPO second frame (phone cameras) as format MPO: it is accepted."""
    client, engine = client
    first, second = Image.new("RGB", (40, 24), (10, 20, 30)), Image.new("RGB", (40, 24), (200, 20, 30))
    buf = io.BytesIO()
    first.save(buf, format="MPO", save_all=True, append_images=[second])
    assert Image.open(io.BytesIO(buf.getvalue())).format == "MPO"
    resp = edit(client, files={"image": ("photo.jpg", buf.getvalue(), "image/jpeg")})
    assert resp.status_code == 200, resp.text
    assert engine.generated[0].image.getpixel((0, 0)) == pytest.approx((10, 20, 30), abs=3)


def test_chat_image_url_parts_data_urls_only():
    from vllm_omni.entrypoints.openai.image_input import ImageInputError, chat_image_urls

    url = "data:image/png;base64," + base64.b64encode(png_bytes()).decode()
    messages = [
        {"role": "system", "content": "be nice"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "make it red"},
                {"type": "image_url", "image_url": {"url": url}},
            ],
        },
    ]
    ((param, found),) = chat_image_urls(messages)
    assert param == "messages[1].content[1].image_url"
    assert decode_data_url(found, ImageInputLimits(), param).size == (40, 24)
    assert chat_image_urls([{"role": "user", "content": "text only"}]) == []
    with pytest.raises(ImageInputError, match="takes 1 input image, got 2"):
        chat_image_urls([{"role": "user", "content": messages[1]["content"] * 2}])


def test_offline_prompt_dict_carries_the_image():
    from types import SimpleNamespace

    from vllm_omni.entrypoints.omni import Omni

    omni = Omni.__new__(Omni)  # no engine: only the request building is under test
    omni.config = SimpleNamespace(default_sampling_params={})
    image = Image.new("RGB", (40, 24))
    (req,) = omni._make_requests({"prompt": "make it red", "multi_modal_data": {"image": [image]}}, None)
    assert req.image is image and req.prompt == "make it red"
    rgba = Image.new("RGBA", (40, 24), (10, 20, 30, 40))  # alpha kept for the family, as over HTTP
    (req,) = omni._make_requests({"prompt": "p", "multi_modal_data": {"image": rgba}}, None)
    assert req.image.mode == "RGBA" and req.image.getpixel((0, 0)) == (10, 20, 30, 40)
    for bad, needle in (
        ({"image": "cat.png"}, "PIL image"),
        ({"video": image}, "multi_modal_data"),
        ({"image": Image.new("La", (8, 8))}, "cannot be read as RGBA"),  # failed late, in encoding
    ):
        with pytest.raises(ValueError, match=needle):
            omni._make_requests({"prompt": "p", "multi_modal_data": bad}, None)

"""`POST /v1/images/edits`: OpenAI's multipart image-edit request, served by an edit model.

    curl http://localhost:8000/v1/images/edits -F image=@cat.png -F prompt="make it a watercolor" \
         -F negative_prompt=" " -F num_inference_steps=30 -F seed=0

Form fields: `image` (a file, repeated for several input images where the model takes them,
Qwen-Image-2.1 up to 10; `image[]` as the OpenAI SDK sends lists), `prompt`, and OpenAI's `model`,
`n`, `size` ('WIDTHxHEIGHT' or 'auto' = the (last) input's aspect at about 1024 x 1024, as diffusers),
`response_format`, `output_format`, `output_compression`, `background`, `quality`, `user`, `stream`
and `partial_images` (server-sent events, docs/streaming.md); our
extensions `negative_prompt`, `num_inference_steps`, `true_cfg_scale`, `guidance_scale`, `seed`,
`max_sequence_length` and `extra_args` (a JSON object, or `extra_args[key]` fields). The answer has
the shape of `/v1/images/generations`'. `mask` and other OpenAI-only options are refused with a 400.
The body is read up to a byte limit (413 beyond), the image decoded off the event loop.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser

from vllm_omni.config import BOOLEAN_WORDS
from vllm_omni.diffusion.models.interface import TEXT_TO_IMAGE_REFUSAL, ImageInput
from vllm_omni.entrypoints.openai.errors import APIError
from vllm_omni.entrypoints.openai.hardening import (
    ClientInputError,
    limited_body,
    parse_json,
    within_body_timeout,
)
from vllm_omni.entrypoints.openai.image_input import ImageInputLimits, decode_input_image, too_many_images
from vllm_omni.entrypoints.openai.protocol import ImageGenerationResponse
from vllm_omni.entrypoints.openai.serving_images import (
    DiffusionServing,
    client_label,
    encode_images,
    new_request_id,
)
from vllm_omni.entrypoints.openai.serving_stream import ImageStreamer
from vllm_omni.inputs import InvalidRequestError

INT_FIELDS = ("n", "num_inference_steps", "seed", "max_sequence_length", "output_compression")
INT_FIELDS += ("height", "width", "priority", "lora_int_id", "partial_images")
JSON_FIELDS = ("sigmas", "timesteps")
"""Form fields holding a JSON value (a list of numbers)."""
FLOAT_FIELDS = ("true_cfg_scale", "guidance_scale", "flow_shift", "lora_scale")
IMAGE_FIELDS = ("image", "image[]")
UNSUPPORTED_FIELDS = {
    "mask": "masked (inpainting) edits are not supported; send the image without a mask",
    "input_fidelity": "input_fidelity is not supported by Qwen-Image-Edit",
}
MAX_FORM_FIELDS = 64
MAX_FORM_FILES = 32
"""File parts a form may have (more: 400 malformed multipart); above every model's input image limit."""
FORM_OVERHEAD_BYTES = 1 << 20
"""Body bytes allowed besides the image files (text fields, multipart framing)."""


def _api_error(status: int, message: str, param: str | None, code: str = "invalid_value") -> APIError:
    return APIError(status, message, param=param, code=code)


_INT = re.compile(r"-?[0-9]{1,19}")
_NUMBER = re.compile(r"-?[0-9]{1,19}(\.[0-9]{1,19})?([eE][-+]?[0-9]{1,3})?")
"""JSON's number syntax (ASCII digits; no '_', '+inf' or 'nan' as Python's int() and float() take)."""


def _typed(key: str, value: str) -> Any:
    """A form field's string -> the JSON type `ImageGenerationRequest` expects."""
    text = value.strip()
    if key in INT_FIELDS:
        if not _INT.fullmatch(text):
            raise _api_error(400, f"{key} must be an integer, got {value!r:.80}", key)
        return int(text)
    if key in FLOAT_FIELDS:
        if not _NUMBER.fullmatch(text):
            raise _api_error(400, f"{key} must be a number, got {value!r:.80}", key)
        return float(text)
    if key in JSON_FIELDS:
        return _json_value(key, value)
    if key == "stream":
        if text.lower() not in BOOLEAN_WORDS:
            raise _api_error(400, f"stream must be true or false, got {value!r:.40}", key)
        return BOOLEAN_WORDS[text.lower()]
    return value


def _json_value(key: str, value: str) -> Any:
    """A form field holding JSON, parsed as strictly as a JSON body (`hardening.parse_json`)."""
    try:
        return parse_json(value, what=key, param=key)
    except ClientInputError as exc:
        raise _api_error(400, exc.message, key) from None


def form_to_fields(items: list[tuple[str, Any]]) -> tuple[dict[str, Any], list[UploadFile]]:
    """Multipart items -> (request fields as `ImageGenerationRequest` takes them, image files)."""
    fields: dict[str, Any] = {}
    extra_args: dict[str, Any] = {}
    images: list[UploadFile] = []
    for key, value in items:
        if key in IMAGE_FIELDS:
            if not isinstance(value, UploadFile):
                raise _api_error(400, f"{key} must be a file upload (multipart file part)", "image")
            images.append(value)
        elif key in UNSUPPORTED_FIELDS:
            raise _api_error(400, UNSUPPORTED_FIELDS[key], key, "unsupported_parameter")
        elif isinstance(value, UploadFile):
            raise _api_error(400, f"{key} must be a text field, not a file", key)
        elif key.startswith("extra_args[") and key.endswith("]"):
            extra_args[key[len("extra_args[") : -1]] = _json_value(key, value)
        elif key == "extra_args":
            parsed = _json_value(key, value)
            if not isinstance(parsed, dict):
                raise _api_error(400, "extra_args must be a JSON object", key)
            extra_args.update(parsed)
        elif key in fields:
            raise _api_error(400, f"{key!r} is given twice; send it once", key)
        else:
            fields[key] = _typed(key, value)
    if extra_args:
        fields["extra_args"] = extra_args
    return fields, images


async def read_form(request: Request, max_bytes: int, timeout_s: float | None) -> list[tuple[str, Any]]:
    """Parse the multipart body, refusing it with 413 as soon as it passes `max_bytes` and with 408
    when it has not arrived within `timeout_s` (`--body-read-timeout`, as for JSON bodies)."""
    content_type = request.headers.get("content-type", "")
    if not content_type.lower().startswith("multipart/form-data"):
        raise _api_error(
            400,
            f"/v1/images/edits takes multipart/form-data (OpenAI's form), got {content_type or 'none'!r}",
            None,
            "invalid_content_type",
        )
    body = CloseDelimiterWatch(limited_body(request, max_bytes), content_type)  # 413 past max_bytes
    # NOTE: max_files is above every model's image limit, so too many images get the answer naming the
    # limit (`decode_images`); the body's byte limit bounds what the files hold.
    parser = MultiPartParser(request.headers, body, max_files=MAX_FORM_FILES, max_fields=MAX_FORM_FIELDS)
    try:
        form = await within_body_timeout(parser.parse(), timeout_s)
    except MultiPartException as exc:
        raise _api_error(400, f"malformed multipart body: {exc.message}", None, "invalid_multipart") from None
    if not body.closed:
        raise _api_error(
            400,
            "malformed multipart body: it ends before its closing boundary line (--BOUNDARY--); "
            "was the upload cut short?",
            None,
            "invalid_multipart",
        )
    return list(form.multi_items())


class CloseDelimiterWatch:
    """A multipart body passed through unchanged, noting whether its closing delimiter `--BOUNDARY--`
    arrived: starlette's parser silently drops a part cut off by a truncated body, which would then be
    answered as if the client had not sent it ('image is required')."""

    def __init__(self, body, content_type: str):
        match = re.search(r'boundary="?([^";]+)"?', content_type, re.IGNORECASE)
        self.body = body
        self.delimiter = f"--{match.group(1)}--".encode("latin-1") if match else None
        self.closed = self.delimiter is None  # no boundary: the parser refuses the body itself

    async def __aiter__(self):
        tail = b""
        async for chunk in self.body:
            window = tail + chunk  # the delimiter may straddle two chunks
            self.closed = self.closed or self.delimiter in window
            tail = window[-len(self.delimiter) :] if self.delimiter else b""
            yield chunk


class ImageEditService:
    """Turns one multipart edit request into an engine request and answers with the images."""

    def __init__(
        self,
        serving: DiffusionServing,
        limits: ImageInputLimits | None = None,
        body_timeout_s: float | None = None,
    ):
        self.serving = serving
        """The app's shared engine path (parse, engine request, generate, encode)."""
        self.limits = limits or ImageInputLimits()
        self.body_timeout_s = body_timeout_s
        """The whole multipart body must arrive within this (`--body-read-timeout`); None = no limit."""

    @property
    def image_input(self) -> ImageInput | None:
        """The served family's image-input capability (`engine.image_input`); None: text-to-image."""
        return getattr(self.serving.engine, "image_input", None)

    @property
    def max_input_images(self) -> int:
        """Input images one request may carry: the family's (Qwen-Image-Edit: 1, Qwen-Image-2.1: 10)."""
        return self.image_input.max_input_images if self.image_input is not None else 1

    async def decode_images(self, files: list[UploadFile]) -> list:
        """Read and decode the uploaded images (limits first; PIL off the event loop)."""
        if not files:
            raise _api_error(400, "image is required: send the input image as a multipart file", "image")
        if len(files) > self.max_input_images:
            raise _api_error(
                400, too_many_images("image", self.max_input_images, len(files)), "image", "too_many_images"
            )
        images = []
        for i, upload in enumerate(files):
            param = "image" if len(files) == 1 else f"image[{i}]"
            data = await upload.read(self.limits.max_bytes + 1)
            # a refused image raises ImageInputError: api_server answers it in OpenAI's shape
            images.append(await asyncio.to_thread(decode_input_image, data, self.limits, param))
        return images

    async def handle(self, request: Request) -> Response:
        """POST /v1/images/edits."""
        label = client_label(request)
        max_body = self.limits.max_bytes * self.max_input_images + FORM_OVERHEAD_BYTES
        fields, files = form_to_fields(await read_form(request, max_body, self.body_timeout_s))
        if self.image_input is None:  # refuse before decoding anything
            raise _api_error(400, TEXT_TO_IMAGE_REFUSAL, "image", "unsupported_endpoint")
        api_request = self.serving.parse(fields)
        inputs = await self.decode_images(files)
        size = edit_size(self.image_input, inputs)
        image = inputs[0] if len(inputs) == 1 else inputs  # one image, or a family's several
        req_id = new_request_id("edit")
        if api_request.stream:  # server-sent events (serving_stream.py)
            streamer = ImageStreamer(self.serving, encode_images)
            return await streamer.respond(request, api_request, req_id, label, "image_edit", image, size)
        images = await self.serving.generate(request, api_request, req_id, label, image=image, size=size)
        return self.serving.images_response(api_request, images, req_id, label)


def edit_size(image_input: ImageInput, images: list) -> dict[str, int]:
    """The default `{"height": ..., "width": ...}` of an edit of `images` (a request without a size, or
    with 'auto', gets it): the family's for the last image, as diffusers (Qwen-Image-Edit and
    Qwen-Image-2.1: its aspect at about 1024 x 1024). The edits and chat routes both call this, so the
    same edit gives the same image on either."""
    try:
        for image in images:
            image_input.check_image(image)  # before a size is derived from it
    except InvalidRequestError as exc:
        raise _api_error(400, str(exc), exc.param) from None
    height, width = image_input.default_size(images[-1])
    return {"height": height, "width": width}


def add_image_edit_route(
    router: APIRouter,
    serving: DiffusionServing,
    limits: ImageInputLimits | None = None,
    body_timeout_s: float | None = None,
) -> None:
    """Register `POST /images/edits` on the app's /v1 router (after its API-key dependency)."""
    edits = ImageEditService(serving, limits, body_timeout_s)

    @router.post("/images/edits", response_model=ImageGenerationResponse)
    async def create_image_edit(request: Request) -> Response:
        return await edits.handle(request)

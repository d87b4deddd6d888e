"""The images service: one request from HTTP body to encoded images, shared by every route.

`DiffusionServing` holds the path both `/v1/images/generations` and
`/v1/chat/completions` take: merge the extension containers, validate shapes with
pydantic, convert to the engine request (`to_engine_request`), await
`engine.generate` (which admits the request off the event loop: validation and
prompt tokenisation run in a worker thread, outside the engine lock), abort if the
client goes away first, and encode the images. The routes differ only in how they
read the prompt and shape the answer.

Identity: the response `id` is made here (`img-<uuid4 hex>`, `chatcmpl-<...>`) and
is the request's `request_id`; the engine gives the admitted request its own key
(`req_id`, `req-<session>-<n>`), which its step and memory lines name. The server's
finish line names both. The client's `X-Request-Id` is only a label, echoed in the
response header and the logs, never a key.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import logging
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from vllm_omni.diffusion.outputs import RequestOutput
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.entrypoints.openai import errors, hardening
from vllm_omni.entrypoints.openai.errors import APIError, ClientDisconnected
from vllm_omni.entrypoints.openai.http_limits import ShutdownGate
from vllm_omni.entrypoints.openai.protocol import (
    ImageData,
    ImageGenerationRequest,
    ImageGenerationResponse,
    ImageTimings,
)
from vllm_omni.entrypoints.openai.request_normalize import merge_extension_fields, to_engine_request
from vllm_omni.inputs import InvalidRequestError

logger = logging.getLogger(__name__)

_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


@dataclass
class EngineTimings:
    """Engine-side times of one finished request, in seconds (None when not reported)."""

    queue_s: float | None
    engine_s: float | None


def seconds_or_na(seconds: float | None) -> str:
    """`1.23 s`, or `n/a` for a time the engine did not report (a log line must never fail on it)."""
    return "n/a" if seconds is None else f"{seconds:.2f} s"


def read_engine_timings(output: RequestOutput) -> EngineTimings:
    """The one place that reads a request's engine timings (from its typed `RequestOutput`)."""
    return EngineTimings(output.timings.queue_s, output.timings.engine_s)


def client_label(request: Request) -> str | None:
    """The client's `X-Request-Id` (a label for logs and the response header), checked."""
    label = request.headers.get("x-request-id")
    if label is not None and not _REQUEST_ID_RE.match(label):
        raise APIError(400, "X-Request-Id must be 1..128 characters of [A-Za-z0-9._:-]", param="X-Request-Id")
    return label


def new_request_id(prefix: str) -> str:
    """A server-made, unique engine request id."""
    return f"{prefix}-{uuid.uuid4().hex}"


def encode_images(
    images: list, output_format: str, quality: int | None, keep_alpha: bool = True
) -> list[str]:
    """PIL images -> base64 strings in `output_format`. An RGBA image (Qwen-Image-2.1) keeps its alpha in
    PNG, and in WebP only with `keep_alpha` (background 'transparent'); 'opaque' drops it everywhere."""
    encoded = []
    for image in images:
        buf = io.BytesIO()
        if output_format == "png":
            image = image if keep_alpha else image.convert("RGB")
            image.save(buf, format="PNG", compress_level=4)
        elif output_format == "webp" and keep_alpha and image.mode == "RGBA":
            image.save(buf, format="WEBP", quality=quality or 95)
        else:
            image.convert("RGB").save(buf, format=output_format.upper(), quality=quality or 95)
        encoded.append(base64.b64encode(buf.getvalue()).decode("ascii"))
    return encoded


async def _wait_for_disconnect(request: Request) -> None:
    """Return when the client disconnects (the body has been read, so only that message can come)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


@dataclass
class GeneratedImages:
    """What a route needs to answer: the engine output, its encoding and its times."""

    output: RequestOutput
    encoded: list[str]
    output_format: str
    timings: ImageTimings


class DiffusionServing:
    """The engine path shared by the images and chat routes."""

    def __init__(self, engine, server_args):
        """`engine` follows the `DiffusionEngine` contract; `server_args` is the app's `ServerArgs`."""
        self.engine = engine
        self.args = server_args
        self.gate = ShutdownGate()
        """Set by the server's shutdown: refuse new requests, then abort the waiting ones."""

    def parse(self, body: dict[str, Any]) -> ImageGenerationRequest:
        """JSON fields -> the validated request model; `APIError` 400/404 on bad input."""
        try:
            api_request = ImageGenerationRequest.model_validate(merge_extension_fields(body))
        except InvalidRequestError as exc:
            raise errors.invalid_value(str(exc), exc.param) from None
        except ValidationError as exc:
            raise errors.from_pydantic(exc) from None
        adapters = self._adapter_names()
        if self.model_adapter(api_request) is not None and api_request.model not in adapters:
            raise APIError(
                404,
                f"The model {hardening.echo(api_request.model)} does not exist; "
                f"served: {self.args.served_model_names}"
                + (f", LoRA adapters: {adapters}" if adapters else ""),
                param="model",
                code="model_not_found",
                metric_kind="model_not_found",
            )
        return api_request

    def model_adapter(self, api_request: ImageGenerationRequest) -> str | None:
        """The LoRA adapter the request's `model` names, or None when it names the base model (or no
        model): as vLLM, an adapter listed by /v1/models is a `model` of its own."""
        model = api_request.model
        return None if model is None or model in self.args.served_model_names else model

    def _adapter_names(self) -> list[str]:
        """The loaded adapters' names (the `/v1/models` cards beside the base model)."""
        manager = getattr(self.engine, "lora", None)
        return [] if manager is None else [e.name for e in manager.list_adapters()]

    def to_engine_request(
        self, api_request: ImageGenerationRequest, req_id: str, size: dict[str, int] | None = None
    ) -> OmniDiffusionRequest:
        """The validated model -> the engine request (server defaults underneath). `size`: the default
        `{"height": ..., "width": ...}` when the request gives none (an edit's, from its input image)."""
        defaults = getattr(self.engine, "default_sampling_params", None) or {}
        defaults = {**defaults, **(size or {})}
        try:
            served = getattr(self.engine, "family", None)  # None: an engine stand-in without a family
            outputs_alpha = served is not None and served.capabilities.outputs_alpha
            adapters = getattr(getattr(self.engine.config, "lora", None), "adapter_defaults", None)
            omni_request = to_engine_request(
                api_request, req_id, defaults, outputs_alpha, self.model_adapter(api_request), adapters
            )
        except (ValueError, TypeError) as exc:
            raise errors.from_engine_error(exc, self.args.retry_after_s) from None
        sp = omni_request.sampling_params
        hardening.check_encodable(api_request.output_format or "png", sp.width, sp.height)
        return omni_request

    async def generate(
        self,
        request: Request,
        api_request: ImageGenerationRequest,
        req_id: str,
        label: str | None,
        image=None,
        size: dict[str, int] | None = None,
    ) -> GeneratedImages:
        """Run one request through the engine and encode its images; `image`: an edit request's decoded
        input image (PIL) or list of them (a family taking several), None for text-to-image; `size`: its
        default height and width."""
        start = time.monotonic()
        omni_request = self.to_engine_request(api_request, req_id, size)
        omni_request.image = image
        if self.args.log_requests:
            sp = omni_request.sampling_params
            logger.info(
                "request %s (client id %s): %dx%d n=%d steps=%d cfg=%s user=%s",
                req_id,
                label,
                sp.width,
                sp.height,
                sp.num_outputs_per_prompt,
                sp.num_inference_steps,
                omni_request.do_classifier_free_guidance,
                hardening.log_safe(api_request.user or api_request.safety_identifier),
            )
        output = await self._run(request, omni_request)
        output_format = api_request.output_format or "png"
        encode_start = time.monotonic()
        keep_alpha = api_request.background != "opaque" and (
            output_format == "png" or api_request.background == "transparent"
        )
        encoded = await asyncio.to_thread(
            encode_images, list(output.images), output_format, api_request.output_compression, keep_alpha
        )
        now = time.monotonic()
        engine_times = read_engine_timings(output)
        if self.args.log_requests:  # the one line that names both ids: the engine's lines use its own
            logger.info(
                "request %s finished as engine request %s: engine %s (queued %s), encode %.2f s",
                req_id,
                output.req_id,
                seconds_or_na(engine_times.engine_s),
                seconds_or_na(engine_times.queue_s),
                now - encode_start,
            )
        timings = ImageTimings(
            queue_s=engine_times.queue_s,
            engine_s=engine_times.engine_s,
            num_steps_sat_out=output.timings.num_steps_sat_out,
            num_preemptions=output.timings.num_preemptions,
            num_cached_steps=output.timings.num_cached_steps,
            encode_s=now - encode_start,
            total_s=now - start,
        )
        return GeneratedImages(output, encoded, output_format, timings)

    def images_response(
        self, api_request: ImageGenerationRequest, images: GeneratedImages, req_id: str, label: str | None
    ) -> JSONResponse:
        """OpenAI's `ImagesResponse` for generated (or edited) images; echoes the client's label."""
        output = images.output
        response = ImageGenerationResponse(
            created=int(time.time()),
            data=[ImageData(b64_json=b64, seed=output.seed, index=i) for i, b64 in enumerate(images.encoded)],
            size=f"{output.width}x{output.height}",
            output_format=images.output_format,
            quality=api_request.quality,
            background=api_request.background,
            id=req_id,
            model=api_request.model or self.args.served_model_names[0],
            timings=images.timings,
        )
        return JSONResponse(response.model_dump(), headers={"X-Request-Id": label or req_id})

    async def _run(self, request: Request, omni_request: OmniDiffusionRequest) -> RequestOutput:
        """Await `engine.generate`; cancel it (the engine then aborts the request) on disconnect or
        when the shutdown drain is over (503 `request_aborted`)."""
        with self.gate.track():
            gen_task = asyncio.ensure_future(self.engine.generate(omni_request))
            disconnect = asyncio.ensure_future(_wait_for_disconnect(request))
            shutdown = asyncio.ensure_future(self.gate.wait_aborted())
            try:
                await asyncio.wait({gen_task, disconnect, shutdown}, return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:  # uvicorn cancels handlers only past the drain and answer grace
                gen_task.cancel()
                raise
            finally:
                disconnect.cancel()
                shutdown.cancel()
        if not gen_task.done():
            gen_task.cancel()
            with contextlib.suppress(BaseException):
                await gen_task
            if self.gate.is_aborted:
                raise self._shutdown_abort(omni_request.request_id)
            raise ClientDisconnected(omni_request.request_id)
        try:
            return gen_task.result()
        except (ValueError, TypeError, RuntimeError) as exc:
            raise errors.from_engine_error(exc, self.args.retry_after_s) from None

    def _shutdown_abort(self, req_id: str) -> APIError:
        drain_s = self.args.http_limits.shutdown_drain_timeout_s
        why = self.gate.abort_reason or f"its drain time ({drain_s:g} s) is over"
        return APIError(
            503,
            f"Request {req_id} aborted: the server is shutting down and {why}; send it again to a running "
            "server",
            type="server_error",
            code="request_aborted",
            metric_kind="shutdown_aborted",
        )


class ImageService:
    """`POST /v1/images/generations`."""

    def __init__(self, serving: DiffusionServing):
        self.serving = serving

    async def handle(self, request: Request, body: dict[str, Any]) -> Response:
        """Answer one parsed JSON body in OpenAI's `ImagesResponse` shape."""
        label = client_label(request)
        req_id = new_request_id("img")
        api_request = self.serving.parse(body)
        if api_request.stream:  # server-sent events (serving_stream.py)
            from vllm_omni.entrypoints.openai.serving_stream import ImageStreamer

            return await ImageStreamer(self.serving, encode_images).respond(
                request, api_request, req_id, label, "image_generation"
            )
        # a client that leaves meanwhile raises ClientDisconnected: 499 (api_server's handler)
        images = await self.serving.generate(request, api_request, req_id, label)
        return self.serving.images_response(api_request, images, req_id, label)

"""Streamed image responses: OpenAI's server-sent events for `stream: true` on
`/v1/images/generations` and `/v1/images/edits` (docs/streaming.md).

    event: image_generation.partial_image      (`image_edit.partial_image` for edits)
    data: {"type": ..., "b64_json": ..., "partial_image_index": 0, "size": "1024x1024",
           "quality": "auto", "background": "auto", "output_format": "png", "created_at": ..., "index": 0}
    ...
    event: image_generation.completed
    data: {... the same fields, no partial_image_index, "usage": {...}}

A request with `n > 1` streams one series per image: every event carries `index` (the image's, as
`data[i].index` of the non-streamed answer); each preview point sends n partial events, then n
completed events end the stream. A failure after the stream began (the request failed, the server
shuts down) is one `error` event (`{"type": "error", "error": {...}}`, OpenAI's error shape, which
the openai SDK raises as `APIError`), then the stream closes. A client that disconnects aborts the
request. Bad input is refused with a 400 before the stream begins, as without `stream`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable

from fastapi import Request
from fastapi.responses import StreamingResponse

from vllm_omni.diffusion.errors import RequestAbortedError
from vllm_omni.diffusion.outputs import PartialImage, RequestOutput
from vllm_omni.entrypoints.openai import errors
from vllm_omni.entrypoints.openai.protocol import ImageGenerationRequest
from vllm_omni.entrypoints.stream_outputs import AsyncRequestStream

logger = logging.getLogger(__name__)

TOKENS_PER_SIDE_PIXELS = 16
"""Pixels per image token side (a latent token is 16 x 16 pixels): `usage.output_tokens`."""


def sse_event(name: str, payload: dict) -> bytes:
    """One server-sent event: `event: <name>` and its JSON `data` line."""
    return f"event: {name}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


class ImageStreamer:
    """Answers one streamed images request (generation or edit) with OpenAI's events."""

    def __init__(self, serving, encode_images: Callable[..., list[str]]):
        """`serving`: the app's `DiffusionServing` (engine, args, shutdown gate); `encode_images`: its
        encoder (PIL images, format, quality, keep_alpha) -> base64 strings, as non-streamed answers use."""
        self.serving = serving
        self.encode_images = encode_images

    async def respond(
        self,
        request: Request,
        api_request: ImageGenerationRequest,
        req_id: str,
        label: str | None,
        kind: str,
        image=None,
        size: dict[str, int] | None = None,
    ) -> StreamingResponse:
        """`kind`: 'image_generation' or 'image_edit' (the events' prefix). The request is admitted here
        (a bad one raises its 400 / 503 before any event); the events follow in the response body."""
        omni_request = self.serving.to_engine_request(api_request, req_id, size)
        omni_request.image = image
        stream = AsyncRequestStream(self.serving.engine, omni_request)
        try:
            await stream.start()
        except (ValueError, TypeError, RuntimeError) as exc:
            raise errors.from_engine_error(exc, self.serving.args.retry_after_s) from None
        sp = omni_request.sampling_params
        if self.serving.args.log_requests:
            logger.info(
                "request %s (client id %s): streamed %dx%d n=%d steps=%d partial_images=%d",
                req_id,
                label,
                sp.width,
                sp.height,
                sp.num_outputs_per_prompt,
                sp.num_inference_steps,
                sp.partial_images,
            )
        fields = {
            "size": f"{sp.width}x{sp.height}",
            "quality": api_request.quality or "auto",
            "background": api_request.background or "auto",
            "output_format": api_request.output_format or "png",
        }
        usage = await asyncio.to_thread(self._usage, omni_request)
        body = self._events(request, api_request, stream, kind, fields, usage)
        return StreamingResponse(
            body,
            media_type="text/event-stream",
            headers={"X-Request-Id": label or req_id, "Cache-Control": "no-cache"},
        )

    def _usage(self, omni_request) -> dict:
        """OpenAI's `usage`: text tokens from the engine's tokenizer; output tokens are the image tokens
        the transformer denoised ((H/16) * (W/16) per image); input images are not counted."""
        text_tokens = self.serving.engine.prompts.count("prompt", omni_request.prompt).num_user_tokens
        sp = omni_request.sampling_params
        per_image = (sp.height // TOKENS_PER_SIDE_PIXELS) * (sp.width // TOKENS_PER_SIDE_PIXELS)
        output_tokens = per_image * sp.num_outputs_per_prompt
        return {
            "input_tokens": text_tokens,
            "input_tokens_details": {"text_tokens": text_tokens, "image_tokens": 0},
            "output_tokens": output_tokens,
            "total_tokens": text_tokens + output_tokens,
        }

    async def _events(self, request, api_request, stream: AsyncRequestStream, kind, fields, usage):
        gate = self.serving.gate
        output_format = fields["output_format"]
        keep_alpha = api_request.background != "opaque" and (
            output_format == "png" or api_request.background == "transparent"
        )
        with gate.track():
            shutdown = asyncio.ensure_future(gate.wait_aborted())
            items = stream.__aiter__()
            try:
                while True:
                    step = asyncio.ensure_future(items.__anext__())
                    await asyncio.wait({step, shutdown}, return_when=asyncio.FIRST_COMPLETED)
                    if not step.done():  # the shutdown drain is over: end the stream with an error
                        step.cancel()
                        stream.abort()
                        yield _error_event(RequestAbortedError("the server is shutting down"))
                        return
                    try:
                        item = step.result()
                    except StopAsyncIteration:
                        return
                    except Exception as exc:  # the request failed or was aborted (shutdown)
                        yield _error_event(exc)
                        return
                    images = await asyncio.to_thread(
                        self.encode_images,
                        list(item.images),
                        output_format,
                        api_request.output_compression,
                        keep_alpha,
                    )
                    for index, b64 in enumerate(images):
                        yield sse_event(*_payload(kind, item, b64, index, fields, usage))
            finally:
                shutdown.cancel()
                stream.abort()  # a client that left (the response is cancelled) aborts its request


def _payload(kind: str, item: PartialImage | RequestOutput, b64: str, index: int, fields: dict, usage):
    """(event name, data) of one image of a preview or of the final output."""
    created_at = int(time.time())
    if isinstance(item, PartialImage):
        name = f"{kind}.partial_image"
        data = {"type": name, "b64_json": b64, "partial_image_index": item.partial_image_index}
    else:
        name = f"{kind}.completed"
        data = {"type": name, "b64_json": b64, "usage": usage}
    return name, {**data, **fields, "created_at": created_at, "index": index}


def _error_event(exc: Exception) -> bytes:
    """OpenAI's error object as the stream's last event."""
    message = str(exc) or type(exc).__name__
    aborted = isinstance(exc, RequestAbortedError)
    error = {
        "message": message,
        "type": "server_error",
        "param": None,
        "code": "request_aborted" if aborted else "request_failed",
    }
    return sse_event("error", {"type": "error", "error": error})

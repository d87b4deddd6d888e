"""`POST /v1/chat/completions` with image output (vLLM-Omni's diffusion chat form).

The prompt is the text of the one user message (a string, or a list of
`{"type": "text"}` parts); the diffusion fields come flattened in the body or in
`extra_body` / `extra_args` / `extra_params`. Everything after that is the images
path (`DiffusionServing`): the same validation, errors and seeds, so the same
request gives the same image on both routes. The answer is a `chat.completion`
whose message content is one `image_url` part (a PNG data URL) per image.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import TypeAdapter, ValidationError

from vllm_omni.entrypoints.openai import errors
from vllm_omni.entrypoints.openai.errors import APIError
from vllm_omni.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionResponse,
    ChatMessage,
    ChatResponseMessage,
    ImageURL,
    ImageURLPart,
    TextPart,
)
from vllm_omni.entrypoints.openai.serving_images import DiffusionServing, client_label, new_request_id

logger = logging.getLogger(__name__)

_MESSAGES = TypeAdapter(list[ChatMessage])
CHAT_ONLY_FIELDS = ("messages", "stream", "stream_options", "modalities")
"""Chat fields read here; every other field goes through the images request model."""


def refuse_image_inputs(message: ChatMessage) -> None:
    """Hook for image editing: an `image_url` part in the user message.

    NOTE(server): this model is text-to-image; an edit pipeline replaces this refusal with its own
    request builder (see docs/serving.md).
    """
    raise APIError(
        400,
        "image inputs (image_url parts) are not supported: this server runs a text-to-image model; "
        "send text content only",
        param="messages",
        code="unsupported_content",
    )


def prompt_from_messages(raw: Any, allow_images: bool = False) -> str:
    """The prompt: the text of the single user message; `APIError` 400 for anything else.

    `allow_images` (an edit model): `image_url` parts are left for `chat_input_images`."""
    try:
        messages = _MESSAGES.validate_python(raw)
    except ValidationError as exc:
        raise errors.from_pydantic(exc, prefix="messages") from None
    if len(messages) != 1 or messages[0].role != "user":
        roles = [m.role for m in messages]
        raise errors.invalid_value(
            f"messages must be exactly one user message holding the image prompt, got roles {roles}; "
            "image generation has no conversation or system prompt",
            "messages",
        )
    message = messages[0]
    content = message.content
    if isinstance(content, list):
        if not allow_images and any(isinstance(part, ImageURLPart) for part in content):
            refuse_image_inputs(message)
        content = "\n".join(part.text for part in content if isinstance(part, TextPart))
    if not content or not content.strip():
        raise errors.invalid_value("messages[0].content must contain the prompt text", "messages")
    return content


async def chat_input_images(messages: Any, max_images: int = 1) -> list:
    """An edit model's input images: the user messages' `image_url` parts in order (data URLs; other
    URLs are refused, never fetched; more than `max_images` refused naming the limit), decoded off the
    event loop; empty when there is none."""
    import asyncio

    from vllm_omni.entrypoints.openai.image_input import ImageInputLimits, chat_image_urls, decode_data_url

    # a refused image raises ImageInputError: api_server answers it in OpenAI's shape
    images = []
    for param, url in chat_image_urls(messages, max_images):
        images.append(await asyncio.to_thread(decode_data_url, url, ImageInputLimits(), param))
    return images


class ChatService:
    """`POST /v1/chat/completions` answered with generated images."""

    def __init__(self, serving: DiffusionServing):
        self.serving = serving

    async def handle(self, request: Request, body: dict[str, Any]) -> Response:
        """Answer one parsed JSON body in OpenAI's `ChatCompletion` shape."""
        label = client_label(request)
        stream = body.get("stream")
        if stream is not None and not isinstance(stream, bool):
            raise errors.invalid_value(f"stream must be a boolean, got {stream!r:.40}", "stream")
        if stream:
            raise errors.invalid_value(
                "stream=true is not supported for image output on chat completions; send stream=false, "
                "or stream previews from /v1/images/generations (stream=true, partial_images)",
                "stream",
            )
        modalities = body.get("modalities")
        if modalities is not None and modalities != ["image"]:
            raise errors.invalid_value(f"modalities must be ['image'], got {modalities!r}", "modalities")
        if "messages" not in body:
            raise errors.invalid_value("messages: field required", "messages")
        fields = {k: v for k, v in body.items() if k not in CHAT_ONLY_FIELDS}
        if "prompt" in fields:
            raise errors.invalid_value("send the prompt as the user message, not as 'prompt'", "prompt")
        image_input = getattr(self.serving.engine, "image_input", None)  # the family's; None: text-to-image
        is_edit_model = image_input is not None
        fields["prompt"] = prompt_from_messages(body["messages"], allow_images=is_edit_model)
        api_request = self.serving.parse(fields)
        inputs = (
            await chat_input_images(body["messages"], image_input.max_input_images) if is_edit_model else []
        )
        image, size = None, None
        if inputs:
            from vllm_omni.entrypoints.openai.image_edit import edit_size

            size = edit_size(image_input, inputs)
            image = inputs[0] if len(inputs) == 1 else inputs
        req_id = new_request_id("chatcmpl")
        images = await self.serving.generate(request, api_request, req_id, label, image=image, size=size)
        mime = f"image/{images.output_format}"
        parts = [ImageURLPart(image_url=ImageURL(url=f"data:{mime};base64,{b64}")) for b64 in images.encoded]
        output = images.output
        response = ChatCompletionResponse(
            id=req_id,
            created=int(time.time()),
            model=api_request.model or self.serving.args.served_model_names[0],
            choices=[ChatChoice(index=0, message=ChatResponseMessage(content=parts))],
            seed=output.seed,
            size=f"{output.width}x{output.height}",
            timings=images.timings,
        )
        payload = response.model_dump(exclude_none=True)
        payload["usage"] = None
        return JSONResponse(payload, headers={"X-Request-Id": label or req_id})

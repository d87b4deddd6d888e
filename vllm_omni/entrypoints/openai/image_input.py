"""Decoding client-sent input images (edit requests), with limits checked before any pixel is decoded.

Only bytes the client sent are decoded: no paths are opened and no URLs fetched. `decode_input_image`
is blocking (PIL); the server calls it through `asyncio.to_thread`.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
import struct
from dataclasses import dataclass

from PIL import ExifTags, Image, ImageOps, UnidentifiedImageError

DATA_URL_RE = re.compile(r"^data:(?P<mime>image/[A-Za-z0-9.+-]+)?(?P<b64>;base64)?,(?P<data>.*)$", re.DOTALL)


@dataclass(frozen=True)
class ImageInputLimits:
    """What an input image may be; every refusal names the limit."""

    max_bytes: int = 20 * 2**20
    """Encoded size of one image (20 MiB)."""
    max_pixels: int = 4096 * 4096
    """Width x height of one image (edit models resize to about 1024 x 1024 anyway)."""
    formats: tuple[str, ...] = ("PNG", "JPEG", "WEBP")
    """PIL format names accepted."""


class ImageInputError(ValueError):
    """A refused input image: `status` 400 (bad image) or 413 (too many bytes); `param` the field."""

    def __init__(self, message: str, param: str = "image", status: int = 400, code: str = "invalid_image"):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


DECODE_ERRORS = (UnidentifiedImageError, OSError, ValueError, SyntaxError, EOFError, IndexError, struct.error)
"""What Pillow raises on a corrupt file (a broken PNG chunk is a SyntaxError, a short one an EOFError)."""


def decode_input_image(data: bytes, limits: ImageInputLimits, param: str = "image") -> Image.Image:
    """Encoded bytes -> a decoded RGB PIL image; `ImageInputError` naming `param` and the limit.

    The format and the pixel count come from the header, so an oversized image is refused before
    its pixels are decoded (no decompression bombs).
    """
    if len(data) == 0:
        raise ImageInputError(f"{param} is empty", param)
    if len(data) > limits.max_bytes:
        raise ImageInputError(
            f"{param} is {len(data)} bytes; the limit is {limits.max_bytes} bytes",
            param,
            413,
            "image_too_large",
        )
    try:
        image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError:  # a header over Pillow's own bound (2 x MAX_IMAGE_PIXELS)
        raise ImageInputError(
            f"{param} declares more than {2 * Image.MAX_IMAGE_PIXELS} pixels; the limit is "
            f"{limits.max_pixels} pixels",
            param,
            code="image_too_large",
        ) from None
    except DECODE_ERRORS:
        raise ImageInputError(
            f"{param} is not an image this server can read (accepted formats: {', '.join(limits.formats)})",
            param,
        ) from None
    # Pillow opens a camera JPEG with a second (depth or preview) frame as MPO; its first frame is the JPEG
    image_format = "JPEG" if image.format == "MPO" else image.format
    if image_format not in limits.formats:
        accepted = ", ".join(limits.formats)
        raise ImageInputError(
            f"{param} is {image.format or 'an unknown format'}; accepted formats: {accepted}",
            param,
            code="unsupported_image_format",
        )
    width, height = image.size
    if width * height > limits.max_pixels:
        raise ImageInputError(
            f"{param} is {width}x{height} = {width * height} pixels; the limit is {limits.max_pixels} pixels",
            param,
            code="image_too_large",
        )
    try:
        image.load()
    except (*DECODE_ERRORS, Image.DecompressionBombError) as exc:
        raise ImageInputError(f"{param} could not be decoded: {exc}", param) from None
    return as_rgb_or_rgba(image, param)


def has_alpha(image: Image.Image) -> bool:
    """An alpha channel, or a palette / grey image with a transparent colour."""
    return image.mode in ("RGBA", "LA", "PA", "La", "RGBa") or "transparency" in image.info


def as_rgb_or_rgba(image: Image.Image, param: str) -> Image.Image:
    """`image` upright, as RGBA when it carries transparency and RGB otherwise: its EXIF Orientation
    applied first (`ImageOps.exif_transpose`: a phone photo stored landscape with Orientation 6 is
    edited portrait), then converted. The alpha is kept for the family to use or drop: Qwen-Image-2.1
    encodes RGBA references, Qwen-Image-Edit converts to RGB as diffusers' `load_image` does (the
    same pixels as dropping it here). `ImageInputError` naming `param` for a mode Pillow cannot
    convert or pixels that cannot be read."""
    mode = "RGBA" if has_alpha(image) else "RGB"
    try:
        if image.getexif().get(ExifTags.Base.Orientation, 1) != 1:
            image = ImageOps.exif_transpose(image)
        return image if image.mode == mode else image.convert(mode)
    except DECODE_ERRORS as exc:
        raise ImageInputError(f"{param} ({image.mode}) cannot be read as {mode}: {exc}", param) from None


def decode_data_url(url: str, limits: ImageInputLimits, param: str) -> Image.Image:
    """`data:image/...;base64,...` -> an RGB or RGBA image. Other URLs are refused (nothing is fetched)."""
    match = DATA_URL_RE.match(url.strip()) if isinstance(url, str) else None
    if match is None or match.group("b64") is None:
        raise ImageInputError(
            f"{param} must be a base64 data URL (data:image/png;base64,...); other URLs are not fetched",
            param,
        )
    encoded = match.group("data")
    if len(encoded) > (limits.max_bytes * 4) // 3 + 4:
        raise ImageInputError(
            f"{param} decodes to more than {limits.max_bytes} bytes; the limit is {limits.max_bytes} bytes",
            param,
            413,
            "image_too_large",
        )
    try:
        data = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise ImageInputError(f"{param} is not valid base64", param) from None
    return decode_input_image(data, limits, param)


def chat_image_urls(messages: list, max_images: int = 1) -> list[tuple[str, str]]:
    """(param, url) of every `image_url` content part of the user messages of a chat request.

    The hook for `/v1/chat/completions` with an edit model (vLLM-Omni's shape: a user message whose
    `content` is a list of `{"type": "text", ...}` and `{"type": "image_url", "image_url": {"url": ...}}`
    parts). Raises `ImageInputError` naming the part when there are more than `max_images` or a part
    is malformed; decode each url with `decode_data_url` (off the event loop).
    """
    found = []
    for i, message in enumerate(messages if isinstance(messages, list) else []):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(message, dict) or message.get("role") != "user" or not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "image_url":
                continue
            param = f"messages[{i}].content[{j}].image_url"
            image_url = part.get("image_url")
            url = image_url.get("url") if isinstance(image_url, dict) else image_url
            if not isinstance(url, str):
                raise ImageInputError(f"{param} must be an object with a string 'url'", param)
            found.append((param, url))
    if len(found) > max_images:
        raise ImageInputError(
            too_many_images("messages", max_images, len(found)), "messages", 400, "too_many_images"
        )
    return found


def too_many_images(param: str, max_images: int, num_images: int) -> str:
    """The refusal of a request with more input images than the model takes, naming the limit."""
    if max_images == 1:
        return f"{param}: this model takes 1 input image, got {num_images}"
    return f"{param}: this model takes at most {max_images} input images, got {num_images}"

"""Defences of the HTTP layer against hostile or broken clients.

Every function here turns a client-caused failure into a `ClientInputError` (answered as a 4xx in
OpenAI's error shape, logged as one line) instead of letting it escape as a 500 with a traceback:

    body reading      Content-Length / size limit (413), read timeout (408), client gone mid-body
    JSON parsing      content type (415), nesting depth, integer digits, NaN/Infinity, duplicate
                      keys, lone UTF-16 surrogates (400 `invalid_json`)
    authentication    bearer compare on bytes (a non-ASCII header is a 401, not a TypeError)
    echo and logs     `echo` truncates client values put into messages; `log_safe` escapes control
                      characters so a newline in `user` cannot forge a log line
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from starlette.requests import ClientDisconnect, Request

T = TypeVar("T")

MAX_JSON_DEPTH = 32
"""Deepest nesting of objects/arrays a body may have (a valid request needs 3)."""
MAX_INT_DIGITS = 64
"""Longest integer literal accepted (seeds need 19 digits; Python refuses more than 4300)."""
MAX_ECHO_CHARS = 80
"""Client values quoted in an error message are cut to this many characters."""
MAX_MESSAGE_CHARS = 2048
"""Error messages are cut to this many characters (a last guard for values quoted elsewhere)."""
MAX_LOG_CHARS = 200
"""Client strings written to the log are cut to this many characters."""
MAX_SIDE_BY_FORMAT = {"webp": 16383, "jpeg": 65535}
"""Largest image side each encoder writes (libwebp's and JPEG's limits); PNG has none we reach."""
JSON_CONTENT_TYPES = ("application/json",)
"""Accepted media types (plus any `application/*+json`); a missing header is accepted (curl -d)."""


@dataclass
class ClientInputError(Exception):
    """A request the client got wrong; the server answers `status` in OpenAI's error shape."""

    status: int
    message: str
    code: str
    param: str | None = None
    metric_kind: str = "invalid_request"
    """Label of `request_errors_total` this refusal counts under."""
    headers: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        return self.message


class ClientGone(Exception):
    """The client closed the connection before its request body was complete."""


# ---- echo and logs ------------------------------------------------------------------------------


def echo(value: Any, limit: int = MAX_ECHO_CHARS) -> str:
    """`repr(value)` cut to `limit` characters, safe to put in an error message or a log line."""
    text = repr(value).encode("utf-8", "backslashreplace").decode("utf-8")
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


def cap_message(message: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """An error message cut to `limit` characters and made encodable as UTF-8 (lone surrogates escaped)."""
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    if len(message) <= limit:
        return message
    return f"{message[:limit]}... [truncated, {len(message)} characters]"


def log_safe(value: Any, limit: int = MAX_LOG_CHARS) -> str:
    """A client string for the log: control and other non-printable characters escaped, length capped.

    `log_safe("bob\\nINFO forged")` -> `'bob\\\\nINFO forged'` (one line).
    """
    if value is None:
        return "-"
    text = str(value)
    if len(text) > limit:
        text = f"{text[:limit]}...({len(text)} chars)"
    if text.isprintable():
        return text
    return "".join(
        c if c.isprintable() else c.encode("unicode_escape", "backslashreplace").decode() for c in text
    )


def check_encodable(output_format: str, width: int, height: int) -> None:
    """Refuse (400, before generation) a size the chosen encoder cannot write."""
    max_side = MAX_SIDE_BY_FORMAT.get(output_format)
    if max_side is not None and max(width, height) > max_side:
        raise ClientInputError(
            400,
            f"output_format {output_format!r} takes image sides up to {max_side} px, size is "
            f"{width}x{height}; use output_format 'png' or a smaller size",
            code="invalid_value",
            param="size",
        )


# ---- authentication -----------------------------------------------------------------------------


def bearer_token_matches(authorization: str | None, api_key: str) -> bool:
    """Whether an `Authorization` header carries `Bearer <api_key>`, compared in constant time on bytes.

    Starlette decodes header bytes as latin-1, so re-encoding as latin-1 gives the bytes the client
    sent; `secrets.compare_digest` on str refuses non-ASCII (TypeError), on bytes it does not.
    """
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    try:
        sent = token.strip().encode("latin-1")
    except UnicodeEncodeError:  # not from a real header; refuse
        return False
    return secrets.compare_digest(sent, api_key.encode("utf-8"))


# ---- body reading -------------------------------------------------------------------------------


def check_content_type(content_type: str | None) -> None:
    """Refuse (415) a body declared as anything but JSON; a missing header is accepted."""
    if content_type is None or not content_type.strip():
        return
    media_type = content_type.split(";", 1)[0].strip().lower()
    if media_type in JSON_CONTENT_TYPES or (
        media_type.startswith("application/") and media_type.endswith("+json")
    ):
        return
    raise ClientInputError(
        415,
        f"Content-Type {echo(media_type)} is not supported; send the body as 'application/json'",
        code="unsupported_media_type",
        param="Content-Type",
    )


async def read_body(request: Request, limit: int, timeout_s: float | None) -> bytes:
    """The request body, at most `limit` bytes, received within `timeout_s` seconds.

    Raises `ClientInputError` 413 (declared or counted size over `limit`), 400 (bad Content-Length),
    408 (the body did not arrive in time; the connection is closed) and `ClientGone` when the client
    disconnects mid-body.
    """

    async def receive_all() -> bytes:
        return b"".join([chunk async for chunk in limited_body(request, limit)])

    return await within_body_timeout(receive_all(), timeout_s)


def _body_too_large(limit: int) -> ClientInputError:
    return ClientInputError(
        413,
        f"request body exceeds the limit of {limit} bytes",
        code="request_too_large",
        metric_kind="body_too_large",
    )


def limited_body(request: Request, limit: int) -> AsyncIterator[bytes]:
    """The body's chunks, refused with `ClientInputError` 413 once the declared (checked now) or the
    counted size passes `limit`, and 400 for a Content-Length that is not a number. Shared by
    `read_body` (JSON) and the multipart parser of /v1/images/edits."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not (declared.isascii() and declared.isdigit()):
            raise ClientInputError(
                400, f"invalid Content-Length header {echo(declared)}", code="invalid_header"
            )
        if int(declared) > limit:
            raise _body_too_large(limit)

    async def chunks() -> AsyncIterator[bytes]:
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _body_too_large(limit)
            yield chunk

    return chunks()


async def within_body_timeout(reading: Awaitable[T], timeout_s: float | None) -> T:
    """Await `reading` (a body read or parse) for at most `timeout_s` seconds: 408 with
    `Connection: close` past it, `ClientGone` when the client disconnects meanwhile."""
    try:
        return await asyncio.wait_for(reading, timeout=timeout_s)
    except ClientDisconnect:
        raise ClientGone() from None
    except asyncio.TimeoutError:
        raise ClientInputError(
            408,
            f"request body not received within {timeout_s:g} s (--body-read-timeout)",
            code="request_timeout",
            metric_kind="request_timeout",
            headers={"Connection": "close"},
        ) from None


# ---- strict JSON --------------------------------------------------------------------------------


class _NotStrictJSON(ValueError):
    """Raised inside `json.loads` by the strict hooks; its message says why."""


def _object_without_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise _NotStrictJSON(f"key {echo(key)} appears twice in one object; send it once")
        obj[key] = value
    return obj


def _parse_int(literal: str) -> int:
    if len(literal.lstrip("-")) > MAX_INT_DIGITS:
        raise _NotStrictJSON(
            f"an integer literal has {len(literal)} digits; at most {MAX_INT_DIGITS} are accepted"
        )
    return int(literal)


def _refuse_constant(name: str) -> None:
    raise _NotStrictJSON(f"{name} is not JSON (RFC 8259); send a finite number")


def _check_tree(root: Any) -> None:
    """Depth <= MAX_JSON_DEPTH and every string (keys too) encodable as UTF-8; iterative, no recursion."""
    stack: list[tuple[Any, int]] = [(root, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, str):
            try:
                node.encode("utf-8")
            except UnicodeEncodeError:
                raise _NotStrictJSON(
                    f"string {echo(node)} holds a lone UTF-16 surrogate (not valid Unicode)"
                ) from None
            continue
        if not isinstance(node, (dict, list)):
            continue
        if depth > MAX_JSON_DEPTH:
            raise _NotStrictJSON(f"nested deeper than {MAX_JSON_DEPTH} levels")
        children = [*node.keys(), *node.values()] if isinstance(node, dict) else node
        stack.extend((child, depth + 1) for child in children)


def parse_json(raw: bytes | str, what: str = "request body", param: str | None = None) -> Any:
    """Parse JSON strictly (a body, or a form field holding JSON); `ClientInputError` 400
    `invalid_json` naming `what` (and `param`) otherwise.

    Beyond `json.loads`: duplicate keys, integer literals over `MAX_INT_DIGITS` digits, NaN/Infinity,
    nesting over `MAX_JSON_DEPTH` and lone surrogates (`"\\ud800"`) are refused, each naming the cause.
    """
    try:
        value = json.loads(
            raw,
            object_pairs_hook=_object_without_duplicates,
            parse_int=_parse_int,
            parse_constant=_refuse_constant,
        )
        _check_tree(value)
        return value
    except RecursionError:
        reason = f"nested deeper than {MAX_JSON_DEPTH} levels"
    except _NotStrictJSON as exc:
        reason = str(exc)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        reason = cap_message(str(exc), 200)
    raise ClientInputError(400, f"{what} is not valid JSON: {reason}", code="invalid_json", param=param)


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """A request body parsed strictly (`parse_json`) into a JSON object; `ClientInputError` 400
    `invalid_json` otherwise."""
    body = parse_json(raw)
    if not isinstance(body, dict):
        raise ClientInputError(
            400, f"request body must be a JSON object, got {type(body).__name__}", code="invalid_json"
        )
    return body

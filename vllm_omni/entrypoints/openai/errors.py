"""Errors of the HTTP layer, and how engine exceptions become OpenAI-shaped answers.

Every non-2xx answer is `{"error": {"message", "type", "param", "code"}}`. The HTTP
status and code of an engine failure follow the exception's type and its typed kind,
never its message text.
"""

from __future__ import annotations

import re

from fastapi.responses import JSONResponse
from pydantic import ValidationError

from vllm_omni.diffusion.errors import QueueFullError, RequestAbortedError, RequestFailedError
from vllm_omni.entrypoints.openai.protocol import ErrorInfo, ErrorResponse
from vllm_omni.inputs import InvalidRequestError
from vllm_omni.lora.errors import LoRANotFoundError

SAMPLING_FIELD_TO_PARAM = {
    "height": "size",
    "width": "size",
    "height*width": "size",
    "num_outputs_per_prompt": "n",
    "lora_request": "lora",
}
"""Sampling-param field -> the API field a client sent it as (where the two differ)."""


class APIError(Exception):
    """An error answered in OpenAI's shape. `metric_kind` is counted in `request_errors_total`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        metric_kind: str | None = "invalid_request",
    ):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers, self.metric_kind = param, code, headers, metric_kind


class BindError(OSError):
    """The listening socket could not be bound (port in use, bad host)."""


class ClientDisconnected(Exception):
    """The client went away before its images were ready; the request was aborted."""


def error_response(
    status: int, message: str, type: str, param: str | None = None, code: str | None = None, headers=None
) -> JSONResponse:
    """A JSON response in OpenAI's error shape."""
    body = ErrorResponse(error=ErrorInfo(message=message, type=type, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def invalid_value(message: str, param: str | None) -> APIError:
    """A 400 for a field whose value is refused."""
    return APIError(400, message, param=param, code="invalid_value")


_UNION_TAG = re.compile(r"^(str|int|float|bool|none|list|dict|tuple)$|\[")
"""Location parts pydantic adds for a union's member (`str`, `list[...]`, `function-after[...]`):
they name a type, not a field."""


def from_pydantic(exc: ValidationError, prefix: str | None = None) -> APIError:
    """The most specific pydantic error as a 400 naming the field (dotted path under `prefix`) and
    the value. Of a union's errors the deepest is the one about the client's value (a bad part of a
    content list, not "not a string")."""
    first = max(exc.errors(), key=lambda e: len(e["loc"]))
    path = [prefix] if prefix else []
    path += [str(p) for p in first["loc"] if not _UNION_TAG.search(str(p))]
    param = ".".join(path) if path else None
    if first["type"] == "extra_forbidden":
        message = f"unknown field {param!r}; see docs/serving.md for the accepted fields"
    else:
        message = f"{param or 'request'}: {first['msg']}"
        if "input" in first and first["type"] != "missing":
            message += f" (got {first['input']!r:.80})"
    return invalid_value(message, param)


def from_engine_error(exc: Exception, retry_after_s: int) -> APIError:
    """An exception from `engine.add_request` or a request's result -> the HTTP answer."""
    if isinstance(exc, QueueFullError):
        return APIError(
            503,
            f"server busy: {exc}",
            type="server_error",
            code="queue_full",
            headers={"Retry-After": str(retry_after_s)},
            metric_kind="queue_full",
        )
    if isinstance(exc, RequestAbortedError):
        return APIError(503, str(exc), type="server_error", code="request_aborted", metric_kind=None)
    if isinstance(exc, RequestFailedError):
        return APIError(500, str(exc), type="server_error", code=exc.kind.value, metric_kind=None)
    if isinstance(exc, LoRANotFoundError):
        return APIError(404, str(exc), param="lora", code="lora_not_found", metric_kind="model_not_found")
    if isinstance(exc, InvalidRequestError):
        param = SAMPLING_FIELD_TO_PARAM.get(exc.param, exc.param)
        message = str(exc)
        if param != exc.param and exc.param and message.startswith(f"{exc.param} "):
            # the engine names its own field; the client sent another (`n`, not num_outputs_per_prompt)
            message = f"{param} ({exc.param}){message[len(exc.param) :]}"
        return invalid_value(message, param)
    if isinstance(exc, (ValueError, TypeError)):
        return invalid_value(str(exc), None)
    raise exc

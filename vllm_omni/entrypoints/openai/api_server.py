"""OpenAI-compatible HTTP server (FastAPI + uvicorn) in front of a `DiffusionEngine`.

The server is a thin translation layer: it checks the API key and body size,
parses and validates the JSON body, converts it into an `OmniDiffusionRequest`,
awaits `engine.generate`, and encodes the images. A client that disconnects
while waiting has its request aborted in the engine. Every error is answered in
OpenAI's shape `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import dataclasses
import io
import logging
import re
import signal
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from vllm_omni import __version__
from vllm_omni.config import TINY_MODEL_NAME, OmniDiffusionConfig
from vllm_omni.diffusion.outputs import RequestOutput
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.diffusion.stats import QueueFullError, RequestAbortedError, RequestFailedError
from vllm_omni.entrypoints.openai import hardening
from vllm_omni.entrypoints.openai.hardening import ClientGone, ClientInputError, cap_message, log_safe
from vllm_omni.entrypoints.openai.http_limits import DrainingServer, HTTPLimits, ShutdownGate, uvicorn_config
from vllm_omni.entrypoints.openai.metrics import METRICS_CONTENT_TYPE, PrometheusStatLogger
from vllm_omni.entrypoints.openai.protocol import (
    ErrorInfo,
    ErrorResponse,
    ImageData,
    ImageGenerationRequest,
    ImageGenerationResponse,
    ImageTimings,
    ModelCard,
    ModelList,
)
from vllm_omni.entrypoints.openai.request_normalize import (
    RequestFieldError,
    build_diffusion_request,
    merge_extension_fields,
)

logger = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BODY_BYTES = 1 << 20
_PARAM_ALIASES = {"height": "size", "width": "size", "height*width": "size", "num_outputs_per_prompt": "n"}
_PARAM_RE = re.compile(r"([a-z_][a-z0-9_.*]*)\b")
_EXTRA_KEY_RE = re.compile(r"extra_args key '([^']+)'")
_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


@dataclass
class ServerArgs:
    """What the HTTP layer needs from the command line."""

    model: str = TINY_MODEL_NAME
    served_model_names: list[str] = field(default_factory=list)
    """Names clients may send as `model`; the first is reported. Defaults to [model]."""
    api_key: str | None = None
    """When set, /v1/* requires `Authorization: Bearer <api_key>`."""
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    """Bodies larger than this are refused with 413."""
    retry_after_s: int = 1
    """`Retry-After` seconds sent with 503 (queue full)."""
    http_limits: HTTPLimits = field(default_factory=HTTPLimits)
    """Read timeouts, connection cap and shutdown drain (`http_limits.py`)."""

    def __post_init__(self) -> None:
        if not self.served_model_names:
            self.served_model_names = [self.model]

    @classmethod
    def from_namespace(cls, args: argparse.Namespace) -> ServerArgs:
        """Build from `vllm serve` arguments (missing attributes take the defaults)."""
        names = getattr(args, "served_model_name", None) or []
        return cls(
            model=getattr(args, "model", None) or TINY_MODEL_NAME,
            served_model_names=[names] if isinstance(names, str) else list(names),
            api_key=getattr(args, "api_key", None) or None,
            max_request_body_bytes=getattr(args, "max_request_body_bytes", None)
            or DEFAULT_MAX_REQUEST_BODY_BYTES,
            http_limits=http_limits_from_namespace(args),
        )


def _default_connection_cap(args: argparse.Namespace) -> int:
    """Every queued and running request holds a connection; 64 more for health checks and scrapes."""
    return (getattr(args, "max_queue_size", None) or 1024) + (getattr(args, "max_num_seqs", None) or 8) + 64


def http_limits_from_namespace(args: argparse.Namespace) -> HTTPLimits:
    """`HTTPLimits` from the `serve` flags (missing ones take the defaults)."""
    defaults = HTTPLimits()
    given = {
        "header_read_timeout_s": getattr(args, "header_read_timeout", None),
        "body_read_timeout_s": getattr(args, "body_read_timeout", None),
        "timeout_keep_alive_s": getattr(args, "timeout_keep_alive", None),
        "limit_concurrency": getattr(args, "limit_concurrency", None),
        "shutdown_drain_timeout_s": getattr(args, "shutdown_drain_timeout", None),
    }
    if given["limit_concurrency"] is None:
        given["limit_concurrency"] = _default_connection_cap(args)
    return HTTPLimits(**{k: v if v is not None else getattr(defaults, k) for k, v in given.items()})


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


def param_from_message(message: str) -> str | None:
    """Guess the API field an engine `ValueError` message names ('height must be ...' -> 'size')."""
    match = _EXTRA_KEY_RE.match(message)
    if match is not None:
        return f"extra_args.{match.group(1)}"
    match = _PARAM_RE.match(message)
    if match is None:
        return None
    return _PARAM_ALIASES.get(match.group(1), match.group(1))


def _pydantic_error(exc: ValidationError) -> APIError:
    first = exc.errors()[0]
    param = ".".join(str(p) for p in first["loc"]) or None
    if first["type"] == "extra_forbidden":
        message = f"unknown field {param!r}; see docs/serving.md for the accepted fields"
    else:
        message = f"{param}: {first['msg']}"
        if "input" in first and first["type"] != "missing":
            message += f" (got {first['input']!r:.80})"
    return APIError(400, message, param=param, code="invalid_value")


async def read_json_body(request: Request, limit: int, timeout_s: float | None = None) -> dict[str, Any]:
    """Read at most `limit` bytes within `timeout_s` and parse a JSON object strictly (`hardening`)."""
    hardening.check_content_type(request.headers.get("content-type"))
    return hardening.parse_json_object(await hardening.read_body(request, limit, timeout_s))


async def _wait_for_disconnect(request: Request) -> None:
    """Return when the client disconnects (the body has been read, so only that message can come)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _encode_images(images: list, output_format: str, quality: int | None) -> list[str]:
    """PIL images -> base64 strings in `output_format`."""
    encoded = []
    for image in images:
        buf = io.BytesIO()
        if output_format == "png":
            image.save(buf, format="PNG", compress_level=4)
        else:
            image.convert("RGB").save(buf, format=output_format.upper(), quality=quality or 95)
        encoded.append(base64.b64encode(buf.getvalue()).decode("ascii"))
    return encoded


class ImageService:
    """Handles image requests for one engine: parse, generate (abort on disconnect), encode."""

    def __init__(self, engine, server_args: ServerArgs, metrics: PrometheusStatLogger):
        self.engine = engine
        self.args = server_args
        self.metrics = metrics
        self.gate = ShutdownGate()
        """Set by the server's shutdown: refuse new requests, then abort the waiting ones."""

    def parse(self, body: dict[str, Any], req_id: str) -> tuple[ImageGenerationRequest, OmniDiffusionRequest]:
        """JSON body -> (validated API request, engine request); `APIError` 400/404 on bad input."""
        try:
            api_request = ImageGenerationRequest.model_validate(merge_extension_fields(body))
        except RequestFieldError as exc:
            raise APIError(400, str(exc), param=exc.param, code="invalid_value") from None
        except ValidationError as exc:
            raise _pydantic_error(exc) from None
        if api_request.model is not None and api_request.model not in self.args.served_model_names:
            raise APIError(
                404,
                f"The model {hardening.echo(api_request.model)} does not exist; "
                f"served: {self.args.served_model_names}",
                param="model",
                code="model_not_found",
                metric_kind="model_not_found",
            )
        fields = api_request.model_dump(exclude_none=True)
        defaults = getattr(self.engine.config, "default_sampling_params", None) or {}
        try:
            omni_request = build_diffusion_request(fields, req_id, defaults)
            self.engine.validate_request(omni_request)
        except RequestFieldError as exc:
            raise APIError(400, str(exc), param=exc.param, code="invalid_value") from None
        except (ValueError, TypeError) as exc:
            raise APIError(400, str(exc), param=param_from_message(str(exc)), code="invalid_value") from None
        sp = omni_request.sampling_params
        hardening.check_encodable(api_request.output_format or "png", sp.width, sp.height)
        return api_request, omni_request

    async def generate(self, request: Request, omni_request: OmniDiffusionRequest) -> RequestOutput:
        """Await the engine; abort the request if the client disconnects first."""
        gen_task = asyncio.ensure_future(self.engine.generate(omni_request))
        disconnect_task = asyncio.ensure_future(_wait_for_disconnect(request))
        shutdown_task = asyncio.ensure_future(self.gate.wait_aborted())
        try:
            await asyncio.wait(
                {gen_task, disconnect_task, shutdown_task}, return_when=asyncio.FIRST_COMPLETED
            )
        except asyncio.CancelledError:  # uvicorn cancels handlers only past the drain and answer grace
            self._abort(gen_task, omni_request.request_id)
            raise
        finally:
            disconnect_task.cancel()
            shutdown_task.cancel()
        if not gen_task.done():
            self._abort(gen_task, omni_request.request_id)
            with contextlib.suppress(BaseException):
                await gen_task
            if self.gate.is_aborted:
                raise APIError(
                    503,
                    f"Request {omni_request.request_id} aborted: the server is shutting down and its drain "
                    f"time ({self.args.http_limits.shutdown_drain_timeout_s:g} s) is over; send it again "
                    "to a running server",
                    type="server_error",
                    code="request_aborted",
                    metric_kind="shutdown_aborted",
                )
            raise ClientDisconnected(omni_request.request_id)
        try:
            return gen_task.result()
        except QueueFullError as exc:
            raise APIError(
                503,
                f"server busy: {exc}",
                type="server_error",
                code="queue_full",
                headers={"Retry-After": str(self.args.retry_after_s)},
                metric_kind="queue_full",
            ) from None
        except RequestAbortedError as exc:
            raise APIError(
                503, str(exc), type="server_error", code="request_aborted", metric_kind=None
            ) from None
        except RequestFailedError as exc:
            raise APIError(
                500, str(exc), type="server_error", code=exc.kind.value, metric_kind=None
            ) from None
        except ValueError as exc:
            raise APIError(400, str(exc), param=param_from_message(str(exc)), code="invalid_value") from None

    @staticmethod
    def _abort(gen_task: asyncio.Future, req_id: str) -> None:
        """Cancel the engine wait; `engine.generate` aborts the request when cancelled."""
        gen_task.cancel()

    async def handle(self, request: Request) -> Response:
        """POST /v1/images/generations."""
        start = time.monotonic()
        req_id = request.headers.get("x-request-id") or f"img-{uuid.uuid4().hex}"
        if not _REQUEST_ID_RE.match(req_id):
            raise APIError(
                400, "X-Request-Id must be 1..128 characters of [A-Za-z0-9._:-]", param="X-Request-Id"
            )
        try:
            body = await read_json_body(
                request, self.args.max_request_body_bytes, self.args.http_limits.body_read_timeout_s
            )
        except ClientGone:
            logger.info("request %s: client disconnected before its body was complete", req_id)
            self.metrics.record_rejection("client_disconnected")
            return Response(status_code=499)
        api_request, omni_request = self.parse(body, req_id)
        sp = omni_request.sampling_params
        logger.info(
            "request %s: %dx%d n=%d steps=%d cfg=%s user=%s",
            req_id,
            sp.width,
            sp.height,
            sp.num_outputs_per_prompt,
            sp.num_inference_steps,
            omni_request.do_classifier_free_guidance,
            log_safe(api_request.user or api_request.safety_identifier),
        )
        try:
            output = await self.generate(request, omni_request)
        except ClientDisconnected:
            logger.info("request %s: client disconnected; aborted", req_id)
            return Response(status_code=499)
        output_format = api_request.output_format or "png"
        encode_start = time.monotonic()
        encoded = await asyncio.to_thread(
            _encode_images, list(output.images), output_format, api_request.output_compression
        )
        now = time.monotonic()
        timings = output.timings
        response = ImageGenerationResponse(
            created=int(time.time()),
            data=[ImageData(b64_json=b64, seed=output.seed, index=i) for i, b64 in enumerate(encoded)],
            size=f"{output.width}x{output.height}",
            output_format=output_format,
            quality=api_request.quality,
            background=api_request.background,
            id=req_id,
            model=api_request.model or self.args.served_model_names[0],
            timings=ImageTimings(
                queue_s=timings.queue_s,
                engine_s=timings.engine_s,
                encode_s=now - encode_start,
                total_s=now - start,
            ),
        )
        return JSONResponse(response.model_dump(), headers={"X-Request-Id": req_id})


def _refusal(request: Request, status: int, message: str, type: str, param, code, headers) -> JSONResponse:
    """An OpenAI-shaped answer for a refused request, logged as one line (no traceback)."""
    message = cap_message(message)
    param = cap_message(param, hardening.MAX_ECHO_CHARS) if param is not None else None
    logger.info("%s %s -> %d %s: %s", request.method, request.url.path, status, code, log_safe(message))
    return error_response(status, message, type, param, code, headers)


def _install_error_handlers(app: FastAPI, metrics: PrometheusStatLogger) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        if exc.metric_kind:
            metrics.record_rejection(exc.metric_kind)
        return _refusal(request, exc.status, exc.message, exc.type, exc.param, exc.code, exc.headers)

    @app.exception_handler(ClientInputError)
    async def _client_input_error(request: Request, exc: ClientInputError) -> JSONResponse:
        metrics.record_rejection(exc.metric_kind)
        kind = "invalid_request_error"
        return _refusal(request, exc.status, exc.message, kind, exc.param, exc.code, exc.headers or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return error_response(exc.status_code, str(exc.detail), kind, headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": str(exc)}
        param = ".".join(str(p) for p in first["loc"]) or None
        return error_response(
            400, f"{param}: {first['msg']}", "invalid_request_error", param, "invalid_value"
        )

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        metrics.record_rejection("internal")
        return error_response(
            500, f"internal server error: {type(exc).__name__}", "server_error", None, "internal"
        )


def build_app(
    engine, args: ServerArgs | argparse.Namespace, metrics: PrometheusStatLogger | None = None
) -> FastAPI:
    """Create the FastAPI app serving `engine`.

    `engine` follows the `DiffusionEngine` contract (`generate`, `abort`,
    `validate_request`, `num_running`, `num_waiting`, `recent_steps`, `config`);
    it must already be started. Pass the `metrics` logger that was given to the
    engine as a stat logger; without one, a fresh logger sees only server-side events.
    """
    server_args = args if isinstance(args, ServerArgs) else ServerArgs.from_namespace(args)
    config: OmniDiffusionConfig = engine.config
    if metrics is None:
        metrics = PrometheusStatLogger(config, server_args.served_model_names[0])
    service = ImageService(engine, server_args, metrics)
    created = int(time.time())

    app = FastAPI(title="vllm-omni", version=__version__)
    app.state.engine, app.state.metrics, app.state.server_args = engine, metrics, server_args
    app.state.shutdown_gate = service.gate
    metrics.describe_engine(engine)
    _install_error_handlers(app, metrics)

    async def check_api_key(request: Request) -> None:
        if server_args.api_key is None:
            return
        if not hardening.bearer_token_matches(request.headers.get("authorization"), server_args.api_key):
            raise APIError(
                401,
                "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
                metric_kind="unauthorized",
            )

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])

    body_schema = {"content": {"application/json": {"schema": ImageGenerationRequest.model_json_schema()}}}

    @v1.post(
        "/images/generations",
        response_model=ImageGenerationResponse,
        openapi_extra={"requestBody": {"required": True, **body_schema}},
    )
    async def create_images(request: Request) -> Response:
        if service.gate.is_draining:
            raise APIError(
                503,
                "the server is shutting down and accepts no new requests; send it to a running server",
                type="server_error",
                code="server_shutting_down",
                metric_kind="shutting_down",
            )
        with service.gate.track():
            return await service.handle(request)

    @v1.get("/models", response_model=ModelList)
    async def list_models() -> ModelList:
        cards = [
            ModelCard(id=name, created=created, root=server_args.model)
            for name in server_args.served_model_names
        ]
        return ModelList(data=cards)

    @v1.get("/debug/steps")
    async def debug_steps() -> dict[str, Any]:
        steps = [dataclasses.asdict(s) for s in engine.recent_steps()]
        return {"num_running": engine.num_running, "num_waiting": engine.num_waiting, "steps": steps}

    app.include_router(v1)

    @app.get("/health")
    async def health() -> dict[str, str]:
        check = getattr(engine, "check_health", None)
        if check is not None:
            try:
                check()
            except Exception as exc:
                raise APIError(
                    503, f"engine unhealthy: {exc}", type="server_error", metric_kind=None
                ) from None
        return {"status": "ok"}

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        metrics.set_queue_sizes(engine.num_running, engine.num_waiting)
        return Response(metrics.render(), media_type=METRICS_CONTENT_TYPE)

    return app


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind the listening socket before the model loads, so a busy port fails fast."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise BindError(f"cannot listen on {host}:{port}: {exc}") from exc
    sock.set_inheritable(True)
    return sock


def _exit_on_sigterm() -> None:
    """After uvicorn's graceful shutdown it re-raises SIGTERM; exit cleanly (engine shutdown runs)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))


def run_server(args: argparse.Namespace, config: OmniDiffusionConfig | None = None) -> None:
    """Bind, load the engine, serve until SIGINT/SIGTERM, then shut the engine down."""
    from vllm_omni.diffusion.engine import DiffusionEngine
    from vllm_omni.entrypoints.cli.serve import engine_config_from_args

    if config is None:
        config = engine_config_from_args(args)
    server_args = ServerArgs.from_namespace(args)
    host, port = args.host or "0.0.0.0", args.port
    sock = bind_socket(host, port)
    metrics = PrometheusStatLogger(config, server_args.served_model_names[0])
    engine = DiffusionEngine(config, stat_loggers=[metrics])
    try:
        engine.start()
        app = build_app(engine, server_args, metrics)
        limits = server_args.http_limits
        uv_config = uvicorn_config(app, limits, getattr(args, "log_level", "info"))
        logger.info("serving %s at http://%s:%d/v1", server_args.served_model_names[0], host, port)
        _exit_on_sigterm()
        server = DrainingServer(uv_config, app.state.shutdown_gate, limits.shutdown_drain_timeout_s)
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        logger.info("interrupted; shutting down")
    finally:
        engine.shutdown()
        sock.close()

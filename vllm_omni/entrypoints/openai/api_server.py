"""OpenAI-compatible HTTP server (FastAPI + uvicorn) in front of a `DiffusionEngine`.

The server is a thin translation layer on top of the engine, and sits under the
CLI: `vllm serve` builds an `OmniDiffusionConfig` and a `ServerArgs` and calls
`run_server(config, server_args)`. This module builds the app (routes, API key,
body limit, error handlers); the images path lives in `serving_images.py`, the
chat path in `serving_chat.py`, the error shapes in `errors.py`. Every error is
answered in OpenAI's shape `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from vllm_omni import __version__
from vllm_omni.config import TINY_MODEL_NAME, OmniDiffusionConfig
from vllm_omni.entrypoints.openai import hardening
from vllm_omni.entrypoints.openai.errors import APIError, BindError, ClientDisconnected, error_response
from vllm_omni.entrypoints.openai.hardening import ClientGone, ClientInputError, cap_message, log_safe
from vllm_omni.entrypoints.openai.http_limits import DrainingServer, HTTPLimits, TLSConfig, uvicorn_config
from vllm_omni.entrypoints.openai.image_input import ImageInputError
from vllm_omni.entrypoints.openai.lora import build_lora_router, lora_model_cards
from vllm_omni.entrypoints.openai.metrics import METRICS_CONTENT_TYPE, PrometheusStatLogger
from vllm_omni.entrypoints.openai.protocol import (
    ChatCompletionResponse,
    ImageGenerationRequest,
    ImageGenerationResponse,
    ModelCard,
    ModelList,
)
from vllm_omni.entrypoints.openai.serving_chat import ChatService
from vllm_omni.entrypoints.openai.serving_images import DiffusionServing, ImageService

__all__ = ["APIError", "BindError", "ServerArgs", "build_app", "run_server"]

logger = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BODY_BYTES = 1 << 20


@dataclass
class CORSConfig:
    """What CORS allows the `--allowed-origins` (vLLM's flags and defaults)."""

    methods: list[str] = field(default_factory=lambda: ["*"])
    """`--allowed-methods`."""
    headers: list[str] = field(default_factory=lambda: ["*"])
    """`--allowed-headers`; "*" lets a browser send `Authorization` (an `--api-key` server) and JSON."""
    allow_credentials: bool = False
    """`--allow-credentials`."""


@dataclass
class ServerArgs:
    """What the HTTP layer needs from the command line (built by `vllm serve`)."""

    model: str = TINY_MODEL_NAME
    served_model_names: list[str] = field(default_factory=list)
    """Names clients may send as `model`; the first is reported. Defaults to [model]."""
    host: str = "0.0.0.0"
    port: int = 8000
    api_key: str | None = None
    """When set, /v1/* requires `Authorization: Bearer <api_key>`."""
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    """Bodies larger than this are refused with 413."""
    retry_after_s: int = 1
    """`Retry-After` seconds sent with 503 (queue full)."""
    log_level: str = "info"
    """uvicorn's log level (`--uvicorn-log-level`, else `--log-level`)."""
    allowed_origins: list[str] = field(default_factory=list)
    """CORS origins allowed to call the API (`--allowed-origins`); empty = no CORS headers."""
    cors: CORSConfig = field(default_factory=CORSConfig)
    """Methods, headers and credentials CORS allows those origins."""
    log_requests: bool = True
    """Log one line per request (`--disable-log-requests` turns it off)."""
    http_limits: HTTPLimits = field(default_factory=HTTPLimits)
    """Read timeouts, connection cap and shutdown drain (`http_limits.py`)."""
    root_path: str = ""
    """Prefix a reverse proxy serves this server under (`--root-path`, FastAPI's `root_path`)."""
    tls: TLSConfig | None = None
    """HTTPS through uvicorn (`--ssl-keyfile` / `--ssl-certfile`); None = plain HTTP."""

    def __post_init__(self) -> None:
        if not self.served_model_names:
            self.served_model_names = [self.model]
        if self.max_request_body_bytes < 1024:
            raise ValueError(f"--max-request-body-bytes must be >= 1024, got {self.max_request_body_bytes}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")


async def read_json_body(request: Request, limit: int, timeout_s: float | None = None) -> dict[str, Any]:
    """Read at most `limit` bytes within `timeout_s` and parse a JSON object strictly (`hardening`)."""
    hardening.check_content_type(request.headers.get("content-type"))
    return hardening.parse_json_object(await hardening.read_body(request, limit, timeout_s))


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
        refusal = APIError(
            exc.status, exc.message, param=exc.param, code=exc.code, headers=exc.headers or None,
            metric_kind=exc.metric_kind,
        )  # fmt: skip
        return await _api_error(request, refusal)

    @app.exception_handler(ImageInputError)
    async def _image_input_error(request: Request, exc: ImageInputError) -> JSONResponse:
        # a refused input image (edits, chat image parts), raised from the decode thread
        return await _api_error(request, APIError(exc.status, str(exc), param=exc.param, code=exc.code))

    @app.exception_handler(ClientGone)
    async def _client_gone(request: Request, _: ClientGone) -> Response:
        logger.info(
            "%s %s: client disconnected before its body was complete", request.method, request.url.path
        )
        metrics.record_rejection("client_disconnected")
        return Response(status_code=499)  # nobody reads it

    @app.exception_handler(ClientDisconnected)
    async def _client_disconnected(_: Request, exc: ClientDisconnected) -> Response:
        logger.info("request %s: client disconnected; aborted", exc.args[0] if exc.args else "?")
        return Response(status_code=499)  # the engine has aborted the request; nobody reads this

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


def build_app(engine, server_args: ServerArgs, metrics: PrometheusStatLogger | None = None) -> FastAPI:
    """Create the FastAPI app serving `engine`.

    `engine` follows the `DiffusionEngine` contract (`generate`, `num_running`,
    `num_waiting`, `recent_steps`, `config`; `check_health` and `default_sampling_params`
    optional). Pass the `metrics`
    logger that was given to the engine as a stat logger; without one, a fresh
    logger sees only server-side events.
    """
    config: OmniDiffusionConfig = engine.config
    if metrics is None:
        metrics = PrometheusStatLogger(config, server_args.served_model_names[0])
    serving = DiffusionServing(engine, server_args)
    images, chat = ImageService(serving), ChatService(serving)
    created = int(time.time())

    app = FastAPI(title="vllm-omni", version=__version__)
    app.state.engine, app.state.metrics, app.state.server_args = engine, metrics, server_args
    app.state.shutdown_gate = gate = serving.gate
    metrics.describe_engine(engine)
    _install_error_handlers(app, metrics)
    if server_args.allowed_origins:
        from fastapi.middleware.cors import CORSMiddleware

        cors = server_args.cors
        app.add_middleware(
            CORSMiddleware,
            allow_origins=server_args.allowed_origins,
            allow_methods=cors.methods,
            allow_headers=cors.headers,
            allow_credentials=cors.allow_credentials,
        )

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

    async def check_accepting() -> None:
        if gate.is_draining:
            raise APIError(
                503,
                "the server is shutting down and accepts no new requests; send it to a running server",
                type="server_error",
                code="server_shutting_down",
                metric_kind="shutting_down",
            )

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key), Depends(check_accepting)])
    body_timeout_s = server_args.http_limits.body_read_timeout_s
    body_schema = {"content": {"application/json": {"schema": ImageGenerationRequest.model_json_schema()}}}

    @v1.post(
        "/images/generations",
        response_model=ImageGenerationResponse,
        openapi_extra={"requestBody": {"required": True, **body_schema}},
    )
    async def create_images(request: Request) -> Response:
        body = await read_json_body(request, server_args.max_request_body_bytes, body_timeout_s)
        return await images.handle(request, body)

    @v1.post("/chat/completions", response_model=ChatCompletionResponse)
    async def create_chat_completion(request: Request) -> Response:
        body = await read_json_body(request, server_args.max_request_body_bytes, body_timeout_s)
        return await chat.handle(request, body)

    @v1.get("/models", response_model=ModelList)
    async def list_models() -> ModelList:
        cards = [
            ModelCard(id=name, created=created, root=server_args.model)
            for name in server_args.served_model_names
        ]
        cards += lora_model_cards(engine, server_args.served_model_names[0], created, ModelCard)
        return ModelList(data=cards)

    @v1.get("/debug/steps")
    async def debug_steps() -> dict[str, Any]:
        steps = [dataclasses.asdict(s) for s in engine.recent_steps()]
        return {"num_running": engine.num_running, "num_waiting": engine.num_waiting, "steps": steps}

    from vllm_omni.entrypoints.openai.image_edit import add_image_edit_route

    add_image_edit_route(v1, serving, body_timeout_s=body_timeout_s)  # POST /v1/images/edits (edit models)
    v1.include_router(
        build_lora_router(
            engine,
            lambda status, message, **kw: APIError(status, message, **kw),
            lambda request: read_json_body(request, server_args.max_request_body_bytes, body_timeout_s),
        )
    )
    app.include_router(v1)

    @app.get("/health")
    async def health() -> dict[str, str]:
        check = getattr(engine, "check_health", None)
        status = None
        if check is not None:
            try:
                status = check()  # replicas answer "degraded" while some are down
            except Exception as exc:
                raise APIError(
                    503, f"engine unhealthy: {exc}", type="server_error", metric_kind=None
                ) from None
        return {"status": status or "healthy"}  # vLLM-Omni's body

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


def run_server(config: OmniDiffusionConfig, server_args: ServerArgs) -> None:
    """Bind, load the engine, serve until SIGINT/SIGTERM, then shut the engine down."""
    from vllm_omni.diffusion.engine import DiffusionEngine

    sock = bind_socket(server_args.host, server_args.port)
    metrics = PrometheusStatLogger(config, server_args.served_model_names[0])
    engine = DiffusionEngine(config, stat_loggers=[metrics])
    try:
        engine.start()
        app = build_app(engine, server_args, metrics)
        limits = server_args.http_limits
        uv_config = uvicorn_config(app, limits, server_args.log_level, server_args.tls, server_args.root_path)
        logger.info(
            "serving %s at %s://%s:%d%s/v1",
            server_args.served_model_names[0],
            "http" if server_args.tls is None else "https",
            server_args.host,
            server_args.port,
            server_args.root_path,
        )
        _exit_on_sigterm()
        DrainingServer(uv_config, app.state.shutdown_gate, limits.shutdown_drain_timeout_s).run(
            sockets=[sock]
        )
    except KeyboardInterrupt:
        logger.info("interrupted; shutting down")
    finally:
        engine.shutdown()
        sock.close()

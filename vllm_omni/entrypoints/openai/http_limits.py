"""Connection limits and graceful shutdown for the uvicorn server.

slow clients   `LimitedH11Protocol` closes a connection whose request headers are not complete
               within `header_read_timeout_s` (uvicorn has no such timeout: a client that sends
               one header byte per minute holds its socket forever); the body read timeout is
               enforced by `hardening.read_body`.
connections    past `limit_concurrency` open connections, a new connection's requests get a JSON
               503 `too_many_connections` and the connection is closed.
shutdown       on SIGTERM / SIGINT, `DrainingServer` stops accepting, lets accepted requests
               finish for `shutdown_drain_timeout_s`, then `ShutdownGate.abort_all()` makes every
               handler still waiting answer a JSON 503 `request_aborted`; uvicorn cancels
               nothing while the answers are written.

SIGTERM ─┬─ stop listening, close idle connections ── new requests: 503 server_shutting_down
         ├─ drain: running and waiting requests go on ─────┐ (all done: exit at once)
         └─ after shutdown_drain_timeout_s ── abort_all ───┴─ every waiting client: 503 request_aborted
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from vllm_omni.entrypoints.openai.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

MAX_HEAD_BYTES = 16 * 1024
"""Request line + headers larger than this get a JSON 400 (h11's default incomplete-event limit)."""
LINGER_S = 1.0
"""After refusing a request head, bytes are read and dropped this long before the socket closes."""
ANSWER_GRACE_S = 5.0
"""After `abort_all`, how long uvicorn waits for the 503 answers to be written before cancelling."""


@dataclass
class HTTPLimits:
    """Per-connection limits and the shutdown drain, from the `serve` flags."""

    header_read_timeout_s: float = 10.0
    """A connection whose request line and headers take longer is closed (`--header-read-timeout`)."""
    body_read_timeout_s: float = 30.0
    """A body that takes longer gets 408 and the connection is closed (`--body-read-timeout`)."""
    timeout_keep_alive_s: float = 5.0
    """An idle keep-alive connection is closed after this (uvicorn's `--timeout-keep-alive`)."""
    limit_concurrency: int | None = None
    """Most open connections; None = no cap (`--limit-concurrency`)."""
    shutdown_drain_timeout_s: float = 20.0
    """On SIGTERM, accepted requests may finish for this long before they are aborted."""

    def __post_init__(self) -> None:
        # `not 0 < x < inf` also refuses NaN, which every comparison passes (it acted as a 0 s timeout)
        for name in ("header_read_timeout_s", "body_read_timeout_s", "timeout_keep_alive_s"):
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(
                    f"--{name.removesuffix('_s').replace('_', '-')} must be a finite number > 0, "
                    f"got {getattr(self, name)}"
                )
        if not 0 <= self.shutdown_drain_timeout_s < math.inf:
            raise ValueError(
                f"--shutdown-drain-timeout must be a finite number >= 0, got {self.shutdown_drain_timeout_s}"
            )
        if self.limit_concurrency is not None and self.limit_concurrency < 1:
            raise ValueError(f"--limit-concurrency must be >= 1, got {self.limit_concurrency}")


class ShutdownGate:
    """What the request handlers see of a shutdown: draining (refuse new work) and aborted (answer now)."""

    def __init__(self) -> None:
        self.is_draining = False
        """Set when shutdown starts; new requests are refused with 503 `server_shutting_down`."""
        self._aborted = asyncio.Event()
        self.num_in_flight = 0
        """Image requests between their start and their answer."""
        self.abort_reason: str | None = None
        """Why the drain ended early (a second stop signal); None when its time ran out."""

    def begin_drain(self) -> None:
        self.is_draining = True

    def abort_all(self, reason: str | None = None) -> None:
        """Wake every handler waiting in `wait_aborted` (they answer 503 `request_aborted`); `reason`
        says why when the drain ends before its time (None: the drain time is over)."""
        self.is_draining = True
        if self._aborted.is_set():
            return
        self.abort_reason = reason
        if self.num_in_flight:
            logger.warning(
                "shutdown: %s; aborting %d in-flight request(s)",
                reason or "drain time over",
                self.num_in_flight,
            )
        self._aborted.set()

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        """Count one request in flight while inside."""
        self.num_in_flight += 1
        try:
            yield
        finally:
            self.num_in_flight -= 1

    @property
    def is_aborted(self) -> bool:
        return self._aborted.is_set()

    async def wait_aborted(self) -> None:
        await self._aborted.wait()


def _error_body(message: str, type: str, code: str) -> bytes:
    """OpenAI's error shape (`protocol.ErrorResponse`, as `errors.error_response` sends it) as the
    bytes of an answer written below the ASGI app."""
    return ErrorResponse(error=ErrorInfo(message=message, type=type, code=code)).model_dump_json().encode()


async def _too_many_connections(scope, receive, send) -> None:
    """ASGI app answering every request of an over-limit connection with a JSON 503, then closing it."""
    body = _error_body(
        "too many open connections (--limit-concurrency); retry later", "server_error", "too_many_connections"
    )
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"retry-after", b"1"),
        (b"connection", b"close"),
    ]
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class LimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol plus a request-header read timeout and a cap on open connections.

    NOTE(hardening): `limits` is set on a subclass by `protocol_class(limits)`; uvicorn builds one
    protocol object per connection with its own constructor arguments.
    """

    limits: HTTPLimits = HTTPLimits()

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        cap = self.limits.limit_concurrency
        if cap is not None and len(self.connections) > cap:
            self.app = _too_many_connections
            logger.warning(
                "connection refused: %d open connections > --limit-concurrency %d", len(self.connections), cap
            )
        self._header_timer: asyncio.TimerHandle | None = None
        self._is_discarding = False
        """Set after a refused head: later bytes are read and dropped until the connection closes."""
        self._head = b""
        """The start of the request head received so far (at most MAX_HEAD_BYTES + 4 bytes)."""
        self._arm_header_timer()

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(self.limits.header_read_timeout_s, self._on_header_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _awaiting_headers(self) -> bool:
        """Whether the next bytes belong to a request head. Not while the rest of an answered
        request's body arrives (a refusal sent before the body was read): uvicorn reads and drops
        those bytes, then takes the next request."""
        return self.conn.their_state is h11.IDLE

    def data_received(self, data: bytes) -> None:
        if self._is_discarding:
            return
        if self._awaiting_headers() and self._head_too_large(data):
            logger.info("request line and headers over %d bytes; answered 400", MAX_HEAD_BYTES)
            self._refuse_head(f"request line and headers exceed {MAX_HEAD_BYTES // 1024} KiB")
            return
        super().data_received(data)
        if not self._awaiting_headers():
            self._cancel_header_timer()
            self._head = b""

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to bytes h11 cannot parse, as JSON."""
        self._refuse_head("invalid HTTP/1.1 request: malformed request line or headers")

    def _refuse_head(self, message: str) -> None:
        body = _error_body(message, "invalid_request_error", "invalid_http_request")
        head = (
            f"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
        )
        self.transport.write(head.encode() + b"connection: close\r\n\r\n" + body)
        # NOTE(hardening): linger before closing: closing with unread bytes from the client sends a
        # TCP reset, which can destroy the answer before the client reads it.
        self._is_discarding = True
        self.loop.call_later(LINGER_S, self.transport.close)

    def _head_too_large(self, data: bytes) -> bool:
        """Whether the request line + headers being received exceed MAX_HEAD_BYTES, however they arrive.

        h11's own limit applies only to bytes it buffers incomplete, so a large head sent in one
        packet passed while the same head sent in pieces was refused.
        """
        self._head += data[: MAX_HEAD_BYTES + 4 - len(self._head)]
        end = self._head.find(b"\r\n\r\n")
        return (end < 0 and len(self._head) > MAX_HEAD_BYTES) or end > MAX_HEAD_BYTES

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        # armed again when a response completes: then also the unread body of a refused request
        # must finish within the timeout, or it would hold the connection
        answered = self.cycle is not None and self.cycle.response_complete
        if (self._awaiting_headers() or answered) and not self.transport.is_closing():
            peer = f"{self.client[0]}:{self.client[1]}" if self.client else "client"
            what = "request headers" if self._awaiting_headers() else "the body of an answered request"
            logger.info(
                "%s: %s not complete within %g s (--header-read-timeout); connection closed",
                peer,
                what,
                self.limits.header_read_timeout_s,
            )
            self.transport.close()


def protocol_class(limits: HTTPLimits) -> type[LimitedH11Protocol]:
    """A `LimitedH11Protocol` subclass bound to `limits`, to pass as `uvicorn.Config(http=...)`."""
    return type("BoundLimitedH11Protocol", (LimitedH11Protocol,), {"limits": limits})


class DrainingServer(uvicorn.Server):
    """`uvicorn.Server` whose shutdown drains accepted requests, then aborts the rest through `gate`.

    Build its config with `timeout_graceful_shutdown = shutdown_drain_timeout_s + ANSWER_GRACE_S`
    (`uvicorn_config` does), so uvicorn cancels handlers only if the 503 answers cannot be written.
    A second SIGINT / SIGTERM ends the drain at once: every waiting handler answers its JSON 503
    (uvicorn's own second Ctrl-C would cancel them, so clients got a text/plain 500 and the log
    tracebacks).
    """

    def __init__(self, config: uvicorn.Config, gate: ShutdownGate, drain_timeout_s: float):
        super().__init__(config)
        self.gate = gate
        self.drain_timeout_s = drain_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        """The serving loop, once shutdown began (a second signal schedules the abort on it)."""
        self._abort_requested = False

    def handle_exit(self, sig: int, frame) -> None:
        """The first signal starts the drain (uvicorn's graceful shutdown); any later one aborts it."""
        if not self.should_exit:
            super().handle_exit(sig, frame)
            return
        # NOTE(shutdown): never uvicorn's force_exit here, and the signal is not re-raised after serving
        # (the first one is): the handlers must get to write their answers.
        self._abort_requested = True
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._abort_drain)

    def _abort_drain(self) -> None:
        self.gate.abort_all("a second stop signal ended the drain")

    async def shutdown(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        if self._abort_requested:  # the second signal came before shutdown started
            self._abort_drain()
        self.gate.begin_drain()
        logger.info(
            "shutdown: not accepting connections; %d request(s) in flight may finish within %g s "
            "(--shutdown-drain-timeout)",
            self.gate.num_in_flight,
            self.drain_timeout_s,
        )
        timer = asyncio.get_running_loop().call_later(self.drain_timeout_s, self.gate.abort_all)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()


@dataclass(frozen=True)
class TLSConfig:
    """HTTPS through uvicorn (vLLM's `--ssl-keyfile` / `--ssl-certfile` / `--ssl-ca-certs` /
    `--ssl-cert-reqs`)."""

    keyfile: str | None
    certfile: str | None
    ca_certs: str | None = None
    """CA bundle to verify client certificates with."""
    cert_reqs: int = 0
    """ssl.CERT_NONE (0), CERT_OPTIONAL (1) or CERT_REQUIRED (2) for client certificates."""

    def __post_init__(self) -> None:
        for flag, path in (("--ssl-keyfile", self.keyfile), ("--ssl-certfile", self.certfile)):
            if path is None:
                raise ValueError(f"{flag} is required for TLS (give --ssl-keyfile and --ssl-certfile)")
        for flag, path in (
            ("--ssl-keyfile", self.keyfile),
            ("--ssl-certfile", self.certfile),
            ("--ssl-ca-certs", self.ca_certs),
        ):
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"{flag} {path}: no such file")

    def uvicorn_kwargs(self) -> dict:
        return {
            "ssl_keyfile": self.keyfile,
            "ssl_certfile": self.certfile,
            "ssl_ca_certs": self.ca_certs,
            "ssl_cert_reqs": self.cert_reqs,
        }


def uvicorn_config(
    app, limits: HTTPLimits, log_level: str, tls: TLSConfig | None = None, root_path: str = ""
) -> uvicorn.Config:
    """The uvicorn config for `app` under `limits` (h11 with the limits; access log only at debug;
    HTTPS with `tls`; `root_path` the prefix a reverse proxy serves the app under, vLLM's
    `--root-path`)."""
    return uvicorn.Config(
        app,
        http=protocol_class(limits),
        log_level=log_level,
        access_log=log_level in ("debug", "trace"),
        timeout_keep_alive=limits.timeout_keep_alive_s,
        timeout_graceful_shutdown=limits.shutdown_drain_timeout_s + ANSWER_GRACE_S,
        root_path=root_path,
        **(tls.uvicorn_kwargs() if tls is not None else {}),
    )

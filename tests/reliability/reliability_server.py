"""Helpers for the reliability suite: a real `vllm-omni serve` subprocess and raw HTTP over sockets.

Each module starts one server (module-scoped fixture) on the tiny model; raw sockets let a test send
exactly the bytes a hostile or broken client would (partial headers, cut-off bodies, non-ASCII
headers) that httpx refuses to produce.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import server_process

SERVED_NAME = "tiny-reliability"
TINY_BATCHING_FLAGS = ["--mixfusion-min-chunk-tokens", "1", "--mixfusion-max-chunks", "100000"]
"""Let the tiny model's images of different sizes share a step (see docs/serving.md)."""


class ServerProcess(server_process.ServerProcess):
    """`python -m vllm_omni.entrypoints.cli.main serve tiny-qwen-image` on a free port, logging to a file."""

    ready_timeout_s = 180.0
    stop_timeout_s = 60.0

    def __init__(self, flags: list[str], log_path: Path, model: str = "tiny-qwen-image"):
        def command(port: int) -> list[str]:
            cmd = [sys.executable, "-m", "vllm_omni.entrypoints.cli.main", "serve", model]
            cmd += ["--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--device", "cpu"]
            return [*cmd, "--served-model-name", SERVED_NAME, *flags]

        super().__init__(command, log_path, env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def metric(self, name: str, **labels: str) -> float:
        """The value of one sample of /metrics (0.0 when absent)."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.base_url}/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    return sample.value
        return 0.0


def start_server(flags: list[str], log_path: Path) -> ServerProcess:
    server = ServerProcess(flags, log_path)
    server.wait_ready()
    return server


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> dict:
        return json.loads(self.body)


def read_response(sock: socket.socket, timeout_s: float = 60.0) -> RawResponse | None:
    """Read one HTTP/1.1 response (Content-Length framed); None when the server closed without one."""
    sock.settimeout(timeout_s)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return None
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return RawResponse(status, headers, body)


def raw_request(port: int, data: bytes, timeout_s: float = 60.0) -> RawResponse | None:
    """Send `data` on a fresh connection and read one response."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        sock.sendall(data)
        return read_response(sock, timeout_s)


def post_bytes(
    body: bytes, headers: dict[str, str] | None = None, path: str = "/v1/images/generations"
) -> bytes:
    """A raw POST with Content-Length; `headers` values may hold any latin-1 characters."""
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", f"Content-Length: {len(body)}"]
    merged = {"Content-Type": "application/json", **(headers or {})}
    lines += [f"{k}: {v}" for k, v in merged.items() if v is not None]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def wait_closed(sock: socket.socket, timeout_s: float = 60.0) -> bytes:
    """Read until the server closes the connection; returns what it sent (fails past `timeout_s`)."""
    sock.settimeout(timeout_s)
    received = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return received
        received += chunk

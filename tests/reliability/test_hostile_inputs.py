"""Every hostile input class of issue 14 against one real server: a 4xx in OpenAI's shape, no traceback.

One server for the module, with small limits so the slow-client cases finish fast:
`--header-read-timeout 1 --body-read-timeout 1 --limit-concurrency 12 --max-queue-size 2`.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import socket
import time

import httpx
import pytest
from reliability_server import (
    SERVED_NAME,
    post_bytes,
    raw_request,
    read_response,
    start_server,
    wait_closed,
)

pytestmark = pytest.mark.slow

API_KEY = "sekret-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
CONNECTION_CAP = 12
SMALL = {"prompt": "a red square", "size": "32x32", "num_inference_steps": 2, "seed": 3}


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    flags = ["--api-key", API_KEY, "--step-execution", "--max-num-seqs", "2", "--max-queue-size", "2"]
    flags += ["--header-read-timeout", "1", "--body-read-timeout", "1"]
    flags += ["--limit-concurrency", str(CONNECTION_CAP)]
    proc = start_server(flags, tmp_path_factory.mktemp("hostile") / "server.log")
    yield proc
    proc.stop()


def assert_openai_error(response, status: int, code: str, param: str | None = "-") -> dict:
    assert response is not None, "the server closed the connection without an answer"
    assert response.status == status, response.body[:500]
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code, error
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")
    if param != "-":
        assert error["param"] == param, error
    return error


DEEP = b'{"prompt": "a", "extra_args": ' + b"[" * 1000 + b"]" * 1000 + b"}"
BODIES = {
    "nested 1000 deep": (DEEP, {}, 400, "invalid_json"),
    "nested 100000 deep": (b"[" * 100_000, {}, 400, "invalid_json"),
    "integer of 5000 digits": (b'{"prompt": "a", "seed": ' + b"9" * 5000 + b"}", {}, 400, "invalid_json"),
    "NaN": (b'{"prompt": "a", "true_cfg_scale": NaN}', {}, 400, "invalid_json"),
    "lone surrogate in an extra_args key": (
        b'{"prompt": "a", "extra_args": {"\\ud800": 1}}',
        {},
        400,
        "invalid_json",
    ),
    "duplicate keys": (b'{"prompt": "a", "prompt": "b"}', {}, 400, "invalid_json"),
    "text/plain body": (
        json.dumps(SMALL).encode(),
        {"Content-Type": "text/plain"},
        415,
        "unsupported_media_type",
    ),
    "fullwidth digits in size": (
        json.dumps({**SMALL, "size": "\uff13\uff12x\uff13\uff12"}).encode(),
        {},
        400,
        "invalid_value",
    ),
    "webp side over 16383": (
        json.dumps({**SMALL, "size": "16384x16", "output_format": "webp"}).encode(),
        {},
        400,
        "invalid_value",
    ),
    "size over the default cap": (
        json.dumps({**SMALL, "size": "4096x4096"}).encode(),
        {},
        400,
        "invalid_value",
    ),
    "non-ASCII bearer token (latin-1)": (
        json.dumps(SMALL).encode(),
        {"Authorization": "Bearer s\xe9kret"},
        401,
        "invalid_api_key",
    ),
    "non-ASCII bearer token (UTF-8 bytes)": (
        json.dumps(SMALL).encode(),
        {"Authorization": "Bearer s\xc3\xa9kret"},
        401,
        "invalid_api_key",
    ),
}


@pytest.mark.parametrize("case", list(BODIES))
def test_hostile_body_gets_a_4xx(server, case):
    body, headers, status, code = BODIES[case]
    response = raw_request(server.port, post_bytes(body, {**AUTH, **headers}))
    error = assert_openai_error(response, status, code)
    if "size" in case:
        assert error["param"] == "size"


def test_webp_limit_is_checked_before_generation(server):
    before = httpx.get(f"{server.base_url}/v1/debug/steps", headers=AUTH).json()["steps"]
    body = json.dumps({**SMALL, "size": "16384x16", "output_format": "webp"}).encode()
    assert_openai_error(raw_request(server.port, post_bytes(body, AUTH)), 400, "invalid_value", "size")
    steps = httpx.get(f"{server.base_url}/v1/debug/steps", headers=AUTH).json()["steps"]
    assert all([16, 16384] not in s["shapes"] for s in steps[len(before) :])


def test_echoed_values_are_truncated(server):
    huge = "x" * 900_000
    body = json.dumps({**SMALL, "extra_args": {"enable_mixfusion": huge}}).encode()
    error = assert_openai_error(raw_request(server.port, post_bytes(body, AUTH)), 400, "invalid_value")
    assert len(error["message"]) < 2200
    body = json.dumps({**SMALL, "model": "m" * 50_000}).encode()
    error = assert_openai_error(
        raw_request(server.port, post_bytes(body, AUTH)), 404, "model_not_found", "model"
    )
    assert len(error["message"]) < 400


def test_headers_over_16_kib_get_a_json_400(server):
    big = post_bytes(json.dumps(SMALL).encode(), {**AUTH, "X-Padding": "p" * 20_000})
    assert_openai_error(raw_request(server.port, big), 400, "invalid_http_request")
    bad_length = b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Length: 12a\r\n\r\n{}"
    assert_openai_error(raw_request(server.port, bad_length), 400, "invalid_http_request")
    with socket.create_connection(("127.0.0.1", server.port)) as sock:  # the same head in pieces
        for i in range(0, 17_000, 1000):
            sock.sendall(big[i : i + 1000])
        assert_openai_error(read_response(sock), 400, "invalid_http_request")


def test_refusal_before_a_large_body_is_read_answers_once_and_keeps_the_connection(server):
    """A 401 sent before a 2 MB body is read: the rest of the body is dropped, not taken for a request
    head (that wrote a second, unrequested 400), and a request pipelined behind it gets its answer."""
    body = b'{"prompt": "' + b"a" * 2_000_000 + b'"}'
    refused = post_bytes(body, {"Authorization": "Bearer wrong-key"})
    health = b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(refused + health)
        received = wait_closed(sock)
    statuses = [int(code) for code in re.findall(rb"HTTP/1\.1 (\d{3}) ", received)]
    assert statuses == [401, 200], received[:2000]


def test_newline_in_user_cannot_forge_a_log_line(server):
    forged = "INFO vllm_omni.forged: admin logged in"
    body = {**SMALL, "user": f"bob\n{forged}"}
    response = httpx.post(f"{server.base_url}/v1/images/generations", json=body, headers=AUTH, timeout=120)
    assert response.status_code == 200
    log = server.log()
    assert "user=bob\\n" + forged in log
    assert not any(line.startswith(forged) for line in log.splitlines())


def test_body_cut_off_by_the_client_is_one_line_and_not_internal(server):
    before = server.metric("vllm_omni:request_errors_total", kind="client_disconnected")
    head = post_bytes(b"", AUTH).replace(b"Content-Length: 0", b"Content-Length: 1000")
    num_sockets = CONNECTION_CAP // 2  # closed sockets count until the server sees them go
    for _ in range(num_sockets):
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(head + b'{"prompt": ')
    deadline = time.monotonic() + 60
    while server.metric("vllm_omni:request_errors_total", kind="client_disconnected") < before + num_sockets:
        assert time.monotonic() < deadline, "the cut-off bodies were not counted as client_disconnected"
        time.sleep(0.1)
    assert server.metric("vllm_omni:request_errors_total", kind="internal") == 0
    assert "client disconnected before its body was complete" in server.log()


def test_partial_headers_are_closed_after_the_header_timeout(server):
    sockets = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(8)]
    try:
        for sock in sockets:
            sock.sendall(b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        for sock in sockets:
            assert wait_closed(sock, timeout_s=60) == b""  # closed, nothing sent
    finally:
        for sock in sockets:
            sock.close()
    assert "request headers not complete within 1 s" in server.log()


def test_slow_body_gets_408_and_the_connection_closes(server):
    head = post_bytes(b"", AUTH).replace(b"Content-Length: 0", b"Content-Length: 100")
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(head + b'{"prompt": "a')
        response = read_response(sock)
        assert_openai_error(response, 408, "request_timeout")
        assert wait_closed(sock, timeout_s=60) == b""


def test_slow_multipart_body_gets_408_too(server):
    """/v1/images/edits reads its multipart body under the same --body-read-timeout."""
    boundary = "b0undary"
    head = post_bytes(
        b"", {**AUTH, "Content-Type": f"multipart/form-data; boundary={boundary}"}, "/v1/images/edits"
    )
    head = head.replace(b"Content-Length: 0", b"Content-Length: 100000")
    part = f'--{boundary}\r\nContent-Disposition: form-data; name="prompt"\r\n\r\na cat'.encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(head + part)
        response = read_response(sock)
        assert_openai_error(response, 408, "request_timeout")
        assert wait_closed(sock, timeout_s=60) == b""


def test_connections_over_the_cap_get_a_json_503(server):
    idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(CONNECTION_CAP)]
    try:
        time.sleep(0.2)  # let the server accept them (the header timeout closes them after 1 s)
        response = raw_request(server.port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        error = assert_openai_error(response, 503, "too_many_connections")
        assert "--limit-concurrency" in error["message"] and response.headers["retry-after"] == "1"
    finally:
        for sock in idle:
            sock.close()
    deadline = time.monotonic() + 60
    while True:  # the closed sockets leave the server's table; then connections are served again
        try:
            if httpx.get(f"{server.base_url}/health", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_queue_full_says_retry_later_once(server):
    body = {**SMALL, "num_inference_steps": 40}

    def post(i: int) -> httpx.Response:
        return httpx.post(
            f"{server.base_url}/v1/images/generations", json={**body, "seed": i}, headers=AUTH, timeout=300
        )

    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        responses = list(pool.map(post, range(10)))
    full = [r for r in responses if r.status_code == 503]
    assert full, "10 requests over 2 slots and a queue of 2 must overflow"
    assert all(r.status_code in (200, 503) for r in responses)
    for r in full:
        error = r.json()["error"]
        assert error["code"] == "queue_full" and r.headers["retry-after"] == "1"
        assert error["message"].count("retry later") == 1, error["message"]


def test_engine_config_info_shows_what_runs(server):
    text = httpx.get(f"{server.base_url}/metrics").text
    line = next(x for x in text.splitlines() if x.startswith("vllm_omni:engine_config_info{"))
    assert 'device="cpu"' in line and 'dtype="float32"' in line and 'enable_mixfusion="true"' in line
    assert f'model="{SERVED_NAME}"' in line


def test_no_tracebacks_and_no_internal_errors(server):
    """Runs last: everything above was refused cleanly."""
    assert server.metric("vllm_omni:request_errors_total", kind="internal") == 0
    log = server.log()
    assert "Traceback" not in log, log[log.index("Traceback") - 2000 :][:6000]

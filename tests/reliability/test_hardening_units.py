"""The input defences of `hardening.py` alone, against what the standard library and Pillow do."""

from __future__ import annotations

import io
import json

import pytest
from PIL import Image

from vllm_omni.entrypoints.openai import hardening
from vllm_omni.entrypoints.openai.hardening import ClientInputError, parse_json_object
from vllm_omni.entrypoints.openai.http_limits import HTTPLimits


@pytest.mark.parametrize(
    "raw",
    [
        b'{"prompt": "a", "seed": 9223372036854775807, "extra_body": {"extra_args": {"k": [1, 2.5]}}}',
        '{"prompt": "caf\u00e9 \U0001f600"}'.encode(),
        b'{"prompt": "a", "true_cfg_scale": -1.5e3}',
    ],
)
def test_valid_bodies_parse_as_json_loads_does(raw):
    assert parse_json_object(raw) == json.loads(raw)


@pytest.mark.parametrize(
    ("raw", "cause"),
    [
        (b"[" * 40 + b"]" * 40, "nested deeper than 32"),
        (b"[" * 100_000, "nested deeper than 32"),
        (b'{"a": ' + b"1" * 65 + b"}", "65 digits"),
        (b'{"a": -' + b"1" * 5000 + b"}", "digits"),
        (b'{"a": Infinity}', "Infinity is not JSON"),
        (b'{"a": 1, "a": 2}', "'a' appears twice"),
        (b'{"a": "\\udc80"}', "lone UTF-16 surrogate"),
        (b'{"\\ud800x": 1}', "lone UTF-16 surrogate"),
        (b'{"a": ', "not valid JSON"),
        (b"\xff\xfe", "not valid JSON"),
        (b"[1, 2]", "must be a JSON object, got list"),
    ],
    ids=lambda value: value[:24].decode("latin-1") if isinstance(value, bytes) else value[:24],
)
def test_hostile_bodies_are_400_naming_the_cause(raw, cause):
    with pytest.raises(ClientInputError) as info:
        parse_json_object(raw)
    assert info.value.status == 400 and info.value.code == "invalid_json"
    assert cause in info.value.message
    info.value.message.encode("utf-8")  # the answer can be encoded


def test_echo_and_cap_bound_what_comes_back():
    assert hardening.echo("short") == "'short'"
    long = hardening.echo("x" * 900_000)
    assert len(long) < 120 and "900002 characters" in long
    assert hardening.cap_message("\ud800" + "y" * 5000).encode("utf-8")
    assert len(hardening.cap_message("y" * 5000)) < hardening.MAX_MESSAGE_CHARS + 50


def test_log_safe_keeps_one_line():
    assert hardening.log_safe("bob\nINFO forged\r\x1b[31m") == "bob\\nINFO forged\\r\\x1b[31m"
    assert hardening.log_safe("caf\u00e9") == "caf\u00e9"
    assert hardening.log_safe(None) == "-"
    assert len(hardening.log_safe("z" * 10_000)) < 250


def _header_as_starlette_sees_it(raw: bytes) -> str:
    from starlette.datastructures import Headers

    return Headers(raw=[(b"authorization", raw)])["authorization"]


@pytest.mark.parametrize(
    ("raw", "key", "ok"),
    [
        (b"Bearer sekret", "sekret", True),
        (b"bearer  sekret ", "sekret", True),
        (b"Bearer wrong", "sekret", False),
        (b"Basic sekret", "sekret", False),
        (b"Bearer s\xe9kret", "sekret", False),
        ("Bearer s\u00e9kret".encode(), "s\u00e9kret", True),  # a UTF-8 key sent as UTF-8 bytes
        (b"Bearer \xff\xfe", "sekret", False),
    ],
)
def test_bearer_compare_takes_any_header_bytes(raw, key, ok):
    assert hardening.bearer_token_matches(_header_as_starlette_sees_it(raw), key) is ok


@pytest.mark.parametrize(
    ("content_type", "ok"),
    [
        (None, True),
        ("application/json", True),
        ("Application/JSON; charset=utf-8", True),
        ("application/merge-patch+json", True),
        ("text/plain", False),
        ("application/x-www-form-urlencoded", False),
    ],
)
def test_content_type(content_type, ok):
    if ok:
        hardening.check_content_type(content_type)
    else:
        with pytest.raises(ClientInputError) as info:
            hardening.check_content_type(content_type)
        assert info.value.status == 415


def test_webp_limit_matches_pillow():
    """The up-front check refuses exactly what Pillow's WebP encoder cannot write."""
    side = hardening.MAX_SIDE_BY_FORMAT["webp"]
    Image.new("RGB", (side, 16)).save(io.BytesIO(), format="WEBP")
    with pytest.raises((OSError, ValueError)):
        Image.new("RGB", (side + 1, 16)).save(io.BytesIO(), format="WEBP")
    hardening.check_encodable("webp", side, 16)
    with pytest.raises(ClientInputError):
        hardening.check_encodable("webp", 16, side + 1)
    hardening.check_encodable("png", 65536, 16)


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"header_read_timeout_s": 0}, "--header-read-timeout"),
        ({"body_read_timeout_s": -1}, "--body-read-timeout"),
        ({"shutdown_drain_timeout_s": -1}, "--shutdown-drain-timeout"),
        ({"limit_concurrency": 0}, "--limit-concurrency"),
        ({"header_read_timeout_s": float("nan")}, "--header-read-timeout"),  # NaN acted as 0 s
        ({"body_read_timeout_s": float("inf")}, "--body-read-timeout"),
        ({"shutdown_drain_timeout_s": float("nan")}, "--shutdown-drain-timeout"),
    ],
)
def test_http_limits_name_the_flag(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        HTTPLimits(**kwargs)

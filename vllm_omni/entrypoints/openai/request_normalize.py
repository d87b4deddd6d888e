"""From a JSON body to an `OmniDiffusionRequest`, without pydantic.

Clients send our extension fields in three places: at the top level (what the
OpenAI SDK does with `extra_body=`), inside a literal `extra_body` object, and
inside `extra_args` (top level or `extra_body.extra_args`). `merge_extension_fields`
flattens all of them into one dict and refuses a key given twice;
`build_diffusion_request` turns the validated fields into the engine request,
applying the server's `--default-sampling-params` underneath the request's own.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.inputs import KNOWN_EXTRA_ARGS, OmniDiffusionSamplingParams

EXTENSION_FIELDS = (
    "negative_prompt",
    "num_inference_steps",
    "true_cfg_scale",
    "guidance_scale",
    "seed",
    "max_sequence_length",
)
"""Request fields beyond OpenAI's; accepted at the top level, in `extra_body` and in `extra_args`."""

DEFAULT_SIZE = (1024, 1024)
"""(width, height) when neither the request nor `--default-sampling-params` gives a size."""

_SIZE_RE = re.compile(r"^\s*(\d{1,6})\s*[xX]\s*(\d{1,6})\s*$", re.ASCII)  # ASCII: no fullwidth digits
_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(OmniDiffusionSamplingParams)}
_SERVER_OWNED_FIELDS = {"output_type", "num_outputs_per_prompt"}
"""Sampling params the server sets itself (from `n` and the response format)."""


class RequestFieldError(ValueError):
    """An invalid request field; `param` names it as the client sent it (HTTP 400)."""

    def __init__(self, message: str, param: str | None):
        super().__init__(message)
        self.param = param


def _put(merged: dict[str, Any], origin: dict[str, str], key: str, value: Any, where: str) -> None:
    if key in origin:
        raise RequestFieldError(
            f"{key!r} is given twice (in {origin[key]} and in {where}); send it once", param=key
        )
    merged[key] = value
    origin[key] = where


def _as_object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise RequestFieldError(f"{where} must be a JSON object, got {type(value).__name__}", param=where)
    return value


def merge_extension_fields(body: dict[str, Any]) -> dict[str, Any]:
    """Flatten `extra_body` and `extra_args` into one dict of request fields.

    Extension fields found in any `extra_args` are lifted to the top level; the
    remaining `extra_args` keys must be in `KNOWN_EXTRA_ARGS`. Any key that
    arrives in two places raises `RequestFieldError` naming it.

        {"prompt": "p", "extra_body": {"seed": 1, "extra_args": {"enable_mixfusion": false}}}
        -> {"prompt": "p", "seed": 1, "extra_args": {"enable_mixfusion": False}}
    """
    merged: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for key, value in body.items():
        if key not in ("extra_body", "extra_args"):
            _put(merged, origin, key, value, "the request body")
    extra_body = _as_object(body["extra_body"], "extra_body") if body.get("extra_body") is not None else {}
    for key, value in extra_body.items():
        if key == "extra_body":
            raise RequestFieldError("extra_body must not contain another extra_body", param="extra_body")
        if key != "extra_args":
            _put(merged, origin, key, value, "extra_body")

    extra_args: dict[str, Any] = {}
    sources = (
        ("extra_args", body.get("extra_args")),
        ("extra_body.extra_args", extra_body.get("extra_args")),
    )
    for where, source in sources:
        if source is None:
            continue
        for key, value in _as_object(source, where).items():
            if key in EXTENSION_FIELDS:
                _put(merged, origin, key, value, where)
                continue
            if key not in KNOWN_EXTRA_ARGS:
                raise RequestFieldError(
                    f"{where} key {key!r} is not supported; accepted keys: "
                    f"{sorted(KNOWN_EXTRA_ARGS)} (and the fields {list(EXTENSION_FIELDS)})",
                    param=f"extra_args.{key}",
                )
            _put(merged, origin, f"extra_args.{key}", value, where)
            extra_args[key] = value
    for key in [k for k in merged if k.startswith("extra_args.")]:
        del merged[key]
    if extra_args:
        merged["extra_args"] = extra_args
    return merged


def parse_size(size: str | None, default_wh: tuple[int, int]) -> tuple[int, int]:
    """'WIDTHxHEIGHT' -> (width, height); None or 'auto' -> `default_wh`."""
    if size is None or size.strip().lower() == "auto":
        return default_wh
    match = _SIZE_RE.match(size)
    if match is None:
        raise RequestFieldError(
            f"size must be 'WIDTHxHEIGHT' (e.g. '1024x1024') or 'auto', got {size!r}", param="size"
        )
    return int(match.group(1)), int(match.group(2))


def check_unsupported_options(fields: dict[str, Any]) -> None:
    """Reject OpenAI options this server cannot honour, with a message saying what it supports."""
    if fields.get("response_format") == "url":
        raise RequestFieldError(
            "response_format 'url' is not supported: this server does not host files; "
            "only 'b64_json' is supported",
            param="response_format",
        )
    if fields.get("stream"):
        raise RequestFieldError("stream=true is not supported; send stream=false or omit it", param="stream")
    if fields.get("background") == "transparent":
        raise RequestFieldError(
            "background 'transparent' is not supported; use 'auto' or 'opaque'", param="background"
        )


def build_diffusion_request(
    fields: dict[str, Any], request_id: str, default_sampling_params: dict[str, Any] | None = None
) -> OmniDiffusionRequest:
    """Turn validated request fields (unset ones absent) into the engine's request.

    Precedence per sampling param: the request's field, then
    `default_sampling_params` (the server's `--default-sampling-params`), then
    `OmniDiffusionSamplingParams`' own default. Range checks are the engine's
    (`DiffusionEngine.validate_request`); this only converts.
    """
    check_unsupported_options(fields)
    params = dict(default_sampling_params or {})
    default_wh = (params.pop("width", DEFAULT_SIZE[0]), params.pop("height", DEFAULT_SIZE[1]))
    width, height = parse_size(fields.get("size"), default_wh)
    params.update(height=height, width=width, output_type="pil", num_outputs_per_prompt=fields.get("n") or 1)
    for name in EXTENSION_FIELDS:
        if name != "negative_prompt" and fields.get(name) is not None:
            params[name] = fields[name]
    extra_args = dict(params.get("extra_args") or {})
    extra_args.update(fields.get("extra_args") or {})
    params["extra_args"] = extra_args
    return OmniDiffusionRequest(
        request_id=request_id,
        prompt=fields["prompt"],
        negative_prompt=fields.get("negative_prompt"),
        sampling_params=OmniDiffusionSamplingParams(**params),
    )


def parse_default_sampling_params(raw: str | dict[str, Any] | None) -> dict[str, Any]:
    """Parse `--default-sampling-params`: a JSON object of sampling-param defaults.

    vLLM-Omni's stage-keyed form `{"0": {...}}` is accepted too (stage 0 is the
    diffusion stage). Keys must be `OmniDiffusionSamplingParams` fields; the
    values are validated now, so a bad default fails at startup, not per request.
    """
    if raw is None or raw == "":
        return {}
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--default-sampling-params must be a JSON object: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"--default-sampling-params must be a JSON object, got {type(raw).__name__}")
    if raw and all(isinstance(k, str) and k.isdigit() for k in raw):
        if set(raw) != {"0"}:
            raise ValueError(
                f"--default-sampling-params: only stage '0' (the diffusion stage) exists, got {sorted(raw)}"
            )
        raw = raw["0"]
        if not isinstance(raw, dict):
            raise ValueError("--default-sampling-params: stage '0' must map to a JSON object")
    allowed = _SAMPLING_FIELDS - _SERVER_OWNED_FIELDS
    unknown = sorted(set(raw) - allowed)
    if unknown:
        raise ValueError(
            f"--default-sampling-params: unknown keys {unknown}; accepted keys: {sorted(allowed)}"
        )
    try:
        OmniDiffusionSamplingParams(**raw).validate()
    except ValueError as exc:
        raise ValueError(f"--default-sampling-params: {exc}") from None
    return dict(raw)

"""From a JSON body to an `OmniDiffusionRequest`.

Clients send our extension fields in several places, as vLLM-Omni accepts them:
at the top level (what the OpenAI SDK does with `extra_body=`), inside a literal
`extra_body` object, and inside `extra_args` / `extra_params` (top level or under
`extra_body`). `merge_extension_fields` flattens all of them into one dict, drops
`null` values (null means "default") and refuses a key given twice. After pydantic
has checked shapes and types, `to_engine_request` is the one function that turns
the request model into the engine request; the meaning of each value is checked
once, by `OmniDiffusionSamplingParams.validate` when the engine admits it.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.entrypoints.openai.protocol import ImageGenerationRequest
from vllm_omni.inputs import KNOWN_EXTRA_ARGS, InvalidRequestError, OmniDiffusionSamplingParams
from vllm_omni.lora.config import with_adapter_defaults
from vllm_omni.lora.request import LoRARequest

EXTENSION_FIELDS = (
    "height",
    "width",
    "negative_prompt",
    "num_inference_steps",
    "true_cfg_scale",
    "guidance_scale",
    "seed",
    "max_sequence_length",
    "flow_shift",
    "sigmas",
    "timesteps",
    "generator_device",
    "lora",
    "lora_name",
    "lora_path",
    "local_path",
    "lora_scale",
    "lora_int_id",
    "vae_use_slicing",
    "vae_use_tiling",
    "priority",
)
"""Request fields beyond OpenAI's; accepted at the top level, in `extra_body`, `extra_args` and
`extra_params` alike (docs/serving.md, "Where extensions may be sent")."""

EXTRA_CONTAINERS = ("extra_args", "extra_params")
"""Per-request containers: vLLM-Omni's `extra_args` and its older spelling `extra_params`."""

DEFAULT_SIZE = (1024, 1024)
"""(width, height) when neither the request nor `--default-sampling-params` gives a size."""

_SIZE_RE = re.compile(r"^\s*(\d{1,6})\s*[xX]\s*(\d{1,6})\s*$", re.ASCII)  # ASCII: no fullwidth digits
_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(OmniDiffusionSamplingParams)}
_SERVER_OWNED_FIELDS = {"output_type", "num_outputs_per_prompt", "lora_request", "sigmas", "timesteps"}
_SERVER_OWNED_FIELDS |= {"partial_images"}
"""Sampling params the server sets itself (from `n`, the response format, `lora` and a stream's
`partial_images`), and the per-request custom schedules (a server-wide one would clash with every
request's step count)."""
_DIRECT_FIELDS = ("num_inference_steps", "true_cfg_scale", "guidance_scale", "seed")
_DIRECT_FIELDS += (
    "max_sequence_length",
    "flow_shift",
    "sigmas",
    "timesteps",
    "generator_device",
    "vae_use_slicing",
    "vae_use_tiling",
    "priority",
)
"""Request fields copied as they are onto the sampling params of the same name."""


def _put(merged: dict[str, Any], origin: dict[str, str], key: str, value: Any, where: str) -> None:
    if key in origin:
        raise InvalidRequestError(
            f"{key!r} is given twice (in {origin[key]} and in {where}); send it once", param=key
        )
    merged[key] = value
    origin[key] = where


def _as_object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InvalidRequestError(f"{where} must be a JSON object, got {type(value).__name__}", param=where)
    return value


def _merge_container(
    source: dict[str, Any], where: str, merged: dict, origin: dict, extra_args: dict[str, Any]
) -> None:
    """Lift extension fields out of one `extra_args` / `extra_params` object; keep engine toggles."""
    for key, value in _as_object(source, where).items():
        if value is None:
            continue
        if key in EXTENSION_FIELDS:
            _put(merged, origin, key, value, where)
            continue
        if key not in KNOWN_EXTRA_ARGS:
            raise InvalidRequestError(
                f"{where} key {key!r} is not supported; accepted keys: "
                f"{sorted(KNOWN_EXTRA_ARGS)} (and the fields {list(EXTENSION_FIELDS)})",
                param=f"extra_args.{key}",
            )
        _put(merged, origin, f"extra_args.{key}", value, where)
        extra_args[key] = value


def merge_extension_fields(body: dict[str, Any]) -> dict[str, Any]:
    """Flatten `extra_body`, `extra_args` and `extra_params` into one dict of request fields.

    Extension fields found in any container are lifted to the top level; the
    remaining container keys must be in `KNOWN_EXTRA_ARGS`. `null` values are
    dropped (the field keeps its default). Any key that arrives in two places
    raises `InvalidRequestError` naming it.

        {"prompt": "p", "extra_body": {"seed": 1, "extra_params": {"enable_mixfusion": false}}}
        -> {"prompt": "p", "seed": 1, "extra_args": {"enable_mixfusion": False}}
    """
    merged: dict[str, Any] = {}
    origin: dict[str, str] = {}
    containers = ("extra_body", *EXTRA_CONTAINERS)
    for key, value in body.items():
        if key not in containers and value is not None:
            _put(merged, origin, key, value, "the request body")
    extra_body = _as_object(body["extra_body"], "extra_body") if body.get("extra_body") is not None else {}
    for key, value in extra_body.items():
        if key == "extra_body":
            raise InvalidRequestError("extra_body must not contain another extra_body", param="extra_body")
        if key not in EXTRA_CONTAINERS and value is not None:
            _put(merged, origin, key, value, "extra_body")

    extra_args: dict[str, Any] = {}
    for name in EXTRA_CONTAINERS:
        for where, source in ((name, body.get(name)), (f"extra_body.{name}", extra_body.get(name))):
            if source is not None:
                _merge_container(source, where, merged, origin, extra_args)
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
        raise InvalidRequestError(
            f"size must be 'WIDTHxHEIGHT' (e.g. '1024x1024') or 'auto', got {size!r}", param="size"
        )
    return int(match.group(1)), int(match.group(2))


def check_unsupported_options(req: ImageGenerationRequest, outputs_alpha: bool = False) -> None:
    """Reject OpenAI options this server cannot honour, with a message saying what it supports.
    `outputs_alpha`: the model's images carry an alpha channel (Qwen-Image-2.1), so 'transparent' can
    be honoured in PNG or WebP."""
    if req.response_format == "url":
        raise InvalidRequestError(
            "response_format 'url' is not supported: this server does not host files; "
            "only 'b64_json' is supported",
            param="response_format",
        )
    if req.partial_images is not None and not req.stream:
        raise InvalidRequestError(
            "partial_images needs stream=true (previews are streamed as server-sent events); send "
            "stream=true or omit partial_images",
            param="partial_images",
        )
    if req.background == "transparent" and not outputs_alpha:
        raise InvalidRequestError(
            "background 'transparent' is not supported; use 'auto' or 'opaque'", param="background"
        )
    if req.background == "transparent" and req.output_format == "jpeg":
        raise InvalidRequestError(
            "background 'transparent' needs output_format 'png' or 'webp' (JPEG has no alpha)",
            param="background",
        )


def _image_size(req: ImageGenerationRequest, defaults: dict[str, Any]) -> dict[str, int]:
    """`{"height": ..., "width": ...}` from `size` or `height`/`width`, else `defaults`' (the server's,
    or an edit's size derived from its input image)."""
    default_wh = (defaults.get("width", DEFAULT_SIZE[0]), defaults.get("height", DEFAULT_SIZE[1]))
    if req.height is None and req.width is None:
        width, height = parse_size(req.size, default_wh)
        return {"height": height, "width": width}
    if req.size is not None:
        raise InvalidRequestError("give either size or height/width, not both", param="size")
    height = req.height if req.height is not None else default_wh[1]  # 0 is refused later, not replaced
    return {"height": height, "width": req.width if req.width is not None else default_wh[0]}


def _one_alias(given: dict[str, Any], what: str) -> Any:
    """The one value among `given` (spelling -> value, None = not given); two spellings of the same
    field given is a 400 naming both, as a key sent twice is (nothing is silently preferred)."""
    present = {name: value for name, value in given.items() if value is not None}
    if len(present) > 1:
        names = " and ".join(present)
        values = ", ".join(repr(v) for v in present.values())
        raise InvalidRequestError(f"{names} both give the adapter's {what} ({values}); send one", "lora")
    return next(iter(present.values()), None)


def lora_from_request(
    req: ImageGenerationRequest, model_adapter: str | None = None
) -> tuple[LoRARequest | None, float | None]:
    """vLLM-Omni's LoRA spellings (`lora` object or flat `lora_*` fields) -> (adapter, scale).

    `model_adapter`: the adapter the request's `model` names (vLLM's way to select an adapter), None
    when `model` is the base model; naming another adapter in `lora` too is a 400 naming both."""
    flat = {
        "name": req.lora_name,
        "path": _one_alias({"lora_path": req.lora_path, "local_path": req.local_path}, "path"),
        "scale": req.lora_scale,
        "int_id": req.lora_int_id,
    }
    if req.lora is not None:
        if any(v is not None for v in flat.values()):
            raise InvalidRequestError("give either the lora object or the lora_* fields, not both", "lora")
        lora = req.lora
        flat = {
            "name": _one_alias(
                {"lora.name": lora.name, "lora.lora_name": lora.lora_name, "lora.adapter": lora.adapter},
                "name",
            ),
            "path": _one_alias(
                {
                    "lora.path": lora.path,
                    "lora.lora_path": lora.lora_path,
                    "lora.local_path": lora.local_path,
                },
                "path",
            ),
            "scale": _one_alias({"lora.scale": lora.scale, "lora.lora_scale": lora.lora_scale}, "scale"),
            "int_id": _one_alias({"lora.int_id": lora.int_id, "lora.lora_int_id": lora.lora_int_id}, "id"),
        }
    if model_adapter is not None:
        if flat["name"] not in (None, model_adapter):
            raise InvalidRequestError(
                f"model {model_adapter!r} is a LoRA adapter and lora names another one "
                f"({flat['name']!r}); name the adapter in one place",
                "model",
            )
        flat["name"] = model_adapter
    if req.lora is None and all(v is None for v in flat.values()):
        return None, None  # an empty `lora` object is refused below: it names no adapter
    if flat["name"] is None:
        raise InvalidRequestError("lora: the adapter needs a name (lora.name or lora_name)", "lora")
    try:
        adapter = LoRARequest(flat["name"], flat["int_id"] or 0, flat["path"])
    except ValueError as exc:
        raise InvalidRequestError(str(exc), "lora") from None
    return adapter, flat["scale"]


def to_engine_request(
    req: ImageGenerationRequest,
    request_id: str,
    default_sampling_params: dict[str, Any] | None = None,
    outputs_alpha: bool = False,
    model_adapter: str | None = None,
    adapter_defaults: dict[str, dict[str, Any]] | None = None,
) -> OmniDiffusionRequest:
    """The one conversion from a validated request model to the engine's request. `model_adapter`:
    the LoRA adapter the request's `model` names (see `lora_from_request`).

    Precedence per sampling param: the request's field, then the named adapter's
    `default_sampling_params` (`adapter_defaults[name]`, from `--lora-modules`' JSON form), then
    `default_sampling_params` (the server's `--default-sampling-params`), then
    `OmniDiffusionSamplingParams`' own default. Values are range-checked once, by
    `OmniDiffusionSamplingParams.validate` at admission; this only converts.
    """
    check_unsupported_options(req, outputs_alpha)
    lora_request, lora_scale = lora_from_request(req, model_adapter)
    params = with_adapter_defaults(default_sampling_params or {}, lora_request, adapter_defaults)
    params.update(_image_size(req, params))
    params.update(output_type="pil", num_outputs_per_prompt=1 if req.n is None else req.n)
    for name in _DIRECT_FIELDS:
        if getattr(req, name) is not None:
            params[name] = getattr(req, name)
    schedule = req.sigmas if req.sigmas is not None else req.timesteps
    if schedule is not None and req.num_inference_steps is None:
        params["num_inference_steps"] = len(schedule)  # a custom schedule sets the step count
    params["lora_request"] = lora_request
    if lora_scale is not None:
        params["lora_scale"] = lora_scale
    params["extra_args"] = {**params.get("extra_args", {}), **(req.extra_args or {})}
    if req.stream and req.partial_images is not None:
        params["partial_images"] = req.partial_images  # its range is checked at admission
    return OmniDiffusionRequest(
        request_id=request_id,
        prompt=req.prompt,
        negative_prompt=req.negative_prompt,
        sampling_params=OmniDiffusionSamplingParams(**params),
    )


def parse_default_sampling_params(raw: str | dict[str, Any] | None) -> dict[str, Any]:
    """Parse `--default-sampling-params`: a JSON object of sampling-param defaults.

    vLLM-Omni's stage-keyed form `{"0": {...}}` is accepted too (stage 0 is the
    diffusion stage). Keys must be `OmniDiffusionSamplingParams` fields; the
    values are validated by `OmniDiffusionConfig` after `--flow-shift` is merged in,
    by the request check itself, so a bad default fails at startup, not per request.
    `null` values mean "the built-in default" and are dropped.
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
    raw = {k: v for k, v in raw.items() if v is not None}
    allowed = _SAMPLING_FIELDS - _SERVER_OWNED_FIELDS
    unknown = sorted(set(raw) - allowed)
    if unknown:
        raise ValueError(
            f"--default-sampling-params: unknown keys {unknown}; accepted keys: {sorted(allowed)}"
        )
    return dict(raw)

"""LoRA on the HTTP server: `/v1/models` cards and runtime load / unload.

request   "lora": {"name": "ink", "scale": 0.8} is parsed with the other fields
          (request_normalize.lora_from_request); the engine resolves the name (404 when unknown)
models    GET /v1/models lists every loaded adapter as vLLM does: id = name, root = path,
          parent = the served model
runtime   POST /v1/load_lora_adapter {"lora_name", "lora_path"} and
          POST /v1/unload_lora_adapter {"lora_name"} (vLLM's bodies), only with --lora-runtime-dir,
          and only for paths inside it
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from vllm_omni.entrypoints.openai import errors


def lora_model_cards(engine, parent: str, created: int, card_cls) -> list:
    """One `/v1/models` card per loaded adapter (vLLM's listing: root = its path, parent = base model)."""
    manager = getattr(engine, "lora", None)
    if manager is None:
        return []
    return [
        card_cls(id=e.name, created=created, root=e.path, parent=e.base_model_name or parent)
        for e in manager.list_adapters()
    ]


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's `POST /v1/load_lora_adapter` body."""

    model_config = ConfigDict(extra="forbid", strict=True)
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRAAdapterRequest(BaseModel):
    """vLLM's `POST /v1/unload_lora_adapter` body (`lora_int_id` accepted, must match when given)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None


def build_lora_router(engine, api_error, read_body) -> APIRouter:
    """`/load_lora_adapter` and `/unload_lora_adapter` (mounted under /v1 with the API-key check).

    `api_error(status, message, param=..., code=...)` builds the server's OpenAI-shaped error;
    `read_body(request)` reads a size-limited JSON body.
    """
    from pydantic import ValidationError

    from vllm_omni.lora.errors import LoRAInUseError, LoRANotFoundError

    router = APIRouter()

    def manager_or_error():
        manager = getattr(engine, "lora", None)
        if manager is None or manager.config.runtime_dir is None:
            raise api_error(
                400,
                "runtime LoRA loading is disabled on this server (start it with --lora-runtime-dir DIR)",
                param="lora_name",
                code="runtime_lora_disabled",
            )
        return manager

    def validated(cls, body):
        try:
            return cls.model_validate(body)
        except ValidationError as exc:
            raise errors.from_pydantic(exc) from None  # the images routes' 400 naming the field

    @router.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        manager = manager_or_error()
        body = validated(LoadLoRAAdapterRequest, await read_body(request))
        try:
            await asyncio.to_thread(manager.add_runtime, body.lora_name, body.lora_path, "lora_path")
        except ValueError as exc:
            param = "lora_name" if str(exc).startswith("lora_name") else "lora_path"
            raise api_error(400, str(exc), param=param, code="invalid_value") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @router.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        manager = manager_or_error()
        body = validated(UnloadLoRAAdapterRequest, await read_body(request))
        known = {e.name: e.lora_int_id for e in manager.list_adapters()}
        if body.lora_int_id is not None and known.get(body.lora_name) not in (None, body.lora_int_id):
            raise api_error(
                400,
                f"lora_int_id {body.lora_int_id} is not {body.lora_name!r}'s id",
                param="lora_int_id",
                code="invalid_value",
            )
        try:
            await asyncio.to_thread(manager.remove, body.lora_name)
        except LoRANotFoundError as exc:
            raise api_error(404, str(exc), param="lora_name", code="lora_not_found") from None
        except LoRAInUseError as exc:
            raise api_error(409, str(exc), param="lora_name", code="lora_in_use") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    return router

"""The errors a LoRA request or an adapter operation raises (torch-free: the API server's error
handlers import them without loading the model stack)."""

from __future__ import annotations

from vllm_omni.inputs import InvalidRequestError


class LoRANotFoundError(InvalidRequestError):
    """The request names an adapter this server does not have (the server answers 404)."""

    def __init__(self, message: str):
        super().__init__(message, "lora")


class LoRAInUseError(ValueError):
    """An adapter cannot be unloaded while requests hold it."""

"""`LoRARequest`: which adapter a request asks for (vLLM's public name and fields, plus the scale)."""

from __future__ import annotations

from dataclasses import dataclass

MAX_ADAPTER_NAME_CHARS = 256


def check_adapter_name(name, field: str) -> None:
    """ValueError naming `field` unless `name` is a non-empty printable string of at most
    `MAX_ADAPTER_NAME_CHARS` characters (names reach logs, metrics labels and /v1/models)."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"{field} must be a non-empty string")
    if len(name) > MAX_ADAPTER_NAME_CHARS:
        raise ValueError(f"{field} is {len(name)} characters; the limit is {MAX_ADAPTER_NAME_CHARS}")
    if not name.isprintable():
        raise ValueError(f"{field} {name[:80]!r} holds control or format characters; use printable ones")


@dataclass(frozen=True)
class LoRARequest:
    """An adapter named by a request.

    Clients name adapters the server registered (`--lora-modules NAME=PATH`); `lora_path` is honoured
    only with `--lora-runtime-dir`, for paths inside it. `lora_int_id` is the engine's id for the
    adapter: the engine sets it from the name at admission (0 = unresolved; a client's value must
    match).
    """

    lora_name: str
    lora_int_id: int = 0
    lora_path: str | None = None

    def __post_init__(self) -> None:
        check_adapter_name(self.lora_name, "lora.name")
        int_id = self.lora_int_id
        if isinstance(int_id, bool) or not isinstance(int_id, int) or int_id < 0:
            raise ValueError(f"lora.int_id must be an integer >= 0, got {self.lora_int_id!r}")
        if self.lora_path is not None and not isinstance(self.lora_path, str):
            raise ValueError("lora.path must be a string")

"""`LoRAConfig`: which adapters the server registers at start-up, the limits, and runtime loading."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_MAX_LORAS = 8
DEFAULT_MAX_LORA_RANK = 64
MAX_LORA_RANK_LIMIT = 1024


@dataclass(frozen=True)
class LoRAModulePath:
    """One `--lora-modules` entry (vLLM's name): an adapter name and its PATH."""

    name: str
    path: str
    base_model_name: str | None = None
    """vLLM's optional JSON key: the `parent` shown in `/v1/models` (default: the served model)."""

    @classmethod
    def parse(cls, text: str) -> LoRAModulePath:
        """`NAME=PATH` or vLLM's JSON form `{"name": ..., "path": ...}`; ValueError naming the flag."""
        text = text.strip()
        if text.startswith("{"):
            try:
                entry = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--lora-modules: invalid JSON {text!r} ({exc.msg})") from exc
            if not isinstance(entry, dict) or set(entry) - {"name", "path", "base_model_name"}:
                raise ValueError(
                    f'--lora-modules: JSON entries are {{"name": ..., "path": ...}}, got {text!r}'
                )
            name, path, base = entry.get("name"), entry.get("path"), entry.get("base_model_name")
            if base is not None and (not isinstance(base, str) or not base.strip()):
                raise ValueError(f"--lora-modules: base_model_name must be a non-empty string, got {text!r}")
        else:
            base = None
            name, sep, path = text.partition("=")
            if not sep:
                raise ValueError(f"--lora-modules: expected NAME=PATH or JSON, got {text!r}")
        if not isinstance(name, str) or not name.strip() or not isinstance(path, str) or not path.strip():
            raise ValueError(f"--lora-modules: name and path must be non-empty strings, got {text!r}")
        return cls(name.strip(), path.strip(), base.strip() if base else None)


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA serving options (`--lora-modules`, `--max-loras`, `--max-lora-rank`, `--lora-runtime-dir`)."""

    lora_modules: tuple[LoRAModulePath, ...] = ()
    """Adapters registered at start-up; their paths are the operator's and are not confined."""
    max_loras: int = DEFAULT_MAX_LORAS
    """Most adapters loaded at once (any number of them may share one step)."""
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK
    """Largest rank an adapter may have on any module."""
    runtime_dir: str | None = None
    """Enables `/v1/load_lora_adapter`, `/v1/unload_lora_adapter` and a request's `lora.path`, for
    paths inside this directory only (None: runtime loading is off)."""
    enabled: bool = field(default=False)
    """Set True to build the LoRA machinery with no adapter yet (runtime loading, tests)."""

    def __post_init__(self) -> None:
        for name, value, low, high in (
            ("max_loras", self.max_loras, 1, 1 << 16),
            ("max_lora_rank", self.max_lora_rank, 1, MAX_LORA_RANK_LIMIT),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ValueError(
                    f"--{name.replace('_', '-')} must be an integer in [{low}, {high}], got {value!r}"
                )
        names = [m.name for m in self.lora_modules]
        if len(set(names)) != len(names):
            raise ValueError(f"--lora-modules: adapter names must be unique, got {names}")
        if len(names) > self.max_loras:
            raise ValueError(f"--lora-modules lists {len(names)} adapters > --max-loras {self.max_loras}")
        # '' would be the current directory (Path('').is_dir() is True): refuse it
        runtime_dir = self.runtime_dir
        if runtime_dir is not None and (not runtime_dir.strip() or not Path(runtime_dir).is_dir()):
            raise ValueError(f"--lora-runtime-dir {runtime_dir!r} is not a directory")

    @property
    def is_enabled(self) -> bool:
        """Whether the engine builds a `LoRAManager` at all."""
        return self.enabled or bool(self.lora_modules) or self.runtime_dir is not None


def resolve_runtime_path(runtime_dir: str | None, path: str, field_name: str) -> Path:
    """`path` (absolute, or relative to `runtime_dir`) resolved, if it lies inside `runtime_dir`.

    Symlinks are resolved before the check, so a link pointing outside is refused like `..`.
    ValueError naming `field_name` otherwise (runtime loading off, outside, or missing).
    """
    if runtime_dir is None:
        raise ValueError(
            f"{field_name}: loading adapters from a path is disabled on this server "
            "(start it with --lora-runtime-dir DIR); name a registered adapter instead"
        )
    if not isinstance(path, str) or not path or "\x00" in path:
        raise ValueError(f"{field_name} must be a non-empty path string")
    shown = f"{path[:80]!r}" + (f" ({len(path)} characters)" if len(path) > 80 else "")
    root = Path(runtime_dir).resolve()
    candidate = Path(path)
    try:
        resolved = (candidate if candidate.is_absolute() else root / candidate).resolve()
        if not resolved.is_relative_to(root):
            raise ValueError(f"{field_name} must lie inside the server's LoRA directory; {shown} does not")
        exists = resolved.exists()
    except OSError as exc:  # e.g. a name over the filesystem's 255-byte limit (ENAMETOOLONG), a loop
        raise ValueError(f"{field_name} {shown} is not a usable path: {exc.strerror or exc}") from None
    if not exists:
        raise ValueError(f"{field_name} {shown} does not exist in the server's LoRA directory")
    return resolved

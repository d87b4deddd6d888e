"""The cache of built-in tiny checkpoints: each is built once per (name, seed, version), atomically.

Model-neutral: a family's tiny builder (e.g. `models/qwen_image/tiny.py`) calls `ensure_built` with its
name, builder and version; `models/registry.py` names the builders of the built-in tiny models.

    $VLLM_OMNI_CACHE_DIR (else ~/.cache/vllm_omni)/<name>-seed<seed>/   one complete checkpoint
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path

VERSION_FILE = "vllm_omni_tiny.json"
"""Written into every built checkpoint: `{"version": ..., "seed": ...}` (a stale one is rebuilt)."""
CACHE_ENV = "VLLM_OMNI_CACHE_DIR"


def write_json(path: Path, data: dict) -> None:
    """`data` as sorted, indented JSON at `path` (parents created)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def empty_output_dir(out_dir: str | Path, builder: str) -> Path:
    """`out_dir` created for a tiny builder to write into; ValueError naming `builder` when it holds
    anything (a builder never writes over files)."""
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ValueError(f"{builder}: output directory {out_dir} is not empty")
    out_dir.mkdir(parents=True, exist_ok=True)
    return out_dir


def save_scheduler_and_index(out_dir: Path, scheduler_config: dict, model_index: dict) -> None:
    """The two files every tiny pipeline ends with: `scheduler/` (a `FlowMatchEulerDiscreteScheduler`
    from `scheduler_config`, its `_`-keys dropped) and `model_index.json` (`model_index` plus the
    installed diffusers version, as `save_pretrained` writes it)."""
    import diffusers
    from diffusers import FlowMatchEulerDiscreteScheduler

    kwargs = {k: v for k, v in scheduler_config.items() if not k.startswith("_")}
    FlowMatchEulerDiscreteScheduler(**kwargs).save_pretrained(out_dir / "scheduler")
    write_json(out_dir / "model_index.json", {**model_index, "_diffusers_version": diffusers.__version__})


def default_cache_dir() -> Path:
    """`$VLLM_OMNI_CACHE_DIR`, else `~/.cache/vllm_omni`."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "vllm_omni"


def _is_current(path: Path, seed: int, version: int) -> bool:
    try:
        info = json.loads((path / VERSION_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return info == {"version": version, "seed": seed}


def ensure_built(name: str, build, version: int, cache_dir: Path | None = None, seed: int = 0) -> Path:
    """Return `<cache_dir>/<name>-seed<seed>`, running `build(dir, seed=seed)` first if absent or stale.

    `build` must write `VERSION_FILE` with `{"version": version, "seed": seed}`. The checkpoint is built
    in a private temporary folder and moved into place with one atomic rename, so concurrent callers
    (server workers, pytest-xdist) each either see a complete checkpoint or build their own and keep
    the first one that landed.
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = cache_dir / f"{name}-seed{seed}"
    if _is_current(final, seed, version):
        return final
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=cache_dir))
    try:
        build(tmp, seed=seed)
        if final.exists() and not _is_current(final, seed, version):
            # Stale version: move it aside (atomic), then delete it.
            stale = cache_dir / f".{final.name}.stale-{uuid.uuid4().hex}"
            try:
                os.rename(final, stale)
                shutil.rmtree(stale, ignore_errors=True)
            except OSError:
                pass  # someone else moved it first
        try:
            os.rename(tmp, final)
        except OSError:
            if not _is_current(final, seed, version):  # lost the race to a complete checkpoint: fine
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def run_checkpoint_cli(make, what: str, description: str, argv: list[str] | None) -> None:
    """`DIR [--seed N]`: build the checkpoint `make(out_dir, seed=...)` writes and report its size."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("out_dir", type=Path, help="output directory (created; must be empty)")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    args = parser.parse_args(argv)
    try:
        path = make(args.out_dir, seed=args.seed)
    except ValueError as exc:
        parser.error(str(exc))
    total = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    print(f"wrote tiny {what} checkpoint to {path} ({total / 2**20:.1f} MiB)")

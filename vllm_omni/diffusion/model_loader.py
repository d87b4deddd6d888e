"""Load Qwen-Image from a diffusers-layout directory, the Hugging Face Hub, or build it with random weights.

    model                      resolve_model_path            load_format "auto"        load_format "dummy"
    "tiny-qwen-image"   ->     built once into the cache     weights from the files    configs of the dir
    local directory     ->     itself (needs model_index)    weights from the files    configs of the dir
    "Org/Name" repo id  ->     snapshot_download             weights from the files    REAL_* configs, no I/O

The transformer is ours (`QwenImageTransformer`, state-dict names identical to diffusers'); it is built
without allocating parameters and each safetensors tensor is moved straight to the target device and
dtype, one tensor at a time. VAE, text encoder and tokenizer are the diffusers / transformers classes.
`dummy` builds every module with parameters on the meta device and materialises each one directly on
the target device in the target dtype, filled from a seeded generator: a real-size model never exists
in fp32 on the host.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from vllm_omni.config import LOAD_FORMATS, TINY_EDIT_MODEL_NAME, TINY_MODEL_NAME, env_flag
from vllm_omni.diffusion.models.qwen_image import configs

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from diffusers import AutoencoderKLQwenImage
    from transformers import PreTrainedTokenizerBase, Qwen2_5_VLForConditionalGeneration

GIB = 1 << 30
COMPONENT_DIRS = ("transformer", "vae", "text_encoder", "tokenizer", "scheduler")
_HUB_ALLOW_PATTERNS = [
    "model_index.json",
    "*/*.json",
    "*/*.safetensors",
    "tokenizer/*",
]
_WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
_WEIGHTS_INDEX_NAME = "diffusion_pytorch_model.safetensors.index.json"


class ModelNotFoundError(ValueError):
    """The model's weights are neither local nor downloadable; the message lists what would work."""


def _log_loaded(what: str, module: torch.nn.Module, start: float) -> None:
    """One progress line per component: parameters, bytes, time."""
    params = list(module.parameters())
    num_params = sum(p.numel() for p in params)
    num_bytes = sum(p.numel() * p.element_size() for p in params)
    size = f"{num_params / 1e9:.2f}B" if num_params >= 1e8 else f"{num_params / 1e6:.2f}M"
    elapsed = time.perf_counter() - start
    logger.info("loaded %s: %s parameters, %.2f GiB, %.1f s", what, size, num_bytes / GIB, elapsed)


@dataclass
class QwenImageComponents:
    """Everything the Qwen-Image pipeline needs, loaded, in eval mode, without gradients."""

    transformer: torch.nn.Module
    """Our `QwenImageTransformer` (diffusers' parameter names)."""
    vae: AutoencoderKLQwenImage
    text_encoder: Qwen2_5_VLForConditionalGeneration
    tokenizer: PreTrainedTokenizerBase
    scheduler_config: dict
    """Contents of scheduler/scheduler_config.json (sigma schedule constants)."""
    transformer_config: dict
    """Contents of transformer/config.json."""
    model_path: Path | None
    """The directory the components came from; None for a dummy model built from REAL_* configs."""
    processor: Any = None
    """Edit checkpoints: the `QwenImageEditProcessor` (qwen_image_edit/loader.py adds it); else None."""


# ---------------------------------------------------------------------------------------------------------
# Paths
# ---------------------------------------------------------------------------------------------------------


def _read_json(path: Path) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _local_dir(model: str) -> Path | None:
    """The directory `model` names, None when it looks like a hub repo id; ValueError when broken."""
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "model_index.json").is_file():
            raise ValueError(
                f"model directory {str(path)!r} has no model_index.json: expected a diffusers-format "
                f"Qwen-Image directory with {', '.join(COMPONENT_DIRS)}"
            )
        return path
    if path.exists() or model.startswith(("/", "./", "../", "~")) or model.count("/") > 1:
        raise ValueError(f"model {model!r} is not a directory (a diffusers-format Qwen-Image directory)")
    return None


def hub_is_offline() -> bool:
    """Whether the Hugging Face Hub may not be contacted (HF_HUB_OFFLINE, read by us or by the hub)."""
    from huggingface_hub import constants as hub_constants

    return bool(env_flag("HF_HUB_OFFLINE")) or bool(hub_constants.HF_HUB_OFFLINE)


def resolve_model_path(model: str) -> Path:
    """Directory holding the diffusers-format checkpoint named by `model`.

    `tiny-qwen-image` builds (once) and returns the cached tiny random model; an existing local
    directory must contain model_index.json; anything else is a Hugging Face repo id, fetched with
    `snapshot_download` (only configs, tokenizer and safetensors). Offline (HF_HUB_OFFLINE=1) or not
    found raises ValueError naming the model and the alternatives.
    """
    if model == TINY_MODEL_NAME:
        from vllm_omni.tools.make_tiny_checkpoint import ensure_tiny_checkpoint

        return ensure_tiny_checkpoint()
    if model == TINY_EDIT_MODEL_NAME:
        from vllm_omni.tools.make_tiny_edit_checkpoint import ensure_tiny_edit_checkpoint

        return ensure_tiny_edit_checkpoint()
    local = _local_dir(model)
    if local is not None:
        return local
    return _hub_snapshot(model, hub_is_offline())


@functools.lru_cache(maxsize=16)
def _hub_snapshot(model: str, offline: bool) -> Path:
    """The Hub snapshot of repo id `model`, resolved once per process: start-up asks for it from
    several places (pipeline class, weights, tokenizer, the edit processor, the engine's prompt
    counter), and each `snapshot_download` is a round trip to the Hub when online. Failures are
    not cached (the next call tries again)."""
    from huggingface_hub import snapshot_download

    try:
        path = snapshot_download(model, allow_patterns=_HUB_ALLOW_PATTERNS, local_files_only=offline)
    except Exception as exc:  # offline, not found, bad id, network: all mean "cannot get it"
        reason = "offline (HF_HUB_OFFLINE=1) and not in the local cache" if offline else "download failed"
        first_line = (str(exc).strip().splitlines() or [""])[0][:160]
        # NOTE(loader): `from None`: the hub's chained tracebacks (about 100 lines) say nothing more.
        raise ModelNotFoundError(
            f"model {model!r} has no weights here: not a local directory, and {reason} "
            f"({type(exc).__name__}: {first_line}). Download it first (`huggingface-cli download {model}`), "
            f"pass a local diffusers-format directory, add --load-format dummy for the real-size "
            f"architecture with random weights, or serve {TINY_MODEL_NAME!r} (built-in tiny random model)"
        ) from None
    path = Path(path)
    if not (path / "model_index.json").is_file():
        raise ValueError(f"model {model!r}: the Hub snapshot at {path} has no model_index.json")
    return path


# ---------------------------------------------------------------------------------------------------------
# Building modules without allocating parameters
# ---------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _parameters_on_meta():
    """Inside: each parameter a module registers is moved to the meta device; buffers are untouched.

    NOTE(loader): patches `nn.Module.register_parameter` process-wide while active, so do not build
    modules on other threads meanwhile (accelerate's `init_empty_weights(include_buffers=False)` does
    the same).
    """
    original = torch.nn.Module.register_parameter

    def register(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    torch.nn.Module.register_parameter = register
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = original


def build_empty(factory, device: str | torch.device) -> torch.nn.Module:
    """`factory()` with every parameter on the meta device and buffers (RoPE tables...) on `device`."""
    with _parameters_on_meta(), torch.device(device):
        return factory()


def _finish(module: torch.nn.Module) -> torch.nn.Module:
    module.eval()
    module.requires_grad_(False)
    return module


# ---------------------------------------------------------------------------------------------------------
# Transformer weights
# ---------------------------------------------------------------------------------------------------------


def _weight_map(weights_dir: Path) -> dict[str, Path]:
    """tensor name -> safetensors file, for a single file or a sharded checkpoint with an index."""
    from safetensors import safe_open

    index = weights_dir / _WEIGHTS_INDEX_NAME
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: no 'weight_map' object")
        return {name: weights_dir / file for name, file in weight_map.items()}
    single = weights_dir / _WEIGHTS_NAME
    if not single.is_file():
        raise ValueError(f"{weights_dir}: neither {_WEIGHTS_NAME} nor {_WEIGHTS_INDEX_NAME} found")
    with safe_open(str(single), framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


def _set_tensor(module: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    owner_name, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_name)
    if leaf in owner._parameters:
        owner._parameters[leaf] = torch.nn.Parameter(value, requires_grad=False)
    else:
        owner._buffers[leaf] = value


def load_transformer_weights(
    transformer: torch.nn.Module, weights_dir: str | Path, device: str | torch.device, dtype: torch.dtype
) -> None:
    """Load diffusers-format safetensors (single file or sharded + index) into `transformer`, strictly.

    Each tensor goes from the file straight to `device` in `dtype` (floating tensors) and replaces
    the parameter (which may be on the meta device). Missing, unexpected or mis-shaped tensors raise
    ValueError listing them, before anything is loaded.
    """
    from safetensors import safe_open

    weights_dir = Path(weights_dir)
    weight_map = _weight_map(weights_dir)
    expected = {name: p.shape for name, p in transformer.named_parameters()}
    expected.update({name: b.shape for name, b in transformer.state_dict(keep_vars=True).items()})
    missing = sorted(set(dict(transformer.named_parameters())) - set(weight_map))
    unexpected = sorted(set(weight_map) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"transformer weights in {weights_dir} do not match {type(transformer).__name__}: "
            f"{len(missing)} missing {missing[:8]}, {len(unexpected)} unexpected {unexpected[:8]}"
        )
    by_file: dict[Path, list[str]] = {}
    for name, file in weight_map.items():
        by_file.setdefault(file, []).append(name)
    for shard, (file, names) in enumerate(sorted(by_file.items()), start=1):
        if len(by_file) > 1:
            logger.info(
                "transformer weights: shard %d/%d (%s, %d tensors)",
                shard,
                len(by_file),
                file.name,
                len(names),
            )
        with safe_open(str(file), framework="pt") as f:
            for name in sorted(names):
                tensor = f.get_tensor(name)
                if tuple(tensor.shape) != tuple(expected[name]):
                    raise ValueError(
                        f"transformer weight {name!r} in {file.name} has shape {tuple(tensor.shape)}, "
                        f"the model expects {tuple(expected[name])}"
                    )
                target_dtype = dtype if tensor.is_floating_point() else tensor.dtype
                _set_tensor(transformer, name, tensor.to(device=device, dtype=target_dtype))


def _make_transformer(transformer_config: dict, device, attn_backend) -> torch.nn.Module:
    from vllm_omni.diffusion.models.qwen_image.transformer import (
        QwenImageTransformer,
        QwenImageTransformerConfig,
    )

    config = QwenImageTransformerConfig.from_dict(transformer_config)
    return build_empty(lambda: QwenImageTransformer(config, attn_backend=attn_backend), device)


# ---------------------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------------------


def vae_dtype(device: str | torch.device, dtype: torch.dtype) -> torch.dtype:
    """fp32 on CPU (bf16 convolutions there are slow and lossy); the requested dtype elsewhere."""
    return torch.float32 if torch.device(device).type == "cpu" else dtype


def load_qwen_image(
    model: str,
    device: str | torch.device,
    dtype: torch.dtype,
    load_format: str = "auto",
    seed: int | None = None,
    attn_backend: Any = None,
) -> QwenImageComponents:
    """Load (or, with `load_format="dummy"`, build with random weights) every Qwen-Image component.

    `model`: `tiny-qwen-image`, a local diffusers-format directory or a Hugging Face repo id.
    `dtype` applies to the transformer and text encoder; the VAE is fp32 on CPU. `seed` fixes the
    dummy weights (default 0). `attn_backend` is passed to `QwenImageTransformer`. `device="meta"`
    (dummy only) builds shapes without memory, e.g. to count real-size parameters.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    if load_format == "dummy":
        return _load_dummy(model, device, dtype, 0 if seed is None else seed, attn_backend)
    from diffusers import AutoencoderKLQwenImage
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    path = resolve_model_path(model)
    logger.info("loading %s from %s onto %s in %s", model, path, device, dtype)
    start = time.perf_counter()
    transformer_config = _read_json(path / "transformer" / "config.json")
    transformer = _make_transformer(transformer_config, device, attn_backend)
    load_transformer_weights(transformer, path / "transformer", device, dtype)
    _log_loaded("transformer", transformer, start)
    start = time.perf_counter()
    vae = AutoencoderKLQwenImage.from_pretrained(path / "vae", torch_dtype=vae_dtype(device, dtype))
    _log_loaded("VAE", vae, start)
    start = time.perf_counter()
    device_map = None if torch.device(device).type == "cpu" else str(torch.device(device))
    text_encoder = Qwen2_5_VLForConditionalGeneration.from_pretrained(
        path / "text_encoder", dtype=dtype, device_map=device_map
    )
    _log_loaded("text encoder", text_encoder, start)
    return QwenImageComponents(
        transformer=_finish(transformer),
        vae=_finish(vae.to(device)),
        text_encoder=_finish(text_encoder.to(device)),
        tokenizer=AutoTokenizer.from_pretrained(path / "tokenizer"),
        scheduler_config=_read_json(path / "scheduler" / "scheduler_config.json"),
        transformer_config=transformer_config,
        model_path=path,
    )


def _dummy_source(model: str) -> Path | None:
    """Directory whose configs a dummy model copies: the tiny model's, a local dir, or None (REAL_*)."""
    if model in (TINY_MODEL_NAME, TINY_EDIT_MODEL_NAME):
        return resolve_model_path(model)
    return _local_dir(model)


def _load_dummy(
    model: str, device: str | torch.device, dtype: torch.dtype, seed: int, attn_backend: Any
) -> QwenImageComponents:
    from diffusers import AutoencoderKLQwenImage
    from transformers import AutoTokenizer, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from vllm_omni.tools.make_tiny_checkpoint import ensure_tiny_checkpoint, randomize_weights_

    source = _dummy_source(model)
    if source is not None:
        transformer_config = _read_json(source / "transformer" / "config.json")
        vae_config = _read_json(source / "vae" / "config.json")
        text_config = Qwen2_5_VLConfig.from_pretrained(source / "text_encoder")
        scheduler_config = _read_json(source / "scheduler" / "scheduler_config.json")
        tokenizer_dir = source / "tokenizer"
    else:
        transformer_config = dict(configs.REAL_TRANSFORMER_CONFIG)
        vae_config = dict(configs.REAL_VAE_CONFIG)
        kwargs = {k: v for k, v in configs.REAL_TEXT_ENCODER_CONFIG.items() if k != "architectures"}
        kwargs.pop("model_type")
        # The tiny tokenizer stands in for the real one (below): the encoder must look for ITS vision ids.
        for key in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
            kwargs[key] = configs.TINY_TEXT_ENCODER_CONFIG[key]
        text_config = Qwen2_5_VLConfig(**kwargs)
        scheduler_config = dict(configs.REAL_SCHEDULER_CONFIG)
        # Real tokenizer files cannot be fetched without network: the tiny tokenizer's ids (< 1100)
        # fit any Qwen2.5-VL vocabulary.
        tokenizer_dir = ensure_tiny_checkpoint() / "tokenizer"

    is_meta = torch.device(device).type == "meta"
    generator = None if is_meta else torch.Generator(device=device).manual_seed(seed)

    def materialise(what: str, module: torch.nn.Module, module_dtype: torch.dtype) -> torch.nn.Module:
        if is_meta:
            torch.nn.Module.to(module, dtype=module_dtype)  # shapes only (skips diffusers' fp32 warning)
            return _finish(module)
        num_params = sum(p.numel() for p in module.parameters())
        num_bytes = num_params * torch.tensor([], dtype=module_dtype).element_size()
        logger.info(
            "building %s with random weights: %.2fM parameters, %.2f GiB in %s on %s",
            what, num_params / 1e6, num_bytes / GIB, module_dtype, device,
        )  # fmt: skip
        start = time.perf_counter()
        randomize_weights_(module, generator, device=device, dtype=module_dtype)
        _log_loaded(f"{what} (dummy, random weights)", module, start)
        return _finish(module)

    transformer = _make_transformer(transformer_config, device, attn_backend)
    vae = build_empty(lambda: AutoencoderKLQwenImage.from_config(vae_config), device)
    text_encoder = build_empty(lambda: Qwen2_5_VLForConditionalGeneration(text_config), device)
    return QwenImageComponents(
        transformer=materialise("transformer", transformer, dtype),
        vae=materialise("VAE", vae, vae_dtype(device, dtype) if not is_meta else dtype),
        text_encoder=materialise("text encoder", text_encoder, dtype),
        tokenizer=AutoTokenizer.from_pretrained(tokenizer_dir),
        scheduler_config=scheduler_config,
        transformer_config=transformer_config,
        model_path=source,
    )


def tokenizer_dir(model: str, load_format: str = "auto") -> Path:
    """The tokenizer directory `load_qwen_image(model, load_format=...)` uses (no weights read)."""
    if load_format == "dummy":
        source = _dummy_source(model)
        if source is None:
            from vllm_omni.tools.make_tiny_checkpoint import ensure_tiny_checkpoint

            return ensure_tiny_checkpoint() / "tokenizer"
        return source / "tokenizer"
    return resolve_model_path(model) / "tokenizer"

"""Generic weight loading: checkpoint paths (local or Hub), modules built on meta, safetensors, dummy weights.

A family's loader (e.g. Qwen-Image's, in its folder) assembles its components with these:

    resolve_model_path     a local diffusers-format directory, or a Hugging Face repo id (snapshot)
    build_empty            a module with parameters on the meta device (no memory)
    load_transformer_weights  safetensors (single or sharded) straight to the device and dtype
    randomize_weights_     seeded random weights for `--load-format dummy` (materialised on the device)

Built-in tiny model names are resolved by `models/registry.py`, not here.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import time
from pathlib import Path

import torch

from vllm_omni.config import TINY_MODEL_NAME, env_flag
from vllm_omni.diffusion.layers import fp8_checkpoint
from vllm_omni.diffusion.layers.linear import Linear
from vllm_omni.diffusion.layers.merged_linear import merge_linears
from vllm_omni.diffusion.layers.quantization import mark_for_quantization

logger = logging.getLogger(__name__)

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


def log_loaded(what: str, module: torch.nn.Module, start: float) -> None:
    """One progress line per component: parameters, bytes, time (since `start`, perf_counter)."""
    params = list(module.parameters())
    num_params = sum(p.numel() for p in params)
    num_bytes = sum(p.numel() * p.element_size() for p in params)
    size = f"{num_params / 1e9:.2f}B" if num_params >= 1e8 else f"{num_params / 1e6:.2f}M"
    elapsed = time.perf_counter() - start
    logger.info("loaded %s: %s parameters, %.2f GiB, %.1f s", what, size, num_bytes / GIB, elapsed)


# ---------------------------------------------------------------------------------------------------------
# Paths
# ---------------------------------------------------------------------------------------------------------


def read_json(path: Path) -> dict:
    """The JSON object in `path`."""
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def local_model_dir(model: str) -> Path | None:
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

    An existing local directory must contain model_index.json; anything else is a Hugging Face repo
    id, fetched with
    `snapshot_download` (only configs, tokenizer and safetensors). Offline (HF_HUB_OFFLINE=1) or not
    found raises ValueError naming the model and the alternatives.
    """
    local = local_model_dir(model)
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


def finish(module: torch.nn.Module) -> torch.nn.Module:
    """`module` in eval mode without gradients (every loaded component ends here)."""
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
        weight_map = read_json(index).get("weight_map")
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
    if isinstance(owner, Linear):  # per parameter, through the layer (its shard, its method's names)
        owner.load_weight(leaf, value)
    elif leaf in owner._parameters:
        owner._parameters[leaf] = torch.nn.Parameter(value, requires_grad=False)
    else:
        owner._buffers[leaf] = value


def load_transformer_weights(
    transformer: torch.nn.Module,
    weights_dir: str | Path,
    device: str | torch.device,
    dtype: torch.dtype,
    quantization=None,
) -> None:
    """Load diffusers-format safetensors (single file or sharded + index) into `transformer`, strictly.

    Each tensor goes from the file straight to `device` in `dtype` (floating tensors) and replaces
    the parameter (which may be on the meta device). Missing, unexpected or mis-shaped tensors raise
    ValueError listing them, before anything is loaded. `quantization` (a `QuantizationConfig`): the
    linears it selects are quantized as their weights arrive (the load's peak is the quantized model).
    An FP8 checkpoint's e4m3 weights load as they are into the linears it selects, dequantised into
    the others (`layers/fp8_checkpoint.py`). Last, the merged projections are stacked (`merge_linears`:
    one QKV GEMM, in the loaded format).
    """
    from safetensors import safe_open

    weights_dir = Path(weights_dir)
    weight_map = _weight_map(weights_dir)
    scales = {n: f for n, f in weight_map.items() if n.endswith(fp8_checkpoint.SCALE_SUFFIXES)}
    tensors = {n: f for n, f in weight_map.items() if n not in scales}
    expected = {name: p.shape for name, p in transformer.named_parameters()}
    expected.update({name: b.shape for name, b in transformer.state_dict(keep_vars=True).items()})
    missing = sorted(set(dict(transformer.named_parameters())) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"transformer weights in {weights_dir} do not match {type(transformer).__name__}: "
            f"{len(missing)} missing {missing[:8]}, {len(unexpected)} unexpected {unexpected[:8]}"
        )
    fp8_weights = fp8_checkpoint.fp8_weight_scales(weights_dir, tensors, scales, quantization)
    mark_for_quantization(transformer, quantization)
    by_file: dict[Path, list[str]] = {}
    for name, file in tensors.items():
        by_file.setdefault(file, []).append(name)
    num_fp8 = num_dequantized = 0
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
                if name in fp8_weights:
                    scale_name = fp8_weights[name]
                    # the scale usually sits in the weight's own shard, already open
                    scale = f.get_tensor(scale_name) if weight_map[scale_name] == file else None
                    weight = fp8_checkpoint.Fp8Weight(
                        name,
                        tensor,
                        scale if scale is not None else _read_tensor(weight_map, scale_name),
                        scale_name.endswith(fp8_checkpoint.BLOCK_SCALE),
                    )
                    layer = transformer.get_submodule(name.rpartition(".")[0])
                    if fp8_checkpoint.load_fp8_weight(layer, weight, device, dtype):
                        num_fp8 += 1
                    else:
                        num_dequantized += 1
                    continue
                if fp8_checkpoint.is_fp8(tensor):
                    raise ValueError(
                        f"transformer weight {name!r} in {file.name} is {tensor.dtype} without a "
                        "weight_scale: an FP8 checkpoint has one per FP8 weight (vLLM's / ModelOpt's layout)"
                    )
                target_dtype = dtype if tensor.is_floating_point() else tensor.dtype
                _set_tensor(transformer, name, tensor.to(device=device, dtype=target_dtype))
    if fp8_weights:
        num_input_scales = sum(n.endswith(fp8_checkpoint.INPUT_SCALE) for n in scales)
        logger.info(
            "FP8 checkpoint: %d linears loaded as they are (e4m3 + scales), %d dequantized to %s (kept in "
            "high precision by the quantization config)%s",
            num_fp8,
            num_dequantized,
            str(dtype).removeprefix("torch."),
            f"; {num_input_scales} static input_scale tensors not used (activations are quantized per "
            "token at run time)"
            if num_input_scales
            else "",
        )
    merge_linears(transformer)  # the merged projections (one QKV GEMM), in the loaded format


def _read_tensor(weight_map: dict[str, Path], name: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(weight_map[name]), framework="pt") as f:
        return f.get_tensor(name)


# ---------------------------------------------------------------------------------------------------------
# Random weights (--load-format dummy)
# ---------------------------------------------------------------------------------------------------------


def _is_norm_scale(module: torch.nn.Module, param_name: str) -> bool:
    return "norm" in type(module).__name__.lower() and param_name in ("weight", "gamma")


@torch.no_grad()
def randomize_weights_(
    module: torch.nn.Module,
    generator: torch.Generator,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
) -> None:
    """Replace every parameter of `module` by seeded random values that keep a signal alive.

    Norm scales get `1 + 0.25 * N(0, 1)`, embeddings `N(0, 1)`, other matrices / conv kernels
    `N(0, 1 / fan_in)`, biases and other vectors `N(0, 0.2^2)`. Parameters are visited in
    `named_modules()` order, so a seed fixes every value. Parameters on the meta device are materialised
    on `device` (required then) in `dtype` (default: the parameter's dtype); `generator` must live on
    that device. Tied parameters stay tied. Buffers are left alone. Merged projections are merged
    again after (`merge_linears`). A linear marked for quantization (`mark_for_quantization`) is
    quantized as its weight is drawn, as a checkpoint's would be as it loads.
    """
    replaced: dict[int, torch.nn.Parameter] = {}
    for _, mod in module.named_modules():
        for name, param in list(mod._parameters.items()):
            if param is None:
                continue
            if id(param) in replaced:
                mod._parameters[name] = replaced[id(param)]
                continue
            target_device = param.device if device is None else torch.device(device)
            if target_device.type == "meta":
                raise ValueError("randomize_weights_: parameters are on the meta device; pass device=")
            target_dtype = param.dtype if dtype is None or not param.is_floating_point() else dtype
            value = torch.empty(param.shape, dtype=target_dtype, device=target_device)
            if _is_norm_scale(mod, name):
                value.normal_(0.0, 0.25, generator=generator).add_(1.0)
            elif isinstance(mod, torch.nn.Embedding):
                value.normal_(0.0, 1.0, generator=generator)
            elif value.dim() >= 2:
                fan_in = value[0].numel()
                value.normal_(0.0, 1.0 / math.sqrt(fan_in), generator=generator)
            else:
                value.normal_(0.0, 0.2, generator=generator)
            if isinstance(mod, Linear) and mod.quantize_on_load is not None and mod.shard is None:
                # marked for quantization (`mark_for_quantization`): the weight switches to its method as
                # it is set, so the random BF16 copy of the whole transformer never exists at once
                mod.load_weight(name, value)
                replaced[id(param)] = mod._parameters[name]
                continue
            new_param = torch.nn.Parameter(value, requires_grad=False)
            replaced[id(param)] = new_param
            mod._parameters[name] = new_param
    merge_linears(module)


# ---------------------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------------------


def vae_dtype(device: str | torch.device, dtype: torch.dtype) -> torch.dtype:
    """fp32 on CPU (bf16 convolutions there are slow and lossy); the requested dtype elsewhere."""
    return torch.float32 if torch.device(device).type == "cpu" else dtype

"""Refuse, before any weight is loaded, what cannot run on the chosen device.

Each check returns one line that names the flag and what would work:

    --device           the device exists (CUDA visible, index below the device count)
    MODEL              offline (HF_HUB_OFFLINE=1), the weights are local or in the Hub cache
    --dtype            bf16 on a CUDA device without bf16 support
    --quantization     fp8 on a CUDA device without FP8 tensor cores (compute capability < 8.9)
    --diffusion-attention-backend
                       the kernel runs on the device, takes the model's head size and dtype, and keeps
                       packed sequences apart in step mode
    parallel sizes     world size (product of the degrees) GPUs from the chosen index on
    memory             weights (parameters x dtype bytes, FP8 weights 1 byte + a 4-byte scale per
                       output channel; counted on the meta device from the model's configs) against
                       the device's free memory, plus the prefix KV arena a family with a prefix cache
                       allocates at start-up on CUDA with graphs (`--kv-cache-memory-bytes` when set;
                       its default size is a share of what is free after loading, so always fits)

`startup_errors(config)` probes the machine; tests pass a `DeviceInfo` to pretend another one.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch

from vllm_omni.config import OmniDiffusionConfig
from vllm_omni.inputs import MAX_NUM_OUTPUTS_PER_PROMPT, MAX_SEQUENCE_LENGTH_LIMIT

logger = logging.getLogger(__name__)

GIB = 1 << 30


@dataclass
class DeviceInfo:
    """What this machine offers, as far as the checks need it."""

    num_cuda_devices: int
    """`torch.cuda.device_count()` (0 without CUDA)."""
    cuda_free_bytes: dict[int, int] = field(default_factory=dict)
    """Free memory of the probed CUDA device, by index (`torch.cuda.mem_get_info`). Only the chosen
    device is probed: `mem_get_info` starts a CUDA context, which this process (the server) would
    then keep on every GPU it touched."""
    cuda_supports_bf16: bool = True
    """`torch.cuda.is_bf16_supported()` on the chosen device."""
    cuda_capability: tuple[int, int] | None = None
    """(major, minor) compute capability of the chosen CUDA device (None: no CUDA device probed)."""
    cpu_available_bytes: int | None = None
    """MemAvailable from /proc/meminfo; None when unknown (the memory check is skipped)."""

    @classmethod
    def probe(cls, device: torch.device) -> DeviceInfo:
        """Measure this machine (touches CUDA only when `device` is CUDA)."""
        info = cls(num_cuda_devices=torch.cuda.device_count() if torch.cuda.is_available() else 0)
        info.cpu_available_bytes = _cpu_available_bytes()
        if device.type == "cuda" and info.num_cuda_devices:
            index = device.index or 0
            if index < info.num_cuda_devices:
                info.cuda_free_bytes = {index: torch.cuda.mem_get_info(index)[0]}
            index = min(index, info.num_cuda_devices - 1)
            info.cuda_capability = tuple(torch.cuda.get_device_capability(index))
            info.cuda_supports_bf16 = info.cuda_capability[0] >= 8
        return info

    def free_bytes(self, device: torch.device) -> int | None:
        if device.type == "cpu":
            return self.cpu_available_bytes
        return self.cuda_free_bytes.get(device.index or 0)


def _name(device: torch.device) -> str:
    """'cuda:0' for a bare 'cuda' (the device the engine then uses)."""
    return f"cuda:{device.index or 0}" if device.type == "cuda" else str(device)


def _cpu_available_bytes() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


@dataclass
class WeightsEstimate:
    """Parameter counts of the model's components and the bytes they need on one device."""

    num_transformer_params: int
    num_text_encoder_params: int
    num_vae_params: int
    head_dim: int
    """The transformer's attention head size (for the backend check)."""
    bytes_per_device: int
    """Transformer / tensor-parallel size + text encoder + VAE, in their load dtypes."""
    resident_bytes: int = 0
    """The runner state of `resident_cap` started requests at their largest (latents of
    n = 10 images of the largest size, fp32; prompt and negative prompt embeddings of 1024 tokens)."""
    prefix_arena_bytes: int = 0
    """The prefix KV arena allocated at start-up (`--kv-cache-memory-bytes`, for a family with a prefix
    cache on CUDA with graphs on); 0 otherwise or at its default size."""

    def describe(self) -> str:
        return (
            f"transformer {_count(self.num_transformer_params)} + text encoder "
            f"{_count(self.num_text_encoder_params)} + VAE {_count(self.num_vae_params)} parameters "
            f"= {self.bytes_per_device / GIB:.2f} GiB of weights per device, + at most "
            f"{self.resident_bytes / GIB:.2f} GiB of started requests' state"
            + (
                f", + {self.prefix_arena_bytes / GIB:.2f} GiB of prefix KV arena"
                if self.prefix_arena_bytes
                else ""
            )
        )


def _count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def estimate_weights(config: OmniDiffusionConfig, device: torch.device) -> WeightsEstimate:
    """Count parameters from the model's configs on the meta device (no memory, no weight files read)."""
    from vllm_omni.diffusion.layers.quantization import weight_bytes
    from vllm_omni.diffusion.model_loader import vae_dtype
    from vllm_omni.diffusion.models import registry

    dtype = config.resolve_dtype()
    family = registry.family_for(config.model, "dummy")  # no weight files read, no Hub download
    meta = family.load_components(config.model, device="meta", dtype=dtype, load_format="dummy")

    def count(module: torch.nn.Module) -> int:
        return sum(p.numel() for p in module.parameters())

    num_tr, num_te, num_vae = count(meta.transformer), count(meta.text_encoder), count(meta.vae)
    item, vae_item = dtype.itemsize, vae_dtype(device, dtype).itemsize  # the VAE runs in fp32 on CPU
    tp = config.parallel_config.tensor_parallel_size
    # FP8 weights at 1 byte (+ scales): the steady state, and a checkpoint load's peak (its layers
    # quantize as they load). NOTE(fp8): --load-format dummy draws --dtype weights first and peaks
    # higher (docs/quantization.md)
    transformer_bytes = weight_bytes(meta.transformer, dtype, config.quantization)
    return WeightsEstimate(
        num_transformer_params=num_tr,
        num_text_encoder_params=num_te,
        num_vae_params=num_vae,
        head_dim=int(meta.transformer_config.get("attention_head_dim", 128)),
        bytes_per_device=transformer_bytes // tp + num_te * item + num_vae * vae_item,
        resident_bytes=config.resident_cap
        * _request_state_bytes(config, int(meta.transformer_config.get("joint_attention_dim", 3584)), item),
        prefix_arena_bytes=_prefix_arena_bytes(config, device, family),
    )


def _prefix_arena_bytes(config: OmniDiffusionConfig, device: torch.device, family) -> int:
    """Bytes of the prefix KV arena the runner allocates at start-up, when the flag sizes it (a family
    with a prefix cache, CUDA, graphs on); its default size is a share of the memory free after loading."""
    has_arena = family.capabilities.prefix_cache and device.type == "cuda"
    if not has_arena or config.enforce_eager or config.batch_invariant:
        return 0
    return config.kv_cache_memory_bytes or 0


def _request_state_bytes(config: OmniDiffusionConfig, joint_attention_dim: int, itemsize: int) -> int:
    """One started request's runner state at its largest: fp32 latents `[n, H*W/256, 64]` and the
    prompt and negative prompt embeddings `[1024, joint_attention_dim]` in the model dtype."""
    latents = MAX_NUM_OUTPUTS_PER_PROMPT * (config.max_generated_image_size // 256) * 64 * 4
    return latents + 2 * MAX_SEQUENCE_LENGTH_LIMIT * joint_attention_dim * itemsize


# ---- the checks ---------------------------------------------------------------------------------


def check_device(config: OmniDiffusionConfig, device: torch.device, info: DeviceInfo) -> str | None:
    """The `--device` exists on this machine."""
    if device.type not in ("cpu", "cuda"):
        return f"--device {config.device}: only cpu and cuda devices are supported; use --device cpu or cuda"
    if device.type == "cuda" and info.num_cuda_devices == 0:
        return f"--device {config.device}: no CUDA device is visible to this process; use --device cpu"
    if device.type == "cuda" and (device.index or 0) >= info.num_cuda_devices:
        return (
            f"--device {config.device}: this host has {info.num_cuda_devices} CUDA device(s) "
            f"(cuda:0..cuda:{info.num_cuda_devices - 1}); pick one of them"
        )
    return None


def check_weights_present(config: OmniDiffusionConfig) -> str | None:
    """With `--load-format auto`, the weights are local or cached when the Hub cannot be reached.

    Online, a hub model missing from the cache is downloaded by the loader; that is not checked here.
    """
    from vllm_omni.diffusion.model_loader import hub_is_offline
    from vllm_omni.diffusion.models.registry import resolve_model_path

    if config.load_format != "auto" or not hub_is_offline():
        return None
    try:
        resolve_model_path(config.model)
    except ValueError as exc:
        return str(exc)
    return None


def check_dtype(config: OmniDiffusionConfig, device: torch.device, info: DeviceInfo) -> str | None:
    """bf16 needs a CUDA device of compute capability 8.0 or newer."""
    if device.type == "cuda" and config.resolve_dtype() == torch.bfloat16 and not info.cuda_supports_bf16:
        return (
            f"--dtype {config.dtype}: {device} has no bfloat16 support (compute capability < 8.0); "
            "use --dtype float16"
        )
    return None


def check_quantization(config: OmniDiffusionConfig, device: torch.device, info: DeviceInfo) -> str | None:
    """FP8 needs FP8 tensor cores on CUDA (Ada / Hopper: compute capability 8.9+); CPU runs it in torch."""
    from vllm_omni.diffusion.layers.quantization import MIN_FP8_CAPABILITY

    capability = info.cuda_capability
    if config.quantization.method != "fp8" or device.type != "cuda":
        return None
    if config.resolve_dtype() != torch.bfloat16:
        # torch's CUDA _scaled_mm with per-row / per-channel scales writes bf16 only
        return f"--quantization fp8 on CUDA computes in bfloat16; use --dtype bfloat16 (got {config.dtype})"
    if capability is not None and tuple(capability) < MIN_FP8_CAPABILITY:
        return (
            f"--quantization fp8: {_name(device)} has compute capability {capability[0]}.{capability[1]}, "
            "FP8 needs 8.9+ (Ada, Hopper); serve without --quantization"
        )
    return None


def check_parallel(config: OmniDiffusionConfig, device: torch.device, info: DeviceInfo) -> str | None:
    """One GPU per rank, from the chosen index on."""
    world_size = config.parallel_config.world_size
    if world_size == 1:
        return None
    if device.type != "cuda":  # one process per rank: at most one per CPU core
        cores = os.cpu_count() or 1
        if world_size > cores:
            return (
                f"the parallel sizes ask for {world_size} worker processes on CPU, but this host has "
                f"{cores} cores; lower them"
            )
        return None
    needed = (device.index or 0) + world_size
    if needed > info.num_cuda_devices:
        pc = config.parallel_config
        return (
            f"--tensor-parallel-size {pc.tensor_parallel_size} x --ulysses-degree {pc.ulysses_degree} x "
            f"--ring-degree {pc.ring_degree} x --cfg-parallel-size {pc.cfg_parallel_size} = {world_size} "
            f"GPUs from {_name(device)} on, but this host has {info.num_cuda_devices}; lower the parallel "
            f"sizes so their product is at most {info.num_cuda_devices - (device.index or 0)}"
        )
    return None


def check_attention_backend(config: OmniDiffusionConfig, device: torch.device, head_dim: int) -> str | None:
    """The chosen attention kernel runs on the device with this model's head size and dtype."""
    from vllm_omni.diffusion.attention import backend_class

    name = config.attention_backend
    if name is None:
        return None
    flag = f"--diffusion-attention-backend {name}"
    fix = "use --diffusion-attention-backend SDPA (any device, dtype and head size) or leave it unset"
    try:
        cls = backend_class(name)
    except ValueError as exc:
        return f"{flag}: {exc}"
    if not cls.is_available(device):
        return f"{flag} cannot run here: {cls.unavailable_reason(device)}; {fix}"
    if not cls.supports_head_size(head_dim):
        return f"{flag} does not take this model's head size {head_dim}; {fix}"
    dtype = config.resolve_dtype()
    if cls.supported_dtypes and dtype not in cls.supported_dtypes:
        names = [str(d).removeprefix("torch.") for d in cls.supported_dtypes]
        return f"{flag} computes in {names}, not {str(dtype).removeprefix('torch.')} (--dtype); {fix}"
    # every registered backend takes packed (varlen) batches; `get_attn_backend` refuses one that
    # does not when the model loads
    return None


def check_lora_modules(config: OmniDiffusionConfig) -> str | None:
    """Every `--lora-modules` path holds an adapter file (its contents are checked when it loads)."""
    from vllm_omni.lora.weights import LoRAFormatError, adapter_file

    for module in config.lora.lora_modules:
        try:
            adapter_file(module.path)
        except LoRAFormatError as exc:
            return f"--lora-modules {module.name}={module.path}: {exc}"
    return None


def check_memory(
    config: OmniDiffusionConfig, device: torch.device, info: DeviceInfo, est: WeightsEstimate
) -> str | None:
    """The weights, and the state of every request the server may hold started, fit in the device's
    free memory."""
    free = info.free_bytes(device)
    if free is None or est.bytes_per_device + est.resident_bytes + est.prefix_arena_bytes <= free:
        return None
    where = "available RAM" if device.type == "cpu" else f"free memory on {_name(device)}"
    if est.prefix_arena_bytes and est.bytes_per_device + est.resident_bytes <= free:
        return (
            f"--kv-cache-memory-bytes {est.prefix_arena_bytes}: the prefix KV arena is allocated at "
            f"start-up, and with the weights ({est.bytes_per_device / GIB:.1f} GiB) and started requests "
            f"({est.resident_bytes / GIB:.1f} GiB) it needs more than the {free / GIB:.1f} GiB of {where}; "
            "lower --kv-cache-memory-bytes"
        )
    if est.bytes_per_device <= free:
        return (
            f"--max-num-resident-reqs {config.resident_cap}: the weights take "
            f"{est.bytes_per_device / GIB:.1f} GiB and that many started requests up to "
            f"{est.resident_bytes / GIB:.1f} GiB more, {where} is {free / GIB:.1f} GiB; lower "
            "--max-num-resident-reqs or --max-generated-image-size"
        )
    return (
        f"MODEL {config.model} (--dtype {str(config.resolve_dtype()).removeprefix('torch.')}) needs "
        f"{est.bytes_per_device / GIB:.1f} GiB for its weights alone ({est.describe()}), {where} is "
        f"{free / GIB:.1f} GiB; use a device with more memory, --tensor-parallel-size, or "
        "tiny-qwen-image for a smoke test"
    )


def startup_errors(config: OmniDiffusionConfig, info: DeviceInfo | None = None) -> list[str]:
    """Every reason `config` cannot run here, one line each (empty: go ahead and load).

    `info` describes the machine; None probes this one.
    """
    try:
        device = torch.device(config.resolve_device())
    except (RuntimeError, ValueError):
        return [f"--device {config.device!r} is not a device; use auto, cpu, cuda or cuda:N"]
    if info is None:
        info = DeviceInfo.probe(device)
    first_error = (
        check_device(config, device, info) or check_weights_present(config) or check_lora_modules(config)
    )
    if first_error is not None:
        return [first_error]
    try:
        est = estimate_weights(config, device)
    except ValueError as exc:
        return [str(exc)]
    logger.info("model %s: %s", config.model, est.describe())
    checks = (
        check_dtype(config, device, info),
        check_quantization(config, device, info),
        check_parallel(config, device, info),
        check_attention_backend(config, device, est.head_dim),
        check_memory(config, device, info, est),
    )
    return [message for message in checks if message is not None]

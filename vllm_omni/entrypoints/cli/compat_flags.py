"""vLLM and vLLM-Omni `serve` flags that mean nothing for this engine.

A user moving from vLLM-Omni keeps their command line: each flag below is accepted
and, when given, logs one warning line saying why it has no effect here. Flags that
change what this server does are real flags in `serve.py`; a flag nobody knows
still fails in argparse.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class NoEffectFlag:
    """One accepted flag with no effect here."""

    flag: str
    reason: str
    takes_value: bool = True
    """False for a switch (`store_true`); True for a flag with one value (or more, see `nargs`)."""
    nargs: str | None = None


_ONE_PROCESS = "this server loads the model in its own process (no stage processes)"
_NO_OFFLOAD = "weights stay on the device (no offloading is implemented)"
_NO_KV_CACHE = "the step-wise engine keeps no diffusion KV cache"
_NO_COMPILE_MODES = "only the fused elementwise kernels are compiled (see --enforce-eager)"
_PER_REQUEST_LORA = (
    "no adapter is applied to every request; register adapters with --lora-modules NAME=PATH "
    "and name one per request ('lora': {'name': ..., 'scale': ...})"
)

NO_EFFECT_FLAGS: tuple[NoEffectFlag, ...] = (
    # vLLM-Omni stage start-up
    NoEffectFlag("--stage-init-timeout", _ONE_PROCESS),
    NoEffectFlag("--stage-configs-path", _ONE_PROCESS),
    NoEffectFlag("--deploy-config", _ONE_PROCESS),
    NoEffectFlag("--init-sleep-seconds", _ONE_PROCESS),
    NoEffectFlag("--trust-remote-code", "Qwen-Image runs on this package's own model code", False),
    NoEffectFlag("--request-batch-max-wait-ms", "request mode admits the next request at once"),
    NoEffectFlag("--diffusion-streaming-output", "partial results are not streamed", False),
    # parallelism variants
    NoEffectFlag("--ulysses-mode", "Ulysses runs in its one (strict) mode"),
    NoEffectFlag("--ulysses-a2a-permute", "Ulysses runs in its one (strict) mode", False),
    NoEffectFlag("--allgather-degree", "sequence parallelism is Ulysses and ring only"),
    NoEffectFlag("--vae-patch-parallel-size", "the VAE decodes on rank 0"),
    NoEffectFlag("--vae-parallel-mode", "the VAE decodes on rank 0"),
    NoEffectFlag("--text-encoder-tp-size", "the text encoder runs on rank 0"),
    NoEffectFlag("--use-hsdp", "weights are replicated or tensor-parallel, not HSDP-sharded", False),
    NoEffectFlag("--hsdp-shard-size", "weights are replicated or tensor-parallel, not HSDP-sharded"),
    NoEffectFlag("--hsdp-replicate-size", "weights are replicated or tensor-parallel, not HSDP-sharded"),
    # quantization and KV cache
    NoEffectFlag("--force-cutlass-fp8", "weights run in --dtype (no fp8)", False),
    NoEffectFlag("--diffusion-kv-cache-dtype", _NO_KV_CACHE),
    NoEffectFlag("--diffusion-kv-cache-skip-steps", _NO_KV_CACHE),
    NoEffectFlag("--diffusion-kv-cache-skip-layers", _NO_KV_CACHE),
    # compile and attention
    NoEffectFlag("--diffusion-compile-granularity", _NO_COMPILE_MODES),
    NoEffectFlag("--diffusion-compile-dynamic", _NO_COMPILE_MODES, False),
    NoEffectFlag("--fa-deterministic", "use --batch-invariant for bit-identical results", False),
    NoEffectFlag("--diffusion-attention-config", "use --diffusion-attention-backend"),
    NoEffectFlag("--fastvideo-vsa-topk", "no video sparse attention (image model)"),
    # cache
    NoEffectFlag("--cache-config", "no step caching (--cache-backend none)"),
    NoEffectFlag("--enable-cache-dit-summary", "no step caching (--cache-backend none)", False),
    # memory and offload
    NoEffectFlag("--enable-cpu-offload", _NO_OFFLOAD, False),
    NoEffectFlag("--enable-layerwise-offload", _NO_OFFLOAD, False),
    NoEffectFlag("--diffusion-offload-config", _NO_OFFLOAD),
    # model selection
    NoEffectFlag("--custom-pipeline-args", "the pipeline is Qwen-Image's own"),
    NoEffectFlag("--diffusers-load-kwargs", "components are loaded by this package's loader"),
    NoEffectFlag("--diffusers-call-kwargs", "requests carry their own sampling fields"),
    # vLLM-Omni's one static LoRA for every request; here adapters are per request (docs/lora.md)
    NoEffectFlag("--lora-path", _PER_REQUEST_LORA, nargs="+"),
    NoEffectFlag("--lora-backend", _PER_REQUEST_LORA),
    NoEffectFlag("--lora-scale", _PER_REQUEST_LORA),
    # request defaults and profiling
    NoEffectFlag("--enable-diffusion-pipeline-profiler", "use /metrics and /v1/debug/steps", False),
    NoEffectFlag("--boundary-ratio", "Qwen-Image has one transformer (no high/low-noise split)"),
    # common vLLM server flags
    NoEffectFlag("--gpu-memory-utilization", "no KV cache is sized from free memory"),
    NoEffectFlag("--max-model-len", "prompt length is capped by max_sequence_length (<= 1024)"),
    NoEffectFlag("--tokenizer", "the tokenizer is the checkpoint's own"),
    NoEffectFlag("--revision", "MODEL is loaded at its default revision"),
    NoEffectFlag("--download-dir", "Hugging Face's cache directory is used"),
    NoEffectFlag("--disable-uvicorn-access-log", "the access log is off unless --log-level debug", False),
    NoEffectFlag("--disable-fastapi-docs", "the OpenAPI docs stay at /docs", False),
)


def add_no_effect_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every `NO_EFFECT_FLAGS` entry to `parser` (default None = not given)."""
    group = parser.add_argument_group(
        "accepted for vLLM / vLLM-Omni compatibility (no effect here; one warning line when given)"
    )
    for spec in NO_EFFECT_FLAGS:
        if spec.takes_value:
            group.add_argument(spec.flag, default=None, nargs=spec.nargs, help=f"No effect: {spec.reason}.")
        else:
            group.add_argument(
                spec.flag, action="store_true", default=None, help=f"No effect: {spec.reason}."
            )


def warn_no_effect_flags(args: argparse.Namespace) -> list[str]:
    """Log one warning line per given no-effect flag; return the flags warned about."""
    given = []
    for spec in NO_EFFECT_FLAGS:
        if getattr(args, spec.flag.lstrip("-").replace("-", "_"), None) is not None:
            logger.warning("%s has no effect here: %s", spec.flag, spec.reason)
            given.append(spec.flag)
    return given


_STEP_MODE_FLAGS = ("max_num_batched_tokens", "mixfusion_min_chunk_tokens", "mixfusion_max_chunks")
_CORS_FLAGS = ("allowed_methods", "allowed_headers")


def warn_flags_without_their_mode(args: argparse.Namespace) -> list[str]:
    """One warning line per given flag whose feature is off in this command line; the flags."""
    given = []

    def warn(flag: str, reason: str) -> None:
        logger.warning("--%s has no effect here: %s", flag.replace("_", "-"), reason)
        given.append(flag)

    if not getattr(args, "step_execution", True):
        for flag in _STEP_MODE_FLAGS:
            if getattr(args, flag, None) is not None:
                warn(flag, "request mode runs one request at a time; add --step-execution")
    elif getattr(args, "enable_mixfusion", None) is False:
        for flag in _STEP_MODE_FLAGS[1:]:
            if getattr(args, flag, None) is not None:
                warn(flag, "--no-enable-mixfusion batches same-shape requests only")
    if not getattr(args, "allowed_origins", None):
        for flag in _CORS_FLAGS:
            if getattr(args, flag, None) is not None:
                warn(flag, "no CORS headers are sent without --allowed-origins")
        if getattr(args, "allow_credentials", False):
            warn("allow_credentials", "no CORS headers are sent without --allowed-origins")
    return given

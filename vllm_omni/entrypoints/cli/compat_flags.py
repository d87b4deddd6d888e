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
    aliases: tuple[str, ...] = ()
    """Other spellings of the flag (vLLM-Omni's short forms, e.g. `-oma`)."""
    negatable: bool = False
    """A switch that also has a `--no-` form (argparse's `BooleanOptionalAction`), as vLLM-Omni has it."""
    only_value: str | None = None
    """The one value accepted (with the warning); any other value is refused at start-up (exit 2)
    with `reason`, since running without the feature would not be what the command line asks."""

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")

    @property
    def spellings(self) -> tuple[str, ...]:
        """Every spelling argparse accepts (the `--no-` form included)."""
        no_form = (f"--no-{self.flag[2:]}",) if self.negatable else ()
        return (self.flag, *self.aliases, *no_form)


_ONE_PROCESS = "this server loads the model in its own process (no stage processes)"
_NO_OFFLOAD = "weights stay on the device (no offloading is implemented)"
_NO_KV_CACHE = "the step-wise engine keeps no diffusion KV cache"
_NO_COMPILE_MODES = "only the fused elementwise kernels are compiled (see --enforce-eager)"
_NO_STAGES = "this server is one process serving one model (no Omni master, stage replicas or Ray)"
_OWN_LOADER = "components are loaded by this package's loader (no loader thread pool to size)"
_NO_TTS = "no speech model is served (Qwen-Image generates images)"
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
    NoEffectFlag("--stage-overrides", _ONE_PROCESS),
    NoEffectFlag("--strategy-config", _ONE_PROCESS),
    NoEffectFlag("--async-chunk", _ONE_PROCESS, False, negatable=True),
    NoEffectFlag("--stage-id", _ONE_PROCESS),
    NoEffectFlag("--replica-id", _ONE_PROCESS),
    NoEffectFlag("--shm-threshold-bytes", _ONE_PROCESS),
    NoEffectFlag("--batch-timeout", _ONE_PROCESS),
    NoEffectFlag("--enable-orch-monitor", _ONE_PROCESS, False),
    NoEffectFlag("--worker-backend", _NO_STAGES),
    NoEffectFlag("--omni-master-address", _NO_STAGES, aliases=("-oma",)),
    NoEffectFlag("--omni-master-port", _NO_STAGES, aliases=("-omp",)),
    NoEffectFlag("--omni-replica-address", _NO_STAGES, aliases=("-ora",)),
    NoEffectFlag("--omni-dp-size-local", _NO_STAGES),
    NoEffectFlag("--omni-lb-policy", _NO_STAGES),
    NoEffectFlag("--omni-heartbeat-timeout", _NO_STAGES),
    NoEffectFlag(
        "--task-type",
        "the checkpoint decides the task (text-to-image, or image edit for an edit checkpoint)",
    ),
    NoEffectFlag(
        "--enable-sleep-mode", "no sleep / wake-up endpoints: the weights stay on the device", False
    ),
    # parallelism variants
    NoEffectFlag("--ulysses-mode", "Ulysses runs in its one (strict) mode"),
    NoEffectFlag("--ulysses-a2a-permute", "Ulysses runs in its one (strict) mode", False, negatable=True),
    NoEffectFlag(
        "--context-parallel-degree",
        "KV-gather context parallelism is not implemented; use --ring N (ring attention) or --usp N",
        aliases=("--cp",),
        only_value="1",
    ),
    NoEffectFlag("--allgather-degree", "sequence parallelism is Ulysses and ring only"),
    NoEffectFlag("--vae-patch-parallel-size", "the VAE decodes on rank 0"),
    NoEffectFlag("--vae-parallel-mode", "the VAE decodes on rank 0"),
    NoEffectFlag("--text-encoder-tp-size", "the text encoder runs on rank 0"),
    NoEffectFlag("--use-hsdp", "weights are replicated or tensor-parallel, not HSDP-sharded", False),
    NoEffectFlag("--hsdp-shard-size", "weights are replicated or tensor-parallel, not HSDP-sharded"),
    NoEffectFlag("--hsdp-replicate-size", "weights are replicated or tensor-parallel, not HSDP-sharded"),
    # quantization and KV cache
    NoEffectFlag("--force-cutlass-fp8", "FP8 GEMMs run through torch._scaled_mm (--quantization fp8)", False),
    NoEffectFlag("--diffusion-kv-cache-dtype", _NO_KV_CACHE),
    NoEffectFlag("--diffusion-kv-cache-skip-steps", _NO_KV_CACHE),
    NoEffectFlag("--diffusion-kv-cache-skip-layers", _NO_KV_CACHE),
    # compile and attention
    NoEffectFlag("--diffusion-compile-granularity", _NO_COMPILE_MODES),
    NoEffectFlag("--diffusion-compile-dynamic", _NO_COMPILE_MODES, False, negatable=True),
    NoEffectFlag("--fa-deterministic", "use --batch-invariant for bit-identical results", False),
    NoEffectFlag("--fastvideo-vsa-topk", "no video sparse attention (image model)"),
    # memory and offload
    NoEffectFlag("--enable-cpu-offload", _NO_OFFLOAD, False),
    NoEffectFlag("--enable-layerwise-offload", _NO_OFFLOAD, False),
    NoEffectFlag("--diffusion-offload-config", _NO_OFFLOAD),
    NoEffectFlag("--enable-distributed-layerwise-offload", _NO_OFFLOAD, False),
    NoEffectFlag("--layerwise-num-gpu-layers", _NO_OFFLOAD),
    NoEffectFlag("--dlo-use-allgather", _NO_OFFLOAD, False),
    NoEffectFlag("--dlo-no-use-allgather", _NO_OFFLOAD, False),
    NoEffectFlag("--dlo-resident-layers", _NO_OFFLOAD),
    NoEffectFlag("--dlo-host-registration-limit-gib", _NO_OFFLOAD),
    NoEffectFlag("--host-weight-runtime-mode", _NO_OFFLOAD),
    NoEffectFlag("--host-weight-runtime-root", _NO_OFFLOAD),
    # weight loading
    NoEffectFlag("--disable-multithread-weight-load", _OWN_LOADER, False),
    NoEffectFlag("--num-weight-load-threads", _OWN_LOADER),
    NoEffectFlag(
        "--enable-broadcast-weight-load", "weights are replicated or tensor-parallel, not HSDP-sharded", False
    ),
    # model selection
    NoEffectFlag("--custom-pipeline-args", "the pipeline is Qwen-Image's own"),
    NoEffectFlag("--diffusers-load-kwargs", "components are loaded by this package's loader"),
    NoEffectFlag("--diffusers-call-kwargs", "requests carry their own sampling fields"),
    NoEffectFlag("--auxiliary-text-encoder", "Qwen-Image uses its checkpoint's own text encoder"),
    NoEffectFlag("--video-output-transport", "no video output (image model)"),
    NoEffectFlag("--no-guardrails", "Qwen-Image has no safety guardrails to turn off (no moderation)", False),
    # other model kinds vLLM-Omni serves
    NoEffectFlag("--tts-max-instructions-length", _NO_TTS),
    NoEffectFlag("--forced-aligner", _NO_TTS),
    NoEffectFlag("--forced-aligner-config", _NO_TTS),
    NoEffectFlag("--forced-aligner-device", _NO_TTS),
    NoEffectFlag("--robot-openpi-idle-timeout", "no realtime robot endpoint is served"),
    NoEffectFlag("--enable-ar-profiler", "no autoregressive stage (use /metrics and /v1/debug/steps)", False),
    # vLLM-Omni's one static LoRA for every request; here adapters are per request (docs/lora.md)
    NoEffectFlag("--lora-path", _PER_REQUEST_LORA, nargs="+"),
    NoEffectFlag("--lora-backend", _PER_REQUEST_LORA),
    NoEffectFlag("--lora-scale", _PER_REQUEST_LORA),
    # request defaults and profiling
    NoEffectFlag("--enable-diffusion-pipeline-profiler", "use /metrics and /v1/debug/steps", False),
    NoEffectFlag("--boundary-ratio", "Qwen-Image has one transformer (no high/low-noise split)"),
    # common vLLM server flags
    NoEffectFlag("--max-model-len", "prompt length is capped by max_sequence_length (<= 1024)"),
    NoEffectFlag("--tokenizer", "the tokenizer is the checkpoint's own"),
    NoEffectFlag("--revision", "MODEL is loaded at its default revision"),
    NoEffectFlag("--download-dir", "Hugging Face's cache directory is used"),
    NoEffectFlag("--disable-uvicorn-access-log", "the access log is off unless --log-level debug", False),
    NoEffectFlag("--disable-fastapi-docs", "the OpenAPI docs stay at /docs", False),
    NoEffectFlag("--max-log-len", "prompts are not logged (one line per request: size, steps, CFG, user)"),
    NoEffectFlag(
        "--disable-frontend-multiprocessing", "the HTTP server and the engine share one process", False
    ),
    NoEffectFlag(
        "--api-server-count",
        "one API server process serves the engine (more would each load the model)",
        only_value="1",
    ),
    NoEffectFlag("--enable-ssl-refresh", "the TLS key and certificate are read once, at start-up", False),
)


def add_no_effect_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every `NO_EFFECT_FLAGS` entry to `parser` (default None = not given)."""
    group = parser.add_argument_group(
        "compatibility",
        "vLLM / vLLM-Omni flags accepted with no effect here (each logs one warning line when given).",
    )
    group.one_line = True  # help.py: one line per flag, not argparse's wrapped paragraphs
    for spec in NO_EFFECT_FLAGS:
        names, help_text = (spec.flag, *spec.aliases), spec.reason
        if spec.negatable:
            action = argparse.BooleanOptionalAction
            group.add_argument(*names, dest=spec.dest, action=action, default=None, help=help_text)
        elif spec.takes_value:
            group.add_argument(*names, dest=spec.dest, default=None, nargs=spec.nargs, help=help_text)
        else:
            group.add_argument(*names, dest=spec.dest, action="store_true", default=None, help=help_text)


def warn_no_effect_flags(args: argparse.Namespace) -> list[str]:
    """Log one warning line per given no-effect flag; return the flags warned about."""
    given = []
    for spec in NO_EFFECT_FLAGS:
        if getattr(args, spec.dest, None) is not None:
            logger.warning("%s has no effect here: %s", spec.flag, spec.reason)
            given.append(spec.flag)
    return given


def refused_values(args: argparse.Namespace) -> list[str]:
    """One message per no-effect flag given a value other than the one it accepts (`only_value`)."""
    errors = []
    for spec in NO_EFFECT_FLAGS:
        value = getattr(args, spec.dest, None)
        if spec.only_value is not None and value is not None and value != spec.only_value:
            spelled = " / ".join((spec.flag, *spec.aliases))
            errors.append(f"{spelled} {value} is not supported: {spec.reason} (only {spec.only_value})")
    return errors


def markdown_table() -> str:
    """The table of docs/serving.md that lists these flags (tests/test_flags.py checks it is there)."""
    rows = ["| flag | why it has no effect here |", "|---|---|"]
    for spec in NO_EFFECT_FLAGS:
        spelled = " / ".join(f"`{name}{' X' if spec.takes_value and not spec.negatable else ''}`"
                             for name in spec.spellings)  # fmt: skip
        only = f" (only `{spec.only_value}`; other values exit 2)" if spec.only_value is not None else ""
        rows.append(f"| {spelled} | {spec.reason}{only} |")
    return "\n".join(rows)


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


if __name__ == "__main__":  # regenerate docs/serving.md's no-effect table
    print(markdown_table())

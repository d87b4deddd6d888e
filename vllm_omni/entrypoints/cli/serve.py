"""`vllm serve MODEL --omni` / `vllm-omni serve MODEL`: startup checks, config, the server's start.

The CLI sits on top of the server: it parses flags (their definitions: `serve_args.py`), builds the engine's
`OmniDiffusionConfig` and the HTTP layer's `ServerArgs`, and calls
`run_server(config, server_args)`. Order at startup: parse flags -> refuse
unsupported cache/quantization flags (exit 2) -> warn once per accepted flag that
has no effect here -> build and validate both configs (exit 2) -> bind the port ->
load the model -> serve. Everything that can be refused is refused before the
(slow) model load.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from vllm_omni.config import (
    TINY_MODEL_NAME,
    OmniDiffusionConfig,
    ParallelConfig,
)
from vllm_omni.diffusion.layers.quant_config import QuantizationConfig
from vllm_omni.diffusion.models.registry import supported_pipelines
from vllm_omni.entrypoints.cli.cache_args import cache_kwargs_from_args
from vllm_omni.entrypoints.cli.compat_flags import (
    refused_values,
    warn_flags_without_their_mode,
    warn_no_effect_flags,
)
from vllm_omni.entrypoints.cli.engine_args import memory_and_log_config_kwargs
from vllm_omni.entrypoints.cli.lora_args import lora_config_from_args
from vllm_omni.entrypoints.cli.prompt_cache_args import prompt_cache_kwargs
from vllm_omni.entrypoints.cli.replica_args import replica_options_from_args
from vllm_omni.entrypoints.cli.serve_args import SSL_CERT_REQS, VLLM_DTYPE_ALIASES, VLLM_POLICY_NAMES
from vllm_omni.entrypoints.openai.api_server import CORSConfig, ServerArgs
from vllm_omni.entrypoints.openai.http_limits import HTTPLimits, TLSConfig
from vllm_omni.entrypoints.openai.request_normalize import parse_default_sampling_params

logger = logging.getLogger(__name__)

EXIT_USAGE = 2
VLLM_OMNI_LOAD_FORMATS = {"default": "auto", "diffusers": "auto", "auto": "auto", "dummy": "dummy"}
"""vLLM-Omni's `--diffusion-load-format` values -> our `load_format` (custom_pipeline is refused)."""


def batching_policy_errors(args: argparse.Namespace) -> list[str]:
    """vLLM-Omni's batching-policy flags: its default ('profile') maps onto --scheduling-policy; its
    compute-budget policy and config are refused with what does the same here."""
    policy = getattr(args, "diffusion_batching_policy", None)
    errors = []
    if policy not in (None, "profile"):
        errors.append(
            f"--diffusion-batching-policy {policy} is not supported: use --scheduling-policy latency (the "
            "default: each step sized from a measured step cost model, packing only while it is nearly "
            "free) or --scheduling-policy fifo --max-num-batched-tokens N (a fixed per-step token budget, "
            "image + text tokens, CFG counting twice)"
        )
    if getattr(args, "diffusion_batching_config", None) is not None:
        errors.append(
            "--diffusion-batching-config is not supported: use --max-num-batched-tokens N "
            "(compute_unit_budget), --scheduling-policy and --packing-max-marginal-cost / "
            "--packing-max-step-slowdown (docs/design/scheduling.md)"
        )
    return errors


def unsupported_flag_errors(args: argparse.Namespace) -> list[str]:
    """One message per flag the engine cannot honour yet (empty when all are at their defaults)."""
    errors = []
    errors += batching_policy_errors(args)
    if getattr(args, "diffusion_load_format", None) == "custom_pipeline":
        errors.append(
            "--diffusion-load-format custom_pipeline is not supported: the pipeline is Qwen-Image's own"
        )
    if args.model is None:
        for flag in ("served_model_name", "lora_path"):
            values = getattr(args, flag, None)
            if isinstance(values, list) and len(values) > 1:
                # argparse gave MODEL to the flag (it takes one or more values): serving the tiny
                # random model under the names given would look like the model asked for
                errors.append(
                    f"MODEL is missing, and --{flag.replace('_', '-')} took {values}: give MODEL first "
                    f"(vllm serve MODEL --{flag.replace('_', '-')} ...), or name {TINY_MODEL_NAME!r} for the "
                    "embedded tiny model"
                )
    errors += refused_values(args)
    class_name = getattr(args, "model_class_name", None)
    if class_name is not None and class_name not in supported_pipelines():
        errors.append(
            f"--model-class-name {class_name} is not supported: this server runs {supported_pipelines()}"
        )
    return errors


def _load_format(args: argparse.Namespace) -> str:
    if args.diffusion_load_format is None:
        return args.load_format
    load_format = VLLM_OMNI_LOAD_FORMATS[args.diffusion_load_format]
    if args.load_format != "auto" and args.load_format != load_format:
        raise ValueError(
            f"--load-format {args.load_format} and --diffusion-load-format "
            f"{args.diffusion_load_format} disagree; give one"
        )
    return load_format


def attention_backend_from_args(args: argparse.Namespace) -> str | None:
    """The backend of `--diffusion-attention-backend`, or of vLLM-Omni's `--diffusion-attention-config`
    / `-dac` (JSON `{"default": {"backend": NAME}}`) or its dotted `.default.backend` form; ValueError
    naming the flag when they disagree or the config asks for what is not served (per-role backends)."""
    given = {}
    if args.diffusion_attention_backend is not None:
        given["--diffusion-attention-backend"] = args.diffusion_attention_backend
    if args.diffusion_attention_config_default_backend is not None:
        given["--diffusion-attention-config.default.backend"] = (
            args.diffusion_attention_config_default_backend
        )
    if args.diffusion_attention_config is not None:
        given["--diffusion-attention-config"] = _dac_backend(args.diffusion_attention_config)
    if len({v.upper() for v in given.values()}) > 1:
        raise ValueError(f"attention backends disagree: {given}; give one")
    return next(iter(given.values()), None)


def _dac_backend(raw: str) -> str:
    try:
        config = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--diffusion-attention-config must be JSON: {exc}") from None
    default = config.get("default") if isinstance(config, dict) else None
    if not isinstance(default, dict) or set(config) != {"default"} or set(default) != {"backend"}:
        raise ValueError(
            '--diffusion-attention-config: only \'{"default": {"backend": NAME}}\' is served here (one '
            "backend for every attention call; per-role backends and sparsity options are not), "
            f"got {raw!r:.200}"
        )
    if not isinstance(default["backend"], str):
        raise ValueError("--diffusion-attention-config: default.backend must be a backend name")
    return default["backend"]


def _parallel_config(args: argparse.Namespace) -> ParallelConfig:
    parallel_config = ParallelConfig(
        tensor_parallel_size=args.tensor_parallel_size,
        ulysses_degree=args.ulysses_degree,
        ring_degree=args.ring_degree,
        cfg_parallel_size=args.cfg_parallel_size,
    )
    if args.num_gpus is not None and args.num_gpus != parallel_config.world_size:
        raise ValueError(
            f"--num-gpus {args.num_gpus} disagrees with the parallel degrees (tensor x ulysses x ring x cfg "
            f"= {parallel_config.world_size} devices); set the degrees so their product is {args.num_gpus}"
        )
    return parallel_config


def effective_max_num_seqs(args: argparse.Namespace) -> int:
    """Requests the engine runs at once: --max-num-seqs with --step-execution (default 8), else 1
    (request mode runs one request at a time, as the engine config clamps it)."""
    if not args.step_execution:
        return 1
    return 8 if args.max_num_seqs is None else args.max_num_seqs


def quantization_config_from_args(args: argparse.Namespace) -> QuantizationConfig:
    """`--quantization` and `--diffusion-quantization-config` as one config; ValueError naming the flag."""
    flat = QuantizationConfig.from_value(args.quantization, "--quantization")
    return flat.merged(
        QuantizationConfig.from_value(args.diffusion_quantization_config, "--diffusion-quantization-config")
    )


def engine_config_from_args(args: argparse.Namespace) -> OmniDiffusionConfig:
    """Build the engine config from `serve` flags; ValueError names the bad flag."""
    # a given value reaches the config as is: it refuses one below 1 and clamps request mode to 1
    max_num_seqs = effective_max_num_seqs(args) if args.max_num_seqs is None else args.max_num_seqs
    if not args.step_execution and args.max_num_seqs is not None and args.max_num_seqs > 1:
        logger.warning(
            "request mode (no --step-execution): --max-num-seqs %d is clamped to 1; "
            "add --step-execution for continuous batching",
            args.max_num_seqs,
        )
    kwargs = dict(
        model=args.model or TINY_MODEL_NAME,
        dtype=VLLM_DTYPE_ALIASES.get(args.dtype, args.dtype),
        device=args.device,
        load_format=_load_format(args),
        step_execution=args.step_execution,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        scheduling_policy=VLLM_POLICY_NAMES.get(args.scheduling_policy, args.scheduling_policy),
        max_num_resident_reqs=args.max_num_resident_reqs,
        scheduling_aging_factor=args.scheduling_aging_factor,
        scheduling_deadline_factor=args.scheduling_deadline_factor,
        packing_max_marginal_cost=args.packing_max_marginal_cost,
        packing_max_step_slowdown=args.packing_max_step_slowdown,
        enable_mixfusion=args.enable_mixfusion,
        mixfusion_min_chunk_tokens=args.mixfusion_min_chunk_tokens,
        mixfusion_max_chunks=args.mixfusion_max_chunks,
        attention_backend=attention_backend_from_args(args),
        max_generated_image_size=args.max_generated_image_size,
        max_decode_pixels=args.max_decode_pixels,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        max_queue_size=args.max_queue_size,
        enforce_eager=args.enforce_eager,
        seed=args.seed,
        default_sampling_params=parse_default_sampling_params(args.default_sampling_params),
        flow_shift=args.flow_shift,
        vae_use_slicing=args.vae_use_slicing,
        vae_use_tiling=args.vae_use_tiling,
        init_timeout_s=args.init_timeout,
        log_stats=args.log_stats is not False,
        parallel_config=_parallel_config(args),
        lora=lora_config_from_args(args),
        quantization=quantization_config_from_args(args),
        **memory_and_log_config_kwargs(args),
        **prompt_cache_kwargs(args),
        **cache_kwargs_from_args(args),
    )
    if args.batch_invariant:
        kwargs["batch_invariant"] = True
    return OmniDiffusionConfig.from_env_defaults(**kwargs)


def _json_string_list(value, flag: str, default: list[str]) -> list[str]:
    """A flag's parsed JSON value as a list of strings (`default` when the flag is absent)."""
    if value is None:
        return list(default)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{flag} must be a JSON list of strings, got {value!r}")
    return value


def server_args_from_args(args: argparse.Namespace) -> ServerArgs:
    """Build the HTTP layer's arguments from `serve` flags; ValueError names the bad flag."""
    names = args.served_model_name or []
    origins = _json_string_list(args.allowed_origins, "--allowed-origins", [])
    cors = CORSConfig(
        methods=_json_string_list(args.allowed_methods, "--allowed-methods", ["*"]),
        headers=_json_string_list(args.allowed_headers, "--allowed-headers", ["*"]),
        allow_credentials=args.allow_credentials,
    )
    return ServerArgs(
        model=args.model or TINY_MODEL_NAME,
        served_model_names=[names] if isinstance(names, str) else list(names),
        host=args.host or "0.0.0.0",
        port=args.port,
        api_key=args.api_key or None,
        max_request_body_bytes=args.max_request_body_bytes,
        log_level=args.uvicorn_log_level or args.log_level,
        allowed_origins=origins,
        cors=cors,
        log_requests=args.log_requests is not False,
        http_limits=http_limits_from_args(args),
        root_path=args.root_path,
        tls=tls_from_args(args),
    )


def tls_from_args(args: argparse.Namespace) -> TLSConfig | None:
    """uvicorn's TLS settings from vLLM's `--ssl-*` flags (None: plain HTTP); ValueError names the flag."""
    if args.ssl_keyfile is None and args.ssl_certfile is None:
        for flag in ("ssl_ca_certs",):
            if getattr(args, flag) is not None:
                raise ValueError("--ssl-ca-certs needs --ssl-keyfile and --ssl-certfile")
        return None
    return TLSConfig(
        keyfile=args.ssl_keyfile,
        certfile=args.ssl_certfile,
        ca_certs=args.ssl_ca_certs,
        cert_reqs=SSL_CERT_REQS[args.ssl_cert_reqs],
    )


def _default_connection_cap(args: argparse.Namespace) -> int:
    """Every queued and running request holds a connection; 64 more for health checks and scrapes."""
    return args.max_queue_size + effective_max_num_seqs(args) + 64


def http_limits_from_args(args: argparse.Namespace) -> HTTPLimits:
    """`HTTPLimits` from the `serve` flags; ValueError names the bad flag."""
    cap = args.limit_concurrency if args.limit_concurrency is not None else _default_connection_cap(args)
    return HTTPLimits(
        header_read_timeout_s=args.header_read_timeout,
        body_read_timeout_s=args.body_read_timeout,
        timeout_keep_alive_s=args.timeout_keep_alive,
        limit_concurrency=cap,
        shutdown_drain_timeout_s=args.shutdown_drain_timeout,
    )


FIELD_FLAGS = {
    "max_num_seqs": "--max-num-seqs",
    "max_num_resident_reqs": "--max-num-resident-reqs",
    "scheduling_aging_factor": "--scheduling-aging-factor",
    "scheduling_deadline_factor": "--scheduling-deadline-factor",
    "packing_max_marginal_cost": "--packing-max-marginal-cost",
    "packing_max_step_slowdown": "--packing-max-step-slowdown",
    "max_num_batched_tokens": "--max-num-batched-tokens",
    "max_queue_size": "--max-queue-size",
    "max_generated_image_size": "--max-generated-image-size",
    "max_decode_pixels": "--max-decode-pixels",
    "kv_cache_memory_bytes": "--kv-cache-memory-bytes",
    "mixfusion_min_chunk_tokens": "--mixfusion-min-chunk-tokens",
    "mixfusion_max_chunks": "--mixfusion-max-chunks",
    "init_timeout_s": "--init-timeout",
    "flow_shift": "--flow-shift",
    "seed": "--seed",
    "tensor_parallel_size": "--tensor-parallel-size",
    "ulysses_degree": "--ulysses-degree (--usp)",
    "ring_degree": "--ring-degree (--ring)",
    "cfg_parallel_size": "--cfg-parallel-size",
    "scheduling_policy": "--scheduling-policy",
    "dtype": "--dtype",
    "cache_backend": "--cache-backend",
    "cache_config": "--cache-config",
}
"""Engine config fields -> the `serve` flag that sets them, for the config's own error messages."""


def as_flag_message(message: str) -> str:
    """A config error that starts with a field name, restated with the flag a user typed."""
    field_name, sep, rest = message.partition(" ")
    return f"{FIELD_FLAGS[field_name]}{sep}{rest}" if field_name in FIELD_FLAGS else message


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(args: argparse.Namespace) -> None:
    """The log on stderr at `--log-level`, and also in `--log-file` when given (appended)."""
    handlers: list[logging.Handler] = [logging.StreamHandler()]
    if getattr(args, "log_file", None):
        handlers.append(logging.FileHandler(args.log_file, encoding="utf-8"))
    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT, handlers=handlers, force=True)


def cmd_serve(args: argparse.Namespace) -> int:
    """Run the server; return the process exit code."""
    configure_logging(args)
    errors = unsupported_flag_errors(args)
    if errors:
        for message in errors:
            print(f"error: {message}", file=sys.stderr)
        return EXIT_USAGE
    warn_no_effect_flags(args)
    warn_flags_without_their_mode(args)
    try:
        config = engine_config_from_args(args)
        server_args = server_args_from_args(args)
        replicas = replica_options_from_args(args)
    except ValueError as exc:
        print(f"error: {as_flag_message(str(exc))}", file=sys.stderr)
        return EXIT_USAGE
    from vllm_omni.entrypoints.cli.startup_checks import startup_errors

    errors = startup_errors(config)
    if errors:
        for message in errors:
            print(f"error: {message}", file=sys.stderr)
        return EXIT_USAGE
    from vllm_omni.diffusion.model_loader import ModelNotFoundError
    from vllm_omni.entrypoints.openai import api_server
    from vllm_omni.entrypoints.openai.errors import BindError

    try:
        if replicas is not None:  # N engine replicas on Ray Serve (docs/scaling.md)
            from vllm_omni.entrypoints.replicas.server import run_replicated_server

            run_replicated_server(config, server_args, replicas)
        else:
            api_server.run_server(config, server_args)
    except (BindError, ModelNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:  # a configuration the model refuses once loaded (e.g. heads vs -tp)
        logger.debug("start-up failed", exc_info=True)
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0

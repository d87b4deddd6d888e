"""`vllm serve MODEL --omni` / `vllm-omni serve MODEL`: flags, startup checks, config.

Order at startup: parse flags -> refuse unsupported parallel/cache/quantization
flags (exit 2) -> build and validate `OmniDiffusionConfig` (exit 2) -> bind the
port -> load the model -> serve. Everything that can be refused is refused
before the (slow) model load.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from vllm_omni.config import DEFAULT_MAX_GENERATED_IMAGE_SIZE, TINY_MODEL_NAME, OmniDiffusionConfig
from vllm_omni.diffusion.distributed.parallel_config import ParallelConfig
from vllm_omni.entrypoints.openai.api_server import DEFAULT_MAX_REQUEST_BODY_BYTES, http_limits_from_namespace
from vllm_omni.entrypoints.openai.http_limits import HTTPLimits
from vllm_omni.entrypoints.openai.request_normalize import parse_default_sampling_params

logger = logging.getLogger(__name__)

EXIT_USAGE = 2
DTYPES = ("auto", "bfloat16", "bf16", "float16", "fp16", "float32", "fp32")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every `serve` flag to `parser`."""
    parser.add_argument(
        "model",
        nargs="?",
        default=TINY_MODEL_NAME,
        help="Local diffusers-format directory, Hugging Face repo id, or the embedded tiny random model "
        f"'{TINY_MODEL_NAME}' (default).",
    )
    parser.add_argument(
        "--omni", action="store_true", default=argparse.SUPPRESS, help="Serve a diffusion model."
    )
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="0.0.0.0", help="Interface to bind (default 0.0.0.0, all).")
    server.add_argument("--port", type=int, default=8000, help="Port to bind (default 8000).")
    server.add_argument(
        "--api-key",
        default=os.environ.get("VLLM_API_KEY"),
        help="Require 'Authorization: Bearer KEY' on /v1/* (default: env VLLM_API_KEY, else no key).",
    )
    server.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="Name(s) clients use as 'model'; the first is reported (default: MODEL).",
    )
    server.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
        help="Larger request bodies get HTTP 413 (default 1 MiB).",
    )
    server.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="Log level (default info).")
    _add_limit_arguments(server)

    model = parser.add_argument_group("model")
    model.add_argument(
        "--dtype", choices=DTYPES, default="auto", help="Weights dtype; auto = bf16 on CUDA, fp32 on CPU."
    )
    model.add_argument(
        "--device", default="auto", help="'auto' (cuda if available), 'cpu', 'cuda' or 'cuda:N'."
    )
    model.add_argument(
        "--load-format",
        choices=("auto", "dummy"),
        default="auto",
        help="'auto' loads weights; 'dummy' builds the real-size architecture with random weights.",
    )
    model.add_argument(
        "--diffusion-attention-backend",
        default=None,
        help="Attention backend, e.g. SDPA or FLASH_ATTN "
        "(default: env DIFFUSION_ATTENTION_BACKEND, else auto).",
    )
    model.add_argument(
        "--seed", type=int, default=None, help="Seed for random weights and assigned request seeds."
    )
    model.add_argument(
        "--enforce-eager",
        action="store_true",
        help="Run plain eager PyTorch. By default on CUDA the transformer blocks' elementwise chains "
        "run as torch.compile'd fused kernels (no CUDA graphs); CPU is always eager.",
    )

    engine = parser.add_argument_group("engine")
    engine.add_argument(
        "--step-execution",
        action="store_true",
        help="Step mode: continuous batching between denoise steps. Without it, requests run one at a time "
        "(request mode, --max-num-seqs is clamped to 1), as in vLLM-Omni.",
    )
    engine.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help="Most requests denoising together (default 8 with --step-execution, else 1).",
    )
    engine.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="Most tokens (image + text, CFG counts twice) in one step (default: no cap).",
    )
    engine.add_argument(
        "--scheduling-policy",
        choices=("fifo", "skip-ahead"),
        default="fifo",
        help="fifo: strict arrival order; skip-ahead: later requests may pass a head that does not fit.",
    )
    engine.add_argument(
        "--enable-mixfusion",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Heterogeneous batching (mixed resolutions in one step). "
        "Default: on when the model supports it.",
    )
    engine.add_argument(
        "--mixfusion-min-chunk-tokens",
        type=int,
        default=256,
        help="Do not form a mixed batch whose image token counts have a gcd below this (default 256).",
    )
    engine.add_argument(
        "--mixfusion-max-chunks",
        type=int,
        default=128,
        help="Do not form a mixed batch whose total image tokens / gcd exceeds this (default 128).",
    )
    engine.add_argument(
        "--max-generated-image-size",
        type=int,
        default=DEFAULT_MAX_GENERATED_IMAGE_SIZE,
        help="Largest height*width in pixels a request may ask for "
        f"(default {DEFAULT_MAX_GENERATED_IMAGE_SIZE}).",
    )
    engine.add_argument(
        "--default-sampling-params",
        default=None,
        help='JSON object of sampling-param defaults, e.g. \'{"num_inference_steps": 30, "height": 512, '
        "\"width\": 512}'; vLLM-Omni's stage-keyed form '{\"0\": {...}}' is accepted too.",
    )
    engine.add_argument(
        "--max-queue-size",
        type=int,
        default=1024,
        help="Waiting requests beyond this get HTTP 503 with Retry-After (default 1024).",
    )
    engine.add_argument(
        "--batch-invariant",
        action="store_true",
        help="Bit-identical results whatever else is in the batch (also env VLLM_BATCH_INVARIANT=1).",
    )
    _add_unsupported_arguments(parser)


def _add_limit_arguments(server: argparse._ArgumentGroup) -> None:
    limits = HTTPLimits()
    server.add_argument(
        "--header-read-timeout",
        type=float,
        default=limits.header_read_timeout_s,
        help="Close a connection whose request headers take longer, in seconds "
        f"(default {limits.header_read_timeout_s:g}).",
    )
    server.add_argument(
        "--body-read-timeout",
        type=float,
        default=limits.body_read_timeout_s,
        help=f"Answer 408 to a body that takes longer, in seconds (default {limits.body_read_timeout_s:g}).",
    )
    server.add_argument(
        "--timeout-keep-alive",
        type=float,
        default=limits.timeout_keep_alive_s,
        help="Close idle keep-alive connections after this many seconds "
        f"(default {limits.timeout_keep_alive_s:g}).",
    )
    server.add_argument(
        "--limit-concurrency",
        type=int,
        default=None,
        help="Most open connections; more get a JSON 503 (default --max-queue-size + --max-num-seqs + 64).",
    )
    server.add_argument(
        "--shutdown-drain-timeout",
        type=float,
        default=limits.shutdown_drain_timeout_s,
        help="On SIGTERM/SIGINT, let accepted requests finish for this many seconds, then answer the rest "
        f"503 request_aborted (default {limits.shutdown_drain_timeout_s:g}).",
    )


def _add_unsupported_arguments(parser: argparse.ArgumentParser) -> None:
    parallel = parser.add_argument_group(
        "parallelism (one process per device; world size = product of the degrees)"
    )
    parallel.add_argument(
        "--usp", "--ulysses-degree", dest="ulysses_degree", type=int, default=1,
        help="Ulysses sequence parallel degree (all-to-all over heads).",
    )  # fmt: skip
    parallel.add_argument(
        "--ring", "--ring-degree", dest="ring_degree", type=int, default=1,
        help="Ring sequence parallel degree (K/V passed around a ring, exact online softmax).",
    )  # fmt: skip
    parallel.add_argument(
        "--cfg-parallel-size",
        type=int,
        default=1,
        help="2: positive and negative CFG sequences on different ranks.",
    )
    parallel.add_argument(
        "--tensor-parallel-size", "-tp", type=int, default=1, help="Tensor parallel degree (heads and MLP)."
    )
    group = parser.add_argument_group(
        "not supported yet (accepted, refused at startup unless at their default)"
    )
    group.add_argument("--cache-backend", default="none", help="Must be 'none'.")
    group.add_argument("--diffusion-quantization-config", default=None, help="Must be unset.")


def unsupported_flag_errors(args: argparse.Namespace) -> list[str]:
    """One message per flag the engine cannot honour yet (empty when all are at their defaults)."""
    errors = []
    cache_backend = getattr(args, "cache_backend", "none")
    if cache_backend not in (None, "none", "None"):
        errors.append(
            f"--cache-backend {cache_backend} is not supported yet: "
            "only 'none' (no step caching) is supported"
        )
    if getattr(args, "diffusion_quantization_config", None):
        errors.append(
            "--diffusion-quantization-config is not supported yet: weights run in --dtype "
            "(bfloat16, float16 or float32)"
        )
    return errors


def engine_config_from_args(args: argparse.Namespace) -> OmniDiffusionConfig:
    """Build the engine config from `serve` flags; ValueError names the bad flag."""
    max_num_seqs = args.max_num_seqs
    if max_num_seqs is None:
        max_num_seqs = 8 if args.step_execution else 1
    elif not args.step_execution and max_num_seqs != 1:
        logger.warning(
            "request mode (no --step-execution): --max-num-seqs %d is clamped to 1; "
            "add --step-execution for continuous batching",
            max_num_seqs,
        )
    kwargs = dict(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        load_format=args.load_format,
        step_execution=args.step_execution,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        scheduling_policy=args.scheduling_policy,
        enable_mixfusion=args.enable_mixfusion,
        mixfusion_min_chunk_tokens=args.mixfusion_min_chunk_tokens,
        mixfusion_max_chunks=args.mixfusion_max_chunks,
        attention_backend=args.diffusion_attention_backend,
        max_generated_image_size=args.max_generated_image_size,
        max_queue_size=args.max_queue_size,
        enforce_eager=args.enforce_eager,
        seed=args.seed,
        default_sampling_params=parse_default_sampling_params(args.default_sampling_params),
    )
    if args.batch_invariant:
        kwargs["batch_invariant"] = True
    kwargs["parallel_config"] = ParallelConfig(
        tensor_parallel_size=args.tensor_parallel_size,
        ulysses_degree=args.ulysses_degree,
        ring_degree=args.ring_degree,
        cfg_parallel_size=args.cfg_parallel_size,
    )
    if args.max_request_body_bytes < 1024:
        raise ValueError(f"--max-request-body-bytes must be >= 1024, got {args.max_request_body_bytes}")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    return OmniDiffusionConfig.from_env_defaults(**kwargs)


def cmd_serve(args: argparse.Namespace) -> int:
    """Run the server; return the process exit code."""
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True
    )
    errors = unsupported_flag_errors(args)
    if errors:
        for message in errors:
            print(f"error: {message}", file=sys.stderr)
        return EXIT_USAGE
    try:
        config = engine_config_from_args(args)
        http_limits_from_namespace(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    from vllm_omni.entrypoints.cli.startup_checks import startup_errors

    errors = startup_errors(config)
    if errors:
        for message in errors:
            print(f"error: {message}", file=sys.stderr)
        return EXIT_USAGE
    from vllm_omni.diffusion.model_loader import ModelNotFoundError
    from vllm_omni.entrypoints.openai.api_server import BindError, run_server

    try:
        run_server(args, config)
    except (BindError, ModelNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0

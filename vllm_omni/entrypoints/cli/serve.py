"""`vllm serve MODEL --omni` / `vllm-omni serve MODEL`: flags, startup checks, config.

The CLI sits on top of the server: it parses flags, builds the engine's
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
import os
import sys

from vllm_omni.config import (
    DEFAULT_MAX_GENERATED_IMAGE_SIZE,
    DTYPES,
    LOAD_FORMATS,
    SCHEDULING_POLICIES,
    TINY_MODEL_NAME,
    OmniDiffusionConfig,
    ParallelConfig,
)
from vllm_omni.diffusion.layers.quant_config import QuantizationConfig
from vllm_omni.diffusion.models.registry import supported_pipelines
from vllm_omni.entrypoints.cli.compat_flags import (
    add_no_effect_arguments,
    refused_values,
    warn_flags_without_their_mode,
    warn_no_effect_flags,
)
from vllm_omni.entrypoints.cli.lora_args import add_lora_arguments, lora_config_from_args
from vllm_omni.entrypoints.openai.api_server import DEFAULT_MAX_REQUEST_BODY_BYTES, CORSConfig, ServerArgs
from vllm_omni.entrypoints.openai.http_limits import HTTPLimits, TLSConfig
from vllm_omni.entrypoints.openai.request_normalize import parse_default_sampling_params

logger = logging.getLogger(__name__)

EXIT_USAGE = 2
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
UVICORN_LOG_LEVELS = (*LOG_LEVELS, "trace")
VLLM_OMNI_LOAD_FORMATS = {"default": "auto", "diffusers": "auto", "auto": "auto", "dummy": "dummy"}
"""vLLM-Omni's `--diffusion-load-format` values -> our `load_format` (custom_pipeline is refused)."""
VLLM_DTYPE_ALIASES = {"half": "float16", "float": "float32"}
"""vLLM's `--dtype` spellings -> ours."""
SSL_CERT_REQS = {"0": 0, "1": 1, "2": 2}
"""`--ssl-cert-reqs`: Python's ssl.CERT_NONE / CERT_OPTIONAL / CERT_REQUIRED, as vLLM takes it."""


def optional_float(text: str) -> float | None:
    """A float flag that 'off' (or 'none') turns off."""
    if text.strip().lower() in ("off", "none"):
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'off', got {text!r}") from None


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every `serve` flag to `parser`."""
    parser.add_argument(
        "model",
        nargs="?",
        default=None,
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
    server.add_argument(
        "--uvicorn-log-level",
        choices=UVICORN_LOG_LEVELS,
        default=None,
        help="uvicorn's log level (default: --log-level); debug/trace also turn on the access log.",
    )
    server.add_argument(
        "--allowed-origins",
        type=json.loads,
        default=None,
        help="CORS origins as a JSON list, e.g. '[\"*\"]' (default: no CORS headers).",
    )
    server.add_argument(
        "--allowed-methods",
        type=json.loads,
        default=None,
        help="CORS methods for --allowed-origins as a JSON list (default '[\"*\"]', as vLLM).",
    )
    server.add_argument(
        "--allowed-headers",
        type=json.loads,
        default=None,
        help="CORS request headers for --allowed-origins as a JSON list (default '[\"*\"]', as vLLM: "
        "Authorization and Content-Type included).",
    )
    server.add_argument(
        "--allow-credentials",
        action="store_true",
        help="CORS: allow credentials (cookies, HTTP auth) for --allowed-origins (default off, as vLLM).",
    )
    requests = server.add_mutually_exclusive_group()
    requests.add_argument(
        "--enable-log-requests",
        dest="log_requests",
        action="store_true",
        default=None,
        help="Log one line per request (the default).",
    )
    requests.add_argument(
        "--disable-log-requests", dest="log_requests", action="store_false", help="Do not log requests."
    )
    stats = server.add_mutually_exclusive_group()
    stats.add_argument(
        "--log-stats",
        dest="log_stats",
        action="store_true",
        default=None,
        help="Log each step's batch composition and time (the default).",
    )
    stats.add_argument(
        "--disable-log-stats", dest="log_stats", action="store_false", help="Do not log per-step stats."
    )
    _add_limit_arguments(server)
    _add_deployment_arguments(server)

    model = parser.add_argument_group("model")
    model.add_argument(
        "--dtype",
        choices=(*DTYPES, *VLLM_DTYPE_ALIASES),
        default="auto",
        help="Weights dtype; auto = bf16 on CUDA, fp32 on CPU; vLLM's half = float16, float = float32.",
    )
    model.add_argument(
        "--device", default="auto", help="'auto' (cuda if available), 'cpu', 'cuda' or 'cuda:N'."
    )
    model.add_argument(
        "--quantization",
        "-q",
        default=None,
        help="Quantize the transformer's linears: 'fp8' (W8A8 e4m3, at load; docs/quantization.md).",
    )
    model.add_argument(
        "--diffusion-quantization-config",
        default=None,
        help='vLLM-Omni\'s form: \'{"method": "fp8", "ignored_layers": [...]}\' or '
        '\'{"transformer": {"method": "fp8", ...}}\' (ignored_layers replaces the default kept set).',
    )
    model.add_argument(
        "--load-format",
        choices=LOAD_FORMATS,
        default="auto",
        help="'auto' loads weights; 'dummy' builds the real-size architecture with random weights.",
    )
    model.add_argument(
        "--diffusion-load-format",
        choices=("default", "diffusers", "dummy", "custom_pipeline"),
        default=None,
        help="vLLM-Omni's spelling: default/diffusers = --load-format auto, dummy = --load-format dummy; "
        "custom_pipeline is refused (the pipeline is Qwen-Image's own).",
    )
    model.add_argument(
        "--model-class-name",
        default=None,
        help="Pipeline class (model_index.json's _class_name): QwenImagePipeline or QwenImageEditPipeline "
        "(anything else is refused).",
    )
    model.add_argument(
        "--flow-shift",
        type=float,
        default=None,
        help="Static sigma shift for every request without its own flow_shift: diffusers' "
        "FlowMatchEulerDiscreteScheduler with shift=FLOW_SHIFT, use_dynamic_shifting=False "
        "(default: Qwen-Image's resolution-dependent shift).",
    )
    model.add_argument(
        "--vae-use-slicing",
        action="store_true",
        help="Decode the n images of a request one at a time (diffusers' vae.enable_slicing(); same pixels).",
    )
    model.add_argument(
        "--vae-use-tiling",
        action="store_true",
        help="Decode in overlapping tiles (diffusers' vae.enable_tiling(); less memory for large images, "
        "pixels differ slightly near tile seams).",
    )
    model.add_argument(
        "--init-timeout",
        type=float,
        default=None,
        help="Seconds parallel worker processes get to load the model (default 1800).",
    )
    model.add_argument(
        "--diffusion-attention-config",
        "-dac",
        default=None,
        help='vLLM-Omni\'s attention config as JSON; only \'{"default": {"backend": NAME}}\' is served '
        "(= --diffusion-attention-backend NAME); per-role and other keys are refused.",
    )
    model.add_argument(
        "--diffusion-attention-config.default.backend",
        dest="diffusion_attention_config_default_backend",
        default=None,
        help="vLLM-Omni's dotted form of --diffusion-attention-config: the backend name.",
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
        help="Most requests in one denoise step (default 8 with --step-execution, else 1).",
    )
    engine.add_argument(
        "--max-num-resident-reqs",
        type=int,
        default=None,
        help="Latency policy: most requests started at once, running or sitting a step out "
        "(default 2 x --max-num-seqs).",
    )
    engine.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="Most tokens (image + text, CFG counts twice) in one step (default: no cap).",
    )
    engine.add_argument(
        "--scheduling-policy",
        choices=(*SCHEDULING_POLICIES, *VLLM_POLICY_NAMES),
        default=None,
        help="latency (default with --step-execution): shortest remaining work first with priority, "
        "within deadlines near request mode's latency, preemption between steps, packing only while "
        "nearly free; skip-ahead: every started request every step, later requests may pass a head "
        "that does not fit; fifo: strict arrival order (the request-mode default). vLLM's fcfs = fifo, "
        "priority = latency.",
    )
    engine.add_argument(
        "--diffusion-batching-policy",
        default=None,
        help="vLLM-Omni's batching policy: 'profile' (its default) is this server's --scheduling-policy; "
        "'compute_budget' is refused with what to use instead (see --scheduling-policy).",
    )
    engine.add_argument(
        "--diffusion-batching-config",
        default=None,
        help="vLLM-Omni's batching-policy JSON: refused, naming this server's flags for each of its keys.",
    )
    engine.add_argument(
        "--scheduling-aging-factor",
        type=optional_float,
        default=None,
        help="Latency policy: seconds of waiting that count as one second less remaining work "
        "(larger: lower mean latency, longer tail; default 'off': the deadline guard bounds the tail).",
    )
    engine.add_argument(
        "--scheduling-deadline-factor",
        type=optional_float,
        default=1.1,
        help="Latency policy tail guard: each request's deadline is this factor x the time request "
        "mode (one at a time, arrival order) would take to finish it; shortest-first gives way to "
        "deadline order where it would break one (>= 1; 'off': shortest-first, with aging if set).",
    )
    engine.add_argument(
        "--packing-max-marginal-cost",
        type=float,
        default=0.5,
        help="Latency policy: a request joins a step only if the step grows by at most this fraction of "
        "its own step time.",
    )
    engine.add_argument(
        "--packing-max-step-slowdown",
        type=float,
        default=2.0,
        help="Latency policy: ...and the step stays within this factor of its head request's own time.",
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
        default=None,
        help="Do not form a mixed batch whose image token counts have a gcd below this "
        "(default: no limit; MixFusion's chunked forward used 256).",
    )
    engine.add_argument(
        "--mixfusion-max-chunks",
        type=int,
        default=None,
        help="Do not form a mixed batch whose total image tokens / gcd exceeds this "
        "(default: no limit; MixFusion's chunked forward used 128).",
    )
    engine.add_argument(
        "--max-generated-image-size",
        type=int,
        default=DEFAULT_MAX_GENERATED_IMAGE_SIZE,
        help="Largest height*width in pixels a request may ask for "
        f"(default {DEFAULT_MAX_GENERATED_IMAGE_SIZE}).",
    )
    engine.add_argument(
        "--max-decode-pixels",
        type=int,
        default=OmniDiffusionConfig.max_decode_pixels,
        help="Most pixels one VAE decode call holds: n images decode in slices of whole images (same "
        f"pixels, bounded memory; default {OmniDiffusionConfig.max_decode_pixels}, one 2048x2048 image).",
    )
    engine.add_argument(
        "--kv-cache-memory-bytes",
        type=int,
        default=None,
        help="Bytes the prefix KV caches of admitted requests may hold together (Qwen-Image-2.1 keeps each "
        "request's prompt and reference-image K/V for its whole run). Default: no separate cap, they count "
        "in the memory budget (90%% of the memory free after loading). A request whose cache could never "
        "fit is refused (400); one that fits later waits for memory.",
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
    add_lora_arguments(parser)
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


def _add_deployment_arguments(server: argparse._ArgumentGroup) -> None:
    """vLLM's flags for running behind proxies and with TLS, and the log file."""
    server.add_argument(
        "--root-path",
        default="",
        help="Path prefix a reverse proxy serves this server under (FastAPI's root_path, as vLLM): "
        "the OpenAPI docs name it, and paths with or without it are served.",
    )
    server.add_argument("--ssl-keyfile", default=None, help="TLS private key file (uvicorn serves HTTPS).")
    server.add_argument("--ssl-certfile", default=None, help="TLS certificate file (with --ssl-keyfile).")
    server.add_argument("--ssl-ca-certs", default=None, help="CA certificates file to verify clients with.")
    server.add_argument(
        "--ssl-cert-reqs",
        choices=tuple(SSL_CERT_REQS),
        default="0",
        help="Client certificates: 0 none (default), 1 optional, 2 required (Python's ssl.CERT_*).",
    )
    server.add_argument(
        "--log-file", default=None, help="Also write the log to this file (appended), as vLLM-Omni."
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
    parallel.add_argument(
        "--num-gpus",
        type=int,
        default=None,
        help="Devices to use; must equal the product of the parallel degrees (default: that product).",
    )
    group = parser.add_argument_group(
        "not supported yet (accepted, refused at startup unless at their default)"
    )
    group.add_argument("--cache-backend", default="none", help="Must be 'none'.")
    add_no_effect_arguments(parser)


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
    cache_backend = getattr(args, "cache_backend", "none")
    if cache_backend not in (None, "none", "None"):
        errors.append(
            f"--cache-backend {cache_backend} is not supported yet: "
            "only 'none' (no step caching) is supported"
        )
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


VLLM_POLICY_NAMES = {"fcfs": "fifo", "priority": "latency"}
"""vLLM's `--scheduling-policy` values -> ours (vLLM's 'priority' orders by each request's priority,
which the latency policy honours)."""


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
        api_server.run_server(config, server_args)
    except (BindError, ModelNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:  # a configuration the model refuses once loaded (e.g. heads vs -tp)
        logger.debug("start-up failed", exc_info=True)
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0

"""The flags of `vllm serve MODEL --omni` / `vllm-omni serve MODEL`: the argparse groups, with each
flag's default and help. What the flags become (the engine's and the server's configs, the refusals
of unsupported values) is `serve.py`'s.
"""

from __future__ import annotations

import argparse
import json
import os

from vllm_omni.config import (
    DEFAULT_MAX_GENERATED_IMAGE_SIZE,
    DTYPES,
    LOAD_FORMATS,
    SCHEDULING_POLICIES,
    TINY_MODEL_NAME,
    OmniDiffusionConfig,
)
from vllm_omni.diffusion.models import registry
from vllm_omni.entrypoints.cli.cache_args import add_cache_arguments
from vllm_omni.entrypoints.cli.compat_flags import add_no_effect_arguments
from vllm_omni.entrypoints.cli.engine_args import add_memory_and_log_arguments
from vllm_omni.entrypoints.cli.help import serve_group
from vllm_omni.entrypoints.cli.lora_args import add_lora_arguments
from vllm_omni.entrypoints.cli.prompt_cache_args import add_prompt_cache_arguments
from vllm_omni.entrypoints.cli.replica_args import add_replica_arguments
from vllm_omni.entrypoints.openai.api_server import DEFAULT_MAX_REQUEST_BODY_BYTES
from vllm_omni.entrypoints.openai.http_limits import HTTPLimits

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
UVICORN_LOG_LEVELS = (*LOG_LEVELS, "trace")
VLLM_DTYPE_ALIASES = {"half": "float16", "float": "float32"}
"""vLLM's `--dtype` spellings -> ours."""
VLLM_POLICY_NAMES = {"fcfs": "fifo", "priority": "latency"}
"""vLLM's `--scheduling-policy` values -> ours (vLLM's 'priority' orders by each request's priority,
which the latency policy honours)."""
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


MAIN_FLAGS = (
    "omni",
    "host",
    "port",
    "api_key",
    "served_model_name",
    "step_execution",
    "max_num_seqs",
    "scheduling_policy",
    "dtype",
    "device",
    "quantization",
    "enforce_eager",
    "lora_modules",
    "tensor_parallel_size",
    "log_level",
)
"""The flags `serve --help` lists before the group list (dests); every flag is under `--help=GROUP`."""


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every `serve` flag to `parser`, one argument group per `--help=GROUP` (help.py).

    A new flag family goes in a function of its own file that creates (or, with `help.serve_group`,
    joins) its group, called with one line below."""
    parser.main_flags = MAIN_FLAGS
    parser.add_argument(
        "model",
        nargs="?",
        default=None,
        help="Local diffusers-format directory, Hugging Face repo id, or the embedded tiny random model "
        f"'{TINY_MODEL_NAME}' (default).",
    )
    parser.add_argument(
        "--omni",
        action="store_true",
        default=argparse.SUPPRESS,
        help="Serve a diffusion model (required with `vllm serve`; accepted with `vllm-omni serve`).",
    )
    _add_server_arguments(parser)
    _add_logging_arguments(parser)
    _add_limit_arguments(parser)
    _add_model_arguments(parser)
    _add_engine_arguments(parser)
    _add_memory_arguments(parser)
    add_lora_arguments(parser)
    add_memory_and_log_arguments(parser)
    add_prompt_cache_arguments(parser)
    add_cache_arguments(parser)
    _add_unsupported_arguments(parser)
    add_replica_arguments(parser)  # joins the parallelism group


def _add_server_arguments(parser: argparse.ArgumentParser) -> None:
    server = parser.add_argument_group("server", "Address, API key, served names, TLS and CORS.")
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


def _add_logging_arguments(parser: argparse.ArgumentParser) -> None:
    logging_ = serve_group(parser, "logging", "Log level, log file, per-request and per-step lines.")
    logging_.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="Log level (default info).")
    logging_.add_argument(
        "--uvicorn-log-level",
        choices=UVICORN_LOG_LEVELS,
        default=None,
        help="uvicorn's log level (default: --log-level); debug/trace also turn on the access log.",
    )
    logging_.add_argument(
        "--log-file", default=None, help="Also write the log to this file (appended), as vLLM-Omni."
    )
    requests = logging_.add_mutually_exclusive_group()
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
    stats = logging_.add_mutually_exclusive_group()
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


def _add_limit_arguments(parser: argparse.ArgumentParser) -> None:
    limits = HTTPLimits()
    server = parser.add_argument_group(
        "limits", "What one request and the server may take: sizes, timeouts, queue."
    )
    server.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
        help="Larger request bodies get HTTP 413 (default 1 MiB).",
    )
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
    server.add_argument(
        "--max-queue-size",
        type=int,
        default=1024,
        help="Waiting requests beyond this get HTTP 503 with Retry-After (default 1024).",
    )
    server.add_argument(
        "--max-generated-image-size",
        type=int,
        default=DEFAULT_MAX_GENERATED_IMAGE_SIZE,
        help="Largest height*width in pixels a request may ask for "
        f"(default {DEFAULT_MAX_GENERATED_IMAGE_SIZE}).",
    )


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group(
        "model", "Weights, dtype, device, quantization, attention, request defaults."
    )
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
        help="Pipeline class (model_index.json's _class_name): "
        f"{' or '.join(registry.supported_pipelines())} (anything else is refused).",
    )
    model.add_argument(
        "--seed", type=int, default=None, help="Seed for random weights and assigned request seeds."
    )
    model.add_argument(
        "--enforce-eager",
        action="store_true",
        help="Run plain eager PyTorch: no torch.compile'd fused elementwise kernels and no CUDA graph "
        "replay of the denoise step. By default on CUDA both are on (graphs where the attention backend "
        "allows them); CPU is always eager.",
    )
    model.add_argument(
        "--diffusion-attention-backend",
        default=None,
        help="Attention backend, e.g. SDPA or FLASH_ATTN "
        "(default: env DIFFUSION_ATTENTION_BACKEND, else auto).",
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
        "--init-timeout",
        type=float,
        default=None,
        help="Seconds parallel worker processes get to load the model (default 1800).",
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
        "--default-sampling-params",
        default=None,
        help='JSON object of sampling-param defaults, e.g. \'{"num_inference_steps": 30, "height": 512, '
        "\"width\": 512}'; vLLM-Omni's stage-keyed form '{\"0\": {...}}' is accepted too.",
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


def _add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    engine = parser.add_argument_group(
        "engine", "Step mode, batch sizes, scheduling policy, packing, batch invariance."
    )
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
        "--batch-invariant",
        action="store_true",
        help="Bit-identical results whatever else is in the batch (also env VLLM_BATCH_INVARIANT=1).",
    )


def _add_memory_arguments(parser: argparse.ArgumentParser) -> None:
    memory = serve_group(parser, "memory", "Memory the engine may hold: decode slices, prefix KV caches.")
    memory.add_argument(
        "--max-decode-pixels",
        type=int,
        default=OmniDiffusionConfig.max_decode_pixels,
        help="Most pixels one VAE decode call holds: n images decode in slices of whole images (same "
        f"pixels, bounded memory; default {OmniDiffusionConfig.max_decode_pixels}, one 2048x2048 image).",
    )
    memory.add_argument(
        "--kv-cache-memory-bytes",
        type=int,
        default=None,
        help="Bytes the prefix KV caches of admitted requests may hold together (Qwen-Image-2.1 keeps each "
        "request's prompt and reference-image K/V for its whole run). Default: no separate cap, they count "
        "in the memory budget (--gpu-memory-utilization of the free memory). A request whose cache could "
        "never fit is refused (400); one that fits later waits for memory.",
    )


def _add_unsupported_arguments(parser: argparse.ArgumentParser) -> None:
    parallel = parser.add_argument_group(
        "parallelism", "One process per device; the world size is the product of the degrees."
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
    add_no_effect_arguments(parser)

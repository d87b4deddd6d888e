"""`vllm serve` flags of the engine's memory budget and step log: --gpu-memory-utilization (vLLM's
name), --log-step-interval."""

from __future__ import annotations

import argparse
from typing import Any

from vllm_omni.config import OmniDiffusionConfig
from vllm_omni.entrypoints.cli.help import serve_group


def add_memory_and_log_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags, in the `memory` and `logging` groups of `serve --help`."""
    memory = serve_group(parser, "memory")
    memory.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=OmniDiffusionConfig.gpu_memory_utilization,
        help="Share of the memory free beside the loaded server (the GPU's; the host's on CPU) that "
        "admitted requests may hold together; measured at start-up and again whenever no request holds "
        f"memory (default {OmniDiffusionConfig.gpu_memory_utilization}). vLLM sizes its KV cache from a "
        "share of the GPU's whole memory instead.",
    )
    logging_ = serve_group(parser, "logging")
    logging_.add_argument(
        "--log-step-interval",
        type=int,
        default=OmniDiffusionConfig.log_step_interval,
        metavar="N",
        help="Log one INFO line every N steps with the step's request ids and batch composition "
        "(default 0: every step's line at DEBUG only, --log-level debug).",
    )


def memory_and_log_config_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The `OmniDiffusionConfig` fields of these flags."""
    return {
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "log_step_interval": args.log_step_interval,
    }

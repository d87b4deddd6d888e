"""`vllm serve` step-caching flags (vLLM-Omni's): --cache-backend, --cache-config,
--enable-cache-dit-summary."""

from __future__ import annotations

import argparse
from typing import Any

from vllm_omni.diffusion.cache.config import CACHE_BACKENDS


def add_cache_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "cache", "Step caching, decided per request and CFG branch inside packed steps (docs/caching.md)."
    )
    group.add_argument(
        "--cache-backend",
        default="none",
        help=f"Step caching: {', '.join(CACHE_BACKENDS)} (cache_dit: cache-dit's DBCache; tea_cache: "
        "TeaCache). Decided per request and CFG branch inside packed steps; a request opts out with "
        'extra_args {"cache_backend": "none"}.',
    )
    group.add_argument(
        "--cache-config",
        default=None,
        metavar="JSON",
        help="The backend's knobs under its own names, e.g. '{\"Fn_compute_blocks\": 8, "
        '"residual_diff_threshold": 0.12}\' (cache_dit) or \'{"rel_l1_thresh": 0.2}\' (tea_cache); '
        "a request's extra_args.cache_config overrides keys.",
    )
    group.add_argument(
        "--enable-cache-dit-summary",
        action="store_true",
        help="Log one line per finished request with its cached steps per CFG branch.",
    )


def cache_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """`OmniDiffusionConfig` keywords of the parsed flags (the config checks them)."""
    return {
        "cache_backend": getattr(args, "cache_backend", "none") or "none",
        "cache_config": getattr(args, "cache_config", None),
        "enable_cache_dit_summary": bool(getattr(args, "enable_cache_dit_summary", False)),
    }

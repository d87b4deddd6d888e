"""`vllm serve` prompt-embedding cache flags (vLLM-Omni's names): --enable-prompt-embed-cache,
--prompt-embed-cache-size (diffusion/prompt_cache.py)."""

from __future__ import annotations

import argparse
from typing import Any

from vllm_omni.diffusion.prompt_cache import DEFAULT_PROMPT_EMBED_CACHE_SIZE


def add_prompt_cache_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "prompt",
        "The prompt-embedding cache: text embeddings kept between requests (docs/design/architecture.md).",
    )
    group.add_argument(
        "--enable-prompt-embed-cache",
        action="store_true",
        default=False,
        help="Cache every prompt's text embedding (least recently used out). Without it only the empty "
        "and single-space negative prompts are cached.",
    )
    group.add_argument(
        "--prompt-embed-cache-size",
        type=int,
        default=DEFAULT_PROMPT_EMBED_CACHE_SIZE,
        metavar="N",
        help=f"Entries of the prompt-embedding cache (default {DEFAULT_PROMPT_EMBED_CACHE_SIZE}); 0 turns "
        "it off.",
    )


def prompt_cache_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The `OmniDiffusionConfig` fields of the parsed flags."""
    return {
        "enable_prompt_embed_cache": bool(getattr(args, "enable_prompt_embed_cache", False)),
        "prompt_embed_cache_size": getattr(args, "prompt_embed_cache_size", DEFAULT_PROMPT_EMBED_CACHE_SIZE),
    }

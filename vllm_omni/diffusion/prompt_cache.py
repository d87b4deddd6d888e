"""The prompt-embedding cache (vLLM-Omni's `--enable-prompt-embed-cache`, `--prompt-embed-cache-size`).

Every CFG request encodes its negative prompt, and most send the same one (" ", or ""): the text
encoder ran again for it on every admission. The cache keeps a prompt's embedding rows
[L, joint_dim] by `(prompt, max_sequence_length)`, least recently used out, up to `size` entries.
It wraps one pipeline's `encode_prompts(prompts, max_sequence_lengths)`, so the chat template and
the encoder (the rest of the key) are that pipeline's, fixed for its life.

Which prompts: by default only `DEFAULT_CACHED_PROMPTS` (the empty and single-space negative
prompts); with `enable_prompt_embed_cache` every prompt, positive and negative.

Bit-identity: an encoder's output for a prompt depends (in its last bits) on what it was padded
and batched with. So a cached prompt is always encoded alone, as diffusers' pipeline and
batch-invariant mode encode it: a hit returns exactly what a miss computes, whatever else arrived
in the same step (tests/test_prompt_cache.py). Prompts outside the cache are still encoded
together in one call. Only text-only encoders are cached: an edit model's prompt embedding depends
on its input image.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the CLI imports this module's defaults before torch is needed
    import torch

logger = logging.getLogger(__name__)

DEFAULT_CACHED_PROMPTS = frozenset({"", " "})
"""Prompts cached even without `enable_prompt_embed_cache`: the usual negative prompts."""

DEFAULT_PROMPT_EMBED_CACHE_SIZE = 32
"""vLLM-Omni's default number of entries."""

Encode = Callable[[list[str], list[int]], list["torch.Tensor"]]


class PromptEmbedCache:
    """An LRU of one pipeline's prompt embeddings; called like the `encode_prompts` it wraps."""

    def __init__(self, encode: Encode, size: int = DEFAULT_PROMPT_EMBED_CACHE_SIZE, cache_all: bool = False):
        if size < 1:
            raise ValueError(f"prompt_embed_cache_size must be >= 1 to cache, got {size}")
        self._encode = encode
        self.size = size
        self.cache_all = cache_all
        self._entries: collections.OrderedDict[tuple[str, int], torch.Tensor] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.num_hits = 0
        self.num_misses = 0

    def caches(self, prompt: str) -> bool:
        return self.cache_all or prompt in DEFAULT_CACHED_PROMPTS

    def __len__(self) -> int:
        return len(self._entries)

    def __call__(self, prompts: list[str], max_sequence_lengths: list[int]) -> list[torch.Tensor]:
        """Each prompt's rows [L_i, J], as the wrapped `encode_prompts` returns them. The returned
        tensors of cached prompts are shared between requests: read them, never write them."""
        out: list[torch.Tensor | None] = [None] * len(prompts)
        batch: list[int] = []
        for i, (prompt, max_len) in enumerate(zip(prompts, max_sequence_lengths, strict=True)):
            if not self.caches(prompt):
                batch.append(i)
                continue
            out[i] = self._cached(prompt, max_len)
        if batch:
            encoded = self._encode([prompts[i] for i in batch], [max_sequence_lengths[i] for i in batch])
            for i, emb in zip(batch, encoded, strict=True):
                out[i] = emb
        return out

    def _cached(self, prompt: str, max_len: int) -> torch.Tensor:
        key = (prompt, max_len)
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
                self.num_hits += 1
                return hit
        (emb,) = self._encode([prompt], [max_len])  # alone: see the module docstring
        with self._lock:
            self.num_misses += 1
            self._entries[key] = emb
            self._entries.move_to_end(key)
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)
        return emb


def install_prompt_cache(pipeline, capable: bool, size: int, cache_all: bool) -> PromptEmbedCache | None:
    """Wrap `pipeline.encode_prompts` in a cache; None (nothing cached) when `size` is 0 or the family
    does not declare a text-only prompt encoder (`capable`: `FamilyCapabilities.prompt_embed_cache`;
    edit models' prompt embedding reads the image)."""
    if size == 0 or not capable:
        return None
    cache = PromptEmbedCache(pipeline.encode_prompts, size, cache_all)
    pipeline.encode_prompts = cache
    logger.info(
        "prompt-embedding cache: %d entries, %s",
        size,
        "every prompt"
        if cache_all
        else "the empty and single-space negative prompts (--enable-prompt-embed-cache caches every prompt)",
    )
    return cache

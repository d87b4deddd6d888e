"""Named elementwise chains, run eager or `torch.compile`d with only their row dimension dynamic.

A model family writes each chain of its blocks once, as a plain torch function, and lists it in a table
`name -> (function, positions of the arguments whose first dim counts rows or sequences)`. `CompiledOps`
runs the table's functions eagerly, or compiled by inductor into fused kernels. The machinery here is
what every family needs around that and nothing family-specific:

- only the listed first dims are dynamic (`maybe_mark_dynamic`); hidden, heads and head_dim stay
  static, so one compile serves every batch composition without making the inner loops symbolic;
- dynamo's recompile limit is raised (dense / packed layouts, one-sequence batches and layouts of the
  per-sequence values each specialise once; the default limit of 8 is too tight);
- a compiled call that raises runs eager for those input shapes only (the shape is remembered), is
  counted in `num_fallbacks` (the runner reports it in /metrics), and logged once per shape.

A family may serve some names with a hand-written kernel (`kernel_for`); the same fallback covers it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import torch

logger = logging.getLogger(__name__)

OpTable = Mapping[str, tuple[Callable, tuple[int, ...]]]
"""name -> (eager function, positions of the arguments whose first dim is a row or sequence count)."""

RECOMPILE_LIMIT = 64
"""Dynamo's per-function recompile limit while ops are compiled: dense and packed calls, one and many
sequences, and the layouts of the per-sequence values each compile once; the default limit (8) is too
tight."""

MAX_FAILED_SHAPES = 256
"""Failed (op, shapes) remembered; beyond this, failures are retried (and counted) every call."""


def raise_recompile_limit(limit: int = RECOMPILE_LIMIT) -> None:
    """Raise dynamo's per-function recompile limit to at least `limit` (both spellings across versions)."""
    import torch._dynamo.config as dynamo_config

    for name in ("recompile_limit", "cache_size_limit"):
        if getattr(dynamo_config, name, limit) < limit:
            setattr(dynamo_config, name, limit)


def mark_rows_dynamic(arg) -> None:
    """Mark dim 0 of a tensor (or of each tensor in a tuple) dynamic for the next compiled call.

    NOTE(perf): `torch.compile(dynamic=True)` also makes the hidden and head sizes symbolic: Qwen-Image's
    norms ran ~1.4x slower that way than with them static.
    """
    for t in arg if isinstance(arg, tuple) else (arg,):
        if isinstance(t, torch.Tensor):
            torch._dynamo.maybe_mark_dynamic(t, 0)


class CompiledOps:
    """A table of elementwise chains (`OpTable`), run eager or as compiled fused kernels.

    `_call(name, *args)` runs one chain. When `compiled`, the table's functions are `torch.compile`d
    once (lazily, per specialisation, at first use) and a call that raises falls back to eager for those
    input shapes only. Capturable in a CUDA graph once warmed up: compiled code reads no host values.
    """

    def __init__(self, table: OpTable, compiled: bool = False):
        self.table = table
        self.compiled = compiled
        self.num_fallbacks = 0
        """Calls that fell back to the eager chain after the compiled one raised (counted in /metrics)."""
        self._failed: set[tuple] = set()
        """(op, input shapes) whose compiled call raised: they run eager; other shapes keep compiling."""
        self._fns: dict[str, Callable] = {name: fn for name, (fn, _) in table.items()}
        """The callables `_call` runs when compiled (the compiled functions; tests swap in others)."""
        if compiled:
            raise_recompile_limit()
            self._fns = {name: torch.compile(fn) for name, fn in self._fns.items()}

    def kernel_for(self, name: str, args: tuple) -> Callable | None:
        """A hand-written kernel serving `name` for these arguments, or None (inductor's). Families
        override this; the fallback covers a kernel that raises."""
        return None

    def _call(self, name: str, *args):
        """`table[name]` on `args`: a family kernel where one serves, else the compiled chain, else eager;
        a kernel or compile that raises falls back to eager for those shapes only."""
        eager, dynamic_args = self.table[name]
        if not self.compiled:
            return eager(*args)
        key = (name, *(tuple(a.shape) for a in args if isinstance(a, torch.Tensor)))
        if key in self._failed:
            return eager(*args)
        kernel = self.kernel_for(name, args)
        if kernel is None:
            for i in dynamic_args:
                mark_rows_dynamic(args[i])
        try:
            return (kernel or self._fns[name])(*args)
        except Exception:
            # A compile (or kernel) failure must not take requests down, nor disable compilation for
            # every other shape (it may be a transient OOM): this shape runs eager from now on.
            self.num_fallbacks += 1
            if len(self._failed) < MAX_FAILED_SHAPES:
                self._failed.add(key)
            logger.exception("compiled op %s failed for shapes %s; running it eager", name, key[1:])
            return eager(*args)

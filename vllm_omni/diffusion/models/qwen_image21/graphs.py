"""CUDA graphs of Qwen-Image-2.1's packed step: static buffers per bucket, prefixes read at static rows.

The eager step (`transformer.denoise_rows`) concatenates, at every layer, each sequence's cached prefix
K/V with its image rows' K/V from host lists: addresses and shapes a graph cannot freeze. Here the step
runs over buffers whose addresses never change, so the worker's graph runner (`worker/cuda_graphs.py`,
through `interface.PackedStepGraphs`) captures it once per bucket and replays it for any batch that fits.

A bucket is (image rows I, prefix rows P, sequence slots S); its static inputs:

    img        [I, C_in]      | real image rows (layout order)                  | zeros           |
    timestep   [S + 1]        real timesteps, then 0 (padding sequence, empty slots)
    cos, sin   [I, D/2]       each real row's RoPE (edits: after their reference blocks), then 1 / 0
    seq_ids    [I]            each row's sequence, padding rows -> slot n (the padding sequence)
    img_index  [I]            K/V row of each image row       } filled when the composition changes:
    prefix_index [P]          K/V row of each prefix row      } one bijection onto the P + I K/V rows
    prefix_src [P]            arena row of each prefix row (arena only; 0 for the unused rows)
    cu_seqlens_q [S + 2]      0 .. I (real sequences), then I repeated
    cu_seqlens_k [S + 2]      0 .. T_k (real sequences: prefix_i + n_i each), T_k + I - n_img (the
                              padding sequence: its image rows only), then repeated

and, shared by every bucket (`PrefixStaging`, sized for the largest):

    layer K/V     [P_max + I_max, H, D] x (K, V): one layer's [prefix_i ; image_i] per sequence:

        | pre 0 | img 0 ... | pre 1 | img 1 . | padding img rows | unused prefix rows |
        0                  ^                 ^ T_k              ^                    ^ P + I
        cu_seqlens_k:      1                 n                  n + 1

Where the prefixes come from, two ways:

- **Prefix arena** (CUDA with graphs: the runner makes one at start-up; prefix_arena.py). Every cached
  prefix already sits at fixed rows of `arena.key / value [num_layers, capacity, H, D]`, so each layer
  (inside the graph) gathers the batch's prefix rows straight from it,
  `keys.index_copy_(0, prefix_index, arena.key[layer].index_select(0, prefix_src))` (same for values).
  Nothing is staged: a composition change rewrites only `prefix_src` (P int64s). A prefix that is not
  in the arena (a sequence without a cached prefix, prefilled in the step: `measure_step_costs`'
  synthetic forwards, tools) is copied for the step into rows of `TRANSIENT_OWNER`, reserved when the
  runner sizes the batch (`bucket_rows`, which frees the previous step's first); when they do not fit,
  the step runs eager with per-request tensors.
- **Staging store** (no arena: CPU tests, tools). The prefixes live in per-request tensors, so a store
  `[num_layers, P_max, H, D] x (K, V)` holds the batch's prefixes packed in order, filled outside the
  graph (`PrefixStaging.stage`, one copy per sequence, only when the batch's prefixes change), and each
  layer copies the store's rows by `prefix_index`.

Each layer then writes its image rows' K/V by `img_index`, and one varlen call reads the contiguous
[prefix_i ; image_i] of every sequence (FA3 / FA2 varlen, device-side boundaries: `for_graph=True`
metadata). Rows past cu_seqlens_k[-1] belong to no sequence; padding rows are their own sequence with
no prefix, so no real row sees them, and a replay equals the eager run of the same padded batch bit for
bit (the runner captures `run_eager`, which the CPU tests run).

Bytes, at the released size (32 layers, 32 x 128 heads, bf16: 16 KiB of K+V per row and layer, 512 KiB
per row over all layers):

                  arena (default grid: P_max 8192, I_max 6144)  | store (P_max 2048, I_max 6144)
    prefix K/V    the arena itself (the cache; no second copy)  | store 2048 x 512 KiB = 1 GiB
    layer K/V     14336 rows x 16 KiB = 224 MiB                  | 8192 rows x 16 KiB = 128 MiB
    per layer     gather + copy of P rows (16 KiB each)          | copy of P rows (16 KiB each)

(a K/V workspace for every layer would be 8192 rows x 512 KiB = 4 GiB). The per-layer copy moves the
bytes the eager step's `torch.cat` moves (0.1 GiB a step for P = 256: tens of microseconds).
With the arena a bucket's prefix rows cost only layer K/V, so the prefix axis reaches 8192 rows
(`ARENA_PREFIX_ROW_BUCKETS`): edits with large reference images replay instead of running eager.
"""

from __future__ import annotations

import sys
import weakref

import numpy as np
import torch

from vllm_omni.diffusion.attention.metadata import AttentionMetadata
from vllm_omni.diffusion.layout import PackedLayout
from vllm_omni.diffusion.models.qwen_image21.prefix_arena import PrefixArena
from vllm_omni.diffusion.models.qwen_image21.prefix_cache import PrefixKV

ARENA_PREFIX_ROW_BUCKETS = (64, 128, 256, 512, 1024, 2048, 3072, 4096, 5120, 6144, 8192)
"""The prefix-row axis of the bucket grid with a prefix arena (no staging store: a bucket's prefix rows
cost only one layer's K/V, 16 KiB a row at the released size). Past 2048 it steps by 1024 (then 2048)
so that a batch pads its prefix rows within the runner's 25 % rule (`CudaGraphConfig.pays`): a 2506-row
prefix takes 3072, an edit with a 1024 x 1024 reference (about 4200 rows) 5120."""
TRANSIENT_OWNER = "\x00transient-prefixes"
"""Arena owner of the rows that hold, for one step, the prefixes not in the arena (a sequence without a
cached prefix, prefilled in the step: `measure_step_costs`' synthetic forwards, tools), held until the
next step sizes its batch (`bucket_rows`). No req_id starts with a NUL."""
NO_BUCKET = sys.maxsize
"""`bucket_rows` when the step's transient prefixes do not fit in the arena: no bucket fits, eager."""


class PrefixStaging:
    """Static K/V homes shared by every bucket: one layer's attention K/V and, without a prefix arena,
    the store of the batch's prefixes (all layers; see the module docstring)."""

    def __init__(
        self,
        num_layers: int,
        max_prefix_rows: int,
        max_img_rows: int,
        heads: int,
        head_dim: int,
        device,
        dtype,
        with_store: bool = True,
    ):
        store = (num_layers, max_prefix_rows if with_store else 0, heads, head_dim)
        layer = (max_prefix_rows + max_img_rows, heads, head_dim)
        self.max_prefix_rows = max_prefix_rows
        self.prefix_key = torch.zeros(store, device=device, dtype=dtype)
        """[num_layers, P_max, H, D]: the batch's prefix keys, sequences packed in order (0 rows with an
        arena: the buckets gather from it)."""
        self.prefix_value = torch.zeros(store, device=device, dtype=dtype)
        self.key = torch.zeros(layer, device=device, dtype=dtype)
        """[P_max + I_max, H, D]: one layer's keys, [prefix_i ; image_i] per sequence."""
        self.value = torch.zeros(layer, device=device, dtype=dtype)
        self._staged: list[weakref.ref] = []
        """The prefixes in the store now, in order (weak: a finished request's prefix is freed)."""

    @property
    def num_bytes(self) -> int:
        return sum(
            t.numel() * t.element_size() for t in (self.prefix_key, self.prefix_value, self.key, self.value)
        )

    def stage(self, prefixes: list[PrefixKV]) -> bool:
        """Copy the prefixes into the store, packed in order, unless it holds exactly them already;
        True when it copied. Stream-ordered after the previous replay, which read the old ones."""
        if len(self._staged) == len(prefixes) and all(r() is p for r, p in zip(self._staged, prefixes)):
            return False
        start = 0
        for prefix in prefixes:
            end = start + prefix.num_rows
            self.prefix_key[:, start:end].copy_(prefix.key)
            self.prefix_value[:, start:end].copy_(prefix.value)
            start = end
        self._staged = [weakref.ref(p) for p in prefixes]
        return True


def num_prefix_rows(transformer, layout: PackedLayout, outside_arena: bool = False) -> int:
    """Prefix rows of the layout's sequences: cached ones' rows, else their text rows (prefilled in the
    step, text-to-image). `outside_arena`: only those of prefixes not in an arena."""
    txt_offsets, total = layout.txt_row_offsets, 0
    for i, spec in enumerate(layout.specs):
        prefix = transformer.prefix_cache.get(spec.req_id, spec.is_negative)
        if prefix is None:
            total += txt_offsets[i + 1] - txt_offsets[i]
        elif not (outside_arena and prefix.arena_start is not None):
            total += prefix.num_rows
    return total


def arena_sources(prefixes: list[PrefixKV], num_prefix_rows: int) -> np.ndarray:
    """prefix_src [P] (int64): the arena row of each of the batch's prefix rows, sequences in order
    (every prefix arena-backed), then row 0 for the bucket's unused rows (they land in K/V rows no
    sequence reads)."""
    rows = [np.arange(p.arena_start, p.arena_start + p.num_rows) for p in prefixes]
    real = sum(p.num_rows for p in prefixes)
    return np.concatenate([*rows, np.zeros(num_prefix_rows - real, dtype=np.int64)]).astype(np.int64)


def place_in_arena(arena: PrefixArena, prefixes: list[PrefixKV]) -> list[PrefixKV]:
    """The step's prefixes, each one not in the arena copied into rows of `TRANSIENT_OWNER` (reserved by
    `bucket_rows`) and returned as a view of them; arena-backed ones as they are."""
    placed = []
    for prefix in prefixes:
        if prefix.arena_start is None:
            start, rows = arena.allocate(TRANSIENT_OWNER, prefix.num_rows), prefix.num_rows
            arena.key[:, start : start + rows].copy_(prefix.key)
            arena.value[:, start : start + rows].copy_(prefix.value)
            view = (arena.key[:, start : start + rows], arena.value[:, start : start + rows])
            prefix = PrefixKV(*view, target_frame=prefix.target_frame, arena_start=start)
        placed.append(prefix)
    return placed


def static_indices(
    img_offsets: list[int], prefix_rows: list[int], num_img_rows: int, num_prefix_rows: int, num_seqs: int
) -> dict[str, np.ndarray]:
    """Host indices of one batch in a bucket (I = num_img_rows, P = num_prefix_rows, S = num_seqs):
    img_index [I], prefix_index [P], seq_ids [I] (int64) and cu_seqlens_q / _k [S + 2] (int32)."""
    n = len(prefix_rows)
    sizes = np.diff(np.asarray(img_offsets, dtype=np.int64))  # [n] image rows per sequence
    pre = np.asarray(prefix_rows, dtype=np.int64)
    k_starts = np.concatenate([[0], np.cumsum(pre + sizes)])  # [n + 1]
    pre_starts = np.concatenate([[0], np.cumsum(pre)])
    n_img, real_p, real_k = int(img_offsets[-1]), int(pre_starts[-1]), int(k_starts[-1])
    num_pad = num_img_rows - n_img
    # image row r of sequence i -> K/V row k_start_i + L_i + (r - img_offset_i); padding rows follow T_k
    img_index = np.concatenate(
        [
            np.arange(n_img) + np.repeat(k_starts[:-1] + pre - np.asarray(img_offsets[:-1]), sizes),
            real_k + np.arange(num_pad),
        ]
    )
    # staged prefix row j of sequence i -> K/V row k_start_i + (j - pre_start_i); unused rows at the end
    prefix_index = np.concatenate(
        [
            np.arange(real_p) + np.repeat(k_starts[:-1] - pre_starts[:-1], pre),
            real_k + num_pad + np.arange(num_prefix_rows - real_p),
        ]
    )
    seq_ids = np.concatenate([np.repeat(np.arange(n), sizes), np.full(num_pad, n)])
    tail = num_seqs + 1 - n  # the padding sequence's end, then the empty slots
    cu_q = np.concatenate([img_offsets, np.full(tail, num_img_rows)]).astype(np.int32)
    cu_k = np.concatenate([k_starts, np.full(tail, real_k + num_pad)]).astype(np.int32)
    return {
        "img_index": img_index,
        "prefix_index": prefix_index,
        "seq_ids": seq_ids,
        "cu_seqlens_q": cu_q,
        "cu_seqlens_k": cu_k,
    }


class PrefixStepBucket:
    """One bucket's static inputs and the step over them (`interface.StaticPackedStep`)."""

    def __init__(
        self, transformer, staging: PrefixStaging, num_img_rows: int, num_prefix_rows: int, num_seqs: int
    ):
        cfg = transformer.config
        device, dtype = staging.key.device, staging.key.dtype
        self.transformer, self.staging = transformer, staging
        self.num_img_rows, self.num_prefix_rows, self.num_seqs = num_img_rows, num_prefix_rows, num_seqs
        self.arena: PrefixArena | None = transformer.prefix_arena
        """Where the prefixes live with an arena (the layers gather from it); None: the staging store."""
        num_kv = num_prefix_rows + num_img_rows
        if num_prefix_rows > staging.max_prefix_rows or num_kv > staging.key.shape[0]:
            raise ValueError(f"bucket ({num_img_rows}, {num_prefix_rows}) exceeds the staging buffers")
        if self.arena is None and num_prefix_rows > staging.prefix_key.shape[1]:
            raise ValueError(f"bucket ({num_img_rows}, {num_prefix_rows}): no prefix arena and no store")
        long = dict(device=device, dtype=torch.long)
        self.img = torch.zeros(num_img_rows, cfg.in_channels * cfg.patch_size**2, device=device, dtype=dtype)
        self.timestep = torch.zeros(num_seqs + 1, device=device, dtype=dtype)
        half = cfg.attention_head_dim // 2
        self.cos = torch.ones(num_img_rows, half, device=device)
        self.sin = torch.zeros(num_img_rows, half, device=device)
        self.seq_ids = torch.zeros(num_img_rows, **long)
        # initially one padding sequence over every image row; the staged rows after it, unused
        self.img_index = torch.arange(num_img_rows, **long)
        self.prefix_index = torch.arange(num_img_rows, num_kv, **long)
        self.prefix_src = torch.zeros(num_prefix_rows if self.arena is not None else 0, **long)
        """[P] with an arena: the arena row of each of the batch's prefix rows (0 for unused rows)."""
        self._prefix_src_cpu: np.ndarray | None = None
        cu = torch.full((num_seqs + 2,), num_img_rows, device=device, dtype=torch.int32)
        cu[0] = 0
        self.attn = AttentionMetadata(
            is_varlen=True,
            cu_seqlens_q=cu,
            cu_seqlens_k=cu.clone(),
            max_seqlen_q=num_img_rows,
            max_seqlen_k=num_kv,
            seq_lens=[num_img_rows] + [0] * num_seqs,
            kv_seq_lens=[num_kv] + [0] * num_seqs,
            for_graph=True,
        )
        self._loaded: weakref.ref | None = None
        """The layout whose composition (indices, RoPE, boundaries) the buffers hold."""

    def load(
        self, img_rows: torch.Tensor, txt_rows: torch.Tensor, timestep: torch.Tensor, layout: PackedLayout
    ) -> None:
        """Write a batch that fits this bucket into the static buffers (the prefixes into the shared
        store when they changed; indices, RoPE and boundaries when the composition changed)."""
        n_img, n = layout.num_img_rows, layout.num_seqs
        self.img[:n_img].copy_(img_rows)
        self.img[n_img:].zero_()
        self.timestep[:n].copy_(timestep)
        self.timestep[n:].zero_()
        prefixes = self.transformer.step_prefixes(txt_rows, layout)
        if self.arena is None:
            self.staging.stage(prefixes)
        else:
            prefixes = place_in_arena(self.arena, prefixes)
            src = arena_sources(prefixes, self.num_prefix_rows)
            if self._prefix_src_cpu is None or not np.array_equal(src, self._prefix_src_cpu):
                self.prefix_src.copy_(torch.from_numpy(src))
                self._prefix_src_cpu = src
        if self._loaded is not None and self._loaded() is layout:
            return
        cos, sin = self.transformer.step_rope(layout, prefixes, self.img.device)
        self.cos[:n_img].copy_(cos)
        self.sin[:n_img].copy_(sin)
        self.cos[n_img:].fill_(1.0)
        self.sin[n_img:].fill_(0.0)
        host = static_indices(
            layout.img_row_offsets,
            [p.num_rows for p in prefixes],
            self.num_img_rows,
            self.num_prefix_rows,
            self.num_seqs,
        )
        for name, dst in (
            ("img_index", self.img_index),
            ("prefix_index", self.prefix_index),
            ("seq_ids", self.seq_ids),
            ("cu_seqlens_q", self.attn.cu_seqlens_q),
            ("cu_seqlens_k", self.attn.cu_seqlens_k),
        ):
            dst.copy_(torch.from_numpy(host[name]))
        self._loaded = weakref.ref(layout)

    def run_eager(self) -> torch.Tensor:
        """The step over the static buffers (what a graph captures): [I, C_out], the batch's rows first."""
        num_kv = self.num_prefix_rows + self.num_img_rows
        keys, values = self.staging.key[:num_kv], self.staging.value[:num_kv]  # [P + I, H, D]
        backend = self.transformer.step_attention_backend(self.img.device)

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            prefix_k, prefix_v = self._layer_prefixes(layer)  # [P, H, D] each
            keys.index_copy_(0, self.prefix_index, prefix_k)
            keys.index_copy_(0, self.img_index, k)
            values.index_copy_(0, self.prefix_index, prefix_v)
            values.index_copy_(0, self.img_index, v)
            return backend.forward(q, keys, values, self.attn)

        return self.transformer.denoise(self.img, self.timestep, self.seq_ids, (self.cos, self.sin), attend)

    def _layer_prefixes(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's prefix K/V of the batch, [P, H, D] each, sequences in order: gathered from the
        arena by `prefix_src`, else the staging store's rows."""
        if self.arena is not None:
            return (
                self.arena.key[layer].index_select(0, self.prefix_src),
                self.arena.value[layer].index_select(0, self.prefix_src),
            )
        rows = slice(0, self.num_prefix_rows)
        return self.staging.prefix_key[layer, rows], self.staging.prefix_value[layer, rows]


class PrefixStepGraphs:
    """Qwen-Image-2.1's packed step for the graph runner (`interface.PackedStepGraphs`): buckets count
    prefix rows on their second axis and share one `PrefixStaging` (with the transformer's prefix arena:
    its layer K/V only; the buckets gather from the arena)."""

    def __init__(self, transformer, max_img_rows: int, max_prefix_rows: int, device, dtype):
        cfg = transformer.config
        self.transformer = transformer
        self.arena: PrefixArena | None = transformer.prefix_arena
        self.staging = PrefixStaging(
            cfg.num_layers,
            max_prefix_rows,
            max_img_rows,
            cfg.num_attention_heads,
            cfg.attention_head_dim,
            device,
            dtype,
            with_store=self.arena is None,
        )

    @property
    def num_bytes(self) -> int:
        """Device bytes of the static buffers shared by every bucket."""
        return self.staging.num_bytes

    def bucket_rows(self, txt_rows: torch.Tensor, layout: PackedLayout) -> int:
        """Rows the batch puts on the bucket's second axis: its prefix rows. With an arena it also
        reserves the rows the step's prefixes outside the arena take for it (`TRANSIENT_OWNER`, the last
        step's freed first); `NO_BUCKET` when they do not fit, so the step runs eager."""
        if self.arena is not None:
            self.arena.release(TRANSIENT_OWNER)
            outside = num_prefix_rows(self.transformer, layout, outside_arena=True)
            if not self.arena.reserve(TRANSIENT_OWNER, outside):
                return NO_BUCKET
        return num_prefix_rows(self.transformer, layout)

    def static_step(self, num_img_rows: int, num_ctx_rows: int, num_seqs: int) -> PrefixStepBucket:
        return PrefixStepBucket(self.transformer, self.staging, num_img_rows, num_ctx_rows, num_seqs)

"""CUDA graphs of the transformer forward: packed buckets captured at start-up, dense shapes on first use.

A graph replays the 60-block forward (~3000 kernels) with one launch, which removes the fixed host
cost that dominates small steps (256x256 CFG step: ~155 ms eager, ~30 ms replayed). A graph's
shapes are frozen at capture, so a batch runs in the smallest *bucket* it fits, padded:

    packed bucket (img rows I, txt rows X, sequence slots S), static buffers:
      img_rows  [I, C_in]     | real image rows (layout order)          | zeros            |
      txt_rows  [X, joint]    | real text rows                          | zeros            |
      joint     [I + X, H, D] | real sequences 0..n-1 (as the layout)   | padding sequence |
      cu_seqlens [S + 2]      0 ... T_real (= cu of the batch), then T_real -> I + X (sequence n,
                              the padding rows), then I + X repeated (empty slots n+1..S)
      timestep  [S + 1]       real timesteps, then 0 for the padding and empty slots

Padding rows (both streams) form their own sequence at the end of the joint buffer, so attention
never lets a real token see them; every other op is row-wise or reads per-sequence values by row id
(padding rows read slot n). Results therefore equal the eager forward of the same padded batch
(bit-equal: same kernels, same shapes) and the unpadded forward up to GEMM tiling.

Attention inside a graph must read the boundaries on the device: the captured metadata has
`for_graph=True`, AUTO then runs FA3 varlen (fa3-fwd, Hopper) or FA2 varlen, and SDPA builds its
block mask from `cu_seqlens` ("mask" impl). Per-sequence SDPA loops over host lengths and is refused.

Dense graphs (one image shape, `[B, S, C]`, no padding) are keyed by the exact shapes and captured
the first time a shape runs, up to `max_dense_graphs`; anything else runs eager. All graphs share one
memory pool, captured largest first; a replay's output is copied out before the next replay. A graph
that fails to build or capture (an OOM, a kernel that does not compile on this GPU) is logged once at
ERROR and its batches run eager from then on: the server starts and steps keep running.

LoRA: a forward in which some row uses an adapter replays a second graph of its bucket (or dense
shape), captured the first time such a forward runs in it. It launches every LoRA linear's delta
kernels over static tile tables (`LoRABatch.static`), which `load` fills like the other static inputs;
padding rows and sequences get slot 0, "no adapter". Adapters live in fixed slots that loading writes
in place, so a replay reads the adapters loaded now. A forward without adapters replays the plain
graph, exactly the graph of a server without LoRA. When a linear gains or loses its slots
(`LoRAStepState.version`), the LoRA graphs are dropped and captured again on use.

A family whose packed forward reads more than this static layout (Qwen-Image-2.1: each sequence's
cached prefix K/V) brings its own static step (`interface.PackedStepGraphs`, the transformer's
`packed_graph_steps`): the bucket's second axis then counts what the family says (2.1: prefix rows),
the family's buffers and forward replace the layout above, and buckets, capture order, pool, padding
rule and replay stay here (2.1's design: the `graphs.py` of its family folder). Its optional
`graph_context_axis` (`interface.GraphContextAxis`) replaces the text-row sizes of the grid (the model
runner applies it: 2.1 with its prefix arena, prefix rows up to 8192).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm_omni.diffusion.attention.metadata import AttentionMetadata
from vllm_omni.diffusion.layout import PackedLayout, SequenceSpec, build_packed_layout
from vllm_omni.diffusion.models.interface import PackedStepGraphs, StaticPackedStep
from vllm_omni.lora.batch import LoRABatch
from vllm_omni.lora.layers import LoRAStepState

logger = logging.getLogger(__name__)


@dataclass(frozen=True, order=True)
class PackedBucket:
    """Static sizes of one packed graph: rows per stream and real-sequence slots."""

    num_img_rows: int
    num_txt_rows: int
    """Text rows (a family with its own graph step: its second-axis rows, e.g. 2.1's prefix rows)."""
    num_seqs: int
    """Real sequences it takes; one more slot holds the padding sequence."""

    @property
    def total_tokens(self) -> int:
        return self.num_img_rows + self.num_txt_rows

    def fits(self, num_img_rows: int, num_txt_rows: int, num_seqs: int) -> bool:
        return (
            num_img_rows <= self.num_img_rows
            and num_txt_rows <= self.num_txt_rows
            and num_seqs <= self.num_seqs
        )


QUANTIZED_IMG_ROWS = (7168, 8192)
"""Image-row buckets past 6144 for a transformer with quantized (FP8) linears. Its eager forward has
more host work per linear (the activation quantisation) and ~1.4x less GPU time, so where BF16 is
GPU-bound it is host-bound: a 1024x1024 CFG step (8192 image rows) ran 174 ms of kernels and ~190 ms
and more of wall time eager on the H200 (issue 25's page of the performance dashboard, the FP8 profile).
Replayed, the launches cost nothing, and the bucket pads ~1 %."""


@dataclass(frozen=True)
class CudaGraphConfig:
    """Which graphs to capture (like vLLM's cudagraph capture sizes) and when a padded replay pays.

    Measured on the H200 (performance_dashboard/h200_results/issue12/cuda_graph_check.json): a replay
    saves the ~100-150 ms of host launches of an eager forward, which matters while the GPU work is not
    much longer than that; past a few thousand tokens padding costs more than the launches saved
    (512+1024 padded 5.2k -> 6.4k tokens: 204 ms replayed vs 182 ms eager), so the grid steps by 1024
    rows from 4096 to 6144, where a batch pads little and eager still shows host time (two 768x1024
    images: 170.6 ms replayed vs 176.0 eager, issue12_r4/). Larger batches run eager (compiled ops,
    FA3; GPU-bound, launch gaps hidden): even a nearly full 8192-row bucket took a 1024x1024 CFG step
    (8266 -> 8320 tokens) to 238 ms against 231 ms eager (issue12_r2/). Dense same-shape batches
    replay exact-shape graphs without padding. With FP8 linears the grid goes on to 8192 image rows
    (`QUANTIZED_IMG_ROWS`: that eager forward is host-bound).
    """

    num_seqs: tuple[int, ...] = (1, 2, 4, 8, 16)
    """Sequence-slot buckets (a CFG request takes two)."""
    img_rows: tuple[int, ...] = (256, 512, 1024, 1536, 2048, 3072, 4096, 5120, 6144)
    """Image-row buckets."""
    txt_rows: tuple[int, ...] = (64, 128, 256, 512, 1024, 2048)
    """Text-row buckets (a bucket of s slots takes at most `txt_rows_per_seq` * s text rows). 64: one CFG
    request with a short prompt (~40 text rows) would otherwise pad to 128, 4 % more rows at 512x512.
    A family with its own second axis replaces both (`interface.GraphContextAxis`)."""
    txt_rows_per_seq: int = 512
    """Second-axis rows one sequence slot may bring (prunes buckets no batch can fill)."""
    max_padding: float = 0.25
    """A bucket is used only when its tokens are at most (1 + this) x the batch's real tokens ..."""
    pad_freely_below: int = 2048
    """... or at most this many: below it a forward is launch-bound and padding costs ~nothing."""
    max_dense_graphs: int = 8
    """Dense shapes captured on first use, at most this many; later new shapes run eager."""
    warmup_runs: int = 1
    """Eager runs before each capture (compiles the fused ops, fills caches, settles cuBLAS)."""

    @classmethod
    def for_max_num_seqs(cls, max_num_seqs: int, quantized: bool = False) -> CudaGraphConfig:
        """Sequence-slot buckets up to `2 * max_num_seqs` (every request with CFG), powers of two; with
        `quantized` linears also the image-row buckets of `QUANTIZED_IMG_ROWS`."""
        slots = [1]
        while slots[-1] < 2 * max_num_seqs:
            slots.append(slots[-1] * 2)
        img_rows = cls.img_rows + (QUANTIZED_IMG_ROWS if quantized else ())
        return cls(num_seqs=tuple(slots), img_rows=img_rows)

    def packed_buckets(self) -> list[PackedBucket]:
        """Every bucket of the grid that can hold a batch, largest first (>= 16 image rows and
        <= `txt_rows_per_seq` text rows per slot)."""
        buckets = {
            PackedBucket(img, txt, seqs)
            for seqs in self.num_seqs
            for img in self.img_rows
            for txt in self.txt_rows
            if img >= 16 * seqs and txt <= self.txt_rows_per_seq * seqs
        }
        return sorted(buckets, key=lambda b: (b.total_tokens, b.num_seqs), reverse=True)

    def pays(self, bucket: PackedBucket, real_tokens: int) -> bool:
        """Whether replaying `bucket` for a batch of `real_tokens` beats running it eager."""
        return bucket.total_tokens <= max(real_tokens * (1 + self.max_padding), self.pad_freely_below)


def select_bucket(buckets: list[PackedBucket], num_img_rows: int, num_txt_rows: int, num_seqs: int):
    """The fitting bucket with the fewest tokens (then slots), or None when none fits."""
    fitting = [b for b in buckets if b.fits(num_img_rows, num_txt_rows, num_seqs)]
    return min(fitting, key=lambda b: (b.total_tokens, b.num_seqs), default=None)


def _graph_layout(bucket: PackedBucket, like: PackedLayout, device, rope_dim: int) -> PackedLayout:
    """A layout of static buffers for `bucket`, initially one padding sequence over every row."""
    n_img, n_txt, total = bucket.num_img_rows, bucket.num_txt_rows, bucket.total_tokens
    slots = bucket.num_seqs + 1
    cu = torch.full((slots + 1,), total, dtype=torch.int32, device=device)
    cu[0] = 0
    attn = AttentionMetadata(
        is_varlen=True,
        cu_seqlens_q=cu,
        cu_seqlens_k=cu,
        max_seqlen_q=total,
        max_seqlen_k=total,
        seq_lens=[total] + [0] * (slots - 1),
        for_graph=True,
    )
    ones = lambda n: torch.ones(n, rope_dim, device=device)  # noqa: E731
    zeros = lambda n: torch.zeros(n, rope_dim, device=device)  # noqa: E731
    arange = torch.arange(total, device=device)
    # host offsets: the whole bucket as one block (only sizes are read from them in the forward)
    return dataclasses.replace(
        like,
        specs=tuple(SequenceSpec(1, (1, 1, 1)) for _ in range(slots)),
        attn=attn,
        txt_to_joint=arange[:n_txt].clone(),
        img_to_joint=arange[n_txt:].clone(),
        txt_seq_ids=torch.zeros(n_txt, dtype=torch.long, device=device),
        img_seq_ids=torch.zeros(n_img, dtype=torch.long, device=device),
        img_rope=(ones(n_img), zeros(n_img)),
        txt_rope=(ones(n_txt), zeros(n_txt)),
        img_row_offsets=[0] * slots + [n_img],
        txt_row_offsets=[0] * slots + [n_txt],
    )


def _lora_scope(lora_state: LoRAStepState | None, static: LoRABatch | None):
    """The scope in which a graph's forward runs: its static LoRA tables active (None: a plain graph,
    which must capture no delta even when called inside a step's LoRA scope)."""
    if lora_state is None:
        return contextlib.nullcontext()
    return lora_state.activate(static)


class PackedGraph:
    """One packed bucket: static inputs, the padded-batch loader, and its captured graph.

    `lora_state`: the model's LoRA state when LoRA is enabled; `with_lora`: this graph adds the
    deltas (its static tables in `self.lora`), else it runs with no LoRA batch. `family_step`: the
    family's own static step for this bucket (`interface.StaticPackedStep`), which replaces the
    static layout below."""

    def __init__(
        self,
        transformer,
        bucket: PackedBucket,
        like: PackedLayout,
        device,
        dtype,
        lora_state: LoRAStepState | None = None,
        with_lora: bool = False,
        family_step: StaticPackedStep | None = None,
    ):
        cfg = transformer.config
        self.transformer, self.bucket, self.lora_state = transformer, bucket, lora_state
        self.family_step = family_step
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | None = None
        self.lora: LoRABatch | None = None
        """Static LoRA tables (per stream: the bucket's rows, one run per sequence slot at most)."""
        self._lora_loaded: LoRABatch | None = None  # the forward's batch last copied in (held: no id reuse)
        if with_lora:
            rows = {"img": bucket.num_img_rows, "txt": bucket.num_txt_rows, "seq": bucket.num_seqs + 1}
            self.lora = LoRABatch.static(rows, bucket.num_seqs + 1, device)
        if family_step is not None:  # the family's buffers replace the static layout
            return
        self.img = torch.zeros(bucket.num_img_rows, cfg.in_channels, device=device, dtype=dtype)
        self.txt = torch.zeros(bucket.num_txt_rows, cfg.joint_attention_dim, device=device, dtype=dtype)
        self.timestep = torch.zeros(bucket.num_seqs + 1, device=device, dtype=dtype)
        self.layout = _graph_layout(bucket, like, device, cfg.attention_head_dim // 2)
        self.arange = torch.arange(max(bucket.num_img_rows, bucket.num_txt_rows), device=device)
        self._loaded: tuple[int, int] | None = None  # ids of the layout and text rows last loaded

    def run_eager(self) -> torch.Tensor:
        """The padded batch through the eager forward (the reference a replay must equal)."""
        with _lora_scope(self.lora_state, self.lora):
            if self.family_step is not None:
                return self.family_step.run_eager()
            return self.transformer.forward_packed(self.img, self.txt, self.timestep, self.layout)

    def load(self, img_rows, txt_rows, timestep, layout: PackedLayout, lora: LoRABatch | None = None) -> None:
        """Write a batch into the static buffers; composition-only parts only when they changed.
        `lora`: the forward's LoRA batch (a LoRA graph's; its rows are the padded batch's first rows)."""
        if self.lora is not None and lora is not self._lora_loaded:
            self.lora.load(lora)
            self._lora_loaded = lora
        if self.family_step is not None:
            self.family_step.load(img_rows, txt_rows, timestep, layout)
            return
        n_img, n_txt, n = layout.num_img_rows, layout.num_txt_rows, layout.num_seqs
        self.img[:n_img].copy_(img_rows)
        self.img[n_img:].zero_()
        self.timestep[:n].copy_(timestep)
        self.timestep[n:].zero_()
        key = (id(layout), id(txt_rows))
        if self._loaded == key:  # same composition as the last step: indices, RoPE and text unchanged
            return
        g, b, real = self.layout, self.bucket, layout.total_tokens
        pad_txt = b.num_txt_rows - n_txt
        self.txt[:n_txt].copy_(txt_rows)
        self.txt[n_txt:].zero_()
        # padding rows fill joint positions [real, total): text padding first, then image padding
        g.txt_to_joint[:n_txt].copy_(layout.txt_to_joint)
        torch.add(self.arange[:pad_txt], real, out=g.txt_to_joint[n_txt:])
        g.img_to_joint[:n_img].copy_(layout.img_to_joint)
        torch.add(self.arange[: b.num_img_rows - n_img], real + pad_txt, out=g.img_to_joint[n_img:])
        for dst, src, rows in (
            (g.txt_seq_ids, layout.txt_seq_ids, n_txt),
            (g.img_seq_ids, layout.img_seq_ids, n_img),
        ):
            dst[:rows].copy_(src)
            dst[rows:].fill_(n)  # the padding sequence's slot
        for (cos, sin), (src_cos, src_sin), rows in (
            (g.txt_rope, layout.txt_rope, n_txt),
            (g.img_rope, layout.img_rope, n_img),
        ):
            cos[:rows].copy_(src_cos)
            sin[:rows].copy_(src_sin)
            cos[rows:].fill_(1.0)
            sin[rows:].fill_(0.0)
        cu = g.attn.cu_seqlens_q
        cu[: n + 1].copy_(layout.attn.cu_seqlens_q)
        cu[n + 1 :].fill_(b.total_tokens)
        self._loaded = key

    def run(self) -> torch.Tensor:
        """Replay when captured, else the eager forward of the padded batch."""
        if self.graph is None:
            return self.run_eager()
        self.graph.replay()
        return self.out


@dataclass(frozen=True)
class DenseKey:
    """Exact shapes of a dense graph."""

    batch: int
    num_img: int
    num_txt: int
    img_shape: tuple[int, int, int]
    masked: bool


class DenseGraph:
    """One dense shape: static inputs and its captured graph (with LoRA tables: see `PackedGraph`)."""

    def __init__(
        self,
        transformer,
        key: DenseKey,
        device,
        dtype,
        lora_state: LoRAStepState | None = None,
        with_lora: bool = False,
    ):
        cfg = transformer.config
        self.transformer, self.key, self.lora_state = transformer, key, lora_state
        self.img = torch.zeros(key.batch, key.num_img, cfg.in_channels, device=device, dtype=dtype)
        self.txt = torch.zeros(key.batch, key.num_txt, cfg.joint_attention_dim, device=device, dtype=dtype)
        self.mask = (
            torch.ones(key.batch, key.num_txt, dtype=torch.long, device=device) if key.masked else None
        )
        self.timestep = torch.zeros(key.batch, device=device, dtype=dtype)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | None = None
        self.lora: LoRABatch | None = None
        if with_lora:
            rows = {"img": key.batch * key.num_img, "txt": key.batch * key.num_txt, "seq": key.batch}
            self.lora = LoRABatch.static(rows, key.batch, device)

    def load(
        self, hidden_states, encoder_hidden_states, mask, timestep, lora: LoRABatch | None = None
    ) -> None:
        self.img.copy_(hidden_states)
        self.txt.copy_(encoder_hidden_states)
        self.timestep.copy_(timestep)
        if self.mask is not None:
            self.mask.copy_(mask)
        if self.lora is not None:
            self.lora.load(lora)

    def run_eager(self) -> torch.Tensor:
        shapes = [self.key.img_shape] * self.key.batch
        with _lora_scope(self.lora_state, self.lora):
            return self.transformer(self.img, self.txt, self.mask, self.timestep, shapes)

    def run(self) -> torch.Tensor:
        if self.graph is None:
            return self.run_eager()
        self.graph.replay()
        return self.out


GRAPH_BACKENDS = ("AUTO", "FLASH_ATTN", "FLASH_ATTN_3")
"""Attention backends whose packed kernel reads the boundaries on the device (graph-safe)."""


def graphs_off_reason(
    transformer,
    device: torch.device,
    enforce_eager: bool,
    batch_invariant: bool,
    model_reason: str | None = None,
) -> str | None:
    """Why the forward must stay eager here, or None when CUDA graphs can be used.

    `model_reason`: the pipeline's own reason its step is not captured (its optional
    `cuda_graphs_off_reason`), reported as such."""
    if enforce_eager:
        return "--enforce-eager"
    if torch.device(device).type != "cuda":
        return f"device {torch.device(device).type} (CUDA graphs need CUDA)"
    if batch_invariant:
        return "batch-invariant mode (its per-sequence attention loops over host lengths)"
    if model_reason is not None:
        return f"{type(transformer).__name__}: {model_reason}"
    if transformer.cuda_graphs_off_reason is not None:  # a parallel wrapper: its collectives stay eager
        return f"{type(transformer).__name__} ({transformer.cuda_graphs_off_reason})"
    name = transformer.get_attn_backend(torch.device(device)).name
    if name not in GRAPH_BACKENDS:
        return f"attention backend {name} (graphs need one of {list(GRAPH_BACKENDS)})"
    return None


class CUDAGraphRunner:
    """The transformer forward the model runner calls: graph replay when a batch fits, else eager.

    `forward_packed(img_rows, txt_rows, timestep, layout)` and `forward_dense(hidden_states,
    encoder_hidden_states, encoder_hidden_states_mask, timestep, img_shapes)` take and return what
    `transformer.forward_packed` / `transformer(...)` do. `enabled=False` (--enforce-eager, CPU,
    batch-invariant mode) makes both plain eager calls. `capture=False` keeps the bucket padding but
    runs the padded batch eagerly (tests on CPU; nothing is captured).

    `lora_state`: the transformer's `LoRAStepState` when LoRA is enabled. A forward called while it
    holds a batch (inside `LoRAManager.activate`) replays the bucket's LoRA graph (see the module
    docstring).
    """

    def __init__(
        self,
        transformer,
        device: torch.device | str,
        dtype: torch.dtype,
        config: CudaGraphConfig | None = None,
        enabled: bool = True,
        capture: bool = True,
        lora_state: LoRAStepState | None = None,
    ):
        self.transformer, self.device, self.dtype = transformer, torch.device(device), dtype
        self.config = config or CudaGraphConfig()
        self.enabled = enabled
        self.capture_graphs = capture and enabled and self.device.type == "cuda"
        self.buckets = self.config.packed_buckets() if enabled else []
        self.lora_state = lora_state
        self._packed: dict[tuple[PackedBucket, bool], PackedGraph] = {}
        """Graphs by (bucket, with LoRA)."""
        self._dense: dict[tuple[DenseKey, bool], DenseGraph] = {}
        self._failed: set[tuple] = set()
        """Keys of `_packed` / `_dense` whose graph failed to build or capture: they run eager."""
        self._lora_version = None if lora_state is None else lora_state.version
        """The slots' layout version the LoRA graphs were captured under."""
        self._pool = None
        self.family_steps: PackedStepGraphs | None = None
        """The transformer's own static step (`packed_graph_steps`), its buffers sized for the grid."""
        make_steps = transformer.packed_graph_steps
        if enabled and make_steps is not None and self.buckets:
            max_img = max(b.num_img_rows for b in self.buckets)
            max_ctx = max(b.num_txt_rows for b in self.buckets)
            self.family_steps = make_steps(max_img, max_ctx, self.device, dtype)
            logger.info(
                "CUDA graphs: %s's static step buffers (%d image + %d second-axis rows): %.2f GiB",
                type(transformer).__name__,
                max_img,
                max_ctx,
                self.family_steps.num_bytes / 2**30,
            )
        self.last_path = "eager"
        """'graph' (replayed or padded), 'eager' (no bucket fits / graphs off): the last forward's path."""

    # ---- start-up --------------------------------------------------------------------------

    def capture_all(self, like: PackedLayout | None = None) -> None:
        """Capture every packed bucket (largest first, one shared pool), logging time and memory.

        `like`: any layout of this model (its RoPE settings are copied into the static layouts);
        by default a one-token layout built from the model's config.
        """
        if not self.enabled:
            return
        if like is None:
            positions = self.transformer.position_tables
            like = build_packed_layout([SequenceSpec(1, (1, 1, 1))], positions, device=self.device)
        from tqdm.auto import tqdm

        start, free_before = time.perf_counter(), self._free_memory()
        bar = tqdm(self.buckets, desc="capturing CUDA graphs", unit="graph", disable=not self.capture_graphs)
        for bucket in bar:
            self._packed_graph(bucket, like)  # a failure is logged; that bucket runs eager
        bar.set_postfix_str(f"{(free_before - self._free_memory()) / 2**30:.2f} GiB")
        bar.close()
        logger.info(
            "CUDA graphs: %d packed buckets (%s) in %.1f s, %.2f GiB of device memory",
            len(self.buckets),
            "captured" if self.capture_graphs else "padded eager, not captured",
            time.perf_counter() - start,
            (free_before - self._free_memory()) / 2**30,
        )

    def _free_memory(self) -> int:
        if self.device.type != "cuda":
            return 0
        torch.cuda.synchronize(self.device)
        return torch.cuda.mem_get_info(self.device)[0]

    def _capture(self, run: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm up `run` on a side stream (torch's recipe), then capture it into the shared pool."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(self.config.warmup_runs):
                run()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = run()
        return graph, out

    def _packed_graph(
        self, bucket: PackedBucket, like: PackedLayout, with_lora: bool = False
    ) -> PackedGraph | None:
        """The bucket's graph, built (and captured) on first use; None when that failed once."""
        key = (bucket, with_lora)
        if key in self._failed:
            return None
        try:
            return self._build_packed_graph(bucket, like, with_lora)
        except Exception:
            self._note_failure(key, f"bucket {bucket}{' with LoRA' if with_lora else ''}")
            self._packed.pop(key, None)
            return None

    def _note_failure(self, key: tuple, what: str) -> None:
        """A graph that failed to build or capture (an OOM, a kernel that does not compile on this GPU):
        its batches run eager from now on, the server stays up, and the log says why once."""
        self._failed.add(key)
        logger.exception("CUDA graph of %s failed to capture; its batches run eager", what)

    def _build_packed_graph(self, bucket: PackedBucket, like: PackedLayout, with_lora: bool) -> PackedGraph:
        graph = self._packed.get((bucket, with_lora))
        if graph is None:
            family_step = None
            if self.family_steps is not None:
                family_step = self.family_steps.static_step(*dataclasses.astuple(bucket))
            graph = self._packed[bucket, with_lora] = PackedGraph(
                self.transformer,
                bucket,
                like,
                self.device,
                self.dtype,
                self.lora_state,
                with_lora,
                family_step,
            )
            if self.capture_graphs:
                start = time.perf_counter()
                with torch.inference_mode():
                    graph.graph, graph.out = self._capture(graph.run_eager)
                if with_lora:
                    logger.info(
                        "CUDA graph of %s with LoRA captured in %.2f s", bucket, time.perf_counter() - start
                    )
        return graph

    def _step_lora(self) -> LoRABatch | None:
        """The LoRA batch of the forward being called (None: no adapter on any row, the plain graphs).

        First drops the LoRA graphs captured before a linear gained or lost its slots."""
        if self.lora_state is None:
            return None
        if self.lora_state.version != self._lora_version:
            stale = [k for k in self._packed if k[1]], [k for k in self._dense if k[1]]
            for key in stale[0]:
                del self._packed[key]
            for key in stale[1]:
                del self._dense[key]
            if any(stale):
                logger.info("LoRA slots changed: %d CUDA graphs with LoRA dropped", sum(map(len, stale)))
            self._lora_version = self.lora_state.version
        return self.lora_state.batch

    def prefers_packed(self, txt_lens: list[int], img_lens: list[int]) -> bool:
        """For a same-shape batch: run it packed rather than dense?

        With graphs on, yes when the text lengths differ (the dense path would need a key mask:
        masked SDPA, and an exact-shape graph per text length) or when a packed bucket pays (its
        replay serves any composition); otherwise the dense path (exact-shape graph or eager).
        """
        if not self.enabled:
            return False
        if len(set(txt_lens)) > 1:
            return True
        num_txt, num_img = sum(txt_lens), sum(img_lens)
        bucket = select_bucket(self.buckets, num_img, num_txt, len(txt_lens))
        return bucket is not None and self.config.pays(bucket, num_txt + num_img)

    # ---- the forwards ----------------------------------------------------------------------

    @torch.inference_mode()
    def forward_packed(
        self, img_rows: torch.Tensor, txt_rows: torch.Tensor, timestep: torch.Tensor, layout: PackedLayout
    ) -> torch.Tensor:
        """`transformer.forward_packed`, replayed in the smallest fitting bucket: [num_img_rows, C_out]."""
        num_ctx = layout.num_txt_rows
        if self.family_steps is not None:
            num_ctx = self.family_steps.bucket_rows(txt_rows, layout)
        bucket = select_bucket(self.buckets, layout.num_img_rows, num_ctx, layout.num_seqs)
        if bucket is None or not self.config.pays(bucket, layout.num_img_rows + num_ctx):
            self.last_path = "eager"
            return self.transformer.forward_packed(img_rows, txt_rows, timestep, layout)
        self.transformer.check_packed(img_rows, txt_rows, timestep, layout)
        lora = self._step_lora()
        graph = self._packed_graph(bucket, layout, with_lora=lora is not None)
        if graph is None:
            self.last_path = "eager"
            return self.transformer.forward_packed(img_rows, txt_rows, timestep, layout)
        graph.load(img_rows, txt_rows, timestep, layout, lora)
        self.last_path = "graph"
        return graph.run()[: layout.num_img_rows].clone()

    @torch.inference_mode()
    def forward_dense(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        encoder_hidden_states_mask: torch.Tensor | None,
        timestep: torch.Tensor,
        img_shapes: list,
    ) -> torch.Tensor:
        """`transformer(...)` (dense), replayed for shapes seen before: [B, S_img, C_out]."""
        args = (hidden_states, encoder_hidden_states, encoder_hidden_states_mask, timestep, img_shapes)
        if not self.enabled:
            self.last_path = "eager"
            return self.transformer(*args)
        img_shape = self.transformer.check_dense(*args)
        key = DenseKey(
            hidden_states.shape[0],
            hidden_states.shape[1],
            encoder_hidden_states.shape[1],
            img_shape,
            encoder_hidden_states_mask is not None,
        )
        lora = self._step_lora()
        graph_key = (key, lora is not None)
        graph = self._dense.get(graph_key)
        inputs = (hidden_states, encoder_hidden_states, encoder_hidden_states_mask, timestep, lora)
        if graph is None:
            if len(self._dense) >= self.config.max_dense_graphs or graph_key in self._failed:
                self.last_path = "eager"
                return self.transformer(*args)
            try:
                graph = self._build_dense_graph(key, lora, inputs)
            except Exception:
                self._note_failure(graph_key, f"dense shape {key}{' with LoRA' if lora is not None else ''}")
                self.last_path = "eager"
                return self.transformer(*args)
        graph.load(*inputs)
        self.last_path = "graph"
        return graph.run().clone()

    def _build_dense_graph(self, key: DenseKey, lora: LoRABatch | None, inputs: tuple) -> DenseGraph:
        graph = DenseGraph(self.transformer, key, self.device, self.dtype, self.lora_state, lora is not None)
        graph.load(*inputs)
        if self.capture_graphs:
            start = time.perf_counter()
            graph.graph, graph.out = self._capture(graph.run_eager)
            logger.info(
                "CUDA graph of dense shape %s%s captured in %.2f s",
                key,
                " with LoRA" if lora is not None else "",
                time.perf_counter() - start,
            )
        self._dense[key, lora is not None] = graph
        return graph

    def __repr__(self) -> str:
        mode = "off" if not self.enabled else ("captured" if self.capture_graphs else "padded eager")
        return f"CUDAGraphRunner({mode}, {len(self.buckets)} packed buckets, {len(self._dense)} dense graphs)"

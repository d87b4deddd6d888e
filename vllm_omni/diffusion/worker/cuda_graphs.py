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

By graph kind: `graph_buckets.py` (the packed grid: buckets, which to capture, which one a batch takes,
when padding pays), `graph_packed.py` (`PackedGraph`: a bucket's static buffers and loader),
`graph_dense.py` (`DenseGraph`: one exact dense shape); here the runner (`CUDAGraphRunner`: capture,
pool, LoRA graph versions, replay or eager) and when graphs are off (`graphs_off_reason`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import torch

from vllm_omni.diffusion.layout import PackedLayout, SequenceSpec, build_packed_layout
from vllm_omni.diffusion.models.interface import DenseInputs, PackedStepGraphs
from vllm_omni.diffusion.worker.graph_buckets import (  # noqa: F401  (the runner's grid, re-exported)
    QUANTIZED_IMG_ROWS,
    CudaGraphConfig,
    PackedBucket,
    select_bucket,
)
from vllm_omni.diffusion.worker.graph_dense import DenseGraph, DenseKey
from vllm_omni.diffusion.worker.graph_packed import PackedGraph
from vllm_omni.lora.batch import LoRABatch
from vllm_omni.lora.layers import LoRAStepState

logger = logging.getLogger(__name__)


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
        # thread_local: the decode worker's thread may allocate and sync on its own stream meanwhile
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
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
        inputs = DenseInputs(
            hidden_states, encoder_hidden_states, encoder_hidden_states_mask, timestep, img_shapes
        )
        if not self.enabled:
            self.last_path = "eager"
            return self.transformer(*inputs.args)
        key = DenseKey.of(inputs, self.transformer.check_dense(inputs))
        lora = self._step_lora()
        graph_key = (key, lora is not None)
        graph = self._dense.get(graph_key)
        if graph is None:
            if len(self._dense) >= self.config.max_dense_graphs or graph_key in self._failed:
                self.last_path = "eager"
                return self.transformer(*inputs.args)
            try:
                graph = self._build_dense_graph(key, lora, inputs)
            except Exception:
                self._note_failure(graph_key, f"dense shape {key}{' with LoRA' if lora is not None else ''}")
                self.last_path = "eager"
                return self.transformer(*inputs.args)
        graph.load(inputs, lora)
        self.last_path = "graph"
        return graph.run().clone()

    def _build_dense_graph(self, key: DenseKey, lora: LoRABatch | None, inputs: DenseInputs) -> DenseGraph:
        graph = DenseGraph(self.transformer, key, self.device, self.dtype, self.lora_state, lora is not None)
        graph.load(inputs, lora)
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

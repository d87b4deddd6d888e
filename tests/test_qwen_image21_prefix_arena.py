"""Qwen-Image-2.1's prefix arena (models/qwen_image21/prefix_arena.py): the row allocator, prefixes
prefilled into fixed rows, the CUDA-graph step gathering from them, and admission against it.

On CPU the arena is made explicitly (the runner makes one only on CUDA with graphs on). An arena-backed
transformer must give the per-request-tensor path's outputs bit for bit; the static bucket step that
gathers from the arena (what a graph captures) must equal the staging-store bucket bit for bit and the
unpadded forward up to fp32 rounding, also for a prefix longer than the old 2048-row grid.
"""

from __future__ import annotations

import logging
import random

import numpy as np
import pytest
import torch
from tiny21 import CASES, TINY, admit, eager, make_request, tiny21_engine
from tiny21 import max_rel_err as rel_err
from utils import run_to_completion

from vllm_omni.config import OmniDiffusionConfig
from vllm_omni.diffusion.attention import SDPABackend
from vllm_omni.diffusion.engine import DiffusionEngine
from vllm_omni.diffusion.layout import SequenceSpec, build_packed_layout
from vllm_omni.diffusion.models.qwen_image21.graphs import (
    ARENA_PREFIX_ROW_BUCKETS,
    TRANSIENT_OWNER,
    arena_sources,
    static_indices,
)
from vllm_omni.diffusion.models.qwen_image21.prefix_arena import (
    PrefixArena,
    PrefixArenaFull,
    RowAllocator,
    arena_rows,
)
from vllm_omni.diffusion.models.qwen_image21.prefix_cache import PrefixKV
from vllm_omni.diffusion.models.qwen_image21.tiny import TINY_MODEL_NAME
from vllm_omni.diffusion.models.qwen_image21.transformer import QwenImage21Transformer
from vllm_omni.diffusion.worker.cuda_graphs import CudaGraphConfig, CUDAGraphRunner
from vllm_omni.inputs import InvalidRequestError

GRAPHS = CudaGraphConfig(num_seqs=(2, 4, 8), img_rows=(64, 128), txt_rows=(64, 128))
LONG_GRAPHS = CudaGraphConfig(
    num_seqs=(2, 4), img_rows=(64, 128), txt_rows=ARENA_PREFIX_ROW_BUCKETS, txt_rows_per_seq=8192
)
"""The arena's prefix-row axis (to 8192 rows) on a small image axis."""
ENGINE_LOG = "vllm_omni.diffusion.engine"

# ---- the allocator ----------------------------------------------------------------------------


def test_first_fit_takes_the_lowest_range_that_fits():
    rows = RowAllocator(100)
    assert [rows.alloc(n) for n in (10, 20, 30)] == [0, 10, 30]
    rows.free(0, 10)  # holes: [0, 10) and [60, 100)
    assert rows.alloc(15) == 60, "the first hole is too small"
    assert rows.alloc(10) == 0, "the first hole fits exactly"
    assert rows.free_ranges == [(75, 25)]


def test_release_coalesces_neighbours_in_any_order():
    rows = RowAllocator(60)
    a, b, c = rows.alloc(20), rows.alloc(20), rows.alloc(20)
    assert rows.free_ranges == [] and rows.alloc(1) is None
    rows.free(a, 20)
    rows.free(c, 20)
    assert rows.free_ranges == [(0, 20), (40, 20)]
    rows.free(b, 20)  # joins both neighbours
    assert rows.free_ranges == [(0, 60)]
    assert rows.alloc(60) == 0


def test_exhaustion_and_double_free():
    rows = RowAllocator(10)
    assert rows.alloc(11) is None
    start = rows.alloc(6)
    assert rows.alloc(5) is None and rows.alloc(4) == 6 and rows.num_free == 0
    rows.free(start, 6)
    with pytest.raises(ValueError, match="already free"):
        rows.free(start + 2, 2)
    with pytest.raises(ValueError, match="not inside"):
        rows.free(8, 5)


@pytest.mark.parametrize("seed", range(5))
def test_random_alloc_free_never_overlaps_and_stays_first_fit(seed):
    """Against a reference occupancy array: no row handed out twice, the free list is exactly the free
    rows (sorted, coalesced), every allocation is the lowest fitting start, and a refusal means no hole
    is large enough."""
    rng = random.Random(seed)
    capacity = 500
    rows, used = RowAllocator(capacity), np.zeros(capacity, dtype=bool)
    held: list[tuple[int, int]] = []
    for _ in range(2000):
        if held and rng.random() < 0.45:
            start, n = held.pop(rng.randrange(len(held)))
            rows.free(start, n)
            used[start : start + n] = False
        else:
            n = rng.randint(1, 60)
            start = rows.alloc(n)
            runs = [s for s in range(capacity - n + 1) if not used[s : s + n].any()]
            if start is None:
                assert not runs, "refused although a hole fits"
                continue
            assert start == runs[0], "not first fit"
            used[start : start + n] = True
            held.append((start, n))
        free = rows.free_ranges
        assert all(a[0] + a[1] < b[0] for a, b in zip(free, free[1:])), "unsorted or not coalesced"
        mask = np.zeros(capacity, dtype=bool)
        for s, n in free:
            mask[s : s + n] = True
        assert np.array_equal(mask, ~used)


def test_reservation_then_allocation_then_release():
    arena = PrefixArena(2, 40, 1, 4, "cpu", torch.float32)
    assert arena.row_bytes == 2 * 2 * 4 * 4 and arena.num_bytes == 40 * arena.row_bytes
    assert arena.reserve("a", 12) and arena.reserve("b", 20)
    assert not arena.reserve("c", 9), "8 rows left"
    assert arena.allocate("a", 7) == 0 and arena.allocate("a", 5) == 7, "inside a's reservation"
    assert arena.allocate("b", 3) == 12
    assert arena.allocate("c", 8) == 32, "no reservation: free rows"
    with pytest.raises(PrefixArenaFull, match="no 1 contiguous free rows for d"):
        arena.allocate("d", 1)
    assert arena.release("c") == 8
    assert arena.allocate("a", 4) == 32, "past a's reservation: a new block of a's"
    assert arena.owner_rows("a") == 16
    assert arena.release("a") == 16 and arena.release("a") == 0
    assert arena.reserve("c", 12) and arena.rows.free_ranges == [(32, 8)], "a's first rows are free again"
    assert arena.owner_rows("c") == 12


def test_default_size():
    row = 512 * 2**10
    assert arena_rows(row, 3 * row + 5, free_bytes=0) == 3
    assert arena_rows(row, None, free_bytes=140 * 2**30) == 65536  # 32 GiB: 8 CFG edits of 2 x 4096 rows
    assert arena_rows(row, None, free_bytes=40 * 2**30) == 10 * 2**30 // row  # a quarter of 40 GiB


# ---- the transformer and its graph step -------------------------------------------------------


def _model(with_arena: bool, rows: int = 8192) -> QwenImage21Transformer:
    torch.manual_seed(0)
    model = QwenImage21Transformer(TINY, attn_backend=SDPABackend("mask")).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    if with_arena:
        row_bytes = 2 * TINY.num_layers * TINY.num_attention_heads * TINY.attention_head_dim * 4
        model.enable_prefix_arena(rows * row_bytes, "cpu", torch.float32)
    return model


@pytest.fixture(scope="module")
def models():
    return _model(False), _model(True)


@torch.inference_mode()
def test_arena_prefill_and_packed_forward_equal_the_per_request_tensors(models):
    plain, arena_model = models
    arena = arena_model.prefix_arena
    for model in models:
        gen = torch.Generator().manual_seed(5)
        txt = torch.randn(9, 32, generator=gen)
        model.prefix_cache.put("q", False, model.prefill(txt, owner="q"))
    want, got = plain.prefix_cache.get("q", False), arena_model.prefix_cache.get("q", False)
    assert want.arena_start is None and got.arena_start is not None
    assert got.key.data_ptr() == arena.key[:, got.arena_start].data_ptr(), "a view of the arena"
    assert torch.equal(got.key, want.key) and torch.equal(got.value, want.value)
    assert got.num_bytes == want.num_bytes
    # the mixed batch (CFG, an edit prefix, an uncached sequence) through forward_packed
    outs = []
    for model in models:
        inputs = _admit_into(model, seed=4)
        outs.append(model.forward_packed(*inputs))
        model.prefix_cache.release(["a", "e"])
    assert torch.equal(outs[0], outs[1])
    for model in models:
        assert model.prefix_cache.release(["q"]) > 0
    assert arena.num_free_rows == arena.capacity_rows


def _admit_into(model, seed: int):
    """The graphs test's batch with its cached prefixes prefilled as the pipeline does (owner=req_id)."""
    inputs = admit(model, seed=seed)
    specs = inputs[3].specs
    txt_offsets = inputs[3].txt_row_offsets
    # re-prefill the cached (non-edit) sequences as owned entries; the edit keeps its own tensors
    # (a cached prefix outside the arena: the graph step places it in transient rows)
    for i, spec in enumerate(specs):
        if spec.req_id == "a":
            txt = inputs[1][txt_offsets[i] : txt_offsets[i + 1]]
            model.prefix_cache.put("a", spec.is_negative, model.prefill(txt, owner="a"))
    return inputs


@torch.inference_mode()
def test_arena_bucket_equals_staging_bucket_and_the_unpadded_forward(models):
    """The same padded batch in a bucket that gathers from the arena and in one that reads the staging
    store: bit for bit; and the unpadded forward up to fp32 rounding. The batch mixes arena prefixes,
    a cached prefix outside the arena and an uncached sequence (both placed in transient rows)."""
    outs = []
    for model in models:
        inputs = _admit_into(model, seed=6)
        runner = CUDAGraphRunner(model, "cpu", torch.float32, GRAPHS, capture=False)
        outs.append(runner.forward_packed(*inputs))
        assert runner.last_path == "graph"
        if model.prefix_arena is not None:
            assert runner.family_steps.staging.prefix_key.numel() == 0, "no staging store"
            (graph,) = runner._packed.values()
            step = graph.family_step
            a_start = model.prefix_cache.get("a", False).arena_start
            assert step.prefix_src[:7].tolist() == list(range(a_start, a_start + 7))
            edit_rows, uncached_rows = model.prefix_cache.get("e", False).num_rows, 5
            assert model.prefix_arena.owner_rows(TRANSIENT_OWNER) == edit_rows + uncached_rows
            want = eager(model, *inputs)
            assert rel_err(outs[-1], want) < 1e-6 and want.abs().max() > 0.1
        model.prefix_cache.release(["a", "e"])
    assert torch.equal(outs[0], outs[1])


@torch.inference_mode()
def test_unused_arena_rows_never_reach_real_rows(models):
    _, model = models
    inputs = _admit_into(model, seed=7)
    runner = CUDAGraphRunner(model, "cpu", torch.float32, GRAPHS, capture=False)
    n_img = inputs[3].num_img_rows
    runner.forward_packed(*inputs)
    (graph,) = runner._packed.values()
    before = graph.run_eager()[:n_img].clone()
    arena = model.prefix_arena
    used = set(graph.family_step.prefix_src.tolist())
    free = torch.tensor([r for r in range(arena.capacity_rows) if r not in used and r != 0])
    arena.key[:, free] = 50.0  # rows no sequence of this batch owns (row 0: the unused rows' source)
    arena.value[:, free] = -50.0
    assert torch.equal(graph.run_eager()[:n_img], before)
    arena.key.zero_()
    arena.value.zero_()
    model.prefix_cache.release(["a", "e"])


@pytest.mark.parametrize(("num_rows", "bucket_rows"), [(2500, 3072), (4200, 5120)])
@torch.inference_mode()
def test_a_prefix_longer_than_2048_rows_runs_in_a_bucket(models, num_rows, bucket_rows):
    """A long prompt (4200 rows: about an edit with a 1024 x 1024 reference) and a short CFG negative
    in a bucket past the old 2048-row grid (whose batches ran eager); equal to the unpadded forward."""
    _, model = models
    gen = torch.Generator().manual_seed(8)
    long_txt, neg_txt = torch.randn(num_rows, 32, generator=gen), torch.randn(6, 32, generator=gen)
    model.prefix_cache.put("long", False, model.prefill(long_txt, owner="long"))
    model.prefix_cache.put("long", True, model.prefill(neg_txt, owner="long"))
    specs = [
        SequenceSpec(num_rows, (1, 4, 6), req_id="long"),
        SequenceSpec(6, (1, 4, 6), req_id="long", is_negative=True),
    ]
    layout = build_packed_layout(specs, model.position_tables)
    inputs = (
        torch.randn(layout.num_img_rows, 16, generator=gen),
        torch.cat([long_txt, neg_txt]),
        torch.tensor([0.8, 0.8]),
        layout,
    )
    runner = CUDAGraphRunner(model, "cpu", torch.float32, LONG_GRAPHS, capture=False)
    out = runner.forward_packed(*inputs)
    assert runner.last_path == "graph"
    (graph,) = runner._packed.values()
    assert graph.bucket.num_txt_rows == bucket_rows
    want = eager(model, *inputs)
    print(f"{num_rows + 6} prefix rows, arena bucket vs unpadded forward: rel {rel_err(out, want):.2e}")
    assert rel_err(out, want) < 1e-5 and want.abs().max() > 0.1
    assert model.prefix_cache.release(["long"]) == (num_rows + 6) * model.prefix_arena.row_bytes


def test_index_tables_of_a_long_prefix():
    """A 6000-row edit prefix next to a 40-row prompt in a (128, 8192, 2) bucket: the K/V rows are one
    bijection and the arena sources follow each prefix's rows, then row 0."""
    prefixes = [_fake_prefix(1000, 6000), _fake_prefix(50, 40)]
    host = static_indices([0, 64, 100], [6000, 40], num_img_rows=128, num_prefix_rows=8192, num_seqs=2)
    rows = np.concatenate([host["img_index"], host["prefix_index"]])
    assert sorted(rows.tolist()) == list(range(128 + 8192))
    assert host["cu_seqlens_k"].tolist() == [0, 6064, 6140, 6168]
    assert host["prefix_index"][5999] == 5999 and host["prefix_index"][6000] == 6064
    src = arena_sources(prefixes, 8192)
    assert src.tolist() == [*range(1000, 7000), *range(50, 90), *[0] * (8192 - 6040)]


def _fake_prefix(start: int, rows: int) -> PrefixKV:
    empty = torch.empty(1, rows, 1, 1)
    return PrefixKV(empty, empty, target_frame=rows, arena_start=start)


@torch.inference_mode()
def test_transient_prefixes_that_do_not_fit_run_eager():
    """A synthetic forward (no cached prefix) whose prefill does not fit next to the arena's held rows
    runs the eager forward (per-request tensors), not a bucket."""
    model = _model(True, rows=12)
    model.prefix_cache.put("held", False, model.prefill(torch.randn(8, 32), owner="held"))
    layout = build_packed_layout([SequenceSpec(5, (1, 4, 4), req_id="synthetic")], model.position_tables)
    inputs = (torch.randn(16, 16), torch.randn(5, 32), torch.tensor([0.5]), layout)
    runner = CUDAGraphRunner(model, "cpu", torch.float32, GRAPHS, capture=False)
    runner.forward_packed(*inputs)
    assert runner.last_path == "eager"
    model.prefix_cache.release(["held"])
    out = runner.forward_packed(*inputs)
    assert runner.last_path == "graph"
    assert rel_err(out, eager(model, *inputs)) < 1e-6


def test_a_full_arena_fails_the_prefill_before_computing():
    model = _model(True, rows=10)
    model.prefill(torch.randn(8, 32), owner="a")
    with pytest.raises(PrefixArenaFull):
        model.prefill(torch.randn(3, 32), owner="b")
    assert model.prefix_arena.owner_rows("b") == 0
    model.prefix_cache.put("a", False, model.prefill(torch.randn(2, 32)))
    with pytest.raises(ValueError, match="before any prefix is cached"):
        model.enable_prefix_arena(None, "cpu", torch.float32)


# ---- the engine: admission against the arena --------------------------------------------------


def _engine(arena_rows: int | None) -> DiffusionEngine:
    engine = tiny21_engine(scheduling_policy="skip-ahead")
    if arena_rows is not None:  # what the runner does on CUDA at start-up
        pipeline = engine.executor.driver_worker.pipeline
        arena = pipeline.transformer.enable_prefix_arena(
            arena_rows * pipeline.prefix_row_bytes, "cpu", torch.float32
        )
        engine.memory.prefix_arena = arena
    return engine


def _rows(engine, requests) -> list[int]:
    return [engine.validate_request(r).num_prefix_cache_rows for r in requests]


def test_engine_images_with_the_arena_equal_without(caplog):
    """Every CASE packed and staggered: the arena engine's images equal the plain engine's bit for bit;
    the arena holds each request's rows while it runs and none after."""
    plain = _engine(None)
    rows = sum(_rows(plain, [make_request(plain, i, c) for i, c in enumerate(CASES)]))
    images = {}
    for name, engine in (("plain", plain), ("arena", _engine(rows + 7))):
        handles = [engine.add_request(make_request(engine, 700 + i, c)) for i, c in enumerate(CASES[:2])]
        futures = [h.future for h in handles]
        engine.step()
        cache = engine.executor.driver_worker.pipeline.transformer.prefix_cache
        first = [cache.get(h.req_id, is_negative) for h in handles for is_negative in (False, True)]
        first = [p for p in first if p is not None]
        if name == "arena":  # prefilled into the rows reserved at admission, no more
            arena = engine.memory.prefix_arena
            assert all(p.arena_start is not None for p in first)
            assert arena.capacity_rows - arena.num_free_rows == sum(p.num_rows for p in first)
        else:
            assert all(p.arena_start is None for p in first)
        futures += [
            engine.add_request(make_request(engine, 700 + i, c)).future
            for i, c in enumerate(CASES[2:], start=2)
        ]
        images[name] = run_to_completion(engine, futures)
        cache = engine.executor.driver_worker.pipeline.transformer.prefix_cache
        assert len(cache) == 0
    assert arena.num_free_rows == arena.capacity_rows and arena.rows.free_ranges == [(0, rows + 7)]
    for got, want in zip(images["arena"], images["plain"], strict=True):
        assert np.array_equal(got, want)


def test_engine_request_waits_for_arena_rows_and_one_too_large_is_refused(caplog):
    probe = _engine(None)
    requests = [make_request(probe, i, c) for i, c in enumerate(CASES[:2])]
    needs = _rows(probe, requests)
    engine = _engine(max(needs) + min(needs) // 2)  # one at a time, never both
    with caplog.at_level(logging.INFO, logger=ENGINE_LOG):
        futures = [
            engine.add_request(make_request(engine, 600 + i, c)).future for i, c in enumerate(CASES[:2])
        ]
    assert len(engine._memory_waiting) == 1, "the second waits for the first's arena rows"
    assert any("waits for memory" in r.getMessage() for r in caplog.records)
    assert any("prefix KV arena" in r.getMessage() for r in caplog.records)
    arena = engine.memory.prefix_arena
    assert arena.num_free_rows == arena.capacity_rows - needs[0], "the first's rows reserved at admission"
    steps = []
    run_to_completion(engine, futures, steps)
    assert max(s.num_reqs for s in steps) == 1
    assert arena.num_free_rows == arena.capacity_rows
    small = _engine(needs[0] - 1)
    with pytest.raises(InvalidRequestError, match="more than the prefix KV arena holds") as info:
        small.add_request(make_request(small, 650, CASES[0]))
    assert info.value.param == "prompt" and small.num_waiting == 0
    assert small.memory.prefix_arena.num_free_rows == needs[0] - 1


def test_startup_memory_check_counts_an_arena_sized_by_the_flag():
    """On CUDA with graphs, `--kv-cache-memory-bytes` sizes the arena allocated at start-up: the
    pre-load memory check counts it (and names the flag when it alone does not fit)."""
    from vllm_omni.entrypoints.cli.startup_checks import GIB, DeviceInfo, estimate_weights, startup_errors

    def config(**kwargs) -> OmniDiffusionConfig:
        return OmniDiffusionConfig(model=TINY_MODEL_NAME, device="cuda", dtype="bfloat16", **kwargs)

    gpu = DeviceInfo(num_cuda_devices=1, cuda_free_bytes={0: 8 * GIB}, cpu_available_bytes=64 * GIB)
    assert estimate_weights(config(kv_cache_memory_bytes=GIB), torch.device("cuda")).prefix_arena_bytes == GIB
    assert estimate_weights(config(), torch.device("cuda")).prefix_arena_bytes == 0, "default: a share"
    eager_only = config(kv_cache_memory_bytes=GIB, enforce_eager=True)
    assert estimate_weights(eager_only, torch.device("cuda")).prefix_arena_bytes == 0, "no arena"
    assert startup_errors(config(kv_cache_memory_bytes=GIB), gpu) == []
    (message,) = startup_errors(config(kv_cache_memory_bytes=9 * GIB), gpu)
    assert "--kv-cache-memory-bytes" in message and "prefix KV arena" in message


def test_the_runner_makes_the_arena_and_takes_its_prefix_axis():
    """What the model runner does at start-up on CUDA with graphs (called directly here): the arena
    sized by --kv-cache-memory-bytes, the graphs' second axis the arena's prefix rows up to 8192."""
    engine = _engine(None)
    runner = engine.executor.driver_worker.runner
    runner.config.kv_cache_memory_bytes = 100 * runner.pipeline.prefix_row_bytes + 5
    try:
        grid = runner._enable_prefix_arena(CudaGraphConfig.for_max_num_seqs(4))
    finally:
        runner.config.kv_cache_memory_bytes = None
    assert runner.transformer.prefix_arena.capacity_rows == 100
    assert runner.pipeline.prefix_arena is runner.transformer.prefix_arena
    assert grid.txt_rows == ARENA_PREFIX_ROW_BUCKETS and grid.txt_rows_per_seq == 8192
    buckets = grid.packed_buckets()
    assert max(b.num_txt_rows for b in buckets) == 8192 and len(buckets) == 396
    steps = runner.transformer.packed_graph_steps(128, 8192, "cpu", torch.float32)
    assert steps.staging.prefix_key.numel() == 0, "no staging store next to an arena"

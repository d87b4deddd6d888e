"""CUDA graphs of Qwen-Image-2.1's packed step (models/qwen_image21/graphs.py) through the worker's graph
runner.

On CPU the runner pads every batch into its bucket exactly as for a graph and runs the static-buffer
step eagerly (`capture=False`): the code a graph captures. It must equal the unpadded `forward_packed`
for mixed sizes, prompt lengths, CFG and edit prefixes, and, through the engine, diffusers' images. On
CUDA a replay must equal the eager run of the same padded batch bit for bit, and the engine's images
with graphs the eager engine's.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny21 import (
    CASES,
    TINY,
    admit,
    assert_matches,
    diffusers_images_21,
    eager,
    make_request,
)
from tiny21 import max_rel_err as rel_err
from utils import run_to_completion

from vllm_omni.diffusion.attention import SDPABackend
from vllm_omni.diffusion.layout import SequenceSpec, build_packed_layout
from vllm_omni.diffusion.models.qwen_image21.graphs import static_indices
from vllm_omni.diffusion.models.qwen_image21.transformer import (
    QwenImage21Transformer,
)
from vllm_omni.diffusion.worker.cuda_graphs import CudaGraphConfig, CUDAGraphRunner, select_bucket

GRAPHS = CudaGraphConfig(num_seqs=(2, 4, 8), img_rows=(64, 128), txt_rows=(64, 128))
"""Buckets (image rows, prefix rows, slots) for the batches below."""


@pytest.fixture(scope="module")
def diffusers_images():
    return diffusers_images_21()


@pytest.fixture(scope="module")
def reference_images(diffusers_images):
    return [diffusers_images(case) for case in CASES]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    model = QwenImage21Transformer(TINY, attn_backend=SDPABackend("mask")).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    return model


def test_static_indices_are_one_bijection_onto_the_kv_rows():
    # two sequences: prefixes 3 and 2 rows, images 2 and 1 rows; bucket I = 5, P = 8, S = 3
    host = static_indices([0, 2, 3], [3, 2], num_img_rows=5, num_prefix_rows=8, num_seqs=3)
    # K/V rows: | p0 p0 p0 i0 i0 | p1 p1 i1 | pad pad | unused x 3 |
    assert host["img_index"].tolist() == [3, 4, 7, 8, 9]
    assert host["prefix_index"].tolist() == [0, 1, 2, 5, 6, 10, 11, 12]
    assert host["seq_ids"].tolist() == [0, 0, 1, 2, 2]
    assert host["cu_seqlens_q"].tolist() == [0, 2, 3, 5, 5]
    assert host["cu_seqlens_k"].tolist() == [0, 5, 8, 10, 10]
    rows = np.concatenate([host["img_index"], host["prefix_index"]])
    assert sorted(rows.tolist()) == list(range(5 + 8))


@torch.inference_mode()
def test_padded_static_step_equals_the_unpadded_forward(model):
    """Mixed sizes, prompt lengths, a CFG pair, an edit prefix and an uncached sequence."""
    inputs = admit(model)
    runner = CUDAGraphRunner(model, "cpu", torch.float32, GRAPHS, capture=False)
    out = runner.forward_packed(*inputs)
    layout = inputs[3]
    assert runner.last_path == "graph" and out.shape == (layout.num_img_rows, 16)
    (graph,) = runner._packed.values()
    assert graph.bucket.num_img_rows > layout.num_img_rows  # there is padding
    want = eager(model, *inputs)
    print(f"padded static step vs unpadded forward: rel {rel_err(out, want):.2e}")
    assert rel_err(out, want) < 1e-6 and want.abs().max() > 0.1  # fp32 rounding (outputs reach ~6)
    model.prefix_cache.release(["a", "e"])


@torch.inference_mode()
def test_padding_and_unused_rows_never_reach_real_rows(model):
    inputs = admit(model, seed=1)
    runner = CUDAGraphRunner(model, "cpu", torch.float32, GRAPHS, capture=False)
    n_img, n = inputs[3].num_img_rows, inputs[3].num_seqs
    runner.forward_packed(*inputs)
    (graph,) = runner._packed.values()
    step, staging = graph.family_step, runner.family_steps.staging
    before = graph.run_eager()[:n_img].clone()
    real_p = sum(p.num_rows for p in model.step_prefixes(inputs[1], inputs[3]))
    step.img[n_img:] = torch.randn_like(step.img[n_img:]) * 100
    step.timestep[n:] = 0.7
    staging.prefix_key[:, real_p:] = 50.0  # staged rows no sequence owns
    staging.prefix_value[:, real_p:] = -50.0
    assert torch.equal(graph.run_eager()[:n_img], before)
    model.prefix_cache.release(["a", "e"])


@torch.inference_mode()
def test_prefixes_are_staged_when_they_change_across_buckets(model):
    """The staging buffers are shared: a batch in another bucket restages its prefixes, and the first
    batch's next step restages its own; an unchanged batch copies nothing."""
    runner = CUDAGraphRunner(model, "cpu", torch.float32, GRAPHS, capture=False)
    first = admit(model, seed=2)
    staging = runner.family_steps.staging
    calls = []
    stage = staging.stage
    staging.stage = lambda prefixes: calls.append(stage(prefixes)) or calls[-1]
    runner.forward_packed(*first)
    model.prefix_cache.put("b", False, model.prefill(torch.randn(40, 32)))
    other_layout = build_packed_layout([SequenceSpec(40, (1, 8, 10), req_id="b")], model.position_tables)
    other = (torch.randn(80, 16), torch.randn(40, 32), torch.tensor([0.3]), other_layout)
    assert select_bucket(runner.buckets, 80, 40, 1) != select_bucket(runner.buckets, 43, 60, 4)
    assert rel_err(runner.forward_packed(*other), eager(model, *other)) < 1e-6
    img2, t2 = first[0] + 0.5, first[2] * 0.5  # the first batch's next step
    second = (img2, first[1], t2, first[3])
    assert rel_err(runner.forward_packed(*second), eager(model, *second)) < 1e-6
    model.prefix_cache.release(["x"])  # nothing cached under x: its prefix is prefilled every step
    cached_only = build_packed_layout(list(first[3].specs[:3]), model.position_tables)
    rows = cached_only.num_img_rows
    inputs = (first[0][:rows], first[1][: cached_only.num_txt_rows], first[2][:3], cached_only)
    runner.forward_packed(*inputs)
    runner.forward_packed(*inputs)
    assert calls == [True, True, True, True, False], calls
    model.prefix_cache.release(["a", "e", "b"])


def test_engine_through_the_padded_static_step_matches_diffusers(reference_images):  # noqa: F811
    """The model runner's graph path for 2.1 (padded buckets, static buffers, run eagerly on CPU) gives
    every request of a mixed, staggered batch the image diffusers gives it alone."""
    from tiny21 import tiny21_engine

    engine = tiny21_engine(scheduling_policy="skip-ahead")
    runner = engine.executor.driver_worker.runner
    runner.transformer.attn_backend = SDPABackend("mask")  # reads the padded boundaries on the device
    buckets = CudaGraphConfig(num_seqs=(2, 4, 8), img_rows=(64, 128), txt_rows=(256, 512, 1024))
    runner.graphs = CUDAGraphRunner(runner.transformer, "cpu", torch.float32, buckets, capture=False)
    paths = []
    forward_packed = runner.graphs.forward_packed

    def spy(*args):
        out = forward_packed(*args)
        paths.append(runner.graphs.last_path)
        return out

    runner.graphs.forward_packed = spy
    futures = [engine.add_request(make_request(engine, 800 + i, c)).future for i, c in enumerate(CASES[:2])]
    engine.step()
    futures += [
        engine.add_request(make_request(engine, 800 + i, c)).future for i, c in enumerate(CASES[2:], start=2)
    ]
    images = run_to_completion(engine, futures)
    assert paths and set(paths) == {"graph"}, paths
    assert_matches(images, reference_images)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a CUDA device")
@pytest.mark.parametrize("with_arena", [False, True], ids=["staging_store", "prefix_arena"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager_ops", "compiled_ops"])
@pytest.mark.parametrize("attention", ["mask", "AUTO"])
def test_replay_equals_eager_of_the_padded_batch(attention, compiled, with_arena):
    """A captured bucket replays the eager static step of the same padded batch bit for bit (max_abs 0),
    for two compositions in one bucket; the real rows stay close to the unpadded forward. AUTO: the
    FA3 / FA2 varlen kernel a server captures (heads of 64, cross lengths, empty slots). compiled_ops:
    the blocks' fused ops compiled (the server's default), captured inside the graph, no fallback.
    prefix_arena: the cached prefixes in a prefix arena, gathered by the graph (the server's layout);
    the uncached sequence through the transient arena rows."""
    import dataclasses

    from vllm_omni.diffusion.attention.backends.auto import AutoAttentionBackend

    device, dtype = torch.device("cuda"), torch.bfloat16
    config, backend = TINY, SDPABackend("mask")
    if attention == "AUTO":
        if not AutoAttentionBackend.is_available(device):
            pytest.skip(AutoAttentionBackend.unavailable_reason(device))
        config, backend = dataclasses.replace(TINY, attention_head_dim=64, axes_dims_rope=(16, 24, 24)), None
    torch.manual_seed(0)
    model = QwenImage21Transformer(config, attn_backend=backend).to(device, dtype).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    print(f"attention: {model.get_attn_backend(device)!r}")
    if compiled:
        model.enable_compile()
    if with_arena:
        model.enable_prefix_arena(None, device, dtype)
    runner = CUDAGraphRunner(model, device, dtype, GRAPHS)
    runner.capture_all()
    for seed in (0, 3):
        inputs = admit(model, device, dtype, seed, owned=with_arena)
        replayed = runner.forward_packed(*inputs)
        assert runner.last_path == "graph"
        layout = inputs[3]
        (graph,) = [
            g for g in runner._packed.values() if g.family_step._loaded and g.family_step._loaded() is layout
        ]
        assert graph.graph is not None
        with torch.inference_mode():
            padded = graph.run_eager()[: layout.num_img_rows].clone()
            unpadded = model.forward_packed(*inputs)
        assert torch.equal(replayed, padded), (replayed - padded).abs().max()
        rel = rel_err(replayed, unpadded)
        print(f"replay vs unpadded eager ({attention}, bf16, compiled={compiled}): rel {rel:.2e}")
        assert rel < 2e-2
        model.prefix_cache.release(["a", "e"])
    assert model.num_compile_fallbacks == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a CUDA device")
def test_engine_images_with_graphs_equal_eager():
    """The tiny 2.1 engine on CUDA (fp32): graphs captured at start-up vs --enforce-eager, a mixed batch."""
    from vllm_omni.config import OmniDiffusionConfig
    from vllm_omni.diffusion.engine import DiffusionEngine
    from vllm_omni.diffusion.models.qwen_image21.tiny import TINY_MODEL_NAME

    images = {}
    for enforce_eager in (True, False):
        config = OmniDiffusionConfig(
            model=TINY_MODEL_NAME,
            dtype="float32",
            device="cuda",
            max_num_seqs=8,
            mixfusion_min_chunk_tokens=1,
            scheduling_policy="skip-ahead",
            enforce_eager=enforce_eager,
        )
        engine = DiffusionEngine(config, autostart=False)
        runner = engine.executor.driver_worker.runner
        if not enforce_eager:  # fp32 on CUDA: no FA kernel, so the graph-safe masked SDPA, captured
            runner.transformer.attn_backend = SDPABackend("mask")
            grid = CudaGraphConfig(num_seqs=(2, 4, 8), img_rows=(64, 128), txt_rows=(256, 512, 1024))
            runner.graphs = CUDAGraphRunner(runner.transformer, "cuda", torch.float32, grid)
            runner.graphs.capture_all()
        paths = []
        forward_packed = runner.graphs.forward_packed

        def spy(*args, forward_packed=forward_packed, paths=paths, graphs=runner.graphs):
            out = forward_packed(*args)
            paths.append(graphs.last_path)
            return out

        runner.graphs.forward_packed = spy
        futures = [engine.add_request(make_request(engine, 900 + i, c)).future for i, c in enumerate(CASES)]
        images[enforce_eager] = run_to_completion(engine, futures)
        assert set(paths) == {"eager" if enforce_eager else "graph"}, paths
        engine.shutdown()
    worst = max(float(np.abs(g - e).max()) for g, e in zip(images[False], images[True], strict=True))
    print(f"engine images, graphs vs eager: max abs {worst:.2e}")
    assert worst <= 1e-4

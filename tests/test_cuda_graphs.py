"""The CUDA-graph runner's padding, bucket choice and fallback, on CPU (capture itself needs a GPU: the
tests at the end of this file, skipped without one).

With `capture=False` the runner pads every batch into its bucket exactly as it does for a graph and
runs the padded batch eagerly, so these tests check what a replay computes: padding rows are their
own sequence and never reach a real token, and real rows match the unpadded forward.
"""

from __future__ import annotations

import pytest
import torch
from utils import GRAPH_SPECS as SPECS
from utils import GRAPHS, batch, diffusers_reference_images, tiny_lora_model, tiny_model
from utils import TINY_CONFIG as TINY

from vllm_omni.diffusion.attention import SDPABackend, build_varlen_metadata
from vllm_omni.diffusion.attention.backends.sdpa import block_diagonal_mask, block_diagonal_mask_from_cu
from vllm_omni.diffusion.models.qwen_image.packing import SequenceSpec
from vllm_omni.diffusion.models.qwen_image.transformer import QwenImageTransformer
from vllm_omni.diffusion.worker.cuda_graphs import (
    CudaGraphConfig,
    CUDAGraphRunner,
    PackedBucket,
    select_bucket,
)


@pytest.fixture(scope="module")
def reference_images(tiny_model_dir):
    return diffusers_reference_images(tiny_model_dir)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def test_buckets_are_the_smallest_that_fit():
    buckets = GRAPHS.packed_buckets()
    assert buckets[0] == PackedBucket(64, 32, 4) and buckets[-1] == PackedBucket(32, 16, 2)
    assert PackedBucket(32, 32, 4) not in buckets  # fewer than 16 image rows per slot
    assert select_bucket(buckets, 30, 15, 2) == PackedBucket(32, 16, 2)
    assert select_bucket(buckets, 30, 15, 3) == PackedBucket(64, 16, 4)
    assert select_bucket(buckets, 33, 17, 1) == PackedBucket(64, 32, 2)
    assert select_bucket(buckets, 65, 1, 1) is None and select_bucket(buckets, 1, 1, 5) is None


def test_padding_must_pay():
    config = CudaGraphConfig(max_padding=0.25, pad_freely_below=2048)
    assert config.pays(PackedBucket(1536, 256, 2), 300)  # launch-bound: padding is free
    assert config.pays(PackedBucket(4096, 256, 2), 3800) and not config.pays(PackedBucket(4096, 256, 2), 3000)
    assert not config.pays(PackedBucket(4096, 2048, 16), 4700)
    default = CudaGraphConfig.for_max_num_seqs(8)
    assert default.num_seqs == (1, 2, 4, 8, 16) and len(default.packed_buckets()) == 243
    # quantized (FP8) linears: a 1024x1024 CFG request (8192 image rows, a short prompt) gets a bucket
    fp8 = CudaGraphConfig.for_max_num_seqs(8, quantized=True)
    assert fp8.img_rows == (*default.img_rows, 7168, 8192)
    bucket = select_bucket(fp8.packed_buckets(), 8192, 40 + 6, 2)
    assert bucket == PackedBucket(8192, 64, 2) and fp8.pays(bucket, 8192 + 46)
    assert select_bucket(default.packed_buckets(), 8192, 46, 2) is None


@torch.inference_mode()
def test_padded_batch_equals_the_unpadded_forward(model):
    img, txt, t, layout = batch(SPECS)
    runner = CUDAGraphRunner(model, "cpu", torch.float32, GRAPHS, capture=False)
    out = runner.forward_packed(img, txt, t, layout)
    assert runner.last_path == "graph" and out.shape == (layout.num_img_rows, 64)
    torch.testing.assert_close(out, model.forward_packed(img, txt, t, layout), rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_an_fp8_model_padded_into_a_bucket_equals_its_unpadded_forward():
    """FP8 servers replay larger buckets (`QUANTIZED_IMG_ROWS`): an FP8 transformer's padded batch (zero
    padding rows, quantised per row like any other) gives the real rows of its unpadded forward."""
    from vllm_omni.diffusion.layers.quant_config import QuantizationConfig
    from vllm_omni.diffusion.layers.quantization import quantize_transformer

    fp8 = tiny_model(dtype=torch.bfloat16)
    quantize_transformer(fp8, QuantizationConfig("fp8"))
    img, txt, t, layout = batch(SPECS, dtype=torch.bfloat16)
    runner = CUDAGraphRunner(fp8, "cpu", torch.bfloat16, GRAPHS, capture=False)
    out = runner.forward_packed(img, txt, t, layout)
    assert runner.last_path == "graph"
    want = fp8.forward_packed(img, txt, t, layout)
    torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2)  # bf16; the GEMMs' row counts differ
    assert not torch.allclose(out, tiny_model(dtype=torch.bfloat16).forward_packed(img, txt, t, layout))


@torch.inference_mode()
def test_padding_rows_never_reach_real_rows(model):
    img, txt, t, layout = batch(SPECS)
    runner = CUDAGraphRunner(model, "cpu", torch.float32, GRAPHS, capture=False)
    runner.forward_packed(img, txt, t, layout)
    (graph,) = runner._packed.values()
    before = graph.run_eager()[: layout.num_img_rows].clone()
    n_img, n_txt = layout.num_img_rows, layout.num_txt_rows
    assert graph.img.shape[0] > n_img and graph.txt.shape[0] > n_txt  # there is padding to poison
    graph.img[n_img:] = torch.randn_like(graph.img[n_img:]) * 100
    graph.txt[n_txt:] = torch.randn_like(graph.txt[n_txt:]) * 100
    graph.timestep[layout.num_seqs :] = 0.7
    assert torch.equal(graph.run_eager()[:n_img], before)


@torch.inference_mode()
def test_steps_and_compositions_reload_what_changed(model):
    runner = CUDAGraphRunner(model, "cpu", torch.float32, GRAPHS, capture=False)
    img, txt, t, layout = batch(SPECS)
    runner.forward_packed(img, txt, t, layout)
    img2, t2 = img + 0.5, t * 0.5  # next step, same composition: only latents and timesteps change
    torch.testing.assert_close(
        runner.forward_packed(img2, txt, t2, layout),
        model.forward_packed(img2, txt, t2, layout),
        rtol=1e-5,
        atol=1e-5,
    )
    specs = [SequenceSpec(4, (1, 3, 3)), SequenceSpec(6, (1, 4, 5)), SequenceSpec(2, (1, 2, 2))]
    other = batch(specs, seed=3)  # another composition in the same bucket
    bucket = select_bucket(runner.buckets, other[3].num_img_rows, other[3].num_txt_rows, 3)
    assert (bucket, False) in runner._packed
    torch.testing.assert_close(
        runner.forward_packed(*other), model.forward_packed(*other), rtol=1e-5, atol=1e-5
    )


@torch.inference_mode()
def test_batches_beyond_every_bucket_and_disabled_runners_run_eager(model):
    big = batch([SequenceSpec(3, (1, 8, 9))])  # 72 image rows > 64
    runner = CUDAGraphRunner(model, "cpu", torch.float32, GRAPHS, capture=False)
    assert torch.equal(runner.forward_packed(*big), model.forward_packed(*big))
    assert runner.last_path == "eager" and not runner._packed
    off = CUDAGraphRunner(model, "cpu", torch.float32, GRAPHS, enabled=False)
    small = batch(SPECS)
    assert torch.equal(off.forward_packed(*small), model.forward_packed(*small)) and off.last_path == "eager"


@torch.inference_mode()
def test_a_graph_that_fails_to_capture_runs_eager_and_is_not_retried(model, monkeypatch, caplog):
    """A capture that raises (an OOM, a kernel that does not compile on this GPU) must not take the
    server down or fail the step: that bucket / dense shape runs eager, the log says why once, and
    it is not tried again; other buckets keep their graphs."""
    runner = CUDAGraphRunner(model, "cpu", torch.float32, GRAPHS, capture=False)
    runner.capture_graphs = True  # the CUDA path, with a capture that fails on this CPU
    attempts = []

    def broken_capture(run):
        attempts.append(run)
        raise RuntimeError("CUDA out of memory while capturing")

    monkeypatch.setattr(runner, "_capture", broken_capture)
    img, txt, t, layout = batch(SPECS)
    for _ in range(2):
        out = runner.forward_packed(img, txt, t, layout)
        assert runner.last_path == "eager" and torch.equal(out, model.forward_packed(img, txt, t, layout))
    dense = (torch.randn(2, 6, 64), torch.randn(2, 4, 32), None, torch.rand(2), [(1, 2, 3)] * 2)
    for _ in range(2):
        assert torch.equal(runner.forward_dense(*dense), model(*dense)) and runner.last_path == "eager"
    assert len(attempts) == 2 and not runner._packed and not runner._dense  # once per graph
    failures = [r for r in caplog.records if "failed to capture" in r.getMessage()]
    assert len(failures) == 2 and all(r.levelname == "ERROR" for r in failures)
    monkeypatch.setattr(runner, "capture_graphs", False)  # another bucket still gets its graph
    other = batch([SequenceSpec(2, (1, 2, 2))], seed=4)
    runner.forward_packed(*other)
    assert runner.last_path == "graph"


@torch.inference_mode()
def test_dense_shapes_are_bounded(model):
    runner = CUDAGraphRunner(model, "cpu", torch.float32, CudaGraphConfig(max_dense_graphs=1), capture=False)
    img, txt, t = torch.randn(2, 6, 64), torch.randn(2, 4, 32), torch.rand(2)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    out = runner.forward_dense(img, txt, mask, t, [(1, 2, 3)] * 2)
    assert runner.last_path == "graph" and torch.equal(out, model(img, txt, mask, t, [(1, 2, 3)] * 2))
    runner.forward_dense(img[:1], txt[:1], None, t[:1], [(1, 2, 3)])
    assert runner.last_path == "eager" and len(runner._dense) == 1


def test_graph_metadata_masks_from_device_boundaries():
    cu = torch.tensor([0, 3, 7, 7, 9], dtype=torch.int32)
    assert torch.equal(
        block_diagonal_mask_from_cu(cu, 9), block_diagonal_mask([3, 4, 2], torch.device("cpu"))
    )
    q = torch.randn(9, 2, 16)
    meta = build_varlen_metadata([9])
    meta.for_graph = True
    with pytest.raises(ValueError, match="CUDA graph"):
        SDPABackend("per_seq").forward(q, q, q, meta)


def test_same_shape_batches_go_packed_when_graphs_pay(model):
    runner = CUDAGraphRunner(model, "cpu", torch.float32, GRAPHS, capture=False)
    assert runner.prefers_packed([5, 3], [16, 16])  # text lengths differ: no key mask, no per-length graph
    assert runner.prefers_packed([5, 5], [16, 16])  # fits a bucket that pays
    assert not runner.prefers_packed([5], [300])  # beyond every bucket: the dense path
    assert not CUDAGraphRunner(model, "cpu", torch.float32, GRAPHS, enabled=False).prefers_packed(
        [5, 3], [16, 16]
    )


def test_engine_steps_through_padded_buckets_match_diffusers(tiny_model_dir, reference_images):  # noqa: F811
    """The model runner's graph path (buckets padded exactly as for a replay, run eagerly on CPU) gives
    every request of a mixed batch the image diffusers' pipeline gives it alone."""
    from utils import CASES, assert_matches, case_request, run_to_completion

    from vllm_omni.config import OmniDiffusionConfig
    from vllm_omni.diffusion.engine import DiffusionEngine

    config = OmniDiffusionConfig(
        model=str(tiny_model_dir),
        dtype="float32",
        device="cpu",
        max_num_seqs=8,
        mixfusion_min_chunk_tokens=1,
        scheduling_policy="skip-ahead",  # every request in every step: the packed-step identity
    )
    engine = DiffusionEngine(config, autostart=False)
    runner = engine.executor.driver_worker.runner
    runner.transformer.attn_backend = SDPABackend("mask")  # reads the padded boundaries on the device
    buckets = CudaGraphConfig(num_seqs=(2, 4, 8, 16), img_rows=(64, 128, 256), txt_rows=(256, 512, 1024))
    runner.graphs = CUDAGraphRunner(runner.transformer, "cpu", torch.float32, buckets, capture=False)
    paths = []
    forward_packed = runner.graphs.forward_packed

    def spy(*args):
        out = forward_packed(*args)
        paths.append(runner.graphs.last_path)
        return out

    runner.graphs.forward_packed = spy
    futures = [engine.add_request(case_request(500 + i, case)) for i, case in enumerate(CASES)]
    images = run_to_completion(engine, futures)
    assert paths and set(paths) == {"graph"}, paths
    assert_matches(images, reference_images)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a CUDA device")
def test_lora_graph_replay_equals_eager_and_reads_rewritten_slots():
    """With adapters (issue 27): the LoRA graph of a bucket replays the eager forward of the same padded
    batch bit for bit (mixed adapters of different ranks, one sequence without), and an adapter slot
    rewritten after capture (unload, then a load that takes the freed slot) is what the next replay
    reads, without a new capture."""
    pytest.importorskip("triton")
    from vllm_omni.lora.batch import LoRAMapping, SeqLoRA
    from vllm_omni.lora.random_adapter import block_targets, random_lora_adapter

    device, dtype = torch.device("cuda"), torch.bfloat16
    model, manager = tiny_lora_model(device, dtype)
    targets = block_targets(QwenImageTransformer.plans, TINY.num_layers)
    ids = {
        name: manager.add_adapter(name, random_lora_adapter(model, targets, rank, seed, std=0.2), "<random>")
        for name, rank, seed in (("a", 8, 1), ("b", 3, 2))
    }
    img, txt, t, layout = batch(SPECS, device=device, dtype=dtype)
    runner = CUDAGraphRunner(model, device, dtype, GRAPHS, lora_state=manager.state)

    def replay_and_eager(third: str):
        mapping = LoRAMapping.for_packed([SeqLoRA(ids["a"]), SeqLoRA(0), SeqLoRA(ids[third], 0.5)], layout)
        with manager.activate(mapping):
            replayed = runner.forward_packed(img, txt, t, layout)
            assert runner.last_path == "graph"
            (graph,) = [g for (_, with_lora), g in runner._packed.items() if with_lora]
            with torch.inference_mode():
                eager = graph.run_eager()[: layout.num_img_rows].clone()
                unpadded = model.forward_packed(img, txt, t, layout)
        assert graph.graph is not None and torch.equal(replayed, eager)  # max_abs 0
        assert rel_err(replayed, unpadded) < 2e-2  # GEMM tiling differs with the row count
        return graph, layout.split_img(replayed)

    graph, before = replay_and_eager("b")
    with manager.activate(None):
        base = layout.split_img(runner.forward_packed(img, txt, t, layout))  # the plain graph
    assert not torch.equal(before[0], base[0]) and not torch.equal(before[2], base[2])
    slots = model.transformer_blocks[0].attn.to_q.lora
    assert slots.group is not None  # q, k, v: one group, one launch pair (what the graph captured)
    slot, ptr = manager.slot_of(ids["b"]), slots.lora_a.data_ptr()
    manager.remove("b")
    ids["c"] = manager.add_adapter("c", random_lora_adapter(model, targets, 5, 3, std=0.2), "<random>")
    assert manager.slot_of(ids["c"]) == slot and slots.lora_a.data_ptr() == ptr
    graph_after, after = replay_and_eager("c")
    assert graph_after is graph  # the same captured graph: it reads the rewritten slot
    assert torch.equal(after[0], before[0]) and torch.equal(after[1], before[1])
    assert not torch.equal(after[2], before[2])


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())

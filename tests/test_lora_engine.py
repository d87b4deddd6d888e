"""Per-request LoRA through the whole engine vs diffusers' QwenImagePipeline + peft (tiny model, fp32, CPU).

Each request's image must equal diffusers' after `load_lora_weights(path, adapter_name=name)` +
`set_adapters([name], [scale])` (`disable_lora()` for base-only requests), whether it runs alone, packed
with requests of other adapters and none, or admitted mid-denoise; and in batch-invariant mode, packed
bits equal alone bits.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from utils import CASES, run_to_completion

from vllm_omni.config import OmniDiffusionConfig
from vllm_omni.diffusion.engine import DiffusionEngine
from vllm_omni.diffusion.models.qwen_image.transformer import QwenImageTransformer
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.inputs import OmniDiffusionSamplingParams
from vllm_omni.lora import LoRAConfig, LoRAModulePath, LoRARequest
from vllm_omni.lora.manager import LoRAInUseError, LoRANotFoundError
from vllm_omni.lora.random_adapter import block_targets, random_lora_state_dict, save_lora_dir

pytest.importorskip("peft")

ADAPTERS = {
    # name: (targets, rank, alpha, key prefix, seed)
    "ink": (None, 4, None, "transformer.", 1),  # None: every attention and MLP linear of every block
    "neon": (("attn.to_q", "attn.to_v", "attn.add_k_proj", "img_mlp.net.2", "img_mod.1"), 2, 4.0, "", 2),
}
# (adapter, scale) per case of test_engine_vs_diffusers.CASES (CFG on for the first three)
ASSIGNMENT = [("ink", 1.0), ("neon", 0.6), (None, 1.0), ("ink", -0.8), ("neon", 1.3)]


@pytest.fixture(scope="module")
def adapter_dirs(tiny_model_dir, tmp_path_factory):
    from diffusers import QwenImageTransformer2DModel

    model = QwenImageTransformer2DModel.from_pretrained(tiny_model_dir, subfolder="transformer")
    root, dirs = tmp_path_factory.mktemp("lora_adapters"), {}
    for name, (suffixes, rank, alpha, prefix, seed) in ADAPTERS.items():
        num_layers = model.config.num_layers
        targets = block_targets(QwenImageTransformer.plans, num_layers, suffixes)
        state = random_lora_state_dict(model, targets, rank, seed, std=0.3, alpha=alpha, prefix=prefix)
        dirs[name] = str(save_lora_dir(root / name, state))
    return dirs


@pytest.fixture(scope="module")
def reference(tiny_model_dir, adapter_dirs):
    """(diffusers with the adapters, base-only) images per case."""
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    for name, path in adapter_dirs.items():
        pipe.load_lora_weights(path, adapter_name=name)
    with_lora, base = [], []
    for (prompt, negative, h, w, steps, scale, seed), (name, lora_scale) in zip(CASES, ASSIGNMENT):
        kwargs = dict(
            prompt=prompt,
            negative_prompt=negative,
            true_cfg_scale=scale,
            height=h,
            width=w,
            num_inference_steps=steps,
            max_sequence_length=512,
            output_type="np",
        )
        pipe.disable_lora()
        base.append(pipe(generator=torch.Generator("cpu").manual_seed(seed), **kwargs).images)
        if name is not None:
            pipe.enable_lora()
            pipe.set_adapters([name], [lora_scale])
        with_lora.append(pipe(generator=torch.Generator("cpu").manual_seed(seed), **kwargs).images)
    return with_lora, base


def _engine(tiny_model_dir, adapter_dirs, **kw) -> DiffusionEngine:
    lora = LoRAConfig(lora_modules=tuple(LoRAModulePath(n, p) for n, p in adapter_dirs.items()))
    config = OmniDiffusionConfig(
        model=str(tiny_model_dir),
        dtype="float32",
        device="cpu",
        max_num_seqs=8,
        scheduling_policy="skip-ahead",  # every request in every step: the packed-step identity
        mixfusion_min_chunk_tokens=1,
        lora=lora,
        **kw,
    )
    return DiffusionEngine(config, autostart=False)


@pytest.fixture(scope="module")
def engine(tiny_model_dir, adapter_dirs):
    return _engine(tiny_model_dir, adapter_dirs)


def _request(i: int, case_index: int) -> OmniDiffusionRequest:
    prompt, negative, h, w, steps, scale, seed = CASES[case_index]
    name, lora_scale = ASSIGNMENT[case_index]
    params = OmniDiffusionSamplingParams(
        height=h,
        width=w,
        num_inference_steps=steps,
        true_cfg_scale=scale,
        seed=seed,
        output_type="np",
        lora_request=LoRARequest(name) if name else None,
        lora_scale=lora_scale,
    )
    return OmniDiffusionRequest(f"lora-{i}", prompt=prompt, negative_prompt=negative, sampling_params=params)


def _assert_matches(images, reference):
    with_lora, base = reference
    for i, got in enumerate(images):
        diff = float(np.abs(got - with_lora[i]).max())
        assert diff <= 1e-4, f"case {i} ({ASSIGNMENT[i]}): max abs diff {diff} vs diffusers + peft"
        if ASSIGNMENT[i][0] is not None:  # the adapter visibly changed the image
            assert float(np.abs(got - base[i]).max()) > 1e-2, f"case {i}: adapter had no effect"


def test_each_request_alone_matches_diffusers(engine, reference):
    images = []
    for i in range(len(CASES)):
        images += run_to_completion(engine, [engine.add_request(_request(i, i))])
    _assert_matches(images, reference)


def test_mixed_adapters_share_one_packed_step_and_match_diffusers(engine, reference, monkeypatch):
    transformer = engine.executor.driver_worker.pipeline.transformer
    calls = []
    for name in ("forward", "forward_packed"):  # dense and packed forwards
        original = getattr(transformer, name)
        monkeypatch.setattr(transformer, name, lambda *a, _f=original, **kw: calls.append(1) or _f(*a, **kw))
    steps = []
    futures = [engine.add_request(_request(100 + i, i)) for i in range(len(CASES))]
    images = run_to_completion(engine, futures, steps)
    _assert_matches(images, reference)
    assert len(calls) == len(steps), "one forward per step, not one per adapter"
    assert steps[0].num_reqs == len(CASES) and steps[0].path == "packed"  # two adapters + none, one forward
    assert all(e.num_users == 0 for e in engine.lora.list_adapters()), "finished requests release"


def test_staggered_arrival_matches_diffusers(engine, reference):
    steps = []
    futures = [engine.add_request(_request(200 + i, i)) for i in range(2)]
    engine.step()
    futures += [engine.add_request(_request(200 + i, i)) for i in range(2, len(CASES))]
    images = run_to_completion(engine, futures, steps)
    _assert_matches(images, reference)
    assert any(s.num_reqs == len(CASES) for s in steps)


def test_same_shape_batch_with_adapters_runs_dense_and_matches_alone(engine):
    cases = [(0, "ink", 1.0), (1, None, 1.0), (2, "neon", 0.5), (3, "ink", 0.5)]

    def request(i, name, scale):
        params = OmniDiffusionSamplingParams(
            height=32,
            width=32,
            num_inference_steps=2,
            true_cfg_scale=3.0,
            seed=i,
            output_type="np",
            lora_request=LoRARequest(name) if name else None,
            lora_scale=scale,
        )
        return OmniDiffusionRequest(
            f"dense-{i}-{len(steps)}", "a dog", negative_prompt="bad", sampling_params=params
        )

    steps = []
    together = run_to_completion(engine, [engine.add_request(request(*c)) for c in cases], steps)
    assert steps[0].path == "dense"
    for case, got in zip(cases, together):
        alone = run_to_completion(engine, [engine.add_request(request(*case))])[0]
        assert np.abs(got - alone).max() <= 1e-5, case


def test_unknown_adapter_is_refused_and_in_use_adapter_is_kept(engine, adapter_dirs):
    bad = _request(300, 0)
    bad.sampling_params.lora_request = LoRARequest("nope")
    with pytest.raises(LoRANotFoundError, match="lora.name: unknown adapter 'nope'"):
        engine.add_request(bad)
    future = engine.add_request(_request(301, 1))  # holds "neon" while waiting and running
    with pytest.raises(LoRAInUseError):
        engine.lora.remove("neon")
    run_to_completion(engine, [future])
    engine.lora.remove("neon")
    with pytest.raises(LoRANotFoundError):
        engine.add_request(_request(302, 1))
    engine.lora.add("neon", adapter_dirs["neon"])


def test_lora_refused_when_not_enabled(tiny_model_dir):
    config = OmniDiffusionConfig(model=str(tiny_model_dir), dtype="float32", device="cpu")
    with pytest.raises(ValueError, match="lora: LoRA adapters are not loaded on this server"):
        DiffusionEngine(config, autostart=False).add_request(_request(400, 0))


def test_batch_invariant_mode_packed_equals_alone_with_adapters(tiny_model_dir, adapter_dirs):
    engine = _engine(tiny_model_dir, adapter_dirs, batch_invariant=True)
    steps = []
    packed = run_to_completion(
        engine, [engine.add_request(_request(500 + i, i)) for i in range(len(CASES))], steps
    )
    assert steps[0].num_reqs == len(CASES) and steps[0].path == "packed"
    for i, got in enumerate(packed):
        alone = run_to_completion(engine, [engine.add_request(_request(510 + i, i))])[0]
        assert float(np.abs(got - alone).max()) == 0.0, f"case {i}: batch-invariant mode must be exact"


def test_aborted_and_failed_requests_release_their_adapter(engine):
    users = lambda: {e.name: e.num_users for e in engine.lora.list_adapters()}  # noqa: E731
    waiting = engine.add_request(_request(600, 0))
    assert users()["ink"] == 1
    engine.abort(waiting.req_id)
    while not waiting.done():
        engine.step()
    assert users()["ink"] == 0
    assert waiting.future.exception() is not None  # it was aborted, not run


def test_cuda_graphs_stay_on_with_lora(engine, monkeypatch):
    """LoRA no longer turns graphs off: the runner keeps them, with the manager's state."""
    from vllm_omni.diffusion.worker import model_runner

    monkeypatch.setattr(model_runner, "graphs_off_reason", lambda *a: None)  # as if on a CUDA device
    monkeypatch.setattr(model_runner.CUDAGraphRunner, "capture_all", lambda self, like=None: None)
    worker = engine.executor.driver_worker
    runner = model_runner.DiffusionModelRunner(worker.pipeline, engine.config, lora_manager=engine.lora)
    assert runner.graphs.enabled and runner.graphs.lora_state is engine.lora.state


def test_padded_graph_buckets_with_mixed_adapters_match_diffusers(engine, reference):
    """The runner's graph path with adapters (buckets padded and LoRA tile tables loaded exactly as for
    a replay, run eagerly on CPU): every request of a mixed-adapter batch gets diffusers' image."""
    from vllm_omni.diffusion.attention import SDPABackend
    from vllm_omni.diffusion.worker.cuda_graphs import CudaGraphConfig, CUDAGraphRunner

    runner = engine.executor.driver_worker.runner
    previous = runner.graphs, runner.transformer.attn_backend
    runner.transformer.attn_backend = SDPABackend("mask")  # reads the padded boundaries on the device
    buckets = CudaGraphConfig(num_seqs=(2, 4, 8, 16), img_rows=(64, 128, 256), txt_rows=(256, 512, 1024))
    graphs = CUDAGraphRunner(
        runner.transformer, "cpu", torch.float32, buckets, capture=False, lora_state=engine.lora.state
    )
    runner.graphs, paths = graphs, []
    forward_packed = graphs.forward_packed

    def spy(*args):
        out = forward_packed(*args)
        paths.append((graphs.last_path, engine.lora.state.batch is not None))
        return out

    graphs.forward_packed = spy
    try:
        futures = [engine.add_request(_request(700 + i, i)) for i in range(len(CASES))]
        images = run_to_completion(engine, futures)
    finally:
        runner.graphs, runner.transformer.attn_backend = previous
    assert paths and set(paths) == {("graph", True)}, paths
    assert any(with_lora for (_, with_lora) in graphs._packed) and all(
        g.lora is not None for g in graphs._packed.values()
    )
    _assert_matches(images, reference)

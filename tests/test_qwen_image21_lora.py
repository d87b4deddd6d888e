"""Per-request LoRA on Qwen-Image-2.1 through the whole engine vs diffusers' `QwenImage21Pipeline` + peft
(tiny checkpoint, fp32, CPU).

Each request's image must equal diffusers' after `load_lora_weights(path, adapter_name=name)` +
`set_adapters([name], [scale])` (`disable_lora()` for a base request), alone and packed in one step with
a request of another adapter and a base request. The adapters cover the blocks' attention and SwiGLU
linears, the shared `modulation` (one row per sequence), the text and image input projections and the
output projection: 2.1's prefix (prefilled at admission) takes the adapter as its image rows do.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny21 import tiny21_engine

from vllm_omni.diffusion.models import registry
from vllm_omni.diffusion.models.qwen_image21.loader import diffusers_pipeline
from vllm_omni.diffusion.models.qwen_image21.tiny import TINY_MODEL_NAME
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.inputs import OmniDiffusionSamplingParams
from vllm_omni.lora import LoRAConfig, LoRAModulePath, LoRARequest
from vllm_omni.lora.random_adapter import random_lora_state_dict, save_lora_dir

pytest.importorskip("peft")

ATOL = 1e-4
BLOCK = (
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "img_mlp.gate_layer",
    "img_mlp.proj",
    "img_mlp.out",
)
ADAPTERS = {
    # name: (per-block suffixes, whole-model targets, rank, alpha, key prefix, seed)
    "ink": (BLOCK, (), 4, None, "transformer.", 1),
    "neon": (
        ("attn.to_k", "img_mlp.out"),
        ("modulation.1", "txt_in.in_layer", "img_in", "proj_out"),
        2,
        4.0,
        "",
        2,
    ),
}
CASES = [
    # (prompt, negative_prompt, height, width, steps, true_cfg_scale, seed, adapter, lora_scale)
    ("a lighthouse on a rocky coast at dusk", "blurry", 32, 32, 2, 4.0, 12, "ink", 1.0),  # CFG on
    ("a red fox", None, 32, 64, 2, 1.0, 11, "neon", 0.7),  # CFG off, wide
    ("a bowl of fruit", None, 32, 32, 2, 1.0, 15, None, 1.0),  # base only
]


@pytest.fixture(scope="module")
def pipe():
    pipe = diffusers_pipeline(registry.resolve_model_path(TINY_MODEL_NAME))
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def adapter_dirs(pipe, tmp_path_factory):
    model, root, dirs = pipe.transformer, tmp_path_factory.mktemp("lora21"), {}
    num_layers = model.config.num_layers
    for name, (suffixes, extra, rank, alpha, prefix, seed) in ADAPTERS.items():
        targets = [f"transformer_blocks.{i}.{s}" for i in range(num_layers) for s in suffixes] + list(extra)
        state = random_lora_state_dict(model, targets, rank, seed, std=0.3, alpha=alpha, prefix=prefix)
        dirs[name] = str(save_lora_dir(root / name, state))
    return dirs


@pytest.fixture(scope="module")
def reference(pipe, adapter_dirs):
    """(with the case's adapter, base only) images of diffusers per case (np RGBA)."""
    for name, path in adapter_dirs.items():
        pipe.load_lora_weights(path, adapter_name=name)
    with_lora, base = [], []
    for prompt, negative, h, w, steps, scale, seed, name, lora_scale in CASES:
        kwargs = dict(
            prompt=prompt,
            negative_prompt=negative,
            true_cfg_scale=scale,
            height=h,
            width=w,
            num_inference_steps=steps,
            output_type="np",
        )
        pipe.disable_lora()
        base.append(pipe(generator=torch.Generator("cpu").manual_seed(seed), **kwargs).images)
        if name is not None:
            pipe.enable_lora()
            pipe.set_adapters([name], [lora_scale])
        with_lora.append(pipe(generator=torch.Generator("cpu").manual_seed(seed), **kwargs).images)
    return with_lora, base


@pytest.fixture(scope="module")
def engine(adapter_dirs):
    lora = LoRAConfig(lora_modules=tuple(LoRAModulePath(n, p) for n, p in adapter_dirs.items()))
    return tiny21_engine(scheduling_policy="skip-ahead", lora=lora)


def _request(engine, i: int, case) -> OmniDiffusionRequest:
    prompt, negative, h, w, steps, scale, seed, name, lora_scale = case
    params = OmniDiffusionSamplingParams(
        **{
            **engine.default_sampling_params,
            "height": h,
            "width": w,
            "num_inference_steps": steps,
            "true_cfg_scale": scale,
            "seed": seed,
            "output_type": "np",
            "lora_request": LoRARequest(name) if name else None,
            "lora_scale": lora_scale,
        }
    )
    return OmniDiffusionRequest(
        f"lora21-{i}", prompt=prompt, negative_prompt=negative, sampling_params=params
    )


def _run(engine, futures, steps_log=None) -> list[np.ndarray]:
    while not all(f.done() for f in futures):
        stats = engine.step()
        if steps_log is not None and stats is not None:
            steps_log.append(stats)
    return [f.result().images for f in futures]


def _assert_matches(images, reference):
    with_lora, base = reference
    for i, got in enumerate(images):
        assert got.shape == with_lora[i].shape, f"case {i}: shape {got.shape} != {with_lora[i].shape}"
        diff = float(np.abs(got - with_lora[i]).max())
        assert diff <= ATOL, f"case {i} ({CASES[i][-2]}): max abs diff {diff} vs diffusers + peft"
        if CASES[i][-2] is not None:  # the adapter visibly changed the image
            assert float(np.abs(got - base[i]).max()) > 1e-2, f"case {i}: the adapter had no effect"


def test_each_request_alone_matches_diffusers(engine, reference):
    images = []
    for i, case in enumerate(CASES):
        images += _run(engine, [engine.add_request(_request(engine, i, case)).future])
    _assert_matches(images, reference)


def test_adapters_and_base_packed_in_one_step_match_diffusers(engine, reference):
    steps = []
    futures = [engine.add_request(_request(engine, 100 + i, case)).future for i, case in enumerate(CASES)]
    images = _run(engine, futures, steps)
    assert max(s.num_reqs for s in steps) == len(CASES), "the three requests shared a packed step"
    _assert_matches(images, reference)


def test_edit_with_an_adapter_matches_diffusers(engine, pipe, reference):
    """An edit's prefix holds text rows (`txt_in`) and reference latent rows (`img_in`): both take the
    request's adapter at admission; packed with a text-to-image request of another adapter."""
    from PIL import Image

    grid = np.linspace(0, 255, 48 * 32 * 3).reshape(32, 48, 3) % 256
    image = Image.fromarray(grid.astype(np.uint8), mode="RGB")
    case = ("make it red", None, 32, 32, 2, 1.0, 5, "neon", 1.2)
    pipe.enable_lora()
    pipe.set_adapters(["neon"], [1.2])
    want = pipe(
        prompt=case[0],
        image=image,
        height=32,
        width=32,
        num_inference_steps=2,
        generator=torch.Generator("cpu").manual_seed(5),
        output_type="np",
    ).images
    request = _request(engine, 500, case)
    request.image = image
    futures = [engine.add_request(request).future, engine.add_request(_request(engine, 501, CASES[0])).future]
    got, other = _run(engine, futures)
    assert float(np.abs(got - want).max()) <= ATOL
    assert float(np.abs(other - reference[0][0]).max()) <= ATOL


def _graph_engine(adapter_dirs, device: str, capture: bool):
    """A LoRA engine whose packed steps go through the graph runner's buckets: the family's static step
    with static LoRA tables (`capture=False`: the padded static step run eagerly, what a graph captures)."""
    from vllm_omni.diffusion.attention import SDPABackend
    from vllm_omni.diffusion.worker.cuda_graphs import CudaGraphConfig, CUDAGraphRunner

    lora = LoRAConfig(lora_modules=tuple(LoRAModulePath(n, p) for n, p in adapter_dirs.items()))
    engine = tiny21_engine(scheduling_policy="skip-ahead", lora=lora, device=device)
    runner = engine.executor.driver_worker.runner
    runner.transformer.attn_backend = SDPABackend("mask")  # graph safe, any dtype
    grid = CudaGraphConfig(num_seqs=(2, 4, 8), img_rows=(64, 128), txt_rows=(256, 512, 1024))
    runner.graphs = CUDAGraphRunner(
        runner.transformer, device, torch.float32, grid, capture=capture, lora_state=runner.lora_manager.state
    )
    runner.graphs.capture_all()
    return engine, runner.graphs


def _spied_paths(graphs) -> list[str]:
    paths, forward_packed = [], graphs.forward_packed

    def spy(*args):
        out = forward_packed(*args)
        paths.append(graphs.last_path)
        return out

    graphs.forward_packed = spy
    return paths


def test_packed_lora_steps_in_graph_buckets_match_diffusers(adapter_dirs, reference):
    """On CPU the bucket's static step runs eagerly over its padded buffers and static LoRA tables."""
    engine, graphs = _graph_engine(adapter_dirs, "cpu", capture=False)
    paths = _spied_paths(graphs)
    futures = [engine.add_request(_request(engine, 200 + i, case)).future for i, case in enumerate(CASES)]
    images = _run(engine, futures)
    assert set(paths) == {"graph"}, paths
    assert any(with_lora for _, with_lora in graphs._packed), "a bucket's LoRA graph ran"
    _assert_matches(images, reference)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a CUDA device")
def test_lora_steps_replay_cuda_graphs_equal_to_eager(adapter_dirs):
    """fp32 on CUDA: packed LoRA steps replayed in captured graphs equal the eager engine's images."""
    lora = LoRAConfig(lora_modules=tuple(LoRAModulePath(n, p) for n, p in adapter_dirs.items()))
    eager = tiny21_engine(scheduling_policy="skip-ahead", lora=lora, device="cuda", enforce_eager=True)
    want = _run(eager, [eager.add_request(_request(eager, 300 + i, c)).future for i, c in enumerate(CASES)])
    eager.shutdown()
    engine, graphs = _graph_engine(adapter_dirs, "cuda", capture=True)
    paths = _spied_paths(graphs)
    got = _run(engine, [engine.add_request(_request(engine, 400 + i, c)).future for i, c in enumerate(CASES)])
    engine.shutdown()
    assert set(paths) == {"graph"}, paths
    assert any(g.graph is not None for (_, with_lora), g in graphs._packed.items() if with_lora)
    worst = max(float(np.abs(g - e).max()) for g, e in zip(got, want, strict=True))
    print(f"2.1 + LoRA engine images, graphs vs eager: max abs {worst:.2e}")
    assert worst <= 1e-4

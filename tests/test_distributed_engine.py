"""The engine with a 2-process `ParallelExecutor` (gloo, CPU) gives the one-process engine's images.

Mixed shapes, CFG requests with different scales and step counts, admitted together and staggered,
on the tiny checkpoint. The one-process engine is itself checked against diffusers'
QwenImagePipeline in tests/test_engine_vs_diffusers.py.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from vllm_omni.config import OmniDiffusionConfig, ParallelConfig
from vllm_omni.diffusion.distributed.executor import ParallelExecutor
from vllm_omni.diffusion.engine import DiffusionEngine
from vllm_omni.diffusion.executor import UniProcExecutor
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.diffusion.worker.model_runner import DiffusionModelRunner
from vllm_omni.inputs import OmniDiffusionSamplingParams

CASES = [
    # (prompt, negative_prompt, height, width, steps, true_cfg_scale, seed)
    ("a lighthouse on a rocky coast at dusk, waves", "blurry", 48, 64, 3, 4.0, 12),
    ("a cat on a sofa", "dark", 64, 32, 2, 2.5, 13),
    ("a bowl of fruit", " ", 32, 32, 3, 7.0, 15),
    ("a red fox", None, 32, 48, 2, 4.0, 11),  # no CFG: one sequence, in the same steps
]


def _request(i: int, case) -> OmniDiffusionRequest:
    prompt, negative, h, w, steps, scale, seed = case
    params = OmniDiffusionSamplingParams(
        height=h, width=w, num_inference_steps=steps, true_cfg_scale=scale, seed=seed, output_type="np"
    )
    return OmniDiffusionRequest(f"req-{i}", prompt=prompt, negative_prompt=negative, sampling_params=params)


def _config(tiny_model_dir) -> OmniDiffusionConfig:
    return OmniDiffusionConfig(
        model=str(tiny_model_dir),
        dtype="float32",
        device="cpu",
        max_num_seqs=8,
        mixfusion_min_chunk_tokens=1,
        scheduling_policy="skip-ahead",  # every request in every step: the packed-step identity
    )


def _run(engine: DiffusionEngine, staggered: bool) -> tuple[list[np.ndarray], list]:
    steps = []
    first = CASES[:2] if staggered else CASES
    futures = [engine.add_request(_request(i, c)) for i, c in enumerate(first)]
    if staggered:
        steps.append(engine.step())
        futures += [engine.add_request(_request(i, c)) for i, c in enumerate(CASES[2:], start=2)]
    while not all(f.done() for f in futures):
        stats = engine.step()
        if stats is not None:
            steps.append(stats)
    return [f.result().images for f in futures], steps


@pytest.fixture(scope="module")
def reference_images(tiny_model_dir):
    engine = DiffusionEngine(_config(tiny_model_dir), autostart=False)
    return _run(engine, staggered=False)[0]


def _parallel_engine(tiny_model_dir, parallel: ParallelConfig, step_execution: bool) -> DiffusionEngine:
    config = dataclasses.replace(
        _config(tiny_model_dir), step_execution=step_execution, parallel_config=parallel
    )
    if not step_execution:
        assert config.max_num_seqs == 1, "request mode runs one request at a time"
    return DiffusionEngine(config, autostart=False)


def _check(images, reference_images, label: str) -> None:
    for i, (got, want) in enumerate(zip(images, reference_images)):
        assert got.shape == want.shape
        diff = float(np.abs(got - want).max())
        assert diff <= 1e-5, f"{label} case {i}: max abs diff {diff}"


@pytest.mark.parametrize(
    "parallel",
    [ParallelConfig(cfg_parallel_size=2), ParallelConfig(ulysses_degree=2)],
    ids=["cfg2", "ulysses2"],
)
def test_two_process_engine_matches_one_process(tiny_model_dir, reference_images, parallel):
    engine = _parallel_engine(tiny_model_dir, parallel, step_execution=True)
    try:
        assert isinstance(engine.executor, ParallelExecutor)
        for staggered in (False, True):
            images, steps = _run(engine, staggered)
            assert any(s.path == "packed" and len(set(s.shapes)) > 1 for s in steps if s), steps
            _check(images, reference_images, f"{parallel} {staggered=}")
        assert engine.executor.driver_worker.pipeline.transformer.num_split_forwards > 0
    finally:
        engine.shutdown()


def test_two_process_request_mode_matches_one_process(tiny_model_dir, reference_images):
    """Request mode built as users build it (step_execution=False at construction): one request at a time."""
    engine = _parallel_engine(tiny_model_dir, ParallelConfig(cfg_parallel_size=2), step_execution=False)
    try:
        images, steps = _run(engine, staggered=False)
        assert all(s.num_reqs == 1 for s in steps if s), "request mode never batches"
        _check(images, reference_images, "request mode")
    finally:
        engine.shutdown()


def test_executor_choice_and_config_validation(tiny_model_dir):
    engine = DiffusionEngine(_config(tiny_model_dir), autostart=False)
    assert isinstance(engine.executor, UniProcExecutor)
    assert isinstance(engine.executor.driver_worker.runner, DiffusionModelRunner)
    pipeline = engine.executor.driver_worker.pipeline
    with pytest.raises(ValueError, match="num_attention_heads"):
        # the tiny transformer has 2 heads: 2 * 2 shards do not divide them (refused before spawning)
        ParallelExecutor(
            engine.config, ParallelConfig(tensor_parallel_size=2, ulysses_degree=2), pipeline=pipeline
        )
    invariant = OmniDiffusionConfig(model=str(tiny_model_dir), device="cpu", batch_invariant=True)
    with pytest.raises(ValueError, match="batch-invariant"):
        ParallelExecutor(invariant, ParallelConfig(cfg_parallel_size=2), pipeline=pipeline)

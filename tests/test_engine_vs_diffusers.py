"""The whole engine against diffusers' QwenImagePipeline on the tiny checkpoint (fp32, CPU).

Every request must get the image diffusers gives it alone, whether it runs
alone, packed with others of different shapes submitted together, or admitted
while others are mid-denoise.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_omni.config import OmniDiffusionConfig
from vllm_omni.diffusion.engine import DiffusionEngine
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.inputs import OmniDiffusionSamplingParams

LONG_PROMPT = (
    "a very detailed oil painting of a lighthouse on a rocky coast at dusk, waves crashing, seagulls, "
    "warm light from the windows, dramatic clouds, a small boat in the distance, reflections on the water"
)

CASES = [
    # (prompt, negative_prompt, height, width, steps, true_cfg_scale, seed)
    # CFG on/off is not an execution barrier: CFG requests put two sequences in the packed forward,
    # the others one, and all five share steps.
    (LONG_PROMPT, "blurry, low quality", 48, 64, 4, 4.0, 12),  # CFG on, non-square
    ("a cat on a sofa", "dark", 64, 32, 2, 2.5, 13),  # CFG on, other scale, tall
    ("a bowl of fruit on a wooden table", " ", 48, 48, 3, 7.0, 15),  # CFG on, square, other steps
    ("a red fox", None, 32, 32, 3, 4.0, 11),  # CFG off: no negative prompt
    ("mountains", "ugly", 32, 48, 5, 1.0, 14),  # CFG off: scale <= 1
]


def _params(case) -> OmniDiffusionSamplingParams:
    _, _, h, w, steps, scale, seed = case
    return OmniDiffusionSamplingParams(
        height=h, width=w, num_inference_steps=steps, true_cfg_scale=scale, seed=seed, output_type="np"
    )


def _request(i: int, case) -> OmniDiffusionRequest:
    return OmniDiffusionRequest(
        f"req-{i}", prompt=case[0], negative_prompt=case[1], sampling_params=_params(case)
    )


@pytest.fixture(scope="module")
def reference_images(tiny_model_dir):
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    images = []
    for prompt, negative, h, w, steps, scale, seed in CASES:
        out = pipe(
            prompt=prompt,
            negative_prompt=negative,
            true_cfg_scale=scale,
            height=h,
            width=w,
            num_inference_steps=steps,
            generator=torch.Generator("cpu").manual_seed(seed),
            max_sequence_length=512,
            output_type="np",
        )
        images.append(out.images)
    return images


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    # The tiny images have 4..12 tokens; relax the MixFusion plan limits so they may share a step.
    config = OmniDiffusionConfig(
        model=str(tiny_model_dir),
        dtype="float32",
        device="cpu",
        max_num_seqs=8,
        mixfusion_min_chunk_tokens=1,
        scheduling_policy="skip-ahead",  # every request in every step: the packed-step identity
    )
    return DiffusionEngine(config, autostart=False)


def _run_to_completion(engine: DiffusionEngine, futures, steps_log=None) -> list[np.ndarray]:
    while not all(f.done() for f in futures):
        stats = engine.step()
        if steps_log is not None and stats is not None:
            steps_log.append(stats)
    return [f.result().images for f in futures]


def _assert_matches(images, reference_images):
    for i, (got, want) in enumerate(zip(images, reference_images)):
        assert got.shape == want.shape, f"case {i}: shape {got.shape} != {want.shape}"
        diff = float(np.abs(got - want).max())
        assert diff <= 1e-4, f"case {i}: max abs diff {diff} vs diffusers"


def test_each_request_alone_matches_diffusers(engine, reference_images):
    images = []
    for i, case in enumerate(CASES):
        images += _run_to_completion(engine, [engine.add_request(_request(i, case))])
    _assert_matches(images, reference_images)


def test_all_together_packs_mixed_shapes_and_matches_diffusers(engine, reference_images):
    steps = []
    futures = [engine.add_request(_request(100 + i, case)) for i, case in enumerate(CASES)]
    images = _run_to_completion(engine, futures, steps)
    _assert_matches(images, reference_images)
    first = steps[0]
    assert first.num_reqs == len(CASES), "CFG and non-CFG requests share the first step"
    assert first.num_seqs == 3 * 2 + 2, "three CFG requests (two sequences each) and two without"
    assert first.path == "packed"
    assert len(set(first.shapes)) >= 3, f"first step should pack mixed shapes, got {first.shapes}"


def test_staggered_arrival_matches_diffusers(engine, reference_images):
    steps = []
    futures = [engine.add_request(_request(200 + i, case)) for i, case in enumerate(CASES[:2])]
    engine.step()  # the first two are now one step into their schedules
    futures += [engine.add_request(_request(200 + i, case)) for i, case in enumerate(CASES[2:], start=2)]
    images = _run_to_completion(engine, futures, steps)
    _assert_matches(images, reference_images)
    # the last three join the first two mid-denoise: five requests, CFG on and off, at different
    # progress, in one step.
    assert any(s.num_reqs == 5 and len(set(s.shapes)) >= 3 for s in steps)


def test_request_mode_gives_the_same_images(tiny_model_dir, reference_images):
    config = OmniDiffusionConfig(
        model=str(tiny_model_dir), dtype="float32", device="cpu", step_execution=False, max_num_seqs=8
    )
    assert config.max_num_seqs == 1
    engine = DiffusionEngine(config, autostart=False)
    futures = [engine.add_request(_request(300 + i, case)) for i, case in enumerate(CASES)]
    images = _run_to_completion(engine, futures)
    _assert_matches(images, reference_images)


def test_dense_path_for_same_shape_batch(engine):
    """Same-shape requests (different text lengths, CFG scales, step counts) run the dense path."""
    cases = [("a dog", "bad", 32, 32, 3, 3.0, 1), (LONG_PROMPT, "worse", 32, 32, 2, 5.0, 2)]  # both CFG
    steps = []
    futures = [engine.add_request(_request(400 + i, c)) for i, c in enumerate(cases)]
    together = _run_to_completion(engine, futures, steps)
    assert steps[0].path == "dense"
    alone = [
        _run_to_completion(engine, [engine.add_request(_request(410 + i, c))])[0] for i, c in enumerate(cases)
    ]
    for a, b in zip(together, alone):
        assert np.abs(a - b).max() <= 1e-5


def test_decode_failure_fails_only_that_request(engine, monkeypatch, reference_images):
    pipeline = engine.executor.driver_worker.pipeline
    original = pipeline.decode

    def flaky_decode(latents, height, width, output_type, modes=None):
        if (height, width) == (64, 32):
            raise RuntimeError("simulated VAE failure")
        return original(latents, height, width, output_type, modes)

    monkeypatch.setattr(pipeline, "decode", flaky_decode)
    futures = [engine.add_request(_request(500 + i, case)) for i, case in enumerate(CASES)]
    while not all(f.done() for f in futures):
        engine.step()
    for i, future in enumerate(futures):
        if CASES[i][2:4] == (64, 32):
            with pytest.raises(Exception, match="simulated VAE failure"):
                future.result()
        else:
            got = future.result().images
            assert np.abs(got - reference_images[i]).max() <= 1e-4


def test_solver_failure_fails_only_that_request(engine, monkeypatch, reference_images):
    """A request whose own CFG/Euler step raises gets an error; the others finish correctly.

    The vectorised step over all requests fails first (as any per-request fault would make it), the
    runner falls back to stepping requests one by one, and only the culprit fails."""
    runner = engine.executor.driver_worker.runner
    original = runner._advance
    original_all = runner._advance_all

    def flaky_advance(state, velocities):
        if (state.params.height, state.params.width) == (48, 48) and state.step_index == 1:
            raise RuntimeError("simulated solver failure")
        return original(state, velocities)

    def flaky_advance_all(plan, out):
        if any((s.params.height, s.params.width) == (48, 48) and s.step_index == 1 for s in plan.states):
            raise RuntimeError("one row is bad")
        return original_all(plan, out)

    monkeypatch.setattr(runner, "_advance", flaky_advance)
    monkeypatch.setattr(runner, "_advance_all", flaky_advance_all)
    futures = [engine.add_request(_request(600 + i, case)) for i, case in enumerate(CASES)]
    _drain(engine, futures)
    for i, future in enumerate(futures):
        if CASES[i][2:4] == (48, 48):
            with pytest.raises(Exception, match="simulated solver failure"):
                future.result()
        else:
            assert np.abs(future.result().images - reference_images[i]).max() <= 1e-4
    assert runner.num_reqs == 0, "failed and finished requests leave no slot behind"


def _drain(engine, futures) -> None:
    while not all(f.done() for f in futures):
        engine.step()


def test_hooked_blocks_fall_back_to_one_request_at_a_time(tiny_model_dir, reference_images, caplog):
    """A native forward hook on a block (as sharding wrappers install) makes the runner run requests
    one by one, logged at startup, with the same images."""
    config = OmniDiffusionConfig(
        model=str(tiny_model_dir),
        dtype="float32",
        device="cpu",
        max_num_seqs=8,
        mixfusion_min_chunk_tokens=1,
        scheduling_policy="skip-ahead",  # every request in every step: the packed-step identity
    )
    hooked = DiffusionEngine(config, autostart=False)
    calls = []
    pipeline = hooked.executor.driver_worker.pipeline
    pipeline.transformer.transformer_blocks[0].register_forward_hook(lambda *a: calls.append(1))
    with caplog.at_level("WARNING"):
        hooked = DiffusionEngine(config, pipeline=pipeline, autostart=False)
    assert "one by one" in caplog.text
    steps = []
    futures = [hooked.add_request(_request(700 + i, case)) for i, case in enumerate(CASES)]
    images = _run_to_completion(hooked, futures, steps)
    _assert_matches(images, reference_images)
    assert steps[0].path == "serial" and steps[0].num_reqs == len(CASES) and calls

"""The whole engine against diffusers' QwenImagePipeline on the tiny checkpoint (fp32, CPU).

Every request must get the image diffusers gives it alone, whether it runs
alone, packed with others of different shapes submitted together, or admitted
while others are mid-denoise.
"""

from __future__ import annotations

import numpy as np
import pytest
from utils import (
    CASES,
    LONG_PROMPT,
    assert_matches,
    case_request,
    diffusers_reference_images,
    run_to_completion,
    tiny_engine,
)

from vllm_omni.config import OmniDiffusionConfig
from vllm_omni.diffusion.engine import DiffusionEngine


@pytest.fixture(scope="module")
def reference_images(tiny_model_dir):
    return diffusers_reference_images(tiny_model_dir)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    # The tiny images have 4..12 tokens: no MixFusion plan limit, so they may share a step; skip-ahead
    # puts every request in every step (the packed-step identity).
    return tiny_engine(tiny_model_dir, mixfusion_min_chunk_tokens=1, scheduling_policy="skip-ahead")


def test_each_request_alone_matches_diffusers(engine, reference_images):
    images = []
    for i, case in enumerate(CASES):
        images += run_to_completion(engine, [engine.add_request(case_request(i, case))])
    assert_matches(images, reference_images)


def test_all_together_packs_mixed_shapes_and_matches_diffusers(engine, reference_images):
    steps = []
    futures = [engine.add_request(case_request(100 + i, case)) for i, case in enumerate(CASES)]
    images = run_to_completion(engine, futures, steps)
    assert_matches(images, reference_images)
    first = steps[0]
    assert first.num_reqs == len(CASES), "CFG and non-CFG requests share the first step"
    assert first.num_seqs == 3 * 2 + 2, "three CFG requests (two sequences each) and two without"
    assert first.path == "packed"
    assert len(set(first.shapes)) >= 3, f"first step should pack mixed shapes, got {first.shapes}"


def test_staggered_arrival_matches_diffusers(engine, reference_images):
    steps = []
    futures = [engine.add_request(case_request(200 + i, case)) for i, case in enumerate(CASES[:2])]
    engine.step()  # the first two are now one step into their schedules
    futures += [engine.add_request(case_request(200 + i, case)) for i, case in enumerate(CASES[2:], start=2)]
    images = run_to_completion(engine, futures, steps)
    assert_matches(images, reference_images)
    # the last three join the first two mid-denoise: five requests, CFG on and off, at different
    # progress, in one step.
    assert any(s.num_reqs == 5 and len(set(s.shapes)) >= 3 for s in steps)


def test_request_mode_gives_the_same_images(tiny_model_dir, reference_images):
    config = OmniDiffusionConfig(
        model=str(tiny_model_dir), dtype="float32", device="cpu", step_execution=False, max_num_seqs=8
    )
    assert config.max_num_seqs == 1
    engine = DiffusionEngine(config, autostart=False)
    futures = [engine.add_request(case_request(300 + i, case)) for i, case in enumerate(CASES)]
    images = run_to_completion(engine, futures)
    assert_matches(images, reference_images)


def test_dense_path_for_same_shape_batch(engine):
    """Same-shape requests (different text lengths, CFG scales, step counts) run the dense path."""
    cases = [("a dog", "bad", 32, 32, 3, 3.0, 1), (LONG_PROMPT, "worse", 32, 32, 2, 5.0, 2)]  # both CFG
    steps = []
    futures = [engine.add_request(case_request(400 + i, c)) for i, c in enumerate(cases)]
    together = run_to_completion(engine, futures, steps)
    assert steps[0].path == "dense"
    alone = [
        run_to_completion(engine, [engine.add_request(case_request(410 + i, c))])[0]
        for i, c in enumerate(cases)
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
    futures = [engine.add_request(case_request(500 + i, case)) for i, case in enumerate(CASES)]
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
    futures = [engine.add_request(case_request(600 + i, case)) for i, case in enumerate(CASES)]
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
    futures = [hooked.add_request(case_request(700 + i, case)) for i, case in enumerate(CASES)]
    images = run_to_completion(hooked, futures, steps)
    assert_matches(images, reference_images)
    assert steps[0].path == "serial" and steps[0].num_reqs == len(CASES) and calls

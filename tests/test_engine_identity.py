"""Request identity, the slot batch and the token budget, on the real engine (tiny model, CPU, fp32).

The caller's `request_id` is only a label: reusing it (in a row, concurrently, right after an abort)
must still serve every request its own image, the one it gets alone. The token budget counts what the
text encoder really keeps (the template tail included), so `max_num_batched_tokens` is a real cap.
"""

from __future__ import annotations

import numpy as np
import pytest

from vllm_omni.config import OmniDiffusionConfig
from vllm_omni.diffusion.engine import DiffusionEngine
from vllm_omni.diffusion.errors import RequestAbortedError
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.diffusion.sched.cost_model import StepCostModel
from vllm_omni.diffusion.worker.model_runner import CPU_MEASURED_LAYOUTS, QueuedStep
from vllm_omni.inputs import OmniDiffusionSamplingParams

# (prompt, negative_prompt, height, width, steps, seed): CFG on and off, two sizes
CASES = [
    ("a red cat", "blurry", 32, 32, 3, 1),
    ("a lighthouse at dusk over a stormy sea", "dark", 32, 32, 2, 2),
    ("a bowl of fruit", None, 48, 32, 3, 3),
]


def _request(label: str, case) -> OmniDiffusionRequest:
    prompt, negative, h, w, steps, seed = case
    params = OmniDiffusionSamplingParams(
        height=h, width=w, num_inference_steps=steps, seed=seed, true_cfg_scale=4.0, output_type="np"
    )
    return OmniDiffusionRequest(label, prompt=prompt, negative_prompt=negative, sampling_params=params)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    config = OmniDiffusionConfig(
        model=str(tiny_model_dir),
        dtype="float32",
        device="cpu",
        max_num_seqs=8,
        scheduling_policy="skip-ahead",  # every request in every step: the packed-step identity
        mixfusion_min_chunk_tokens=1,  # let the tiny sizes mix
        log_stats=False,
    )
    return DiffusionEngine(config, autostart=False)


def _drain(engine, handles, steps=None):
    while not all(h.done() for h in handles):
        stats = engine.step()
        if steps is not None and stats is not None:
            steps.append(stats)


@pytest.fixture(scope="module")
def alone(engine):
    """Each case's image when it runs alone."""
    images = []
    for case in CASES:
        handle = engine.add_request(_request("solo", case))
        _drain(engine, [handle])
        images.append(handle.result().images)
    return images


def test_same_label_in_a_row_and_concurrently_gets_own_images(engine, alone):
    # in a row: same label, same size, both CFG (the case that once reused the first one's text rows)
    for case, want in zip(CASES[:2], alone[:2]):
        handle = engine.add_request(_request("same-id", case))
        _drain(engine, [handle])
        assert np.array_equal(handle.result().images, want)
    # concurrently: one label for all three, sharing steps
    handles = [engine.add_request(_request("same-id", case)) for case in CASES]
    assert len({h.req_id for h in handles}) == len(CASES), "the engine makes a new id per request"
    steps = []
    _drain(engine, handles, steps)
    assert steps[0].num_reqs == len(CASES)
    for handle, want in zip(handles, alone):
        out = handle.result()
        assert out.request_id == "same-id" and out.req_id == handle.req_id
        assert np.abs(out.images - want).max() <= 1e-5


def test_reuse_right_after_abort(engine, alone):
    first = engine.add_request(_request("again", CASES[0]))
    engine.step()
    engine.abort(first.req_id)
    second = engine.add_request(_request("again", CASES[1]))
    _drain(engine, [first, second])
    with pytest.raises(RequestAbortedError):
        first.result()
    assert np.array_equal(second.result().images, alone[1])
    assert engine.executor.driver_worker.runner.num_reqs == 0, "the aborted request gave its slot back"


def test_timings_and_finish_reason_travel_on_the_output(engine):
    handle = engine.add_request(_request("timed", CASES[2]))
    _drain(engine, [handle])
    out = handle.result()
    assert out.finish_reason == "completed" and out.num_steps_done == CASES[2][4]
    assert 0 <= out.timings.queue_s <= out.timings.engine_s


def test_token_budget_counts_the_embedded_prompt(tiny_model_dir, engine):
    """'a red cat' keeps 8 encoder rows (3 words + the template tail), and the budget counts those."""
    num_pos, num_neg = engine.validate_request(_request("count", CASES[0])).text_rows
    pipeline = engine.executor.driver_worker.pipeline
    embedded = pipeline.encode_prompts(["a red cat", "blurry"], [512, 512])
    assert (num_pos, num_neg) == (embedded[0].shape[0], embedded[1].shape[0])
    assert num_pos > 3

    first = engine.add_request(_request("budget", CASES[0]))
    steps = []
    _drain(engine, [first], steps)
    cost = steps[0].num_tokens  # real tokens of one CASES[0] request in a forward
    config = OmniDiffusionConfig(
        model=str(tiny_model_dir),
        dtype="float32",
        device="cpu",
        max_num_seqs=8,
        scheduling_policy="skip-ahead",  # every request in every step: the packed-step identity
        max_num_batched_tokens=2 * cost,
        log_stats=False,
    )
    capped = DiffusionEngine(config, pipeline=pipeline, autostart=False)
    handles = [capped.add_request(_request(f"b{i}", CASES[0])) for i in range(5)]
    steps = []
    _drain(capped, handles, steps)
    assert max(s.num_tokens for s in steps) == 2 * cost, "two fit, a third never joins"
    assert all(s.num_reqs <= 2 for s in steps)


def test_sizes_off_the_latent_grid_round_down_like_diffusers(tiny_model_dir, engine):
    """1472x1140 (Qwen-Image's own aspect) is not a multiple of 16: diffusers rounds down, so do we."""
    import torch
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    want = pipe(
        prompt="a red cat",
        negative_prompt="blurry",
        true_cfg_scale=4.0,
        height=40,
        width=36,
        num_inference_steps=2,
        generator=torch.Generator("cpu").manual_seed(5),
        output_type="np",
    ).images
    params = OmniDiffusionSamplingParams(
        height=40, width=36, num_inference_steps=2, seed=5, true_cfg_scale=4.0, output_type="np"
    )
    handle = engine.add_request(OmniDiffusionRequest("odd", "a red cat", "blurry", params))
    _drain(engine, [handle])
    out = handle.result()
    assert (out.height, out.width) == (32, 32) and out.images.shape == want.shape == (1, 32, 32, 3)
    assert np.abs(out.images - want).max() <= 1e-4


def test_host_waits_for_the_step_before_the_previous_one(engine, monkeypatch):
    """The runner keeps one step queued on the GPU, no more: before step k it waits for the end of step
    k - 2 (nothing in a step reads the device, so without the wait the host would run ahead until
    CUDA's launch queue is full). CPU has no events: fake ones stand in for the GPU's."""
    runner = engine.executor.driver_worker.runner
    waits: list[int] = []

    class StepEnd:
        def __init__(self, step: int):
            self.step = step

        def synchronize(self):
            waits.append(self.step)

    recorded = []
    monkeypatch.setattr(
        runner,
        "_step_queued",
        lambda denoise: (
            runner._queued_steps.append(QueuedStep(StepEnd(len(recorded)), None)) or recorded.append(1)
        ),
    )
    handle = engine.add_request(_request("paced", ("a red cat", None, 32, 32, 4, 9)))
    for step in range(4):
        engine.step()
        assert waits == list(range(max(0, step - 1)))  # step k waited for step k - 2
        assert len(runner._queued_steps) == min(step + 1, 2)
    assert handle.result(timeout=60).num_images == 1  # decoded beside the steps, after the last one
    runner._queued_steps.clear()


def test_a_preempted_request_gets_the_image_it_gets_uninterrupted(tiny_model_dir):
    """Latency policy, one request per step: a long request sits out while a shorter one arrives and
    runs, and a still shorter one preempts that one in turn. Each image equals the same request run
    alone, bit for bit (CPU fp32): sitting out leaves latents, schedule and generator untouched."""
    config = OmniDiffusionConfig(
        model=str(tiny_model_dir),
        dtype="float32",
        device="cpu",
        max_num_seqs=1,
        max_num_resident_reqs=3,
        scheduling_policy="latency",
        scheduling_aging_factor=1e9,  # remaining work alone decides (the order asserted below)
        scheduling_deadline_factor=None,
        log_stats=False,
    )
    engine = DiffusionEngine(config, autostart=False)
    # the prior (proportional to tokens) decides: CPU step times are too noisy to order tiny requests
    prior = StepCostModel()
    prior.observe = lambda num_tokens, seconds: None
    engine.scheduler.cost_model = engine.scheduler.latency_policy.cost_model = prior
    cases = {
        "long": ("a red cat", "blurry", 64, 64, 6, 11),
        "mid": ("a lighthouse at dusk", "dark", 48, 48, 3, 12),
        "short": ("a bowl of fruit", None, 32, 32, 2, 13),
    }
    alone = {}
    for label, case in cases.items():
        handle = engine.add_request(_request(label, case))
        _drain(engine, [handle])
        alone[label] = handle.result().images
    handles = {"long": engine.add_request(_request("long", cases["long"]))}
    engine.step()
    handles["mid"] = engine.add_request(_request("mid", cases["mid"]))
    engine.step()  # mid runs, long sits out
    handles["short"] = engine.add_request(_request("short", cases["short"]))
    _drain(engine, list(handles.values()))
    outputs = {label: h.result() for label, h in handles.items()}
    assert outputs["short"].timings.finished_time < outputs["mid"].timings.finished_time
    assert outputs["mid"].timings.finished_time < outputs["long"].timings.finished_time
    assert outputs["long"].timings.num_steps_sat_out == 5 and outputs["long"].timings.num_preemptions == 1
    assert outputs["mid"].timings.num_steps_sat_out == 2 and outputs["mid"].timings.num_preemptions == 1
    for label, out in outputs.items():
        assert np.array_equal(out.images, alone[label]), label


def test_step_costs_measured_at_start_up_cover_the_typical_layouts(engine):
    """What the start-up measures (a CPU: the small layouts, eager): one point per CFG layout, with the
    layout's real tokens (2 sequences of 32 text tokens + the image per request). The scheduler's cost
    model starts from them, on a CPU too (without them it would pack nothing at first)."""
    samples = engine.executor.driver_worker.runner.measure_step_costs(iters=1, budget_s=1e9)
    expected = [2 * n * (32 + (side // 16) ** 2) for side, n in CPU_MEASURED_LAYOUTS]
    assert [s.num_tokens for s in samples] == expected
    assert all(s.seconds > 0 for s in samples)
    assert engine.scheduler.cost_model.num_points >= 1  # seeded at start-up, before any request


def test_priority_is_refused_where_the_policy_keeps_arrival_order(engine):
    params = OmniDiffusionSamplingParams(height=32, width=32, num_inference_steps=2, seed=1, priority=1)
    with pytest.raises(ValueError, match="priority: this server's --scheduling-policy skip-ahead"):
        engine.add_request(OmniDiffusionRequest("prio", "a red cat", None, params))

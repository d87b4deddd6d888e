"""StepScheduler driven by a fake runner (hand-written RunnerOutputs, no model, no torch).

Upstream behaviours (vLLM-Omni tests/diffusion/test_diffusion_scheduler.py) plus the ones this engine
adds: mixed-shape admission under the MixFusion plan, skip-ahead with aging, the token budget.
"""

from __future__ import annotations

import pytest
from utils import FakeRunner, make_req

from vllm_omni.config import OmniDiffusionConfig
from vllm_omni.diffusion.errors import QueueFullError
from vllm_omni.diffusion.request import RequestStatus
from vllm_omni.diffusion.sched.interface import (
    ModelRunnerOutput,
    RunnerOutput,
    SchedulerOutput,
)
from vllm_omni.diffusion.sched.scheduler import FinishedRequest, StepScheduler

SOLO = {"extra_args": {"enable_mixfusion": False}}
"""A request that batches only with its own shape: a real execution barrier for these tests."""


def make_sched(supports_mixfusion: bool = True, **config) -> StepScheduler:
    # These tests exercise strict FIFO and MixFusion's plan limits; the defaults are skip-ahead, no limits.
    config = {
        "scheduling_policy": "fifo",
        "mixfusion_min_chunk_tokens": 256,
        "mixfusion_max_chunks": 128,
        **config,
    }
    return StepScheduler(OmniDiffusionConfig(**config), supports_mixfusion=supports_mixfusion)


def step(sched: StepScheduler, runner: FakeRunner) -> tuple[SchedulerOutput, list[FinishedRequest]]:
    out = sched.schedule()
    return out, sched.update_from_output(out, runner.execute(out))


def new_ids(out: SchedulerOutput) -> list[str]:
    return [r.req_id for r in out.scheduled_new_reqs]


# ------------------------------------------------------------------ lifecycle


def test_single_request_lifecycle():
    sched, runner = make_sched(), FakeRunner()
    req = make_req("a", steps=3)
    sched.add_request(req)
    assert sched.num_waiting == 1 and sched.has_requests() and req.sampling_params.seed is not None
    out, finished = step(sched, runner)
    assert new_ids(out) == ["a"] and out.num_running_reqs == 1 and out.num_waiting_reqs == 0
    assert sched.get_state("a").num_steps_done == 1 and not finished
    out, _ = step(sched, runner)
    assert out.scheduled_cached_req_ids == ["a"] and not out.scheduled_new_reqs
    assert sched.get_state("a").num_steps_done == 2
    _, finished = step(sched, runner)
    assert [(f.req_id, f.status, f.num_steps_done) for f in finished] == [
        ("a", RequestStatus.FINISHED_COMPLETED, 3)
    ]
    assert finished[0].result.images == ["a"] and finished[0].first_scheduled_time is not None
    assert not sched.has_requests() and sched.get_request("a") is None and sched.running_key is None


def test_new_request_data_carries_the_engine_s_copy_with_seed():
    """The engine copies a request's params once (input_processor.py); the scheduler assigns the seed
    on that copy and hands the same object to the runner (no second copy)."""
    sched = StepScheduler(OmniDiffusionConfig(seed=7))
    req = make_req("a", extra_args={"enable_mixfusion": True})
    sched.add_request(req)
    data = sched.schedule().scheduled_new_reqs[0]
    assert data.sampling_params is req.sampling_params and data.sampling_params.seed is not None
    other = StepScheduler(OmniDiffusionConfig(seed=7))
    req2 = make_req("a")
    other.add_request(req2)
    assert (
        req2.sampling_params.seed == req.sampling_params.seed
    )  # config.seed makes assigned seeds repeatable


def test_duplicate_id_and_queue_full():
    sched = make_sched(max_queue_size=2, max_num_seqs=1)
    sched.add_request(make_req("a"))
    with pytest.raises(ValueError, match="'a' is already"):
        sched.add_request(make_req("a"))
    sched.add_request(make_req("b"))
    with pytest.raises(QueueFullError, match="max_queue_size = 2"):
        sched.add_request(make_req("c"))
    sched.schedule()  # a leaves the waiting queue
    sched.add_request(make_req("c"))
    assert sched.num_waiting == 2 and sched.num_running == 1


# ------------------------------------------------------------------ batching


def test_heterogeneous_requests_share_a_step():
    sched, runner = make_sched(max_num_seqs=4), FakeRunner()
    sched.add_request(make_req("a", 512, 512, steps=2, true_cfg_scale=4.0))
    sched.add_request(make_req("b", 256, 256, steps=5, true_cfg_scale=7.0))  # gcd 256, 5 chunks: plan ok
    sched.add_request(make_req("c", 512, 256, steps=3, true_cfg_scale=2.5))
    out, _ = step(sched, runner)
    assert new_ids(out) == ["a", "b", "c"]
    done = {}
    for _ in range(5):
        _, finished = step(sched, runner)
        done.update({f.req_id: f.num_steps_done for f in finished})
    assert done == {"a": 2, "b": 5, "c": 3}  # different step counts batch and finish independently


def test_mixfusion_off_batches_by_shape_and_per_request_override():
    sched = make_sched(max_num_seqs=4, enable_mixfusion=False)
    for req_id, width in [("a", 512), ("b", 768), ("c", 512)]:
        sched.add_request(make_req(req_id, 512, width))
    assert new_ids(sched.schedule()) == ["a"]  # fifo: b (other shape) blocks c
    sched = make_sched(max_num_seqs=4, enable_mixfusion=False)
    sched.add_request(make_req("a", 512, 512, extra_args={"enable_mixfusion": True}))
    sched.add_request(make_req("b", 512, 768, extra_args={"enable_mixfusion": True}))
    assert new_ids(sched.schedule()) == ["a", "b"]
    # Server on, requests opting out: shapes split again.
    sched = make_sched(max_num_seqs=4, enable_mixfusion=True)
    sched.add_request(make_req("a", 512, 512, extra_args={"enable_mixfusion": False}))
    sched.add_request(make_req("b", 512, 768, extra_args={"enable_mixfusion": False}))
    assert new_ids(sched.schedule()) == ["a"]


def test_request_toggle_is_a_no_op_without_pipeline_support():
    sched = make_sched(supports_mixfusion=False, max_num_seqs=4)
    sched.add_request(make_req("a", 512, 512, extra_args={"enable_mixfusion": True}))
    sched.add_request(make_req("b", 512, 768, extra_args={"enable_mixfusion": True}))
    sched.add_request(make_req("c", 512, 512, extra_args={"enable_mixfusion": True}))
    assert new_ids(sched.schedule()) == ["a"]
    assert sched.running_key.height == 512


def test_plan_rejects_dissimilar_shapes_until_the_batch_drains():
    sched, runner = make_sched(max_num_seqs=4), FakeRunner()
    sched.add_request(make_req("big", 1024, 1024, steps=2))  # 64x64 tokens
    sched.add_request(make_req("odd", 832, 1216, steps=2))  # 52x76 tokens: gcd 16 < 256
    out, _ = step(sched, runner)
    assert new_ids(out) == ["big"] and sched.num_waiting == 1
    out, finished = step(sched, runner)
    assert not out.scheduled_new_reqs and [f.req_id for f in finished] == ["big"]
    out, _ = step(sched, runner)
    assert new_ids(out) == ["odd"]  # waited, never dropped


def test_plan_accepts_compatible_shapes_and_request_knobs_relax_it():
    sched = make_sched(max_num_seqs=4)
    sched.add_request(make_req("big", 1024, 1024))
    sched.add_request(make_req("quarter", 512, 512))  # (64,64)+(32,32): chunk 1024, 5 chunks
    assert new_ids(sched.schedule()) == ["big", "quarter"]
    relaxed = {"mixfusion_min_chunk_tokens": 16, "mixfusion_max_chunks": 1000}
    sched = make_sched(max_num_seqs=4)
    sched.add_request(make_req("big", 1024, 1024))
    sched.add_request(make_req("odd", 832, 1216, extra_args=relaxed))
    assert new_ids(sched.schedule()) == ["big", "odd"]
    sched = make_sched(max_num_seqs=4, mixfusion_min_chunk_tokens=16, mixfusion_max_chunks=502)
    sched.add_request(make_req("big", 1024, 1024))
    sched.add_request(make_req("odd", 832, 1216))  # 503 chunks > 502
    assert new_ids(sched.schedule()) == ["big"]


def test_tiny_mixed_shapes_need_relaxed_knobs():
    # 32x32 px (4 tokens) + 64x48 px (12 tokens): gcd 4 is below the default 256.
    sched = make_sched(max_num_seqs=4)
    sched.add_request(make_req("a", 32, 32))
    sched.add_request(make_req("b", 64, 48))
    assert new_ids(sched.schedule()) == ["a"]
    sched = make_sched(max_num_seqs=4, mixfusion_min_chunk_tokens=1)
    sched.add_request(make_req("a", 32, 32))
    sched.add_request(make_req("b", 64, 48))
    assert new_ids(sched.schedule()) == ["a", "b"]


def test_max_num_seqs_is_a_hard_cap():
    sched, runner = make_sched(max_num_seqs=3), FakeRunner()
    for i in range(10):
        sched.add_request(make_req(f"r{i}", steps=1 + i % 4))
    num_done, order = 0, []
    while sched.has_requests():
        out, finished = step(sched, runner)
        assert out.num_scheduled_reqs <= 3 and sched.num_running <= 3
        order += new_ids(out)
        num_done += len(finished)
    assert num_done == 10 and order == [f"r{i}" for i in range(10)]


def test_request_mode_runs_one_request_at_a_time():
    sched, runner = StepScheduler(OmniDiffusionConfig(step_execution=False, max_num_seqs=8)), FakeRunner()
    for i in range(3):
        sched.add_request(make_req(f"r{i}", steps=2))
    scheduled = []
    while sched.has_requests():
        out, _ = step(sched, runner)
        assert out.num_scheduled_reqs == 1
        scheduled.append(out.scheduled_req_ids[0])
    assert scheduled == ["r0", "r0", "r1", "r1", "r2", "r2"]


# ------------------------------------------------------------------ fifo vs skip-ahead


def test_fifo_head_of_line_blocking():
    # Upstream: capacity 3, queue [A, B(width=768), C] -> only A; after A finishes only B.
    sched, runner = make_sched(max_num_seqs=3, enable_mixfusion=False), FakeRunner()
    sched.add_request(make_req("A", steps=1))
    sched.add_request(make_req("B", width=768, steps=1))
    sched.add_request(make_req("C", steps=1))
    out, _ = step(sched, runner)
    assert new_ids(out) == ["A"] and sched.num_waiting == 2
    out, _ = step(sched, runner)
    assert new_ids(out) == ["B"]
    out, _ = step(sched, runner)
    assert new_ids(out) == ["C"]


def test_skip_ahead_passes_an_incompatible_head():
    sched = make_sched(max_num_seqs=3, scheduling_policy="skip-ahead", max_waiting_steps=10)
    sched.add_request(make_req("A", steps=5))
    sched.add_request(make_req("B", 768, **SOLO))
    sched.add_request(make_req("C"))
    out = sched.schedule()
    assert new_ids(out) == ["A", "C"] and sched.get_state("B").status == RequestStatus.WAITING
    assert sched.policy.num_steps_aged("B", out.step_id + 1) == 1


def run_adversarial_stream(max_waiting_steps: int, num_steps: int = 500, run_steps: int = 6) -> int | None:
    """A compatible request arrives every step while an incompatible (LoRA) head waits.

    Returns the step at which the head was admitted (None if never).
    """
    sched = make_sched(max_num_seqs=4, scheduling_policy="skip-ahead", max_waiting_steps=max_waiting_steps)
    runner = FakeRunner()
    sched.add_request(make_req("s0", steps=run_steps))
    sched.add_request(make_req("head", 768, **SOLO, steps=2))
    for i in range(1, num_steps):
        sched.add_request(make_req(f"s{i}", steps=run_steps))
        out, _ = step(sched, runner)
        assert out.num_scheduled_reqs <= 4
        if "head" in new_ids(out):
            assert out.num_scheduled_reqs == 1  # an incompatible key runs only after the batch drains
            return out.step_id
    return None


def test_skip_ahead_aging_bounds_the_wait():
    max_waiting_steps, run_steps = 5, 6
    admitted = run_adversarial_stream(max_waiting_steps, run_steps=run_steps)
    # Passed over first in step 0; passing stops after max_waiting_steps; the batch drains in run_steps.
    assert admitted is not None and admitted <= max_waiting_steps + run_steps


def test_no_starvation_over_a_long_adversarial_stream():
    assert run_adversarial_stream(max_waiting_steps=50, num_steps=500) <= 50 + 6
    # Without aging the head starves for the whole run: the bound above is what prevents it.
    assert run_adversarial_stream(max_waiting_steps=10**9, num_steps=500) is None


def test_fifo_under_the_same_stream_admits_the_head_once_the_batch_drains():
    sched, runner = make_sched(max_num_seqs=4, scheduling_policy="fifo"), FakeRunner()
    sched.add_request(make_req("s0", steps=6))
    sched.add_request(make_req("head", 768, **SOLO, steps=2))
    for i in range(1, 20):
        sched.add_request(make_req(f"s{i}", steps=6))
        out, _ = step(sched, runner)
        if "head" in new_ids(out):
            assert out.step_id == 6 and i == 7  # s0 ran steps 0..5; nothing passed the head
            return
        assert new_ids(out) in ([], ["s0"])
    pytest.fail("head never admitted under fifo")


def test_empty_running_set_admits_the_oldest_first():
    sched = make_sched(max_num_seqs=2, scheduling_policy="skip-ahead", max_waiting_steps=100)
    sched.add_request(make_req("old", 768, **SOLO))
    sched.add_request(make_req("young1"))
    sched.add_request(make_req("young2"))
    assert new_ids(sched.schedule()) == ["old"]  # the young ones are incompatible with it


# ------------------------------------------------------------------ token budget


def test_token_budget_limits_admission():
    # 512x512 with CFG: 2 * (1024 + 11) + ... ; estimate: pos "a red cat" = 11, neg "blurry" = 9.
    per_req = (1024 + 11) + (1024 + 9)
    sched, runner = make_sched(max_num_seqs=8, max_num_batched_tokens=2 * per_req), FakeRunner()
    for i in range(3):
        sched.add_request(make_req(f"r{i}", steps=2))
    out, _ = step(sched, runner)
    assert new_ids(out) == ["r0", "r1"]
    out, _ = step(sched, runner)
    assert not out.scheduled_new_reqs  # running requests are never preempted, r2 still waits
    out, _ = step(sched, runner)
    assert new_ids(out) == ["r2"]


def test_huge_request_runs_alone():
    sched, runner = make_sched(max_num_seqs=8, max_num_batched_tokens=1000), FakeRunner()
    sched.add_request(make_req("huge", 1024, 1024, steps=2))  # ~8200 tokens > budget
    sched.add_request(make_req("small", 64, 64, steps=1, negative_prompt=None))  # 16 + 11 tokens
    out, _ = step(sched, runner)
    assert new_ids(out) == ["huge"]
    out, _ = step(sched, runner)
    assert not out.scheduled_new_reqs
    out, _ = step(sched, runner)
    assert new_ids(out) == ["small"]


def test_skip_ahead_fills_the_budget_past_a_large_request():
    budget = dict(max_num_seqs=8, max_num_batched_tokens=2500, max_waiting_steps=5)
    # No CFG: tokens = (H/16)(W/16) + 11 text tokens.
    shapes = [("a", 512, 512), ("b", 768, 512), ("c", 256, 256)]  # 1035, 1547 (2582 > 2500), 267 (1302)
    for policy, expected in [("skip-ahead", ["a", "c"]), ("fifo", ["a"])]:
        sched = make_sched(scheduling_policy=policy, **budget)
        for req_id, height, width in shapes:
            sched.add_request(make_req(req_id, height, width, negative_prompt=None))
        assert new_ids(sched.schedule()) == expected, policy


# ------------------------------------------------------------------ abort


def test_abort_waiting_request():
    sched, runner = make_sched(max_num_seqs=1), FakeRunner()
    sched.add_request(make_req("a", steps=2))
    sched.add_request(make_req("b", steps=2))
    step(sched, runner)
    assert sched.abort_request("b") and not sched.abort_request("b") and not sched.abort_request("zzz")
    out, finished = step(sched, runner)
    assert "b" in out.finished_req_ids and "b" not in out.scheduled_req_ids
    assert [(f.req_id, f.status, f.error) for f in finished] == [
        ("b", RequestStatus.FINISHED_ABORTED, "Request b aborted."),
        ("a", RequestStatus.FINISHED_COMPLETED, None),
    ]
    assert finished[0].first_scheduled_time is None and not sched.has_requests()


def test_abort_running_request_then_empty_step_frees_it():
    sched, runner = make_sched(), FakeRunner()
    sched.add_request(make_req("a", steps=5))
    step(sched, runner)
    assert sched.abort_request("a")
    assert sched.num_running == 0 and sched.num_waiting == 0 and sched.running_key is None
    assert sched.has_requests()  # one more step tells the runner and reports the abort
    out, finished = step(sched, runner)
    assert out.finished_req_ids == {"a"} and not out.scheduled_req_ids and "a" not in runner.steps
    assert [(f.req_id, f.status, f.num_steps_done) for f in finished] == [
        ("a", RequestStatus.FINISHED_ABORTED, 1)
    ]
    assert not sched.has_requests() and sched.pop_finished() == []


def test_abort_between_schedule_and_update_is_reported_once():
    sched, runner = make_sched(max_num_seqs=2), FakeRunner()
    sched.add_request(make_req("a", steps=1))
    sched.add_request(make_req("b", steps=1))
    out = sched.schedule()
    runner_out = runner.execute(out)  # both "finish" in this step
    assert sched.abort_request("a")
    finished = {f.req_id: f.status for f in sched.update_from_output(out, runner_out)}
    assert finished == {"a": RequestStatus.FINISHED_ABORTED, "b": RequestStatus.FINISHED_COMPLETED}
    assert sched.pop_finished() == []
    assert sched.schedule().finished_req_ids == {"a"}


def test_pop_finished_reports_an_abort_without_a_step():
    sched = make_sched()
    sched.add_request(make_req("a"))
    sched.abort_request("a")
    assert [f.status for f in sched.pop_finished()] == [RequestStatus.FINISHED_ABORTED]
    assert sched.pop_finished() == []


# ------------------------------------------------------------------ runner errors


def test_missing_output_and_error_string():
    sched = make_sched(max_num_seqs=3)
    for req_id in ("a", "b", "c"):
        sched.add_request(make_req(req_id, steps=3))
    out = sched.schedule()
    runner_out = ModelRunnerOutput(
        [RunnerOutput("b", 1, finished=True, error="CUDA out of memory"), RunnerOutput("c", 1)]
    )
    finished = {f.req_id: f for f in sched.update_from_output(out, runner_out)}
    assert finished["a"].status == RequestStatus.FINISHED_ERROR
    assert finished["a"].error == "No output for request a"
    assert (
        finished["b"].status == RequestStatus.FINISHED_ERROR and finished["b"].error == "CUDA out of memory"
    )
    assert set(finished) == {"a", "b"} and sched.get_state("c").num_steps_done == 1
    next_out = sched.schedule()
    assert next_out.finished_req_ids == {"a", "b"} and next_out.scheduled_cached_req_ids == ["c"]


def test_running_key_resets_after_drain():
    sched, runner = make_sched(max_num_seqs=2), FakeRunner()
    sched.add_request(make_req("a", steps=1))
    out, _ = step(sched, runner)
    assert sched.running_key is None
    sched.add_request(make_req("b", 768, **SOLO, steps=1))
    sched.add_request(make_req("c", 768, **SOLO, steps=1))
    out, _ = step(sched, runner)
    assert new_ids(out) == ["b", "c"]

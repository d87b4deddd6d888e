"""The latency policy (shortest remaining work first, aging, priority, packing while free, preemption)
driven by a fake runner whose steps cost what a saturating cost model says. Decisions, not durations:
the scheduler's clock is the sum of the fake steps' times, so every check is deterministic."""

from __future__ import annotations

import argparse

import pytest
from utils import FakeRunner, make_req

from vllm_omni.config import OmniDiffusionConfig
from vllm_omni.diffusion.request import RequestStatus
from vllm_omni.diffusion.sched.cost_model import StepCostModel, StepCostSample
from vllm_omni.diffusion.sched.interface import ModelRunnerOutput, SchedulerOutput, StepStats
from vllm_omni.diffusion.sched.scheduler import StepScheduler
from vllm_omni.entrypoints.cli.serve_args import add_serve_arguments

FLAT_BELOW = 2000
"""The fake GPU is launch-bound (10 ms a step) up to this many tokens, then linear."""


def saturating_cost_model() -> StepCostModel:
    """10 ms from 500 up to 2000 tokens, then 5 us a token (three 256x256 CFG requests, 2 x (256 + 11)
    tokens each, share the launch-bound region; a 1024x1024 one, 2 x (4096 + 11), saturates it)."""
    points = [(500, 0.010), (FLAT_BELOW, 0.010), (4000, 0.020), (8000, 0.040), (32000, 0.160)]
    return StepCostModel([StepCostSample(n, s) for n, s in points])


def linear_cost_model() -> StepCostModel:
    """Every token costs its own time: packing is never free (one request per step)."""
    return StepCostModel([StepCostSample(1000, 0.010), StepCostSample(100000, 1.0)])


def make_latency_sched(cost_model: StepCostModel | None = None, **config) -> StepScheduler:
    config = {"scheduling_policy": "latency", "max_num_seqs": 4, **config}
    return StepScheduler(OmniDiffusionConfig(**config), cost_model=cost_model or linear_cost_model())


class TimedRunner(FakeRunner):
    """A FakeRunner whose step takes the cost model's time for its tokens (the scheduler's clock)."""

    def __init__(self, sched: StepScheduler):
        super().__init__()
        self.sched = sched

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        tokens = sum(self.sched.get_state(r).profile.num_step_tokens for r in out.scheduled_req_ids)
        result = super().execute(out)
        result.stats = StepStats(
            num_reqs=out.num_scheduled_reqs, step_time_s=self.sched.cost_model.step_time(tokens)
        )
        return result


def run_step(sched: StepScheduler, runner: FakeRunner):
    out = sched.schedule()
    return out, sched.update_from_output(out, runner.execute(out))


def test_latency_is_the_default_in_step_mode_and_fifo_in_request_mode():
    assert OmniDiffusionConfig().scheduling_policy == "latency"
    assert OmniDiffusionConfig().resident_cap == 16
    request_mode = OmniDiffusionConfig(step_execution=False)
    assert request_mode.scheduling_policy == "fifo" and request_mode.resident_cap == 1
    with pytest.raises(ValueError, match="max_num_resident_reqs only applies to the latency policy"):
        OmniDiffusionConfig(scheduling_policy="fifo", max_num_resident_reqs=16)
    with pytest.raises(ValueError, match="must be >= max_num_seqs"):
        OmniDiffusionConfig(max_num_seqs=8, max_num_resident_reqs=4)


def test_shortest_remaining_work_runs_first():
    sched = make_latency_sched()
    runner = TimedRunner(sched)
    sched.add_request(make_req("big", 1024, 1024, steps=4))
    sched.add_request(make_req("small", 256, 256, steps=4))
    sched.add_request(make_req("mid", 512, 512, steps=4))
    order = []
    while sched.has_requests():
        out, _ = run_step(sched, runner)
        assert out.num_scheduled_reqs == 1  # linear costs: packing is never free
        order.append(out.scheduled_req_ids[0])
    assert order == ["small"] * 4 + ["mid"] * 4 + ["big"] * 4


def test_a_short_request_preempts_a_long_one_which_resumes_where_it_stopped():
    # without the deadline guard: the long one, started alone, has 10 % slack (less than 2 steps)
    sched = make_latency_sched(scheduling_deadline_factor=None)
    runner = TimedRunner(sched)
    sched.add_request(make_req("long", 1024, 1024, steps=6))
    run_step(sched, runner)
    run_step(sched, runner)
    sched.add_request(make_req("short", 256, 256, steps=2))
    out, _ = run_step(sched, runner)
    assert [r.req_id for r in out.scheduled_new_reqs] == ["short"] and out.paused_req_ids == ["long"]
    assert not out.scheduled_cached_req_ids and "long" not in out.finished_req_ids
    assert sched.get_state("long").status == RequestStatus.RUNNING  # still started: its state stays
    _, finished = run_step(sched, runner)
    assert [f.req_id for f in finished] == ["short"]
    out, _ = run_step(sched, runner)
    assert out.scheduled_cached_req_ids == ["long"] and sched.get_state("long").num_steps_done == 3
    finished = []
    while sched.has_requests():
        finished += run_step(sched, runner)[1]
    (long,) = finished
    assert (long.num_steps_done, long.num_steps_sat_out, long.num_preemptions) == (6, 2, 1)


def test_aging_bounds_how_long_a_large_request_is_overtaken():
    """A steady stream of small requests would starve a large one under pure shortest-first. With
    aging, no request arriving more than `aging_factor x alone time` after the large one runs before it
    finishes (the documented bound)."""
    aging = 2.0
    sched = make_latency_sched(
        scheduling_aging_factor=aging, scheduling_deadline_factor=None, max_num_resident_reqs=64
    )
    runner = TimedRunner(sched)
    sched.add_request(make_req("large", 1024, 1024, steps=5))
    large = sched.get_state("large")
    alone_s = sched.latency_policy.remaining_work(large)
    arrivals: dict[str, float] = {}
    run_times: dict[str, float] = {}
    k = 0
    while sched.has_requests():
        if k < 200:  # two small requests per step: more work arrives than the GPU can serve
            for _ in range(2):
                req_id = f"s{k}"
                sched.add_request(make_req(req_id, 256, 256, steps=2))
                arrivals[req_id], k = sched.clock_s, k + 1
        out, finished = run_step(sched, runner)
        for req_id in out.scheduled_req_ids:
            run_times.setdefault(req_id, sched.clock_s)
        if any(f.req_id == "large" for f in finished):
            large_done = sched.clock_s
            break
    late = [r for r, t in arrivals.items() if t > aging * alone_s and run_times.get(r, 1e9) < large_done]
    assert not late, f"requests arriving after the aging bound overtook the large one: {late[:5]}"
    assert any(run_times.get(r, 1e9) < large_done for r in arrivals)  # it was overtaken before that


def test_the_deadline_guard_ends_a_large_request_near_its_request_mode_finish():
    """Under the same stream, with the deadline guard (the default, factor 1.1, no aging) the large
    request, started alone, gets the deadline `1.1 x its work`; shortest-first lets small requests
    pass only while the large one can still make it, then the step is built in deadline order: it
    ends by its deadline plus one step (the granularity), far sooner than with aging (factor 4)
    alone, and pure shortest-first (neither) would never end it."""

    def large_finish(**config) -> tuple[float, float, int, int]:
        sched = make_latency_sched(max_num_resident_reqs=64, **config)
        runner = TimedRunner(sched)
        sched.add_request(make_req("large", 1024, 1024, steps=5))
        work_s = sched.latency_policy.remaining_work(sched.get_state("large"))
        run_step(sched, runner)  # alone: its deadline counts only its own work
        k = num_deadline_ordered = 0
        while True:
            for _ in range(2):  # more small work arrives than the GPU can serve
                sched.add_request(make_req(f"s{k}", 256, 256, steps=2))
                k += 1
            out, finished = run_step(sched, runner)
            num_deadline_ordered += out.deadline_ordered
            if any(f.req_id == "large" for f in finished):
                return sched.clock_s, work_s, k, num_deadline_ordered

    guarded, work_s, num_small, num_guarded_steps = large_finish()
    aging_only, _, _, num_unguarded = large_finish(
        scheduling_deadline_factor=None, scheduling_aging_factor=4.0
    )
    assert num_guarded_steps >= 1 and num_unguarded == 0  # the SchedulerOutput says so (log, metrics)
    step_s = work_s / 5
    assert guarded <= 1.1 * work_s + step_s + 1e-9, (guarded, work_s)
    assert aging_only > 2 * work_s, (aging_only, work_s)  # the guard is what bounded it
    assert num_small >= 4  # small ones arrived (and the first passed it) before it ended


def test_a_burst_is_reordered_freely_by_the_deadline_guard():
    """Requests that arrive in the same step share one deadline (the work of all of them): in arrival
    order the last one would end when all of it ends, so shortest-first is within every deadline."""
    sched = make_latency_sched()
    for name, side in (("a", 1024), ("b", 1024), ("c", 256)):
        sched.add_request(make_req(name, side, side, steps=3))
    out, _ = run_step(sched, TimedRunner(sched))
    assert out.scheduled_req_ids == ["c"]
    deadlines = {sched.get_state(r).deadline_clock_s for r in ("a", "b", "c")}
    assert len(deadlines) == 1


def test_a_burst_whose_first_request_started_a_step_early_is_still_reordered_freely():
    """Concurrent clients never land in one step: the first request of a burst starts alone (its
    deadline then counts only its own work), the rest arrive during that step. Arrivals within one
    step share a deadline, so the smaller ones still pass it (without that rule the guard holds them
    behind it: the small request waits for all of the large one's steps)."""
    sched = make_latency_sched()
    runner = TimedRunner(sched)
    sched.add_request(make_req("large", 1024, 1024, steps=5))
    run_step(sched, runner)  # the large request's first step, alone
    for name, side in (("mid", 768), ("small", 512)):
        sched.add_request(make_req(name, side, side, steps=5))
    finished_order = []
    while sched.has_requests():
        _, finished = run_step(sched, runner)
        finished_order += [f.req_id for f in finished]
    assert finished_order == ["small", "mid", "large"]


def test_the_start_up_line_names_the_policy_settings():
    line = make_latency_sched().latency_policy.describe()
    assert "deadline guard 1.1x" in line and "p99 of the last 100" in line and "aging off" in line
    line = make_latency_sched(
        scheduling_deadline_factor=None, scheduling_aging_factor=4.0
    ).latency_policy.describe()
    assert "deadline guard off" in line and "aging 4" in line


def test_deadline_factor_flag_and_config():
    assert OmniDiffusionConfig().scheduling_deadline_factor == 1.1
    assert OmniDiffusionConfig().scheduling_aging_factor is None  # the guard bounds the tail
    with pytest.raises(ValueError, match="scheduling_aging_factor must be > 0"):
        OmniDiffusionConfig(scheduling_aging_factor=0.0)
    with pytest.raises(ValueError, match="scheduling_deadline_factor must be >= 1"):
        OmniDiffusionConfig(scheduling_deadline_factor=0.9)
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    assert parser.parse_args(["--scheduling-deadline-factor", "off"]).scheduling_deadline_factor is None
    assert parser.parse_args(["--scheduling-deadline-factor", "1.5"]).scheduling_deadline_factor == 1.5
    assert parser.parse_args([]).scheduling_deadline_factor == 1.1
    assert parser.parse_args([]).scheduling_aging_factor is None
    assert parser.parse_args(["--scheduling-aging-factor", "4"]).scheduling_aging_factor == 4.0
    assert parser.parse_args(["--scheduling-aging-factor", "off"]).scheduling_aging_factor is None


def test_priority_comes_before_remaining_work():
    sched = make_latency_sched()
    runner = TimedRunner(sched)
    sched.add_request(make_req("small-low", 256, 256, steps=2, priority=1))
    sched.add_request(make_req("big-high", 1024, 1024, steps=2, priority=-1))
    out, _ = run_step(sched, runner)
    assert out.scheduled_req_ids == ["big-high"]


def test_packs_only_while_the_step_is_nearly_free():
    sched = make_latency_sched(cost_model=saturating_cost_model(), max_num_seqs=8)
    runner = TimedRunner(sched)
    for i in range(3):
        sched.add_request(make_req(f"tiny{i}", 256, 256, steps=3))
    sched.add_request(make_req("big", 1024, 1024, steps=3))
    out, _ = run_step(sched, runner)
    # three 256x256 CFG requests fit the launch-bound region together; the big one would cost its own time
    assert sorted(out.scheduled_req_ids) == ["tiny0", "tiny1", "tiny2"]
    assert out.num_waiting_reqs == 1


def test_a_free_join_still_never_slows_the_head_past_the_limit():
    sched = make_latency_sched(
        cost_model=saturating_cost_model(), packing_max_marginal_cost=1.0, packing_max_step_slowdown=2.0
    )
    runner = TimedRunner(sched)
    sched.add_request(make_req("head", 256, 256, steps=1))  # 10 ms alone
    sched.add_request(make_req("wide", 1024, 768, steps=1))  # marginal cost == its own: "free" at 1.0
    out, _ = run_step(sched, runner)
    assert out.scheduled_req_ids == ["head"]  # together the step would take > 2 x 10 ms


def test_resident_cap_keeps_new_requests_waiting():
    sched = make_latency_sched(max_num_seqs=1, max_num_resident_reqs=2, scheduling_deadline_factor=None)
    runner = TimedRunner(sched)
    sched.add_request(make_req("a", 1024, 1024, steps=3))
    run_step(sched, runner)
    sched.add_request(make_req("b", 512, 512, steps=3))
    run_step(sched, runner)  # b preempts a: two started
    sched.add_request(make_req("c", 256, 256, steps=3))
    out, _ = run_step(sched, runner)
    assert out.scheduled_req_ids == ["b"] and out.num_running_reqs == 2 and out.num_waiting_reqs == 1


def test_abort_of_a_paused_request_frees_its_runner_state():
    sched = make_latency_sched()
    runner = TimedRunner(sched)
    sched.add_request(make_req("long", 1024, 1024, steps=6))
    run_step(sched, runner)
    sched.add_request(make_req("short", 256, 256, steps=3))
    out, _ = run_step(sched, runner)
    assert out.paused_req_ids == ["long"]
    assert sched.abort_request("long")
    out, finished = run_step(sched, runner)
    assert "long" in out.finished_req_ids and "long" not in out.scheduled_req_ids
    assert [(f.req_id, f.status) for f in finished] == [("long", RequestStatus.FINISHED_ABORTED)]
    assert "long" not in runner.steps  # the runner was told to free it


def test_cost_model_interpolates_and_learns():
    model = saturating_cost_model()
    assert model.step_time(1000) == pytest.approx(0.010)
    assert model.step_time(6000) == pytest.approx(0.030)
    assert model.step_time(64000) == pytest.approx(0.320)  # the last segment's slope
    assert model.step_time(250) == pytest.approx(0.010)  # flat below the first point
    assert model.saturation_tokens() == FLAT_BELOW
    for _ in range(50):
        model.observe(8000, 0.080)  # the GPU turned out twice as slow there
    assert model.step_time(8000) == pytest.approx(0.080, rel=1e-3)
    assert StepCostModel().step_time(1000) > 0  # the prior, before any step


def test_the_request_overhead_is_learned_from_the_step_clock():
    """A step's time beyond its predicted denoise (prompt encoding, decode) per finished request: the
    deadline guard counts it in every request's work. A fake runner whose steps take the model's time
    plus 0.05 s whenever a request starts or ends shows 0.1 s per request."""
    sched = make_latency_sched(scheduling_deadline_factor=None)
    assert sched.cost_model.request_overhead_s == 0.0  # before any request finished
    runner = TimedRunner(sched)
    for k in range(4):
        sched.add_request(make_req(f"r{k}", 256, 256, steps=3))
    while sched.has_requests():
        out = sched.schedule()
        result = runner.execute(out)
        events = len(out.scheduled_new_reqs) + sum(o.finished for o in result.outputs)
        result.stats.step_time_s += 0.05 * events
        sched.update_from_output(out, result)
    assert sched.cost_model.request_overhead_s == pytest.approx(0.1)


def test_one_slow_step_does_not_flatten_the_cost_model():
    """A slow step at a small token count (a first call that compiles, a hiccup) leaves the table as it
    was: a bin's point is the median of its recent steps, and the table is made non-decreasing by
    pooling, not by lifting every larger point to the outlier. (With an average per bin and a running
    maximum, one 1 s step at 2000 tokens priced every larger step at 0.2 s: shortest remaining work
    first became fewest remaining steps first.)"""
    model = saturating_cost_model()
    before = {n: model.step_time(n) for n in (1000, 2000, 4000, 8000, 32000)}
    model.observe(2100, 1.0)
    assert {n: model.step_time(n) for n in before} == pytest.approx(before)
    sched = make_latency_sched(saturating_cost_model())
    sched.cost_model.observe(2100, 1.0)  # also in a scheduler: a small request still goes first
    runner = TimedRunner(sched)
    sched.add_request(make_req("large", 1024, 1024, steps=3))
    sched.add_request(make_req("small", 256, 256, steps=4))
    out, _ = run_step(sched, runner)
    assert out.scheduled_req_ids[0] == "small"
    fresh = StepCostModel()  # a bin whose only step was slow is pooled with its neighbours, not copied up
    for n, s in [(1000, 0.01), (4000, 0.02), (8000, 0.04)] * 3 + [(2000, 1.0)]:
        fresh.observe(n, s)
    assert fresh.step_time(8000) < 0.2


def test_a_lasting_change_of_speed_is_followed():
    model = saturating_cost_model()
    for k in range(1, 6):
        model.observe(8000, 0.080)  # the GPU got twice as slow there (e.g. it throttles)
        expected = {3: 0.060, 4: 0.080, 5: 0.080}.get(k, 0.040)  # 3 seed steps: median of 3 + k
        assert model.step_time(8000) == pytest.approx(expected), k


def test_metrics_show_the_cost_model_and_each_request_s_sat_out_steps():
    from types import SimpleNamespace

    from vllm_omni.diffusion.outputs import FinishReason, RequestOutput, RequestTimings
    from vllm_omni.entrypoints.openai.metrics import PrometheusStatLogger

    metrics = PrometheusStatLogger(OmniDiffusionConfig(), "m")
    engine = SimpleNamespace(
        config=OmniDiffusionConfig(), scheduler=SimpleNamespace(cost_model=saturating_cost_model())
    )
    metrics.describe_engine(engine)
    timings = RequestTimings(0.0, 1.0, 3.0, num_steps_sat_out=5, num_preemptions=2)
    output = RequestOutput(
        "r", "r", FinishReason.COMPLETED, images=[None], height=512, width=512, timings=timings
    )
    metrics.on_request_finished(output)
    metrics.on_step(StepStats(num_reqs=1, shapes=[(512, 512)], deadline_ordered=True), 1, 0)
    engine.scheduler.cost_model.observe_overhead(0.25, 1)
    text = metrics.render().decode()
    assert "vllm_omni:steps_deadline_ordered_total 1.0" in text
    assert "vllm_omni:request_overhead_seconds 0.25" in text
    assert 'vllm_omni:step_cost_model_seconds{num_tokens="8192"} 0.04' in text
    assert f"vllm_omni:step_cost_saturation_tokens {float(FLAT_BELOW)}" in text
    assert "vllm_omni:request_preemptions_total 2.0" in text
    assert "vllm_omni:request_steps_sat_out_sum 5.0" in text
    assert 'vllm_omni:request_latency_by_size_seconds_count{size_class="<=512x512"} 1.0' in text


def test_the_resident_cap_follows_the_mode_and_policy_through_dataclasses_replace():
    import dataclasses

    step_mode = OmniDiffusionConfig(scheduling_policy="skip-ahead")
    assert step_mode.resident_cap == 8
    assert dataclasses.replace(step_mode, step_execution=False).resident_cap == 1
    assert dataclasses.replace(OmniDiffusionConfig(), max_num_seqs=4).resident_cap == 8

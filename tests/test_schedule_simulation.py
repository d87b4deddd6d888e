"""The scheduling simulation (`benchmarks/diffusion/schedule_simulation.py`): the real `StepScheduler` on
the H200's measured step costs, on the trace the load benchmark sends to the GPU. Decisions, not
durations: the simulated clock is deterministic, so the policies' tails are checked exactly."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from benchmarks.diffusion import schedule_simulation as sim
from benchmarks.diffusion.common import percentile


def test_the_load_benchmark_trace_is_dataset_c_at_half_steps():
    traces = sim.load_benchmark_traces("0.8,1.0", 80, 0, str(sim.ALONE_TIMES))
    assert set(traces) == {"0.8", "1"} and all(len(t) == 80 for t in traces.values())
    sizes = {(a.side, a.steps) for a in traces["1"]}
    assert sizes == {(512, 4), (768, 4), (1024, 5), (1536, 7)}
    # the same unit trace at a higher rate: the same sizes, earlier arrivals
    assert [a.side for a in traces["0.8"]] == [a.side for a in traces["1"]]
    assert traces["1"][-1].time_s < traces["0.8"][-1].time_s


def test_full_step_traces_need_full_step_alone_times(tmp_path):
    """`--steps-scale 1.0` draws the steady traces' steps (8/8/10/14), priced by alone times at those
    steps (here the H200's steady run's)."""
    steady = (
        Path(sim.__file__).parent / "performance_dashboard/h200_results/issue22/steady/request/steady.json"
    )
    alone = tmp_path / "alone.json"
    alone.write_text(json.dumps(json.loads(steady.read_text())["alone_times"]))
    full = sim.load_benchmark_traces("1.0", 80, 0, str(alone), steps_scale=1.0)["1"]
    assert len(full) == 80
    assert {(a.side, a.steps) for a in full} == {(512, 8), (768, 8), (1024, 10), (1536, 14)}


def test_the_deadline_guard_keeps_the_tail_near_request_mode_where_aging_alone_does_not():
    """On the 80-request trace at 100 % load (the one the H200 ran): with the guard (the default) p99
    stays within the issue's 1.15x of request mode's and the mean still improves; shortest-first
    without it gives a lower mean and a p99 far above."""
    trace = sim.load_benchmark_traces("1.0", 80, 0, str(sim.ALONE_TIMES))["1"]
    request_mode = sim.simulate_request_mode(trace)
    guarded = sim.simulate_steps(trace)
    unguarded = sim.simulate_steps(trace, scheduling_deadline_factor=None)

    def p99_ratio(lat):
        return percentile(lat, 99) / percentile(request_mode, 99)

    def mean_ratio(lat):
        return statistics.fmean(lat) / statistics.fmean(request_mode)

    assert p99_ratio(guarded) <= 1.15 and mean_ratio(guarded) < 1.0
    assert p99_ratio(unguarded) > 1.25 and mean_ratio(unguarded) < mean_ratio(guarded)


def test_in_steady_state_the_default_policy_meets_the_issue_targets_that_aging_misses():
    """400 requests of Dataset C at full steps, 80 % and 100 % of request mode's capacity (seed 0):
    the default (shortest-first, the deadline guard, no aging) has mean <= 0.75x and p50 <= 0.6x
    request mode's with p99 within 1.2x (1.17x / 1.04x on this seed; shortest-first without the guard
    1.51x / 1.80x); adding aging (factor 4) costs the mean, the reason it is off."""
    for load in (0.8, 1.0):
        trace = sim.make_trace(load, 400, 0)
        request_mode = sim.summary(sim.simulate_request_mode(trace))
        default = sim.summary(sim.simulate_steps(trace))
        aged = sim.summary(sim.simulate_steps(trace, scheduling_aging_factor=4.0))
        ratio = {m: default[m] / request_mode[m] for m in ("mean", "p50", "p99")}
        assert ratio["mean"] <= 0.75 and ratio["p50"] <= 0.6 and ratio["p99"] <= 1.2, (load, ratio)
        assert aged["mean"] > 1.05 * default["mean"], (load, aged["mean"], default["mean"])

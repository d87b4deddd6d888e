"""Simulate the step scheduler's policies on measured step costs (no model, no GPU, seconds of CPU).

The real `StepScheduler` decides every step; a fake runner advances a clock by what the H200 measured
for that step (`measured_2026-12.md`: CFG step time by packed tokens, +50 ms for a request's first
step (prompt encoding: the load benchmark's alone times leave no room for the notes' 300 ms), + its
VAE decode on its last). Request mode is simulated as one request at a time in arrival order. Used to
choose the latency policy's defaults before spending GPU time, and to show what each policy does to a
trace; the load benchmark (`load_benchmark.py`) measures the real server.

    python benchmarks/diffusion/schedule_simulation.py --loads 0.5,0.8,1.0,1.2 --num-requests 400 \\
        --aging-factors off,4 --deadline-factors off,1.1,1.2
    python benchmarks/diffusion/schedule_simulation.py --load-benchmark-trace 80 --loads 0.8,1.0

Packing gains are modelled only through the token-cost curve (a step of several small requests
costs the curve at their summed tokens), so packed steps are, if anything, priced pessimistically.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `vllm_omni` importable from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.diffusion import load_benchmark as lb  # noqa: E402
from benchmarks.diffusion import serving_benchmark as sb  # noqa: E402
from benchmarks.diffusion.common import percentile  # noqa: E402
from vllm_omni.config import OmniDiffusionConfig  # noqa: E402
from vllm_omni.diffusion.request import OmniDiffusionRequest  # noqa: E402
from vllm_omni.diffusion.sched.cost_model import StepCostModel, StepCostSample  # noqa: E402
from vllm_omni.diffusion.sched.interface import ModelRunnerOutput, RunnerOutput, StepStats  # noqa: E402
from vllm_omni.diffusion.sched.scheduler import StepScheduler  # noqa: E402
from vllm_omni.entrypoints.cli.serve_args import optional_float  # noqa: E402
from vllm_omni.inputs import OmniDiffusionSamplingParams  # noqa: E402

H200_CFG_STEP_MS = ((552, 22.9), (2088, 58.5), (4648, 133.0), (8232, 230.0), (13818, 420.0), (18472, 610.0))
"""(packed tokens, ms) of one CFG request's step alone on the H200 (256..1536 square, 20-token prompts)."""
ENCODE_S = 0.05
DECODE_S_PER_MPIXEL = 0.21
DATASET_C = ((512, 0.15, 8), (768, 0.25, 8), (1024, 0.45, 10), (1536, 0.15, 14))
"""(side, weight, steps): vLLM-Omni's Dataset C weights, steps scaled as in the December runs."""


ALONE_TIMES = Path(__file__).parent / "performance_dashboard/h200_results/issue22/alone_times.json"
"""The H200's alone times of the load benchmark's sizes (its issue-22 runs' capacity)."""

BURST = (1024, (1024, 768), (768, 1024), 512, 1024, 512, 256, 1328)
"""The load benchmark's 8-request burst (sides, or (width, height)), 20 steps each, all at t = 0."""


@dataclass
class Arrival:
    time_s: float
    side: int
    steps: int
    height: int | None = None
    """None: square (`side`)."""

    @property
    def shape(self) -> tuple[int, int]:
        return (self.height or self.side, self.side)


def h200_cost_model() -> StepCostModel:
    return StepCostModel([StepCostSample(n, ms / 1e3) for n, ms in H200_CFG_STEP_MS])


def make_trace(load: float, num_requests: int, seed: int) -> list[Arrival]:
    """Poisson arrivals at `load` x request mode's capacity, sizes drawn from Dataset C."""
    rng = random.Random(seed)
    rate = load / mean_service_s()
    t, trace = 0.0, []
    for _ in range(num_requests):
        side, _, steps = rng.choices(DATASET_C, weights=[w for _, w, _ in DATASET_C])[0]
        trace.append(Arrival(t, side, steps))
        t += rng.expovariate(rate)
    return trace


def replay_traces(path: str) -> dict[str, list[Arrival]]:
    """load_benchmark.py's traces from its JSON (`--json-output`), by load: the same arrivals, sizes and
    steps the server got, to compare the simulation with the measurement and policies on one trace."""
    payload = json.loads(Path(path).read_text())
    traces = {}
    for load, result in next(iter(payload["configs"].values()))["loads"].items():
        trace = []
        for r in sorted(result["requests"], key=lambda r: r["index"]):
            width, height = (int(x) for x in r["size"].split("x"))
            trace.append(Arrival(r["arrival_s"], width, r["num_inference_steps"], height))
        traces[load] = trace
    return traces


def load_benchmark_traces(
    loads: str, num: int, seed: int, alone_path: str, steps_scale: float = 0.5
) -> dict[str, list[Arrival]]:
    """The traces `load_benchmark.py --steps-scale X --num-requests N --seed S --alone-times F`
    sends (before it runs: to choose what to measure on the GPU)."""
    profile = lb.load_profile(steps_scale, 1.0)
    unit = lb.unit_trace(profile, num, seed)
    mean_service = lb.mean_service_s(profile, sb.parse_alone_times(alone_path))
    if mean_service is None:
        sizes = ", ".join(e.key for e in profile)
        raise ValueError(f"--alone-times {alone_path} lacks an alone time for one of {sizes} (--steps-scale)")
    capacity = 1 / mean_service
    traces = {}
    for load in (float(x) for x in loads.split(",")):
        items = lb.load_items(unit, load * capacity)
        traces[f"{load:g}"] = [
            Arrival(i.arrival_s, i.size.width, i.num_inference_steps, i.size.height) for i in items
        ]
    return traces


def step_tokens(shape: tuple[int, int]) -> int:
    """A CFG request's tokens per step: 2 x (image rows + a 20-token prompt)."""
    return 2 * ((shape[0] // 16) * (shape[1] // 16) + 20)


def alone_s(shape: tuple[int, int], steps: int) -> float:
    """One request alone: its steps, the first step's encoding and its decode."""
    decode_s = DECODE_S_PER_MPIXEL * shape[0] * shape[1] / 1e6
    return steps * h200_cost_model().step_time(step_tokens(shape)) + ENCODE_S + decode_s


def mean_service_s() -> float:
    return sum(w * alone_s((side, side), steps) for side, w, steps in DATASET_C)


def simulate_request_mode(trace: list[Arrival]) -> list[float]:
    """FIFO, one whole request at a time: latencies in trace order."""
    free_at, latencies = 0.0, []
    for a in trace:
        start = max(free_at, a.time_s)
        free_at = start + alone_s(a.shape, a.steps)
        latencies.append(free_at - a.time_s)
    return latencies


def simulate_steps(trace: list[Arrival], **config) -> list[float]:
    """The step scheduler with `config` on the trace: latencies in trace order."""
    model = h200_cost_model()
    sched = StepScheduler(OmniDiffusionConfig(max_num_seqs=8, **config), cost_model=model)
    left: dict[str, int] = {}
    done: dict[str, float] = {}
    now, i = 0.0, 0
    while len(done) < len(trace):
        while i < len(trace) and trace[i].time_s <= now:
            a = trace[i]
            height, width = a.shape
            sp = OmniDiffusionSamplingParams(height=height, width=width, num_inference_steps=a.steps, seed=i)
            sched.add_request(OmniDiffusionRequest(str(i), "p " * 18, " ", sp))
            i += 1
        if not sched.has_requests():
            now = trace[i].time_s
            continue
        out = sched.schedule()
        tokens = sum(step_tokens(trace[int(r)].shape) for r in out.scheduled_req_ids)
        step_s = model.step_time(tokens) + ENCODE_S * len(out.scheduled_new_reqs)
        outputs = []
        for r in out.scheduled_req_ids:
            left.setdefault(r, trace[int(r)].steps)
            left[r] -= 1
            if left[r] == 0:
                height, width = trace[int(r)].shape
                step_s += DECODE_S_PER_MPIXEL * height * width / 1e6
            outputs.append(RunnerOutput(r, trace[int(r)].steps - left[r], finished=left[r] == 0))
        now += step_s
        stats = StepStats(num_reqs=out.num_scheduled_reqs, num_tokens=tokens, step_time_s=step_s)
        for f in sched.update_from_output(out, ModelRunnerOutput(outputs, stats)):
            done[f.req_id] = now
    return [done[str(k)] - a.time_s for k, a in enumerate(trace)]


def summary(latencies: list[float]) -> dict[str, float]:
    # the load benchmark's percentile (interpolated between order statistics, never past the max)
    return {
        "mean": statistics.fmean(latencies),
        "p50": percentile(latencies, 50),
        "p90": percentile(latencies, 90),
        "p99": percentile(latencies, 99),
        "max": max(latencies),
    }


def print_burst(steps: int) -> None:
    """The 8-request burst: each request's latency under request mode, skip-ahead and latency."""
    trace = [Arrival(0.0, s, steps) if isinstance(s, int) else Arrival(0.0, s[0], steps, s[1]) for s in BURST]
    # concurrent clients never land in one step: the first request starts alone, the rest arrive during
    # its first step (the latency policy's one-step deadline rule is what keeps this burst reorderable)
    staggered = [trace[0]] + [Arrival(0.01, a.side, a.steps, a.height) for a in trace[1:]]
    rows = {
        "request mode": simulate_request_mode(trace),
        "skip-ahead": simulate_steps(trace, scheduling_policy="skip-ahead"),
        "latency": simulate_steps(trace),
        "latency, the rest 10 ms after the first": simulate_steps(staggered),
    }
    sizes = [f"{a.shape[1]}x{a.shape[0]}" for a in trace]
    print(f"burst of 8, {steps} steps, CFG on, seconds")
    print("| policy | mean | " + " | ".join(sizes) + " |")
    print("|---" * (len(sizes) + 2) + "|")
    for name, lat in rows.items():
        print(f"| {name} | {statistics.fmean(lat):.2f} | " + " | ".join(f"{x:.2f}" for x in lat) + " |")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--loads", default="0.5,0.8,1.0,1.2")
    parser.add_argument("--num-requests", type=int, default=400)
    parser.add_argument(
        "--aging-factors",
        default="off,4",
        help="the latency policy at each of these aging factors ('off': none)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--burst-steps", type=int, default=20)
    parser.add_argument(
        "--deadline-factors",
        default="off,1.1",
        help="the latency policy at each aging factor with each of these deadline factors ('off': no guard)",
    )
    parser.add_argument(
        "--load-benchmark-trace",
        type=int,
        default=None,
        metavar="N",
        help="simulate load_benchmark.py's N-request trace (its quota draw, seed, sizes and steps at "
        "--steps-scale, capacity from --alone-times) instead of this script's own",
    )
    parser.add_argument(
        "--steps-scale",
        type=float,
        default=0.5,
        help="load_benchmark.py's --steps-scale, for --load-benchmark-trace",
    )
    parser.add_argument(
        "--alone-times",
        default=str(ALONE_TIMES),
        help="load_benchmark.py's alone times JSON (its capacity, for --load-benchmark-trace)",
    )
    parser.add_argument("--replay", default=None, help="load_benchmark.py JSON: simulate its traces instead")
    args = parser.parse_args()
    if args.replay:
        traces = replay_traces(args.replay)
    elif args.load_benchmark_trace:
        traces = load_benchmark_traces(
            args.loads, args.load_benchmark_trace, args.seed, args.alone_times, args.steps_scale
        )
    else:
        print_burst(args.burst_steps)
        print(
            f"request mode capacity: {1 / mean_service_s():.3f} req/s (mean service {mean_service_s():.2f} s)"
        )
        traces = {
            f"{x:g}": make_trace(x, args.num_requests, args.seed) for x in map(float, args.loads.split(","))
        }
    print(
        "| load | policy | mean | p50 | p90 | p99 | max "
        "| mean / request mode | p50 / request mode | p99 / request mode |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for load, trace in traces.items():
        base = summary(simulate_request_mode(trace))
        rows = [
            ("request mode", base),
            ("skip-ahead", summary(simulate_steps(trace, scheduling_policy="skip-ahead"))),
        ]
        for k in (optional_float(x) for x in args.aging_factors.split(",") if x):
            for g in (optional_float(x) for x in args.deadline_factors.split(",")):
                aging, deadline = "off" if k is None else f"{k:g}", "off" if g is None else f"{g:g}x"
                name = f"latency, aging {aging}, deadline {deadline}"
                config = dict(scheduling_aging_factor=k, scheduling_deadline_factor=g)
                rows.append((name, summary(simulate_steps(trace, **config))))
        for name, s in rows:
            cells = " | ".join(f"{s[m]:.2f}" for m in ("mean", "p50", "p90", "p99", "max"))
            print(
                f"| {load} | {name} | {cells} | {s['mean'] / base['mean']:.2f} "
                f"| {s['p50'] / base['p50']:.2f} | {s['p99'] / base['p99']:.2f} |"
            )


if __name__ == "__main__":
    main()

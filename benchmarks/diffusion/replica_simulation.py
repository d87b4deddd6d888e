"""Simulate N data-parallel replicas behind the router, on the H200's measured step costs (CPU, seconds).

Each replica runs the real `StepScheduler` (the `latency` policy by default) on the fake runner of
`schedule_simulation.py` (a step costs the measured CFG step time at its packed tokens, + encode for
new requests, + decode for finishing ones). Requests arrive as a Poisson trace of Dataset C sizes at
`load` x the fleet's request-mode capacity (N x one GPU's), and the router (`vllm_omni.entrypoints.
replicas.routing.ReplicaRouter`) places each one. Replicas report their state after every step; the
router's own accounting covers what it routed since. Compare routing policies on the same traces:

    python benchmarks/diffusion/replica_simulation.py --replicas 4,8 --loads 0.7,0.9,1.1 \\
        --num-requests 2000 --json-output replica_simulation.json --plot replica_simulation.png
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from tqdm import tqdm

if __package__ in (None, ""):  # run as a file: make `vllm_omni` importable from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.diffusion import schedule_simulation as ss  # noqa: E402
from vllm_omni.config import OmniDiffusionConfig  # noqa: E402
from vllm_omni.diffusion.request import OmniDiffusionRequest  # noqa: E402
from vllm_omni.diffusion.sched.interface import ModelRunnerOutput, RunnerOutput, StepStats  # noqa: E402
from vllm_omni.diffusion.sched.scheduler import StepScheduler  # noqa: E402
from vllm_omni.entrypoints.replicas.routing import ReplicaReport, ReplicaRouter  # noqa: E402
from vllm_omni.inputs import OmniDiffusionSamplingParams  # noqa: E402

POLICIES = ("work", "least-requests", "round-robin", "power-of-two")
"""`power-of-two` is Ray Serve's default router: two random replicas, the one with fewer requests."""


def decode_s(shape: tuple[int, int]) -> float:
    return ss.DECODE_S_PER_MPIXEL * shape[0] * shape[1] / 1e6


def request_work_s(arrival: ss.Arrival, steps_left: int) -> float:
    """What the router prices a request at: its remaining steps at its own step cost, + its decode."""
    step_s = ss.h200_cost_model().step_time(ss.step_tokens(arrival.shape))
    return steps_left * step_s + decode_s(arrival.shape)


class SimulatedReplica:
    """One engine: a `StepScheduler` and a clock advanced by the measured cost of each step it runs."""

    def __init__(self, trace: list[ss.Arrival], **config):
        self.trace = trace
        self.model = ss.h200_cost_model()
        self.sched = StepScheduler(OmniDiffusionConfig(max_num_seqs=8, **config), cost_model=self.model)
        self.clock = 0.0
        self.steps_left: dict[int, int] = {}
        """Live requests (trace index) -> steps left."""
        self.num_received = 0
        self.done: dict[int, float] = {}

    def add(self, index: int, now: float) -> None:
        a = self.trace[index]
        height, width = a.shape
        sp = OmniDiffusionSamplingParams(height=height, width=width, num_inference_steps=a.steps, seed=index)
        self.sched.add_request(OmniDiffusionRequest(str(index), "p " * 18, " ", sp))
        self.steps_left[index] = a.steps
        self.num_received += 1
        self.clock = max(self.clock, now)

    def advance(self, until: float) -> None:
        """Run steps while the next one would start before `until`; an idle replica waits for it."""
        while self.sched.has_requests() and self.clock < until:
            self.step()
        self.clock = max(self.clock, until)

    def step(self) -> None:
        out = self.sched.schedule()
        ids = [int(r) for r in out.scheduled_req_ids]
        tokens = sum(ss.step_tokens(self.trace[i].shape) for i in ids)
        step_s = self.model.step_time(tokens) + ss.ENCODE_S * len(out.scheduled_new_reqs)
        outputs = []
        for i in ids:
            self.steps_left[i] -= 1
            finished = self.steps_left[i] == 0
            step_s += decode_s(self.trace[i].shape) if finished else 0.0
            outputs.append(RunnerOutput(str(i), self.trace[i].steps - self.steps_left[i], finished=finished))
        self.clock += step_s
        stats = StepStats(num_reqs=len(ids), num_tokens=tokens, step_time_s=step_s)
        for f in self.sched.update_from_output(out, ModelRunnerOutput(outputs, stats)):
            self.done[int(f.req_id)] = self.clock
            del self.steps_left[int(f.req_id)]

    def report(self) -> ReplicaReport:
        work = sum(request_work_s(self.trace[i], left) for i, left in self.steps_left.items())
        return ReplicaReport(work, len(self.steps_left), self.num_received)


def simulate(trace: list[ss.Arrival], num_replicas: int, policy: str, seed: int = 0, **config) -> list[float]:
    """Latencies (trace order) of `trace` on `num_replicas` replicas routed by `policy`."""
    replicas = [SimulatedReplica(trace, **config) for _ in range(num_replicas)]
    router = ReplicaRouter(num_replicas, "work" if policy == "power-of-two" else policy)
    rng = random.Random(seed)
    for index, a in enumerate(trace):
        for k, replica in enumerate(replicas):
            replica.advance(a.time_s)
            router.report(k, replica.report())
        if policy == "power-of-two":
            pair = rng.sample(range(num_replicas), min(2, num_replicas))
            chosen = min(pair, key=lambda k: (len(replicas[k].steps_left), k))
        else:
            chosen = router.choose(request_work_s(a, a.steps)).replica
        replicas[chosen].add(index, a.time_s)
    for replica in replicas:
        replica.advance(float("inf"))
    done = {i: t for replica in replicas for i, t in replica.done.items()}
    return [done[i] - a.time_s for i, a in enumerate(trace)]


def fleet_trace(load: float, num_replicas: int, num_requests: int, seed: int) -> list[ss.Arrival]:
    """Poisson arrivals at `load` x the fleet's request-mode capacity (Dataset C sizes)."""
    one_gpu = ss.make_trace(load, num_requests, seed)
    return [ss.Arrival(a.time_s / num_replicas, a.side, a.steps, a.height) for a in one_gpu]


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(results)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, metric in zip(axes, ("mean", "p99")):
        width = 0.8 / len(POLICIES)
        for j, policy in enumerate(POLICIES):
            values = [results[c][policy][metric] for c in cases if policy in results[c]]
            ax.bar([i + j * width for i in range(len(values))], values, width, label=policy)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cases))], cases, rotation=30, fontsize=8)
        ax.set_ylabel(f"{metric} latency, s")
        ax.set_title(f"{metric} latency by routing policy")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--replicas", default="4,8", help="comma list of fleet sizes")
    parser.add_argument(
        "--loads", default="0.7,0.9,1.1", help="fractions of the fleet's request-mode capacity"
    )
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--num-requests", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json-output", default=None)
    parser.add_argument("--plot", default=None, help="PNG: mean and p99 latency per case and policy")
    args = parser.parse_args()
    policies = args.policies.split(",")
    unknown = set(policies) - set(POLICIES)
    if unknown:
        parser.error(f"--policies: unknown {sorted(unknown)}; choose from {', '.join(POLICIES)}")
    cases = [(int(n), float(x)) for n in args.replicas.split(",") for x in args.loads.split(",")]
    results: dict[str, dict[str, dict[str, float]]] = {}
    with tqdm(total=len(cases) * len(policies), desc="simulations") as bar:
        for n, load in cases:
            trace = fleet_trace(load, n, args.num_requests, args.seed)
            case = f"{n} replicas, load {load:g}"
            results[case] = {}
            for policy in policies:
                results[case][policy] = ss.summary(simulate(trace, n, policy, args.seed))
                bar.update()
    print("| replicas | load | policy | mean s | p50 | p90 | p99 | mean / round-robin | p99 / round-robin |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (n, load), rows in zip(cases, results.values()):
        base = rows.get("round-robin")
        for policy, s in rows.items():
            ratio = f"{s['mean'] / base['mean']:.2f} | {s['p99'] / base['p99']:.2f}" if base else "- | -"
            cells = " | ".join(f"{s[m]:.2f}" for m in ("mean", "p50", "p90", "p99"))
            print(f"| {n} | {load:g} | {policy} | {cells} | {ratio} |")
    if args.json_output:
        Path(args.json_output).write_text(
            json.dumps({"args": vars(args), "results": results}, indent=2) + "\n"
        )
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()

"""Issue 7: three server configurations x two arrival scenarios, measured with one command.

For each configuration the harness starts `python -m vllm_omni.entrypoints.cli.main serve MODEL --omni`
on a free port, waits for /health, warms it up, runs both scenarios through serving_benchmark's
functions, reads the engine's /metrics around each scenario, and stops the server (SIGINT) before the
next one starts:

    a  same-shape FIFO        --no-enable-mixfusion --scheduling-policy fifo
    b  MixFusion FIFO         --enable-mixfusion --scheduling-policy fifo
    c  MixFusion skip-ahead   --enable-mixfusion --scheduling-policy skip-ahead
                              [--max-num-batched-tokens N: this script's option, default none]
    all three also get --step-execution --max-num-seqs 8 (without --step-execution the server runs
    one request at a time) and --server-args.

Workload (same in every configuration): --sizes (default 1024x1024,1024x768,768x1024,512x512) x
--repeat 2 = 8 requests, request i with prompt i and seed --seed + i, --steps each, CFG only with
--true-cfg-scale > 1 and --negative-prompt.
    s0  burst       all 8 at t = 0
    s1  staggered   request i at i * --interval s (default 2.5; 'scaled' = 2.5 * steps / 50)

Estimate: on the first server the harness times each size alone at 2 and 2 + --calibration-steps
steps (fixed cost + per-step cost), simulates the run one request after another (exact for (a),
an upper bound for (b) and (c) with a safety factor) and prints the estimated remaining time.
`--steps auto --time-budget S` picks the largest step count <= 50 whose estimate fits S seconds
(counted from the harness start). The JSON is rewritten after every scenario, and SIGTERM (e.g.
from `timeout`) stops the server and keeps what was measured.

CPU smoke (seconds):
    python benchmarks/diffusion/run_serving_scenarios.py --model tiny-qwen-image --device cpu \\
        --sizes 64x64,64x48,48x64,32x32 --steps 3 --interval 0.2 \\
        --server-args "--mixfusion-min-chunk-tokens 1 --mixfusion-max-chunks 100000" \\
        --json-output outputs/bench/scenarios_cpu.json --plot outputs/bench/scenarios_cpu.png
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
if __package__ in (None, ""):  # run as a file: make `benchmarks.diffusion` importable
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.diffusion import serving_benchmark as sb  # noqa: E402
from benchmarks.diffusion.common import (  # noqa: E402
    BarPanel,
    Column,
    add_output_args,
    environment_info,
    format_cell,
    parse_size_list,
    plot_bar_panels,
    positive_int,
    ratio,
    write_json,
)

CONFIG_FLAGS: dict[str, tuple[str, list[str]]] = {
    "a": ("same-shape FIFO", ["--no-enable-mixfusion", "--scheduling-policy", "fifo"]),
    "b": ("MixFusion FIFO", ["--enable-mixfusion", "--scheduling-policy", "fifo"]),
    "c": ("MixFusion skip-ahead", ["--enable-mixfusion", "--scheduling-policy", "skip-ahead"]),
}
SCENARIOS = {"s0": "burst", "s1": "staggered"}
TARGETS = [("c", "a", "s1", 1.3), ("c", "b", "s0", 1.0), ("c", "b", "s1", 1.0)]
"""(config, baseline, scenario, target): speedup = baseline duration / config duration."""
MAX_AUTO_STEPS = 50
SEED_INTERVAL_S, SEED_STEPS = 2.5, 50
SAFETY = 1.15
"""Margin on the serial estimate: calibration noise, and a batched step may be a little slower."""
STOP_ESTIMATE_S = 10.0
"""Estimate of one server's shutdown (SIGINT, engine shutdown, process exit) before it is measured."""


class Interrupted(BaseException):
    """SIGTERM arrived: stop the server, keep the results so far (not an Exception: nothing that
    catches a failed request may swallow it)."""


def _on_sigterm(signum, frame):
    raise Interrupted("SIGTERM")


# ---- servers ------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_command(args: argparse.Namespace, key: str, port: int) -> list[str]:
    """The full `serve` command line of configuration `key`."""
    cmd = [sys.executable, "-m", "vllm_omni.entrypoints.cli.main", "serve", args.model, "--omni"]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--device", args.device, "--dtype", args.dtype]
    cmd += ["--load-format", args.load_format, "--seed", str(args.seed)]
    cmd += ["--step-execution", "--max-num-seqs", str(args.max_num_seqs), *CONFIG_FLAGS[key][1]]
    if key == "c" and args.max_num_batched_tokens is not None:
        cmd += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    return cmd + shlex.split(args.server_args or "")


class ServerProcess:
    """One `serve` subprocess (same process group, so `timeout` reaches it too), logging to a file."""

    def __init__(self, cmd: list[str], port: int, log_path: Path):
        self.base_url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def log_tail(self, num_chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def wait_ready(self, timeout_s: float) -> None:
        """Poll /health; RuntimeError (with the log tail) if the server exits or is not up in time."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.25)
        raise RuntimeError(f"server not healthy after {timeout_s:.0f} s:\n{self.log_tail()}")

    def metrics_text(self) -> str:
        """The /metrics exposition text; "" on failure (metrics are diagnostics: never fail a run)."""
        try:
            with urllib.request.urlopen(f"{self.base_url}/metrics", timeout=10) as response:
                return response.read().decode()
        except Exception:
            return ""

    def metrics(self) -> dict[str, float]:
        """/metrics samples summed over labels, plus `steps_total[path]` per path; {} on failure."""
        from prometheus_client.parser import text_string_to_metric_families

        text = self.metrics_text()
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out[s.name] = out.get(s.name, 0.0) + s.value
                if s.name.endswith("steps_total") and "path" in s.labels:
                    out[f"steps_total[{s.labels['path']}]"] = s.value
        return out

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def engine_stats(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """What the engine did during one scenario, from two /metrics snapshots."""
    if not before or not after:
        return {}

    def delta(name: str) -> float:
        return after.get(f"vllm_omni:{name}", 0.0) - before.get(f"vllm_omni:{name}", 0.0)

    paths = {k[12:-1]: after[k] - before.get(k, 0.0) for k in after if k.startswith("steps_total[")}
    return {
        "num_steps": delta("steps_total"),
        "steps_by_path": {p: n for p, n in paths.items() if n},
        "num_mixed_resolution_steps": delta("mixed_resolution_steps_total"),
        "num_request_steps": delta("step_num_requests_sum"),
        "mean_reqs_per_step": ratio(delta("step_num_requests_sum"), delta("step_num_requests_count")),
        "mean_tokens_per_step": ratio(delta("step_num_tokens_sum"), delta("step_num_tokens_count")),
        "busy_s": delta("step_latency_seconds_sum"),
    }


# ---- estimate -----------------------------------------------------------------------------------


@dataclass
class Calibration:
    """Alone cost of each size: `fixed_s + steps * step_s` (fixed: encode, decode, HTTP)."""

    fixed_s: dict[str, float] = field(default_factory=dict)
    step_s: dict[str, float] = field(default_factory=dict)

    def alone_s(self, size: str, steps: int) -> float:
        return self.fixed_s[size] + steps * self.step_s[size]


def serial_duration(alone_s: list[float], arrivals: list[float]) -> float:
    """Duration when requests run one at a time in arrival order (what (a) does with no two equal
    shapes next to each other in the queue)."""
    now = 0.0
    for cost, arrival in sorted(zip(alone_s, arrivals), key=lambda x: x[1]):
        now = max(now, arrival) + cost
    return now


def resolve_interval(interval: str, steps: int) -> float:
    """--interval: seconds, or 'scaled' = 2.5 s * steps / 50 (the seed's load per unit of work)."""
    if interval == "scaled":
        return SEED_INTERVAL_S * steps / SEED_STEPS
    try:
        value = float(interval)
    except ValueError:
        raise ValueError(f"--interval must be seconds > 0 or 'scaled', got {interval!r}") from None
    if not value > 0:
        raise ValueError(f"--interval must be > 0 seconds, got {value}")
    return value


def estimate(cal: Calibration, sizes: list[str], steps: int, interval: str) -> dict[str, Any]:
    """Per scenario: serial duration (estimate for (a), upper bound for (b)/(c)) and the floor of any
    batched duration (max over requests of arrival + alone time), hence the best possible speedup."""
    alone = [cal.alone_s(s, steps) for s in sizes]
    out: dict[str, Any] = {"steps": steps, "interval_s": resolve_interval(interval, steps)}
    for scenario in SCENARIOS:
        arrivals = sb.arrival_times(len(sizes), SCENARIOS[scenario], out["interval_s"])
        serial = serial_duration(alone, arrivals)
        floor = max(a + t for a, t in zip(arrivals, alone))
        out[scenario] = {"serial_s": serial, "floor_s": floor, "max_speedup": ratio(serial, floor)}
    return out


def remaining_s(est: dict[str, Any], num_configs_left: int, overhead_s: float) -> float:
    """Time to run the scenarios of the current config and `num_configs_left` more (each with
    `overhead_s` for start, warmup and stop), counting every config as serial x SAFETY."""
    per_config = SAFETY * sum(est[s]["serial_s"] for s in SCENARIOS)
    return per_config * (1 + num_configs_left) + overhead_s * num_configs_left


def choose_steps(cal: Calibration, sizes: list[str], interval: str, budget_s: float, num_configs_left: int,
                 overhead_s: float) -> int:  # fmt: skip
    """Largest steps <= 50 whose `remaining_s` fits `budget_s` (at least 2: one step is refused, its
    schedule is degenerate)."""
    for steps in range(MAX_AUTO_STEPS, 1, -1):
        if remaining_s(estimate(cal, sizes, steps, interval), num_configs_left, overhead_s) <= budget_s:
            return steps
    return 2


# ---- running ------------------------------------------------------------------------------------


def client_args(
    args: argparse.Namespace, base_url: str, scenario: str, interval_s: float
) -> argparse.Namespace:
    """serving_benchmark's own argument namespace for one scenario (no warmup: the harness warms up)."""
    argv = ["--base-url", base_url, "--sizes", args.sizes, "--repeat", str(args.repeat)]
    argv += ["--steps", str(args.steps), "--seed", str(args.seed), "--arrival", SCENARIOS[scenario]]
    argv += ["--interval", str(interval_s), "--num-warmups", "0", "--timeout", str(args.request_timeout)]
    if args.true_cfg_scale is not None:
        argv += ["--true-cfg-scale", str(args.true_cfg_scale)]
    if args.negative_prompt is not None:
        argv += ["--negative-prompt", args.negative_prompt]
    return sb.parse_args(argv + (["--no-progress"] if args.no_progress else []))


async def warm_and_calibrate(ns: argparse.Namespace, sizes: list, warmup_steps: int, calib_steps: int | None):
    """A burst of every distinct size (`warmup_steps` steps, unmeasured); then, when `calib_steps` is
    given, each size alone at 2 and 2 + calib_steps steps -> Calibration (one step is refused)."""
    client = sb.ImagesClient(ns)
    try:
        await asyncio.gather(*(client.generate(1000 + i, s, warmup_steps) for i, s in enumerate(sizes)))
        if calib_steps is None:
            return None
        cal = Calibration()
        for i, size in enumerate(sizes):
            times = []
            for steps in (2, 2 + calib_steps):
                start = time.perf_counter()
                await client.generate(2000 + i, size, steps)
                times.append(time.perf_counter() - start)
            cal.step_s[size.label] = max(0.0, (times[1] - times[0]) / calib_steps)
            cal.fixed_s[size.label] = max(0.0, times[0] - 2 * cal.step_s[size.label])
        return cal
    finally:
        await client.close()


def run_scenario(ns: argparse.Namespace, server: ServerProcess) -> dict[str, Any]:
    """One scenario through serving_benchmark: summary, per-request records and engine stats."""
    workload = sb.build_workload(ns.sizes, ns.repeat, None, None, ns.steps, ns.seed)
    items = sb.make_items(workload, sb.arrival_times(len(workload), ns.arrival, ns.interval))
    before = server.metrics()
    run = asyncio.run(sb.run_benchmark(ns, items, {}))
    summary = sb.summarize(run["records"], run["duration_s"], {}, ns.slo_scale)
    return {
        "arrival": ns.arrival,
        "interval_s": ns.interval if ns.arrival == "staggered" else None,
        "summary": summary,
        "engine": engine_stats(before, server.metrics()),
        "requests": [{**asdict(r), "latency_s": r.latency_s} for r in run["records"]],
    }


def print_estimate(est: dict[str, Any], remaining: float, elapsed: float, budget: float | None) -> None:
    lines = [f"estimate at {est['steps']} steps (s1 interval {est['interval_s']:.2f} s):"]
    for scenario, arrival in SCENARIOS.items():
        e = est[scenario]
        best = format_cell(e["max_speedup"], ".2f")
        lines.append(
            f"  {scenario} {arrival}: one at a time {e['serial_s']:.1f} s ((a); upper bound for (b), (c)); "
            f"batched floor {e['floor_s']:.1f} s -> best possible speedup vs (a) {best}x"
        )
    limit = f" (--time-budget {budget:.0f} s)" if budget else ""
    lines.append(f"  remaining <= {remaining:.0f} s; total <= {elapsed + remaining:.0f} s{limit}")
    if (est["s1"]["max_speedup"] or 0.0) < TARGETS[0][3]:
        note = "  note: arrivals bound s1 below the 1.3x target; more steps or --interval scaled raise it"
        lines.append(note)
    print("\n".join(lines), file=sys.stderr, flush=True)


def run_config(args, key: str, state: dict, payload: dict, log_dir: Path) -> None:
    """Start configuration `key`, (calibrate,) run both scenarios, stop; results go into `payload`."""
    port = free_port()
    cmd = server_command(args, key, port)
    result: dict[str, Any] = {"label": CONFIG_FLAGS[key][0], "server_command": cmd, "scenarios": {}}
    payload["configs"][key] = result
    print(f"[{key}] {CONFIG_FLAGS[key][0]}: {shlex.join(cmd[1:])}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    server = ServerProcess(cmd, port, log_dir / f"server_{key}.log")
    try:
        server.wait_ready(args.server_timeout)
        result["server_start_s"] = time.perf_counter() - t0
        sizes = list(dict.fromkeys(parse_size_list(args.sizes, "--sizes")))
        t1 = time.perf_counter()
        first = state.get("calibration") is None
        ns = client_args(args, server.base_url, "s0", 1.0)
        cal = asyncio.run(
            warm_and_calibrate(ns, sizes, args.warmup_steps, args.calibration_steps if first else None)
        )
        result["warmup_s"] = time.perf_counter() - t1
        if first:
            state["calibration"] = cal
            state["overhead_s"] = result["server_start_s"] + result["warmup_s"] + STOP_ESTIMATE_S
            labels = [s.label for s in parse_size_list(args.sizes, "--sizes")] * args.repeat
            left = len(state["keys"]) - 1
            elapsed = time.perf_counter() - state["start"]
            if args.steps_auto:
                budget = args.time_budget - elapsed
                args.steps = choose_steps(cal, labels, args.interval, budget, left, state["overhead_s"])
                print(f"--steps auto: {args.steps} steps fit the time budget", file=sys.stderr)
            est = estimate(cal, labels, args.steps, args.interval)
            est["remaining_s"] = remaining_s(est, left, state["overhead_s"])
            payload["calibration"] = {"config": key, **asdict(cal), "estimate": est}
            payload["steps"], payload["interval_s"] = args.steps, est["interval_s"]
            print_estimate(est, est["remaining_s"], elapsed, args.time_budget)
        interval_s = resolve_interval(args.interval, args.steps)
        for scenario in SCENARIOS:
            ns = client_args(args, server.base_url, scenario, interval_s)
            result["scenarios"][scenario] = run_scenario(ns, server)
            s = result["scenarios"][scenario]["summary"]
            print(
                f"[{key}] {scenario}: {s['duration_s']:.2f} s, {s['num_completed']}/{s['num_requests']} done",
                file=sys.stderr,
                flush=True,
            )
            write_partial(args, payload, state["start"])
    except Exception as exc:  # this config failed (server, HTTP); the next one still runs
        result["error"] = f"{type(exc).__name__}: {exc}"
        print(f"[{key}] failed: {result['error']}", file=sys.stderr)
    finally:
        t2 = time.perf_counter()
        server.stop()
        result["server_stop_s"] = time.perf_counter() - t2
        result["server_log"] = str(server.log_path)


# ---- report -------------------------------------------------------------------------------------


def compare(payload: dict) -> dict[str, Any]:
    """Durations, per-resolution mean latencies and the target speedups, from what was measured."""
    durations, per_res = {}, {}
    for key, result in payload["configs"].items():
        for scenario, run in result["scenarios"].items():
            summary = run["summary"]
            complete = summary["num_failed"] == 0
            durations.setdefault(key, {})[scenario] = summary["duration_s"] if complete else None
            per_res.setdefault(key, {})[scenario] = {
                size: stats["mean_s"] for size, stats in summary["per_resolution"].items()
            }

    def speedup(key: str, base: str, scenario: str, target: float | None) -> dict[str, Any]:
        value = ratio(durations.get(base, {}).get(scenario), durations.get(key, {}).get(scenario))
        met = None if value is None or target is None else value >= target
        names = ("config", "baseline", "scenario", "value", "target", "met")
        return dict(zip(names, (key, base, scenario, value, target, met)))

    speedups = [speedup(*t) for t in TARGETS]
    speedups += [speedup("b", "a", scenario, None) for scenario in SCENARIOS]  # context, no target
    return {"duration_s": durations, "mean_latency_s_per_resolution": per_res, "speedups": speedups}


def markdown_table(rows: list[dict[str, Any]], columns: list[Column]) -> str:
    """A GitHub-markdown table; None / NaN cells print as '-'."""
    lines = ["| " + " | ".join(c.header for c in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(format_cell(r.get(c.key), c.fmt) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


RUN_COLUMNS = [
    ("config", "config"), ("scenario", "scenario"), ("duration_s", "duration s", ".2f"), ("done", "done"),
    ("mean_s", "mean s", ".2f"), ("p90_s", "p90 s", ".2f"), ("reqs_step", "reqs/step", ".2f"),
    ("mixed", "mixed steps", ".0f"), ("busy", "engine busy s", ".1f"),
]  # fmt: skip
"""Columns of the runs table (per-resolution mean latency columns go after p90)."""
SPEED_COLUMNS = [("name", "speedup"), ("scenario", "scenario"), ("value", "x", ".3f"), ("target", "target"),
                 ("met", "met")]  # fmt: skip


def report(payload: dict) -> str:
    """The two markdown tables printed on stdout."""
    sizes = list(dict.fromkeys(s.label for s in parse_size_list(payload["config"]["sizes"], "--sizes")))
    columns = [Column(*c) for c in RUN_COLUMNS[:6]] + [
        Column(f"res:{s}", f"{s} mean s", ".2f") for s in sizes
    ]
    columns += [Column(*c) for c in RUN_COLUMNS[6:]]
    rows = []
    for key, result in payload["configs"].items():
        for scenario, run in result["scenarios"].items():
            s, engine = run["summary"], run["engine"]
            done, lat = f"{s['num_completed']}/{s['num_requests']}", s["latency"]
            values = (f"({key}) {result['label']}", f"{scenario} {run['arrival']}", s["duration_s"], done,
                      lat["mean_s"], lat["p90_s"], engine.get("mean_reqs_per_step"),
                      engine.get("num_mixed_resolution_steps"), engine.get("busy_s"))  # fmt: skip
            row = dict(zip((c[0] for c in RUN_COLUMNS), values))
            row.update({f"res:{size}": st["mean_s"] for size, st in s["per_resolution"].items()})
            rows.append(row)
        if result.get("error"):
            rows.append({"config": f"({key}) {result['label']}", "scenario": "FAILED: see JSON 'error'"})
    speed_rows = [
        {
            **sp,
            "name": f"({sp['config']}) vs ({sp['baseline']})",
            "scenario": sp["scenario"],
            "target": None if sp["target"] is None else f">= {sp['target']:g}",
            "met": None if sp["met"] is None else ("yes" if sp["met"] else "NO"),
        }
        for sp in payload["comparison"]["speedups"]
    ]
    head = f"steps {payload.get('steps')}, s1 interval {format_cell(payload.get('interval_s'), '.2f')} s"
    speed_table = markdown_table(speed_rows, [Column(*c) for c in SPEED_COLUMNS])
    return f"{head}\n\n{markdown_table(rows, columns)}\n\n{speed_table}"


def plot(path: str, payload: dict) -> Path:
    """Durations per config per scenario, and per-resolution mean latency per config."""
    comp, keys = payload["comparison"], list(payload["configs"])
    labels = {k: f"({k}) {payload['configs'][k]['label']}" for k in keys}
    durations = BarPanel(
        "total duration per scenario (lower is better)",
        [f"{s} {a}" for s, a in SCENARIOS.items()],
        {labels[k]: [comp["duration_s"].get(k, {}).get(s) for s in SCENARIOS] for k in keys},
        "seconds",
    )
    cats = [
        (s, size) for s in SCENARIOS for size in dict.fromkeys(parse_size_list(payload["config"]["sizes"]))
    ]
    per_res = comp["mean_latency_s_per_resolution"]
    latency = BarPanel(
        "mean latency per resolution",
        [f"{s} {size.label}" for s, size in cats],
        {labels[k]: [per_res.get(k, {}).get(s, {}).get(size.label) for s, size in cats] for k in keys},
        "seconds",
    )
    return plot_bar_panels(path, [durations, latency], f"serving scenarios, {payload.get('steps')} steps")


def write_partial(args: argparse.Namespace, payload: dict, start: float) -> None:
    """Refresh the comparison and rewrite the JSON (after every scenario, and at the end)."""
    payload["comparison"] = compare(payload)
    payload["elapsed_s"] = time.perf_counter() - start
    if args.json_output:
        write_json(args.json_output, payload)


# ---- main ---------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="Qwen/Qwen-Image", help="served model (tiny-qwen-image for CPU)")
    p.add_argument("--load-format", choices=("auto", "dummy"), default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--configs", default="a,b,c", help="which configurations, in run order")
    p.add_argument("--max-num-seqs", type=int, default=8, help="every configuration (default 8)")
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="token budget of configuration (c) only (default: none; see docs/benchmarks.md)",
    )
    p.add_argument("--server-args", default=None, help="extra serve flags for every configuration")
    p.add_argument("--server-timeout", type=float, default=600.0, help="seconds to wait for /health")
    p.add_argument("--log-dir", default=None, help="server logs (default: next to --json-output)")
    p.add_argument("--sizes", default="1024x1024,1024x768,768x1024,512x512")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--steps", default="50", help="denoise steps per request, or 'auto' (needs --time-budget)")
    p.add_argument("--time-budget", type=float, default=None, help="seconds from start for --steps auto")
    p.add_argument(
        "--interval", default="2.5", help="s1 seconds between arrivals, or 'scaled' (2.5*steps/50)"
    )
    p.add_argument("--seed", type=int, default=0, help="request i gets seed + i; also the weights' seed")
    p.add_argument("--true-cfg-scale", type=float, default=None)
    p.add_argument("--negative-prompt", default=None)
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--calibration-steps", type=int, default=4, help="estimate: time 1 and 1+N steps")
    p.add_argument("--request-timeout", type=float, default=1800.0)
    add_output_args(p)
    args = p.parse_args(argv)
    args.steps_auto = args.steps == "auto"
    if args.steps_auto:
        if args.time_budget is None or args.time_budget <= 0:
            raise ValueError("--steps auto needs --time-budget > 0 (seconds)")
        args.steps = MAX_AUTO_STEPS
    else:
        try:
            args.steps = positive_int("--steps", int(args.steps))
        except ValueError as exc:
            raise ValueError(f"--steps must be a positive integer or 'auto', got {args.steps!r}") from exc
    keys = [k.strip() for k in args.configs.split(",") if k.strip()]
    if not keys or any(k not in CONFIG_FLAGS for k in keys) or len(set(keys)) != len(keys):
        raise ValueError(f"--configs must list distinct keys of {sorted(CONFIG_FLAGS)}, got {args.configs!r}")
    args.config_keys = keys
    positive_int("--max-num-seqs", args.max_num_seqs)
    positive_int("--repeat", args.repeat)
    positive_int("--calibration-steps", args.calibration_steps)
    positive_int("--warmup-steps", args.warmup_steps)
    if args.max_num_batched_tokens is not None:
        positive_int("--max-num-batched-tokens", args.max_num_batched_tokens)
    parse_size_list(args.sizes, "--sizes")
    resolve_interval(args.interval, args.steps)
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run every configuration; print the markdown tables, write JSON / plot; return the payload."""
    start = time.perf_counter()
    args = parse_args(argv)
    try:
        import httpx  # noqa: F401 - serving_benchmark's default client
    except ImportError as exc:
        raise ValueError("run_serving_scenarios needs httpx (pip install httpx)") from exc
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:  # measure anyway: the JSON has everything the plot shows
            print("warning: matplotlib is not installed; --plot is skipped", file=sys.stderr)
            args.plot = None
    payload: dict[str, Any] = {
        "benchmark": "run_serving_scenarios",
        "env": environment_info(args.device if args.device.startswith("cuda") else None),
        "config": {
            **{k: v for k, v in vars(args).items() if k != "config_keys"},
            "steps": "auto" if args.steps_auto else args.steps,
        },  # fmt: skip
        "scenarios": SCENARIOS,
        "targets": [dict(zip(("config", "baseline", "scenario", "target"), t)) for t in TARGETS],
        "steps": args.steps,
        "interval_s": None if args.steps_auto else resolve_interval(args.interval, args.steps),
        "configs": {},
        "complete": False,
    }
    json_dir = Path(args.json_output).with_suffix("") if args.json_output else None
    log_dir = Path(args.log_dir) if args.log_dir else Path(f"{json_dir}_logs") if json_dir else None
    if log_dir is None:
        import tempfile

        log_dir = Path(tempfile.mkdtemp(prefix="serving_scenarios_logs_"))
    state = {"start": start, "keys": args.config_keys, "calibration": None}
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if main_thread else None
    try:
        for i, key in enumerate(args.config_keys):
            state["keys"] = args.config_keys[i:]
            run_config(args, key, state, payload, log_dir)
        payload["complete"] = all(
            not r.get("error") and len(r["scenarios"]) == len(SCENARIOS) for r in payload["configs"].values()
        )
    except (Interrupted, KeyboardInterrupt) as exc:
        payload["interrupted"] = repr(exc)
        print(f"interrupted ({exc!r}); keeping what was measured", file=sys.stderr)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        write_partial(args, payload, start)
    print(report(payload), flush=True)
    print(f"server logs in {log_dir}", file=sys.stderr)
    if args.json_output:
        print(f"wrote {args.json_output}", file=sys.stderr)
    if args.plot and payload["configs"]:
        print(f"wrote {plot(args.plot, payload)}", file=sys.stderr)
    return payload


if __name__ == "__main__":
    main()

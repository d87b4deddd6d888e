"""Poisson load of Dataset C at fractions of request mode's capacity, every scheduling policy.

For each configuration the harness starts `python -m vllm_omni.entrypoints.cli.main serve MODEL --omni`
once (waits for /health), warms it up, runs every load and then the 8-request burst against it, and
stops it (SIGINT) before the next one starts:

    request      no --step-execution: one request at a time, FIFO (vLLM-Omni main's default)
    skip-ahead   --step-execution --max-num-seqs 8 --scheduling-policy skip-ahead (pack all)
    budget-fifo  --step-execution --max-num-seqs 8 --scheduling-policy fifo
                 --max-num-batched-tokens N (--max-num-batched-tokens, default 8192)
    latency      --step-execution --max-num-seqs 8 --scheduling-policy latency
    every one also gets --server-args. A server that does not start (e.g. an unknown policy) is
    recorded as that configuration's error; the others still run.

Workload: Dataset C (512² .15, 768² .25, 1024² .45, 1536² .15), CFG on (--negative-prompt " ",
--true-cfg-scale 4), steps 8/8/10/14 x --steps-scale (rounded, at least 2). One unit-rate trace is
drawn (each size's share of --num-requests in a seeded order, seeded Poisson gaps); load L sends it with
its times divided by L x capacity: the same trace for every configuration.
Capacity of request mode = 1 / E[service],
E[service] the Dataset-C-weighted mean of each size's alone latency, measured (after the warm-up) on
the first configuration run, which should be `request`, and stored in the JSON; a later call with the
same --json-output reuses them, as does --alone-times. The burst: 1024², 1024x768, 768x1024, 512²,
1024², 512², 256², 1328² at t = 0, --burst-steps (20) x --steps-scale each; its sizes are timed alone
too.

Reported per (load, configuration): mean, p50, p90, p99, max latency, mean per size, SLO attainment
at 2x and 4x the size's alone latency, completed requests per second (completed / first arrival to
last completion), failures, ratios of mean / p50 / p99 to `request` at the same load, the server's
mean queue time (its `timings` extension). The JSON (--json-output) is merged with the file already
there (this call's configurations added or replaced) and rewritten after every load; the markdown
tables go to stdout and --markdown-output; --plot-dir gets one latency CDF per load and one burst
plot.

H200 (two calls of at most 10 minutes, one JSON; the dashboard's serving.md has the latest command):
    python benchmarks/diffusion/load_benchmark.py --model Qwen/Qwen-Image --load-format dummy \\
        --configs request,latency --steps-scale 0.5 --num-requests 10 \\
        --json-output out/load.json --markdown-output out/load.md --plot-dir out/plots
    python benchmarks/diffusion/load_benchmark.py ... --configs skip-ahead,budget-fifo   # same file

CPU smoke (a minute; tests/test_load_benchmark_smoke.py runs a shorter one):
    python benchmarks/diffusion/load_benchmark.py --model tiny-qwen-image --device cpu \\
        --size-scale 0.0625 --steps-scale 0.1 --num-requests 4 --loads 1.0 --configs request,skip-ahead \\
        --json-output outputs/bench/load_cpu.json --markdown-output outputs/bench/load_cpu.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import shlex
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
if __package__ in (None, ""):  # run as a file: make `benchmarks.diffusion` importable
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.diffusion import server_process as sp  # noqa: E402
from benchmarks.diffusion import serving_benchmark as sb  # noqa: E402
from benchmarks.diffusion.common import (  # noqa: E402
    SIZE_MULTIPLE,
    ImageSize,
    environment_info,
    format_cell,
    get_pyplot,
    mean,
    parse_size_list,
    positive_int,
    ratio,
    write_json,
)

CONFIGS: dict[str, list[str]] = {
    "request": [],
    "skip-ahead": ["--step-execution", "--scheduling-policy", "skip-ahead"],
    "budget-fifo": ["--step-execution", "--scheduling-policy", "fifo"],
    "latency": ["--step-execution", "--scheduling-policy", "latency"],
}
"""Configuration name -> its own serve flags (step mode also gets --max-num-seqs; budget-fifo the token
budget)."""
BASELINE = "request"

DATASET_C: list[tuple[int, int, float]] = [(512, 8, 0.15), (768, 8, 0.25), (1024, 10, 0.45), (1536, 14, 0.15)]
"""(side, steps, weight): vLLM-Omni's Dataset C weights, steps as in measured_2026-12.md."""
BURST_SIZES = "1024x1024,1024x768,768x1024,512x512,1024x1024,512x512,256x256,1328x1328"
SLO_SCALES = (2.0, 4.0)
SMALLEST_BURST_SIZE = "256x256"
"""The issue's burst target: this request at most 3x its alone time."""
MIN_STEPS = 2


# ---- workload -----------------------------------------------------------------------------------


def scale_size(size: ImageSize, scale: float) -> ImageSize:
    """Both sides x `scale`, rounded to a multiple of 16 (at least 16)."""

    def side(n: int) -> int:
        return max(SIZE_MULTIPLE, SIZE_MULTIPLE * round(n * scale / SIZE_MULTIPLE))

    return ImageSize(side(size.width), side(size.height))


def scale_steps(steps: int, scale: float) -> int:
    return max(MIN_STEPS, round(steps * scale))


@dataclass(frozen=True)
class ProfileEntry:
    """One size of the load profile."""

    size: ImageSize
    steps: int
    weight: float

    @property
    def key(self) -> str:
        return sb.alone_key(self.size, self.steps)


def load_profile(steps_scale: float, size_scale: float) -> list[ProfileEntry]:
    return [
        ProfileEntry(scale_size(ImageSize(side, side), size_scale), scale_steps(steps, steps_scale), weight)
        for side, steps, weight in DATASET_C
    ]


def burst_items(args: argparse.Namespace) -> list[sb.WorkItem]:
    sizes = [scale_size(s, args.size_scale) for s in parse_size_list(BURST_SIZES)]
    steps = scale_steps(args.burst_steps, args.steps_scale)
    return [sb.WorkItem(i, size, steps, 0.0) for i, size in enumerate(sizes)]


def quota_counts(weights: list[float], num: int) -> list[int]:
    """`num` split in proportion to `weights` (largest remainder; ties to the larger weight)."""
    total = sum(weights)
    exact = [w * num / total for w in weights]
    counts = [math.floor(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: (counts[i] - exact[i], -weights[i], i))
    for i in order[: num - sum(counts)]:
        counts[i] += 1
    return counts


def unit_trace(
    profile: list[ProfileEntry], num: int, seed: int, draw: str = "quota"
) -> list[tuple[ProfileEntry, float]]:
    """(entry, arrival at rate 1/s) per request, Poisson gaps (seeded, request 0 at t = 0).

    Sizes: 'quota' = each size's share of `num` by weight (so that a short trace has Dataset C's mix),
    in a seeded random order; 'random' = `num` independent seeded draws by weight."""
    rng = random.Random(seed)
    if draw == "quota":
        counts = quota_counts([e.weight for e in profile], num)
        sizes = [e for e, n in zip(profile, counts) for _ in range(n)]
        rng.shuffle(sizes)
    else:
        sizes = rng.choices(profile, weights=[e.weight for e in profile], k=num)
    return list(zip(sizes, sb.arrival_times(num, "poisson", rate=1.0, seed=seed)))


def load_items(unit: list[tuple[ProfileEntry, float]], rate: float) -> list[sb.WorkItem]:
    """The unit trace at `rate` requests per second (its arrivals divided by the rate)."""
    return [sb.WorkItem(i, e.size, e.steps, t / rate) for i, (e, t) in enumerate(unit)]


def mean_service_s(profile: list[ProfileEntry], alone: dict[str, float]) -> float | None:
    """E[service] of request mode: the weighted mean of the sizes' alone times (None if one is missing)."""
    times = [sb.lookup_alone(alone, e.size.label, e.steps) for e in profile]
    if any(t is None for t in times):
        return None
    return sum(e.weight * t for e, t in zip(profile, times)) / sum(e.weight for e in profile)


def load_key(load: float) -> str:
    return f"{load:g}"


# ---- statistics ---------------------------------------------------------------------------------


def completed_per_s(records: list[sb.RequestRecord]) -> float | None:
    """Completed requests / (first arrival to last completion)."""
    done = [r for r in records if r.ok]
    if not done:
        return None
    span = max(r.end_s for r in done) - min(r.arrival_s for r in records)
    return len(done) / span if span > 0 else None


def summarize(records: list[sb.RequestRecord], alone: dict[str, float]) -> dict[str, Any]:
    """Latency stats, per-size means, SLO attainment at each of SLO_SCALES, completed/s, queue time."""
    done = [r for r in records if r.ok]
    per_size = {}
    for size in sorted({r.size for r in records}, key=lambda s: parse_size_list(s)[0].num_img_tokens):
        group = [r for r in records if r.size == size]
        per_size[size] = {
            **sb.latency_stats([r.latency_s for r in group if r.ok]),
            "num_failed": sum(not r.ok for r in group),
        }
    return {
        "num_requests": len(records),
        "num_completed": len(done),
        "num_failed": len(records) - len(done),
        "latency": sb.latency_stats([r.latency_s for r in done]),
        "slo_attainment": {f"{s:g}x": sb.slo_attainment(records, alone, s) for s in SLO_SCALES},
        "completed_req_s": completed_per_s(records),
        "makespan_s": max((r.end_s for r in done), default=None),
        "server_timings_mean": server_timings_mean(done),
        "per_size": per_size,
        "errors": sorted({r.error for r in records if r.error})[:5],
    }


def server_timings_mean(records: list[sb.RequestRecord]) -> dict[str, float]:
    """Mean of each numeric field of the server's `timings` extension (queue_s, engine_s, ... and
    whatever fields a newer server adds) over the requests that carry it."""
    values: dict[str, list[float]] = {}
    for r in records:
        for field, value in (r.server_timings or {}).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                values.setdefault(field, []).append(float(value))
    return {field: mean(v) for field, v in values.items()}


def record_dicts(records: list[sb.RequestRecord], alone: dict[str, float]) -> list[dict[str, Any]]:
    out = []
    for r in records:
        base = sb.lookup_alone(alone, r.size, r.num_inference_steps)
        out.append({**asdict(r), "latency_s": r.latency_s, "alone_s": base})
    return out


# ---- running ------------------------------------------------------------------------------------


class LoggedClient:
    """serving_benchmark's ImagesClient, printing one line per finished request (elapsed time since
    the phase began) so that a long GPU run shows progress."""

    def __init__(self, inner: sb.ImagesClient, label: str, total: int, quiet: bool):
        self.inner, self.label, self.total, self.quiet = inner, label, total, quiet
        self.done, self.start = 0, time.perf_counter()

    async def generate(self, index: int, size: ImageSize, steps: int):
        sent = time.perf_counter()
        status = "ok"
        try:
            return await self.inner.generate(index, size, steps)
        except Exception as exc:
            status = f"FAILED {type(exc).__name__}: {str(exc)[:200]}"
            raise
        finally:
            self.done += 1
            if not self.quiet:
                now = time.perf_counter()
                print(
                    f"[{self.label}] {self.done}/{self.total} #{index} {size.label}@{steps} "
                    f"{now - sent:.2f} s {status} (t={now - self.start:.1f} s)",
                    file=sys.stderr,
                    flush=True,
                )


class NullBar:
    def update(self, n: int = 1) -> None:
        pass


def client_namespace(args: argparse.Namespace, base_url: str) -> argparse.Namespace:
    """serving_benchmark's argument namespace for the client (CFG fields, seed, timeout)."""
    argv = ["--base-url", base_url, "--client", args.client, "--seed", str(args.seed)]
    argv += ["--timeout", str(args.request_timeout), "--true-cfg-scale", str(args.true_cfg_scale)]
    argv += ["--negative-prompt", args.negative_prompt, "--no-progress"]
    return sb.parse_args(argv)


async def run_phase(ns, items: list[sb.WorkItem], label: str, quiet: bool) -> list[sb.RequestRecord]:
    """Send `items` at their arrival times (serving_benchmark.run_items); the records."""
    client = LoggedClient(sb.ImagesClient(ns), label, len(items), quiet)
    try:
        records, _ = await sb.run_items(client, items, ns, NullBar())
    finally:
        await client.inner.close()
    return records


async def warm_up(ns, sizes: list[ImageSize], steps: int, label: str, quiet: bool) -> None:
    """One request of each size, one after another (unmeasured: first-shape costs, VAE autotune)."""
    client = LoggedClient(sb.ImagesClient(ns), f"{label} warm-up", len(sizes), quiet)
    try:
        for i, size in enumerate(sizes):
            await client.generate(900 + i, size, steps)
    finally:
        await client.inner.close()


async def measure_alone(ns, items: list[sb.WorkItem], label: str, quiet: bool) -> dict[str, float]:
    """Latency of one request of each distinct (size, steps), each sent alone, one after another."""
    firsts: dict[str, sb.WorkItem] = {}
    for item in items:
        firsts.setdefault(item.key, item)
    client = LoggedClient(sb.ImagesClient(ns), f"{label} alone", len(firsts), quiet)
    alone = {}
    try:
        for key, item in firsts.items():
            start = time.perf_counter()
            try:
                await client.generate(item.index, item.size, item.num_inference_steps)
            except Exception:  # no alone time: its requests are left out of the SLO numbers
                continue
            alone[key] = time.perf_counter() - start
    finally:
        await client.inner.close()
    return alone


def server_command(args: argparse.Namespace, name: str, port: int) -> list[str]:
    """The full `serve` command line of configuration `name`."""
    cmd = [sys.executable, "-m", "vllm_omni.entrypoints.cli.main", "serve", args.model, "--omni"]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--device", args.device, "--dtype", args.dtype]
    cmd += ["--load-format", args.load_format, "--seed", str(args.seed), *CONFIGS[name]]
    if "--step-execution" in CONFIGS[name]:
        cmd += ["--max-num-seqs", str(args.max_num_seqs)]
    if name == "budget-fifo":
        cmd += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    return cmd + shlex.split(args.server_args or "")


def workload_signature(args: argparse.Namespace) -> dict[str, Any]:
    """What must be equal for two calls' results to share one JSON (the same traces and requests)."""
    keys = ("model", "load_format", "loads", "num_requests", "seed", "size_draw", "steps_scale",
            "size_scale", "burst_steps", "true_cfg_scale", "negative_prompt")  # fmt: skip
    return {k: getattr(args, k) for k in keys}


def new_payload(args: argparse.Namespace, profile: list[ProfileEntry]) -> dict[str, Any]:
    return {
        "benchmark": "load_benchmark",
        "workload": workload_signature(args),
        "profile": [{"size": e.size.label, "steps": e.steps, "weight": e.weight} for e in profile],
        "burst": [{"size": i.size.label, "steps": i.num_inference_steps} for i in burst_items(args)],
        "alone_times": {},
        "alone_config": None,
        "mean_service_s": None,
        "capacity_req_s": None,
        "loads": {},
        "configs": {},
        "calls": [],
    }


def open_payload(args: argparse.Namespace, profile: list[ProfileEntry]) -> dict[str, Any]:
    """The JSON already at --json-output (same workload) to extend, else a new one."""
    path = Path(args.json_output) if args.json_output else None
    if path is None or not path.is_file():
        return new_payload(args, profile)
    payload = json.loads(path.read_text())
    old = payload.get("workload")
    if old != json.loads(json.dumps(workload_signature(args))):
        raise ValueError(
            f"--json-output {path} holds another workload ({old}); give the same options or another file"
        )
    return payload


def set_capacity(payload: dict[str, Any], profile: list[ProfileEntry]) -> None:
    service = mean_service_s(profile, payload["alone_times"])
    payload["mean_service_s"] = service
    payload["capacity_req_s"] = None if service is None else 1.0 / service


def save(args: argparse.Namespace, payload: dict[str, Any]) -> None:
    payload["comparison"] = comparison_rows(payload)
    payload["burst_comparison"] = burst_rows(payload)
    if args.json_output:
        write_json(args.json_output, payload)


def run_config(args, name: str, payload: dict, profile: list[ProfileEntry], unit, log_dir: Path) -> None:
    """Start configuration `name`, (measure alone times,) run every load and the burst, stop."""
    port = sp.free_port()
    cmd = server_command(args, name, port)
    result: dict[str, Any] = {"server_command": cmd, "loads": {}, "burst": None}
    payload["configs"][name] = result
    print(f"[{name}] {shlex.join(cmd[1:])}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    server = sp.ServerProcess(cmd, port, log_dir / f"server_{name}.log")
    try:
        server.wait_ready(args.server_timeout)
        result["server_start_s"] = time.perf_counter() - t0
        print(f"[{name}] up after {result['server_start_s']:.0f} s", file=sys.stderr, flush=True)
        ns = client_namespace(args, server.base_url)
        burst = burst_items(args) if args.burst else []
        sizes = list(dict.fromkeys([e.size for e in profile] + [i.size for i in burst]))
        if args.warmup_steps:
            asyncio.run(warm_up(ns, sizes, args.warmup_steps, name, args.no_progress))
        alone_items = [sb.WorkItem(i, e.size, e.steps, 0.0) for i, e in enumerate(profile)] + burst
        alone = payload["alone_times"]
        missing = [
            i for i in alone_items if sb.lookup_alone(alone, i.size.label, i.num_inference_steps) is None
        ]
        if missing:
            if name != BASELINE:
                print(f"warning: alone times measured on {name!r}, not {BASELINE!r}", file=sys.stderr)
            measured = asyncio.run(measure_alone(ns, missing, name, args.no_progress))
            payload["alone_times"].update(measured)
            payload["alone_config"] = payload["alone_config"] or name
            set_capacity(payload, profile)
            save(args, payload)
        capacity = payload["capacity_req_s"]
        if capacity is None and args.loads:
            raise RuntimeError("no capacity: an alone time of the profile is missing (see the JSON)")
        for load in args.loads:
            key, rate = load_key(load), load * capacity
            items = load_items(unit, rate)
            payload["loads"][key] = {
                "fraction": load,
                "rate_req_s": rate,
                "trace": [[i.size.label, i.num_inference_steps, i.arrival_s] for i in items],
            }
            before = server.metrics()
            records = asyncio.run(run_phase(ns, items, f"{name} load {key}", args.no_progress))
            result["loads"][key] = {
                "summary": summarize(records, payload["alone_times"]),
                "engine": sp.engine_stats(before, server.metrics()),
                "requests": record_dicts(records, payload["alone_times"]),
            }
            result["loads"][key]["step_cost_model"] = step_cost_model_lines(server)
            print_load_line(name, key, result["loads"][key]["summary"])
            save(args, payload)
        if burst:
            records = asyncio.run(run_phase(ns, burst, f"{name} burst", args.no_progress))
            result["burst"] = {
                "summary": summarize(records, payload["alone_times"]),
                "requests": record_dicts(records, payload["alone_times"]),
            }
            save(args, payload)
    except Exception as exc:  # this configuration failed (server, HTTP); the next one still runs
        result["error"] = f"{type(exc).__name__}: {exc}"
        print(f"[{name}] failed: {result['error']}", file=sys.stderr, flush=True)
    finally:
        t1 = time.perf_counter()
        server.stop()
        result["server_stop_s"] = time.perf_counter() - t1
        result["server_log"] = str(server.log_path)
        result["server_log_tail"] = server.log_tail(4000)
        log_lines = server.log_path.read_text(errors="replace").splitlines()
        result["scheduler_log"] = [ln for ln in log_lines if "scheduling:" in ln][:4]  # the start-up table
        save(args, payload)


def step_cost_model_lines(server: sp.ServerProcess) -> list[str]:
    """The step cost model as the server's /metrics has it after a load (`step_cost_*` samples, with
    their token labels): what the latency policy priced each step at; [] where there is none."""
    return [ln for ln in server.metrics_text().splitlines() if ln.startswith("vllm_omni:step_cost")]


def print_load_line(name: str, key: str, s: dict[str, Any]) -> None:
    lat = s["latency"]
    print(
        f"[{name}] load {key}: {s['num_completed']}/{s['num_requests']} done, mean {lat['mean_s']:.2f} s, "
        f"p50 {lat['p50_s']:.2f}, p99 {lat['p99_s']:.2f}, {format_cell(s['completed_req_s'], '.3f')} req/s",
        file=sys.stderr,
        flush=True,
    )


# ---- report -------------------------------------------------------------------------------------


def comparison_rows(payload: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (load, configuration) with the ratios to `request` at the same load."""
    rows = []
    for key in sorted(payload["loads"], key=float):
        base = payload["configs"].get(BASELINE, {}).get("loads", {}).get(key)
        base_lat = base["summary"]["latency"] if base else {}
        for name, result in payload["configs"].items():
            run = result.get("loads", {}).get(key)
            if run is None:
                continue
            s, lat = run["summary"], run["summary"]["latency"]
            row = {"load": key, "config": name, "done": f"{s['num_completed']}/{s['num_requests']}"}
            row.update({k: lat[k] for k in ("mean_s", "p50_s", "p90_s", "p99_s", "max_s")})
            row.update({f"size:{size}": st["mean_s"] for size, st in s["per_size"].items()})
            row.update({f"slo:{k}": None if v is None else 100 * v for k, v in s["slo_attainment"].items()})
            row.update(completed_req_s=s["completed_req_s"], rate=payload["loads"][key]["rate_req_s"])
            timings = s["server_timings_mean"]
            row.update(mean_queue_s=timings.get("queue_s"), sat_out=timings.get("num_steps_sat_out"))
            row.update(failed=s["num_failed"], reqs_step=run.get("engine", {}).get("mean_reqs_per_step"))
            for stat in ("mean_s", "p50_s", "p99_s"):
                row[f"x:{stat}"] = ratio(lat[stat], base_lat.get(stat))
            row["x:completed_req_s"] = ratio(s["completed_req_s"], base["summary"]["completed_req_s"] if base
                                             else None)  # fmt: skip
            rows.append(row)
    return rows


def burst_rows(payload: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per configuration: each burst request's latency, the mean, makespan, ratios."""
    base = (payload["configs"].get(BASELINE) or {}).get("burst")
    rows = []
    for name, result in payload["configs"].items():
        burst = result.get("burst")
        if not burst:
            continue
        s = burst["summary"]
        row = {"config": name, "done": f"{s['num_completed']}/{s['num_requests']}",
               "mean_s": s["latency"]["mean_s"], "makespan_s": s["makespan_s"]}  # fmt: skip
        for r in burst["requests"]:
            row[f"req:{r['index']}"] = r["latency_s"] if r["ok"] else None
            if r["size"] == scale_label(payload, SMALLEST_BURST_SIZE):
                row["small_x_alone"] = ratio(r["latency_s"] if r["ok"] else None, r["alone_s"])
        base_mean = base["summary"]["latency"]["mean_s"] if base else None
        row["x:mean_s"] = ratio(s["latency"]["mean_s"], base_mean)
        rows.append(row)
    return rows


def scale_label(payload: dict[str, Any], label: str) -> str:
    """The label `label` of the burst has in this payload (sizes may be scaled)."""
    index = parse_size_list(BURST_SIZES).index(parse_size_list(label)[0])
    return payload["burst"][index]["size"]


LOAD_COLUMNS = [
    ("load", "load", ""),
    ("rate", "req/s in", ".3f"),
    ("config", "config", ""),
    ("done", "done", ""),
    ("mean_s", "mean s", ".2f"),
    ("p50_s", "p50", ".2f"),
    ("p90_s", "p90", ".2f"),
    ("p99_s", "p99", ".2f"),
    ("max_s", "max", ".2f"),
    # (per-size means and SLO attainments go here)
    ("completed_req_s", "req/s done", ".3f"),
    ("x:mean_s", "mean x req", ".2f"),
    ("x:p50_s", "p50 x req", ".2f"),
    ("x:p99_s", "p99 x req", ".2f"),
    ("x:completed_req_s", "req/s x req", ".2f"),
    ("mean_queue_s", "queue s", ".2f"),
    ("sat_out", "steps sat out", ".1f"),
    ("reqs_step", "reqs/step", ".2f"),
    ("failed", "failed", ""),
]
"""(row key, header, format) of the loads table; 'x req' = ratio to `request` at the same load."""
BURST_COLUMNS = [
    ("config", "burst", ""),
    ("done", "done", ""),
    # (one latency column per request goes here)
    ("mean_s", "mean s", ".2f"),
    ("x:mean_s", "mean x req", ".2f"),
    ("makespan_s", "makespan", ".2f"),
]


def markdown(rows: list[dict[str, Any]], columns: list[tuple[str, str, str]]) -> str:
    lines = ["| " + " | ".join(h for _, h, _ in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(format_cell(r.get(k), f) for k, _, f in columns) + " |" for r in rows]
    return "\n".join(lines)


def report(payload: dict[str, Any]) -> str:
    """The markdown: setup, alone times, the loads table, the burst table, errors."""
    w = payload["workload"]
    profile = ", ".join(f"{p['size']}@{p['steps']} x{p['weight']:g}" for p in payload["profile"])
    head = [
        f"Dataset C: {profile}; CFG scale {w['true_cfg_scale']:g}; {w['num_requests']} requests per load, "
        f"seed {w['seed']}.",
        f"Request mode: E[service] {format_cell(payload['mean_service_s'], '.3f')} s, capacity "
        f"{format_cell(payload['capacity_req_s'], '.4f')} req/s (alone times on "
        f"`{payload['alone_config']}`).",
    ]
    alone = payload["alone_times"]
    alone_table = markdown([{"key": k, "s": v} for k, v in alone.items()],
                           [("key", "alone: size@steps", ""), ("s", "s", ".3f")])  # fmt: skip
    sizes = [p["size"] for p in payload["profile"]]
    cols = LOAD_COLUMNS[:9] + [(f"size:{s}", f"{s} mean", ".2f") for s in sizes]
    cols += [(f"slo:{s:g}x", f"SLO {s:g}x %", ".0f") for s in SLO_SCALES] + LOAD_COLUMNS[9:]
    out = "\n".join(head) + "\n\n" + alone_table
    if payload.get("comparison"):  # (none with --loads none: the burst alone)
        out += "\n\n" + markdown(payload["comparison"], cols)
    burst = payload.get("burst_comparison") or []
    if burst:
        bcols = BURST_COLUMNS[:2] + [(f"req:{i}", b["size"], ".2f") for i, b in enumerate(payload["burst"])]
        small = scale_label(payload, SMALLEST_BURST_SIZE)
        bcols += BURST_COLUMNS[2:] + [("small_x_alone", f"{small} x alone", ".2f")]
        steps = payload["burst"][0]["steps"]
        out += f"\n\nBurst of 8 at t = 0, {steps} steps each (latency per request, s):\n\n"
        out += markdown(burst, bcols)
    errors = [f"- `{n}`: {error_line(r['error'])}" for n, r in payload["configs"].items() if r.get("error")]
    if errors:
        out += "\n\nFailed configurations:\n" + "\n".join(errors)
    return out + "\n"


def error_line(error: str) -> str:
    """An error on one line: its first line and, when it carries a log tail, the tail's last line."""
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
    return lines[0] if len(lines) < 2 else f"{lines[0]} ... {lines[-1]}"


def cdf_points(latencies: list[float]) -> tuple[list[float], list[float]]:
    data = sorted(latencies)
    return data, [(i + 1) / len(data) for i in range(len(data))]


def write_plots(plot_dir: str, payload: dict[str, Any]) -> list[Path]:
    """load_<L>.png: latency CDF per configuration; burst.png: per-request latency bars."""
    plt = get_pyplot()
    out_dir = Path(plot_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for key in sorted(payload["loads"], key=float):
        if not any(key in r.get("loads", {}) for r in payload["configs"].values()):
            continue  # (cut short before any configuration finished it)
        fig, ax = plt.subplots(figsize=(8, 5))
        for k, (name, result) in enumerate(payload["configs"].items()):
            run = result.get("loads", {}).get(key)
            if run is None:
                continue
            lat = [r["latency_s"] for r in run["requests"] if r["ok"]]
            if lat:
                xs, ys = cdf_points(lat)
                ax.step(xs, ys, where="post", color=f"C{k}", label=f"{name} (mean {mean(lat):.2f} s)")
        rate = payload["loads"][key]["rate_req_s"]
        ax.set_title(f"latency CDF at {float(key):.0%} of request-mode capacity ({rate:.3f} req/s)")
        ax.set_xlabel("latency (s)")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        paths.append(out_dir / f"load_{key}.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    bursts = {n: r["burst"] for n, r in payload["configs"].items() if r.get("burst")}
    if bursts:
        fig, ax = plt.subplots(figsize=(10, 5))
        labels = [f"#{i} {b['size']}" for i, b in enumerate(payload["burst"])]
        width = 0.8 / len(bursts)
        for k, (name, burst) in enumerate(bursts.items()):
            lat = {r["index"]: r["latency_s"] if r["ok"] else math.nan for r in burst["requests"]}
            xs = [i + (k - (len(bursts) - 1) / 2) * width for i in range(len(labels))]
            ax.bar(xs, [lat.get(i, math.nan) for i in range(len(labels))], width,
                   label=f"{name} (mean {burst['summary']['latency']['mean_s']:.2f} s)")  # fmt: skip
        alone = [payload["alone_times"].get(f"{b['size']}@{b['steps']}") for b in payload["burst"]]
        ax.scatter(range(len(labels)), [math.nan if a is None else a for a in alone], marker="_", s=300,
                   color="black", label="alone", zorder=3)  # fmt: skip
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels, rotation=15, fontsize=8)
        ax.set_ylabel("latency (s)")
        ax.set_title(f"burst of 8 at t = 0, {payload['burst'][0]['steps']} steps each")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        paths.append(out_dir / "burst.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


# ---- main ---------------------------------------------------------------------------------------


def parse_loads(text: str) -> list[float]:
    """Fractions of request mode's capacity; 'none': no load, only the burst (with --burst)."""
    if text.strip().lower() == "none":
        return []
    try:
        loads = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--loads must be a comma list of fractions of capacity, got {text!r}") from None
    if not loads or any(not (x > 0 and math.isfinite(x)) for x in loads):
        raise ValueError(f"--loads must be a comma list of positive fractions, got {text!r}")
    return loads


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="Qwen/Qwen-Image", help="served model (tiny-qwen-image for CPU)")
    p.add_argument("--load-format", choices=("auto", "dummy"), default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list of {list(CONFIGS)}, in order")
    p.add_argument("--max-num-seqs", type=int, default=8, help="step-mode configurations (default 8)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="budget-fifo's token budget")
    p.add_argument("--server-args", default=None, help="extra serve flags for every configuration")
    p.add_argument("--server-timeout", type=float, default=300.0, help="seconds to wait for /health")
    p.add_argument("--log-dir", default=None, help="server logs (default: next to --json-output)")
    p.add_argument(
        "--loads",
        default="0.5,0.8,1.0,1.2",
        help="fractions of request mode's capacity ('none': the burst only)",
    )
    p.add_argument("--num-requests", type=int, default=24, help="requests per load")
    p.add_argument("--steps-scale", type=float, default=1.0, help="x the steps 8/8/10/14 and --burst-steps")
    p.add_argument("--size-scale", type=float, default=1.0, help="x every image side (CPU smoke runs)")
    p.add_argument("--burst-steps", type=int, default=20, help="burst requests' steps (x --steps-scale)")
    p.add_argument("--no-burst", dest="burst", action="store_false", help="skip the 8-request burst")
    p.add_argument(
        "--size-draw", choices=("quota", "random"), default="quota", help="trace sizes: see unit_trace"
    )
    p.add_argument("--seed", type=int, default=0, help="trace draws; request i gets seed + i; weights' seed")
    p.add_argument("--true-cfg-scale", type=float, default=4.0)
    p.add_argument("--negative-prompt", default=" ")
    p.add_argument("--warmup-steps", type=int, default=2, help="per-size warm-up steps, >= 2 (0: none)")
    p.add_argument("--alone-times", default=None, help="JSON object or file: WxH[@steps] -> seconds")
    p.add_argument("--client", choices=("openai", "httpx"), default="openai", help="see serving_benchmark")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--json-output", default=None, help="JSON, merged with the file already there")
    p.add_argument("--markdown-output", default=None, help="the markdown tables")
    p.add_argument("--plot-dir", default=None, help="load_<L>.png latency CDFs and burst.png")
    p.add_argument("--no-progress", action="store_true", help="no per-request log lines")
    p.add_argument(
        "--merge",
        nargs="+",
        default=None,
        metavar="JSON",
        help="start no server: merge these runs' configurations (one workload, e.g. one configuration "
        "per device call) into --json-output, then write the tables and plots",
    )
    args = p.parse_args(argv)
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    if not names or any(n not in CONFIGS for n in names) or len(set(names)) != len(names):
        raise ValueError(f"--configs must list distinct names of {list(CONFIGS)}, got {args.configs!r}")
    args.config_names = names
    args.loads = parse_loads(args.loads)
    if not args.loads and not args.burst:
        raise ValueError("--loads none with --no-burst leaves nothing to run")
    for name in ("num_requests", "max_num_seqs", "max_num_batched_tokens", "burst_steps"):
        positive_int(f"--{name.replace('_', '-')}", getattr(args, name))
    if args.warmup_steps and args.warmup_steps < 2:  # the server refuses 1-step schedules (degenerate)
        raise ValueError(f"--warmup-steps must be 0 (no warm-up) or >= 2, got {args.warmup_steps}")
    for name in ("steps_scale", "size_scale"):
        if not getattr(args, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    return args


def merge_runs(paths: list[str]) -> dict[str, Any]:
    """One payload from several runs of one workload (same trace, capacity and alone times): the first
    run's, with every later run's configurations added (a later one of the same name replaces it)."""
    payload = json.loads(Path(paths[0]).read_text())
    for path in paths[1:]:
        other = json.loads(Path(path).read_text())
        for key in ("workload", "alone_times"):
            if other.get(key) != payload.get(key):
                raise ValueError(f"--merge: {path} has another {key} than {paths[0]}; runs must share them")
        payload["configs"].update(other["configs"])
        payload["calls"] += other.get("calls", [])
    return payload


def write_outputs(args: argparse.Namespace, payload: dict[str, Any]) -> None:
    """The markdown report (printed and --markdown-output) and the plots."""
    text = report(payload)
    print(text, flush=True)
    if args.markdown_output:
        Path(args.markdown_output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown_output).write_text(text)
    if args.plot_dir:
        for path in write_plots(args.plot_dir, payload):
            print(f"wrote {path}", file=sys.stderr)
    if args.json_output:
        print(f"wrote {args.json_output}", file=sys.stderr)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the configurations; print and write the markdown, JSON and plots; return the payload."""
    args = parse_args(argv)
    if args.merge:
        payload = merge_runs(args.merge)
        save(args, payload)
        write_outputs(args, payload)
        return payload
    profile = load_profile(args.steps_scale, args.size_scale)
    payload = open_payload(args, profile)
    if args.alone_times:
        payload["alone_times"].update(sb.parse_alone_times(args.alone_times))
        payload["alone_config"] = payload["alone_config"] or "--alone-times"
    set_capacity(payload, profile)
    payload["env"] = environment_info()
    payload["config"] = {k: v for k, v in vars(args).items() if k != "config_names"}
    payload["calls"].append({"time_utc": payload["env"]["time_utc"], "configs": args.config_names})
    unit = unit_trace(profile, args.num_requests, args.seed, args.size_draw)
    json_dir = Path(args.json_output).with_suffix("") if args.json_output else None
    log_dir = Path(args.log_dir) if args.log_dir else Path(f"{json_dir}_logs") if json_dir else None
    if log_dir is None:
        import tempfile

        log_dir = Path(tempfile.mkdtemp(prefix="load_benchmark_logs_"))
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, sp.on_sigterm) if main_thread else None
    try:
        for name in args.config_names:
            run_config(args, name, payload, profile, unit, log_dir)
    except (sp.Interrupted, KeyboardInterrupt) as exc:
        payload["interrupted"] = repr(exc)
        print(f"interrupted ({exc!r}); keeping what was measured", file=sys.stderr)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        save(args, payload)
    write_outputs(args, payload)
    return payload


if __name__ == "__main__":
    main()

"""Serving benchmark: a workload of image requests against a running server's OpenAI images API.

    vllm serve Qwen/Qwen-Image --omni --load-format dummy --max-num-seqs 8 --port 8000 &
    python benchmarks/diffusion/serving_benchmark.py --base-url http://127.0.0.1:8000 \
        --profile datasetC --num-requests 100 --arrival poisson --rate 0.5 --measure-alone \
        --json-output serve.json --plot serve.png

Requests are `POST /v1/images/generations` with n=1 and `response_format="b64_json"`; our extension
fields (num_inference_steps, negative_prompt, true_cfg_scale, seed, extra_args) travel in `extra_body`.
`--client httpx` (default, needs only httpx) sends them as a JSON `extra_body` object inside the body;
`--client openai` uses the OpenAI Python SDK's `images.generate(..., extra_body=...)`, which merges them
into the top level. The server accepts both.

Workload (request i gets prompt i of common.DEFAULT_PROMPTS, cycled, and seed `--seed + i`):
    --sizes A,B,C --repeat R       the list in order, R times, each with --steps
    --profile datasetC             --num-requests draws (seeded) from the weighted profile below

Arrivals (t = 0 is the benchmark start):
    burst       every request at t = 0
    staggered   request i at i * --interval seconds
    poisson     exponential gaps with mean 1 / --rate (seeded); request 0 at t = 0
A client-side semaphore (--max-concurrency) caps requests in flight; a request waits for it after
its arrival time.

Numbers:
    latency      completion - arrival (what the user sees: includes time waiting for the semaphore);
                 mean / p50 / p90 / p99 (linear interpolation), overall and per resolution
    duration     t = 0 to the last completion; throughput = completed requests (images) / duration
    SLO          a request meets it when latency <= --slo-scale x the alone time of its (size, steps);
                 failed requests miss it; attainment = met / requests with a known alone time. Alone
                 times come from --measure-alone (one request of each (size, steps) sent alone, one
                 after another, before the run) and/or --alone-times (JSON object or file:
                 {"1024x1024": 12.3} or {"1024x1024@25": 9.1}; measured values win).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make `benchmarks.diffusion` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.diffusion.common import (  # noqa: E402
    DEFAULT_PROMPTS,
    Column,
    ImageSize,
    add_output_args,
    environment_info,
    format_table,
    get_pyplot,
    mean,
    parse_size,
    parse_size_list,
    percentile,
    positive_int,
    progress,
    write_json,
)

PROFILES: dict[str, list[tuple[ImageSize, int, float]]] = {
    "datasetC": [
        (ImageSize(512, 512), 20, 0.15),
        (ImageSize(768, 768), 20, 0.25),
        (ImageSize(1024, 1024), 25, 0.45),
        (ImageSize(1536, 1536), 35, 0.15),
    ],
}
"""(size, steps, weight): vLLM-Omni's Qwen-Image serving dashboard 'Dataset C'."""

ARRIVALS = ("burst", "staggered", "poisson")


@dataclass(frozen=True)
class WorkItem:
    """One request of the workload."""

    index: int
    size: ImageSize
    num_inference_steps: int
    arrival_s: float
    """Scheduled arrival, seconds after the benchmark start."""

    @property
    def key(self) -> str:
        return alone_key(self.size, self.num_inference_steps)


@dataclass
class RequestRecord:
    """What happened to one request (times in seconds after the benchmark start)."""

    index: int
    size: str
    num_inference_steps: int
    arrival_s: float
    send_s: float
    end_s: float
    ok: bool
    num_images: int = 0
    error: str | None = None
    server_timings: dict[str, Any] | None = None
    """The server's `timings` extension (queue_s, engine_s, encode_s, total_s) when it sends one."""

    @property
    def latency_s(self) -> float:
        return self.end_s - self.arrival_s


# ---- workload -----------------------------------------------------------------------------------


def build_workload(
    sizes: str | None, repeat: int, profile: str | None, num_requests: int | None, steps: int, seed: int
) -> list[tuple[ImageSize, int]]:
    """(size, steps) per request: the --sizes list repeated in order, or seeded draws from a profile."""
    if profile is not None:
        if sizes is not None:
            raise ValueError("--sizes and --profile are exclusive: give one workload")
        if profile not in PROFILES:
            raise ValueError(f"--profile must be one of {sorted(PROFILES)}, got {profile!r}")
        count = positive_int("--num-requests", num_requests if num_requests is not None else 100)
        entries = PROFILES[profile]
        rng = random.Random(seed)
        drawn = rng.choices(entries, weights=[w for _, _, w in entries], k=count)
        return [(size, n) for size, n, _ in drawn]
    positive_int("--repeat", repeat)
    positive_int("--steps", steps)
    sizes_list = parse_size_list(sizes or "1024x1024,1024x768,768x1024,512x512", "--sizes")
    workload = [(size, steps) for _ in range(repeat) for size in sizes_list]
    if num_requests is not None:
        workload = workload[: positive_int("--num-requests", num_requests)]
    return workload


def arrival_times(
    num: int, arrival: str, interval: float | None = None, rate: float | None = None, seed: int = 0
) -> list[float]:
    """Arrival offsets in seconds for `num` requests (see the module docstring)."""
    if arrival == "burst":
        return [0.0] * num
    if arrival == "staggered":
        if interval is None or interval <= 0:
            raise ValueError(f"--arrival staggered needs --interval > 0 (seconds), got {interval}")
        return [i * interval for i in range(num)]
    if arrival == "poisson":
        if rate is None or rate <= 0:
            raise ValueError(f"--arrival poisson needs --rate > 0 (requests per second), got {rate}")
        rng, times, now = random.Random(seed), [], 0.0
        for i in range(num):
            if i:
                now += rng.expovariate(rate)
            times.append(now)
        return times
    raise ValueError(f"--arrival must be one of {list(ARRIVALS)}, got {arrival!r}")


def make_items(workload: list[tuple[ImageSize, int]], arrivals: list[float]) -> list[WorkItem]:
    return [WorkItem(i, size, steps, t) for i, ((size, steps), t) in enumerate(zip(workload, arrivals))]


# ---- statistics ---------------------------------------------------------------------------------


def alone_key(size: ImageSize, steps: int) -> str:
    return f"{size.label}@{steps}"


def parse_alone_times(text: str) -> dict[str, float]:
    """--alone-times: a JSON object (or a file holding one) of 'WxH' or 'WxH@steps' -> seconds."""
    path = Path(text)
    raw = path.read_text() if not text.lstrip().startswith("{") and path.is_file() else text
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--alone-times must be a JSON object or a file holding one: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError("--alone-times must be a JSON object of 'WxH' or 'WxH@steps' -> seconds")
    out = {}
    for key, value in data.items():
        label, at, steps = str(key).partition("@")
        try:
            size = parse_size(label, "--alone-times key")
        except ValueError as exc:
            raise ValueError(f"--alone-times key {key!r} must be 'WxH' or 'WxH@steps'") from exc
        if at and not steps.isdigit():
            raise ValueError(f"--alone-times key {key!r} must be 'WxH' or 'WxH@steps'")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"--alone-times[{key!r}] must be a positive number of seconds, got {value!r}")
        out[f"{size.label}{at}{steps}"] = float(value)
    return out


def lookup_alone(alone: dict[str, float], size: str, steps: int) -> float | None:
    """Alone time of (size, steps): the exact 'WxH@steps' entry, else the 'WxH' entry, else None."""
    return alone.get(f"{size}@{steps}", alone.get(size))


def latency_stats(latencies: list[float]) -> dict[str, float | int]:
    return {
        "count": len(latencies),
        "mean_s": mean(latencies),
        "p50_s": percentile(latencies, 50),
        "p90_s": percentile(latencies, 90),
        "p99_s": percentile(latencies, 99),
        "max_s": max(latencies) if latencies else float("nan"),
    }


def slo_attainment(records: list[RequestRecord], alone: dict[str, float], slo_scale: float) -> float | None:
    """Fraction of the records with a known alone time that completed within `slo_scale` x that time;
    failed requests count as misses. None when no record has an alone time."""
    met, num = 0, 0
    for r in records:
        base = lookup_alone(alone, r.size, r.num_inference_steps)
        if base is not None:
            num += 1
            met += r.ok and r.latency_s <= slo_scale * base
    return met / num if num else None


def summarize(
    records: list[RequestRecord], duration_s: float, alone: dict[str, float], slo_scale: float
) -> dict:
    """Duration, throughput, latency stats and SLO attainment, overall and per resolution."""
    done = [r for r in records if r.ok]
    per_size: dict[str, Any] = {}
    for size in dict.fromkeys(r.size for r in records):
        group = [r for r in records if r.size == size]
        steps = sorted({r.num_inference_steps for r in group})
        per_size[size] = {
            **latency_stats([r.latency_s for r in group if r.ok]),
            "num_failed": sum(not r.ok for r in group),
            "num_inference_steps": steps,
            "alone_s": [lookup_alone(alone, size, n) for n in steps],
            "slo_attainment": slo_attainment(group, alone, slo_scale),
        }
    return {
        "num_requests": len(records),
        "num_completed": len(done),
        "num_failed": len(records) - len(done),
        "duration_s": duration_s,
        "throughput_req_s": len(done) / duration_s if duration_s > 0 else None,
        "throughput_img_s": sum(r.num_images for r in done) / duration_s if duration_s > 0 else None,
        "latency": latency_stats([r.latency_s for r in done]),
        "slo_scale": slo_scale,
        "slo_attainment": slo_attainment(records, alone, slo_scale),
        "per_resolution": per_size,
    }


# ---- client -------------------------------------------------------------------------------------


def extra_body(args: argparse.Namespace, steps: int, seed: int) -> dict[str, Any]:
    """Our extension fields of one request."""
    body: dict[str, Any] = {"num_inference_steps": steps, "seed": seed}
    if args.negative_prompt is not None:
        body["negative_prompt"] = args.negative_prompt
    if args.true_cfg_scale is not None:
        body["true_cfg_scale"] = float(args.true_cfg_scale)
    if args.extra_args:
        body["extra_args"] = json.loads(args.extra_args)
    return body


class ImagesClient:
    """`POST /v1/images/generations`, n=1, b64_json, through one of two clients:

    httpx   (default; needs only httpx) the JSON body carries the extension fields in an
            `extra_body` object, which the server merges (as vLLM-Omni's server does)
    openai  the OpenAI Python SDK's `images.generate(..., extra_body=...)`, which merges the
            extension fields into the top level of the body
    """

    def __init__(self, args: argparse.Namespace):
        self.args = args
        base = args.base_url.rstrip("/")
        self.base = base if base.endswith("/v1") else f"{base}/v1"
        if args.client == "openai":
            from openai import AsyncOpenAI

            self.sdk = AsyncOpenAI(
                base_url=self.base, api_key=args.api_key or "EMPTY", max_retries=0, timeout=args.timeout
            )
        else:
            import httpx

            headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
            self.http = httpx.AsyncClient(headers=headers, timeout=args.timeout, limits=limits)

    async def generate(self, index: int, size: ImageSize, steps: int) -> tuple[int, dict | None]:
        """One request; returns (number of images, the server's `timings` or None). Raises on failure."""
        args = self.args
        fields: dict[str, Any] = {"prompt": DEFAULT_PROMPTS[index % len(DEFAULT_PROMPTS)], "size": size.label}
        fields.update(n=1, response_format="b64_json", **({"model": args.model} if args.model else {}))
        extra = extra_body(args, steps, args.seed + index)
        if args.client == "openai":
            response = await self.sdk.images.generate(**fields, extra_body=extra)
            return len(response.data or []), response.model_dump().get("timings")
        response = await self.http.post(
            f"{self.base}/images/generations", json={**fields, "extra_body": extra}
        )
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:500]}")
        body = response.json()
        return len(body.get("data") or []), body.get("timings")

    async def close(self) -> None:
        await (self.sdk.close() if self.args.client == "openai" else self.http.aclose())


async def run_items(client, items: list[WorkItem], args: argparse.Namespace, bar) -> tuple[list, float]:
    """Send `items` at their arrival times under the concurrency cap; (records, duration)."""
    semaphore = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    start = time.perf_counter()

    async def one(item: WorkItem) -> RequestRecord:
        await asyncio.sleep(max(0.0, item.arrival_s - (time.perf_counter() - start)))
        async with semaphore if semaphore is not None else contextlib.nullcontext():
            sent = time.perf_counter() - start
            try:
                num_images, timings = await client.generate(item.index, item.size, item.num_inference_steps)
                error = None
            except Exception as exc:  # record every failure; the run goes on
                num_images, timings, error = 0, None, f"{type(exc).__name__}: {exc}"
        end = time.perf_counter() - start
        record = RequestRecord(
            item.index,
            item.size.label,
            item.num_inference_steps,
            item.arrival_s,
            sent,
            end,
            error is None,
            num_images,
            error,
            timings,
        )
        bar.update(1)
        return record

    records = await asyncio.gather(*(one(item) for item in items))
    return list(records), time.perf_counter() - start


async def measure_alone(client, items: list[WorkItem], args: argparse.Namespace, bar) -> dict[str, float]:
    """Latency of one request of each distinct (size, steps), each sent alone, one after another."""
    firsts: dict[str, WorkItem] = {}
    for item in items:
        firsts.setdefault(item.key, item)
    alone: dict[str, float] = {}
    for item in firsts.values():
        start = time.perf_counter()
        try:
            await client.generate(item.index, item.size, item.num_inference_steps)
            alone[item.key] = time.perf_counter() - start
        except Exception as exc:  # no alone time: its requests are left out of the SLO numbers
            print(f"alone request {item.key} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        bar.update(1)
    return alone


async def run_benchmark(args: argparse.Namespace, items: list[WorkItem], alone: dict[str, float]) -> dict:
    client = ImagesClient(args)
    keys = {i.key for i in items}
    total = len(items) + args.num_warmups + (len(keys) if args.measure_alone else 0)
    try:
        with progress(total, "serving", args.no_progress) as bar:
            smallest = min(items, key=lambda i: i.size.num_img_tokens)
            for _ in range(args.num_warmups):
                await client.generate(0, smallest.size, args.warmup_steps)
                bar.update(1)
            if args.measure_alone:
                alone = {**alone, **await measure_alone(client, items, args, bar)}
            records, duration = await run_items(client, items, args, bar)
    finally:
        await client.close()
    return {"alone_times": alone, "records": records, "duration_s": duration}


# ---- output -------------------------------------------------------------------------------------

TABLE_COLUMNS = [
    Column("resolution", "resolution"),
    Column("count", "done"),
    Column("num_failed", "failed"),
    Column("mean_s", "mean s", ".2f"),
    Column("p50_s", "p50 s", ".2f"),
    Column("p90_s", "p90 s", ".2f"),
    Column("p99_s", "p99 s", ".2f"),
    Column("alone", "alone s"),
    Column("slo_pct", "SLO %", ".1f"),
]


def table_rows(summary: dict) -> list[dict]:
    rows = []
    for size, stats in summary["per_resolution"].items():
        alone = ",".join(f"{a:.2f}" for a in stats["alone_s"] if a is not None) or None
        slo = stats["slo_attainment"]
        rows.append(
            {**stats, "resolution": size, "alone": alone, "slo_pct": None if slo is None else 100 * slo}
        )
    slo = summary["slo_attainment"]
    rows.append(
        {
            **summary["latency"],
            "resolution": "all",
            "num_failed": summary["num_failed"],
            "slo_pct": None if slo is None else 100 * slo,
        }
    )
    return rows


def plot_latencies(
    path: str, records: list[RequestRecord], alone: dict[str, float], slo_scale: float
) -> Path:
    """Latency vs arrival time, one colour per resolution, dashed SLO line per resolution."""
    plt = get_pyplot()
    path_obj = Path(path)
    path_obj.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(9, 5))
    for k, size in enumerate(dict.fromkeys(r.size for r in records)):
        group = [r for r in records if r.size == size]
        ok = [r for r in group if r.ok]
        ax.scatter([r.arrival_s for r in ok], [r.latency_s for r in ok], s=16, color=f"C{k}", label=size)
        failed = [r for r in group if not r.ok]
        if failed:
            ax.scatter(
                [r.arrival_s for r in failed], [r.latency_s for r in failed], marker="x", color=f"C{k}"
            )
        for steps in sorted({r.num_inference_steps for r in group}):
            base = lookup_alone(alone, size, steps)
            if base is not None:
                ax.axhline(slo_scale * base, color=f"C{k}", linestyle="--", linewidth=0.8)
    ax.set_xlabel("arrival time (s)")
    ax.set_ylabel("latency (s)")
    ax.set_title(f"latency per request (dashed: SLO = {slo_scale:g} x alone time; x: failed)")
    ax.grid(alpha=0.3)
    ax.legend(title="resolution", fontsize=8)
    fig.tight_layout()
    fig.savefig(path_obj, dpi=120)
    plt.close(fig)
    return path_obj


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (…/v1 is appended)")
    p.add_argument("--model", default=None, help="model name to send (default: none, the server's)")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--client", choices=("httpx", "openai"), default="httpx", help="see ImagesClient")
    p.add_argument("--timeout", type=float, default=3600.0, help="per-request timeout, seconds")
    p.add_argument("--max-concurrency", type=int, default=None, help="client-side cap on requests in flight")
    p.add_argument("--arrival", choices=ARRIVALS, default="burst")
    p.add_argument("--interval", type=float, default=None, help="staggered: seconds between arrivals")
    p.add_argument("--rate", type=float, default=None, help="poisson: mean requests per second")
    p.add_argument(
        "--sizes", default=None, help="fixed list WxH,... (default 1024x1024,1024x768,768x1024,512x512)"
    )
    p.add_argument("--repeat", type=int, default=1, help="repeat the --sizes list this many times, in order")
    p.add_argument("--profile", default=None, help=f"weighted workload: {sorted(PROFILES)}")
    p.add_argument("--num-requests", type=int, default=None, help="profile: requests to draw; sizes: cut")
    p.add_argument("--seed", type=int, default=0, help="workload draws, Poisson gaps, request seeds")
    p.add_argument("--steps", type=int, default=50, help="denoise steps of --sizes requests")
    p.add_argument("--true-cfg-scale", type=float, default=None)
    p.add_argument("--negative-prompt", default=None)
    p.add_argument(
        "--extra-args", default=None, help='JSON object sent as extra_args, e.g. {"enable_mixfusion": false}'
    )
    p.add_argument("--num-warmups", type=int, default=1, help="unmeasured requests first (smallest size)")
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--measure-alone", action="store_true", help="measure each (size, steps) alone first")
    p.add_argument("--alone-times", default=None, help="JSON object or file: WxH[@steps] -> seconds")
    p.add_argument("--slo-scale", type=float, default=3.0, help="SLO = this x the alone time")
    add_output_args(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; print the table, write JSON / plot when asked, return the JSON payload."""
    args = parse_args(argv)
    workload = build_workload(args.sizes, args.repeat, args.profile, args.num_requests, args.steps, args.seed)
    items = make_items(
        workload, arrival_times(len(workload), args.arrival, args.interval, args.rate, args.seed)
    )
    alone = parse_alone_times(args.alone_times) if args.alone_times else {}
    if args.max_concurrency is not None:
        positive_int("--max-concurrency", args.max_concurrency)
    positive_int("--num-warmups", args.num_warmups, 0)
    positive_int("--warmup-steps", args.warmup_steps)
    if args.extra_args is not None and not isinstance(json.loads(args.extra_args), dict):
        raise ValueError("--extra-args must be a JSON object")
    if args.slo_scale <= 0:
        raise ValueError(f"--slo-scale must be > 0, got {args.slo_scale}")

    run = asyncio.run(run_benchmark(args, items, alone))
    summary = summarize(run["records"], run["duration_s"], run["alone_times"], args.slo_scale)
    print(format_table(table_rows(summary), TABLE_COLUMNS))
    print(
        f"duration {summary['duration_s']:.2f} s, {summary['num_completed']}/{summary['num_requests']} done, "
        f"{summary['throughput_req_s'] or 0:.3f} req/s, {summary['throughput_img_s'] or 0:.3f} images/s"
    )
    payload = {
        "benchmark": "serving_benchmark",
        "env": environment_info(),
        "config": vars(args),
        "alone_times": run["alone_times"],
        "summary": summary,
        "requests": [{**asdict(r), "latency_s": r.latency_s} for r in run["records"]],
    }
    if args.json_output:
        print(f"wrote {write_json(args.json_output, payload)}", file=sys.stderr)
    if args.plot:
        print(
            f"wrote {plot_latencies(args.plot, run['records'], run['alone_times'], args.slo_scale)}",
            file=sys.stderr,
        )
    return payload


if __name__ == "__main__":
    main()

"""Where one engine step's wall time goes on the GPU: busy, idle gaps, and what the host did in them.

    python benchmarks/diffusion/step_timeline.py --model Qwen/Qwen-Image --load-format dummy \
        --mixes "1024x1024;512x512+1024x1024" --negative-prompt " " --json-output timeline.json
    python benchmarks/diffusion/step_timeline.py --model Qwen/Qwen-Image --load-format dummy \
        --request-mode --mixes 256x256 --cfg-modes off --json-output timeline.json

For every mix (CFG on unless `--cfg-modes off`) one denoise-only step runs under `torch.profiler` and is
cut into: the host work before the first kernel, the GPU busy time (the union of kernel intervals),
the idle gaps (the largest with the kernels around them and the CUDA runtime calls the host made
meanwhile), the tail after the last kernel, and the runner's `_forward` host range. The next step runs
under `torch.cuda.set_sync_debug_mode("warn")`: every synchronizing call is reported with the frames
of this package that made it. `--request-mode` profiles a whole request as request mode runs it (text
encoder, every step, decode) and charges each idle gap to the runner phase (`_encode`, `_denoise`,
`_finish`) whose host work ended it. docs/benchmarks.md has the details.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make `benchmarks.diffusion` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.diffusion.common import (  # noqa: E402
    Column,
    add_mix_args,
    add_output_args,
    environment_info,
    format_table,
    mixes_from_args,
    resolve_cfg_modes,
    sync,
    write_json,
)
from benchmarks.diffusion.kernel_profile import category  # noqa: E402
from benchmarks.diffusion.step_batching_benefit import build_engine, make_requests  # noqa: E402

GAP_BINS_US = (2, 10, 50, 200)
"""Gap-size bins (microseconds): [0, 2), [2, 10), ... [200, inf)."""


def merge_intervals(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, non-overlapping union of (start, end) intervals."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def gap_bin(us: float) -> str:
    lower = 0
    for upper in GAP_BINS_US:
        if us < upper:
            return f"{lower}-{upper} us"
        lower = upper
    return f">= {lower} us"


PHASES = ("runner._encode", "runner._denoise", "runner._finish")
"""The runner's phases every profile marks (`timed_ranges`; a denoise-only step has no `_encode`)."""


def analyse(prof, top_gaps: int = 12) -> dict[str, Any]:
    """Cut the profiled step (the `engine.step` range) into before / busy / gaps / after."""
    import torch

    cuda_type = torch.autograd.DeviceType.CUDA
    ranges = ("engine.step", "runner._forward", *PHASES)
    events = list(prof.events())
    host = [e for e in events if e.device_type != cuda_type]
    step = next(e for e in host if e.name == "engine.step")
    forward = [e for e in host if e.name == "runner._forward"]
    # GPU work only: kernels, copies, memsets (not the GPU-side copies of the annotated ranges)
    kernels = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in events
        if e.device_type == cuda_type and not getattr(e, "is_user_annotation", False) and e.name not in ranges
    )
    runtime = [
        e for e in events if e.device_type != cuda_type and e.name.startswith(("cuda", "cu")) and e.cpu_parent
    ]
    host_ops = [e for e in events if e.device_type != cuda_type and e.name.startswith("aten::")]
    busy = merge_intervals([(s, e) for s, e, _ in kernels])
    t0, t1 = step.time_range.start, step.time_range.end
    if not busy:  # CPU run: no device timeline, the whole step is host time
        busy = [(t1, t1)]
    result: dict[str, Any] = {
        "step_ms": (t1 - t0) / 1e3,
        "before_ms": (busy[0][0] - t0) / 1e3,
        "busy_ms": sum(e - s for s, e in busy) / 1e3,
        "after_ms": (t1 - busy[-1][1]) / 1e3,
        "forward_host_ms": sum(f.time_range.elapsed_us() for f in forward) / 1e3,
        "num_kernels": len(kernels),
    }
    by_cat: Counter = Counter()
    for s, e, name in kernels:
        by_cat[category(name)] += (e - s) / 1e3
    result["kernel_ms_by_category"] = dict(by_cat)
    # the kernel ending each busy interval / starting the next (names for the gap table)
    ends = {e: name for _, e, name in kernels}
    starts = {s: name for s, e, name in reversed(kernels)}
    gaps = []
    for (_, end), (start, _) in zip(busy, busy[1:]):
        gaps.append((start - end, end, start))
    hist: Counter = Counter()
    hist_n: Counter = Counter()
    for us, _, _ in gaps:
        hist[gap_bin(us)] += us / 1e3
        hist_n[gap_bin(us)] += 1
    result["gap_ms"] = sum(us for us, _, _ in gaps) / 1e3
    result["gap_ms_by_size"] = {k: {"ms": hist[k], "count": hist_n[k]} for k in hist}
    largest = []
    for us, end, start in sorted(gaps, reverse=True)[:top_gaps]:
        during = Counter(r.name for r in runtime if r.time_range.start < start and r.time_range.end > end)
        ops = sorted(
            (o for o in host_ops if o.time_range.start < start and o.time_range.end > end),
            key=lambda o: o.time_range.elapsed_us(),
        )
        largest.append(
            {
                "gap_us": us,
                "at_ms": (end - t0) / 1e3,
                "after_kernel": ends.get(end, "?")[:70],
                "before_kernel": starts.get(start, "?")[:70],
                "runtime_calls": dict(during.most_common(4)),
                "host_ops": [o.name for o in ops[:3]],
            }
        )
    result["largest_gaps"] = largest
    result["phases"] = phase_table([e for e in host if e.name in PHASES], gaps, t0)
    return result


def phase_table(phases: list, gaps: list[tuple[float, float, float]], t0: float) -> list[dict[str, Any]]:
    """Per marked phase: how often it ran, its host time, and the idle GPU time of the gaps that ended
    while the host was inside it (the next kernel was waiting for that phase's host work); gaps that
    ended outside every phase go to "(none)". Gaps are (us, end of the busy interval, next start)."""

    def row_of(name: str, first_at_ms: float | None) -> dict[str, Any]:
        return {"phase": name, "count": 0, "host_ms": 0.0, "idle_gpu_ms": 0.0, "first_at_ms": first_at_ms}

    rows: dict[str, dict[str, Any]] = {}
    for event in phases:
        row = rows.setdefault(event.name, row_of(event.name, (event.time_range.start - t0) / 1e3))
        row["count"] += 1
        row["host_ms"] += event.time_range.elapsed_us() / 1e3
    outside = row_of("(none)", None)
    for us, _, start in gaps:
        inside = [e for e in phases if e.time_range.start <= start <= e.time_range.end]
        row = rows[min(inside, key=lambda e: e.time_range.elapsed_us()).name] if inside else outside
        row["idle_gpu_ms"] += us / 1e3
    return [*rows.values(), outside]


class SyncRecorder:
    """Collects the synchronizing CUDA calls of a block of code (sync debug mode "warn") with the
    frames of `vllm_omni` that issued them."""

    def __init__(self):
        self.sites: Counter = Counter()

    def _show(self, message, category_, filename, lineno, file=None, line=None):
        frames = [
            f"{Path(f.filename).name}:{f.lineno} {f.name}"
            for f in traceback.extract_stack()
            if "vllm_omni" in f.filename
        ]
        self.sites[(str(message).split("\n")[0][:80], " <- ".join(reversed(frames[-4:])))] += 1

    def run(self, fn):
        import torch

        with warnings.catch_warnings():
            warnings.simplefilter("always")
            shown, warnings.showwarning = warnings.showwarning, self._show
            torch.cuda.set_sync_debug_mode("warn")
            try:
                return fn()
            finally:
                torch.cuda.set_sync_debug_mode("default")
                warnings.showwarning = shown


def timed_ranges(engine, names=("_forward",)) -> None:
    """Wrap each named method of the model runner in a profiler range `runner.<name>`."""
    import torch

    runner = engine.executor.driver_worker.runner

    def wrap(name):
        inner = getattr(runner, name)

        def method(*args, **kwargs):
            with torch.profiler.record_function(f"runner.{name}"):
                return inner(*args, **kwargs)

        setattr(runner, name, method)

    for name in names:
        wrap(name)


def profiled_step(engine, device):
    """One `engine.step()` inside the `engine.step` range that `analyse` cuts, its GPU work finished."""
    import torch

    with torch.profiler.record_function("engine.step"):
        stats = engine.step()
        sync(device)
    return stats


def measure(mix, device, profiled: Callable[[], Any], sync_checked: Callable[[], Any]) -> dict[str, Any]:
    """`profiled()` (returning the profiled step's stats) under the profiler, cut by `analyse`; then
    `sync_checked()` under the sync check (CUDA only)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        stats = profiled()
        wall_ms = (time.perf_counter() - start) * 1e3
    path = getattr(stats.path, "value", stats.path)
    entry = {"mix": mix.name, "num_reqs": stats.num_reqs, "path": path, "wall_ms": wall_ms}
    entry.update(analyse(prof))
    recorder = SyncRecorder()
    if device.type == "cuda":
        recorder.run(sync_checked)
        sync(device)
    entry["syncs"] = [{"call": c, "where": w, "count": n} for (c, w), n in recorder.sites.most_common()]
    return entry


def profile_mix(engine, mix, cfg, args, device) -> dict[str, Any]:
    """Step the mix to its steady state, profile one denoise-only step, sync-check the next."""
    futures = [engine.add_request(r) for r in make_requests(mix, cfg, args, f"timeline-{mix.name}")]
    for _ in range(args.warm_steps):
        engine.step()
    sync(device)
    entry = measure(mix, device, lambda: profiled_step(engine, device), engine.step)
    while not all(f.future.done() for f in futures):
        engine.step()
    for f in futures:
        f.future.result()
    return entry


def profile_request(engine, mix, cfg, args, device) -> dict[str, Any]:
    """Request mode: one warm-up request, then one whole request profiled, then one sync-checked."""

    def run(tag: str, step):
        (request,) = make_requests(mix, cfg, args, f"timeline-{mix.name}-{tag}")
        future = engine.add_request(request).future
        stats = step()
        while not future.done():  # a request-mode step finishes its request; loop for safety
            engine.step()
        future.result()
        return stats

    run("warm", engine.step)
    sync(device)

    def profiled():
        return run("profiled", lambda: profiled_step(engine, device))

    return measure(mix, device, profiled, lambda: run("sync-check", engine.step))


def print_entry(entry: dict[str, Any]) -> None:
    print(
        f"\n== {entry['mix']} ({entry['num_reqs']} reqs, {entry['path']}): step {entry['step_ms']:.1f} ms"
        f" = before {entry['before_ms']:.2f} + busy {entry['busy_ms']:.1f} + gaps {entry['gap_ms']:.2f}"
        f" + after {entry['after_ms']:.2f}; forward (host range) {entry['forward_host_ms']:.1f} ms,"
        f" {entry['num_kernels']} kernels"
    )
    print("   kernels by category (ms):", {k: round(v, 2) for k, v in entry["kernel_ms_by_category"].items()})
    gaps = {k: (round(v["ms"], 2), v["count"]) for k, v in entry["gap_ms_by_size"].items()}
    print("   gaps by size (ms, count):", gaps)
    print(
        format_table(
            entry["largest_gaps"],
            [
                Column("gap_us", "gap us", ".0f"),
                Column("at_ms", "at ms", ".2f"),
                Column("after_kernel", "after"),
                Column("before_kernel", "before"),
                Column("runtime_calls", "runtime calls"),
                Column("host_ops", "host ops"),
            ],
        )
    )
    if len(entry["phases"]) > 1:  # the runner's phases that ran in the profiled step
        columns = [Column("phase", "phase"), Column("count", "count"), Column("host_ms", "host ms", ".2f")]
        columns.append(Column("idle_gpu_ms", "idle GPU ms (gaps ending in it)", ".2f"))
        print(format_table(entry["phases"], columns))
    print("   synchronizing calls in the next step (request mode: request):", entry["syncs"] or "none")


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny-qwen-image")
    parser.add_argument("--load-format", choices=("auto", "dummy"), default="auto")
    add_mix_args(parser, default_mixes="1024x1024;512x512+1024x1024")
    parser.add_argument("--steps", type=int, default=8, help="denoise steps per request")
    parser.add_argument("--warm-steps", type=int, default=3, help="steps before the profiled one")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--attention-backend", default=None)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--output-type", choices=("np", "latent"), default="latent")
    parser.add_argument(
        "--quantization", default=None, help="the transformer's linears: fp8, or a quantization config's JSON"
    )
    parser.add_argument(
        "--request-mode",
        action="store_true",
        help="profile whole requests, one at a time, as `vllm serve` without --step-execution runs them "
        "(each mix one size; --output-type np to include the decode's copy to the host)",
    )
    add_output_args(parser)
    args = parser.parse_args(argv)
    args.enable_mixfusion, args.batch_invariant = True, None
    args.mixfusion_min_chunk_tokens = args.mixfusion_max_chunks = None
    if not args.request_mode and args.steps < args.warm_steps + 3:
        parser.error("--steps must leave the profiled step, a sync-checked one and the decode")
    return args


def main(argv=None) -> dict[str, Any]:
    args = parse_args(argv)
    mixes = mixes_from_args(args, "1024x1024;512x512+1024x1024")
    cfg_modes = resolve_cfg_modes(args.cfg_modes or "on", args.true_cfg_scale, args.negative_prompt)
    if len(cfg_modes) != 1:
        raise SystemExit(f"--cfg-modes: one mode, got {args.cfg_modes!r}")
    (cfg,) = cfg_modes
    if args.request_mode and any(len(m) != 1 for m in mixes):
        raise SystemExit("--request-mode: every mix is one size (request mode runs one request at a time)")
    engine = build_engine(args, max(len(m) for m in mixes), request_mode=args.request_mode)
    device = engine.executor.driver_worker.device
    timed_ranges(engine, ("_forward", *(p.removeprefix("runner.") for p in PHASES)))
    entries = []
    for mix in mixes:
        profiler = profile_request if args.request_mode else profile_mix
        entries.append(profiler(engine, mix, cfg, args, device))
        print_entry(entries[-1])
    columns = [Column("mix", "mix"), Column("path", "path")] + [
        Column(k, k.replace("_", " "), ".2f")
        for k in ("step_ms", "before_ms", "busy_ms", "gap_ms", "after_ms", "forward_host_ms")
    ]
    print(format_table(entries, columns))
    payload = {"benchmark": "step_timeline", "env": environment_info(device), "args": vars(args)}
    payload["results"] = entries
    if args.json_output:
        write_json(args.json_output, payload)
    engine.shutdown()
    return payload


if __name__ == "__main__":
    main()

"""Where one engine step's wall time goes on the GPU: busy, idle gaps, and what the host did in them.

    python benchmarks/diffusion/step_timeline.py --model Qwen/Qwen-Image --load-format dummy \
        --mixes "1024x1024;512x512+1024x1024" --negative-prompt " " --json-output timeline.json

For every mix (CFG on), its requests are submitted together and stepped; one denoise-only step
(not the first, which encodes, nor one that decodes) runs under `torch.profiler` (CPU and CUDA
activity) and is cut into:

    before    step start -> the first GPU kernel: host work the GPU waits for (scheduler, plan,
              inputs); the engine syncs with the host at the end of every step, so this is exposed
    busy      the union of the step's kernel intervals
    gaps      idle GPU time between the first and the last kernel, by gap size; the largest gaps
              name the kernels around them and the CUDA runtime calls the host made meanwhile (a
              `cudaStreamSynchronize` or a device-to-host copy there means the host waited on the GPU)
    after     the last kernel -> step end (output handling after the GPU finished)
    forward   the runner's `_forward` (its host range): the part of the step that is the transformer

The next step then runs with `torch.cuda.set_sync_debug_mode("warn")`, and every synchronizing call
is reported once with the Python frames of this package that made it.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
import warnings
from collections import Counter
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
from benchmarks.diffusion.forward_profile import category  # noqa: E402
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


def analyse(prof, top_gaps: int = 12) -> dict[str, Any]:
    """Cut the profiled step (the `engine.step` range) into before / busy / gaps / after."""
    import torch

    cuda_type = torch.autograd.DeviceType.CUDA
    ranges = ("engine.step", "runner._forward")
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
    return result


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


def timed_forward_ranges(engine) -> None:
    """Wrap the model runner's `_forward` in a profiler range named `runner._forward`."""
    import torch

    runner = engine.executor.driver_worker.runner
    inner = runner._forward

    def forward(*args, **kwargs):
        with torch.profiler.record_function("runner._forward"):
            return inner(*args, **kwargs)

    runner._forward = forward


def profile_mix(engine, mix, cfg, args, device) -> dict[str, Any]:
    """Step the mix to its steady state, profile one denoise-only step, sync-check the next."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    futures = [engine.add_request(r) for r in make_requests(mix, cfg, args, f"timeline-{mix.name}")]
    for _ in range(args.warm_steps):
        engine.step()
    sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        with torch.profiler.record_function("engine.step"):
            stats = engine.step()
            sync(device)
        wall_ms = (time.perf_counter() - start) * 1e3
    path = getattr(stats.path, "value", stats.path)
    entry = {"mix": mix.name, "num_reqs": stats.num_reqs, "path": path, "wall_ms": wall_ms}
    entry.update(analyse(prof))
    recorder = SyncRecorder()
    if device.type == "cuda":
        recorder.run(engine.step)
        sync(device)
    entry["syncs"] = [{"call": c, "where": w, "count": n} for (c, w), n in recorder.sites.most_common()]
    while not all(f.future.done() for f in futures):
        engine.step()
    for f in futures:
        f.future.result()
    return entry


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
    print("   synchronizing calls in the next step:", entry["syncs"] or "none")


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
    add_output_args(parser)
    args = parser.parse_args(argv)
    args.enable_mixfusion, args.batch_invariant = True, None
    args.mixfusion_min_chunk_tokens = args.mixfusion_max_chunks = None
    if args.steps < args.warm_steps + 3:
        parser.error("--steps must leave the profiled step, a sync-checked one and the decode")
    return args


def main(argv=None) -> dict[str, Any]:
    args = parse_args(argv)
    mixes = mixes_from_args(args, "1024x1024;512x512+1024x1024")
    (cfg,) = resolve_cfg_modes("on", args.true_cfg_scale, args.negative_prompt)
    engine = build_engine(args, max(len(m) for m in mixes))
    device = engine.executor.driver_worker.device
    timed_forward_ranges(engine)
    entries = []
    for mix in mixes:
        entries.append(profile_mix(engine, mix, cfg, args, device))
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

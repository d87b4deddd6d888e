"""What the kernel-profile benchmarks share (`lora_profile.py`, `step_profile.py`): one request under
`torch.profiler` then a few without it, its kernels summed by name, two runs compared kernel by kernel.

On CUDA the profile holds the device kernels of every thread (the engine's loop runs in its own) and
kernels launched from CUDA graphs one by one; on CPU (a smoke run) only the calling thread's ops, by
CPU time.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

from benchmarks.diffusion.common import environment_info, parse_size, write_json

CATEGORIES = (
    ("triton (fused)", ("triton",)),
    ("attention", ("flash", "fmha", "attn", "cudnn")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "sm90", "cublas")),
    ("copy/index", ("index", "copy", "cat", "gather", "scatter", "stack")),
)
"""A kernel's category by the first needle its lower-cased name contains; the rest is elementwise."""


def category(kernel: str) -> str:
    name = kernel.lower()
    for cat, needles in CATEGORIES:
        if any(n in name for n in needles):
            return cat
    return "other elementwise"


def kernel_times(prof, on_cuda: bool) -> dict[str, dict[str, float]]:
    """Kernels of a profile by name: {"calls", "ms"}."""
    import torch

    device_type = torch.autograd.DeviceType.CUDA if on_cuda else torch.autograd.DeviceType.CPU
    out: dict[str, dict[str, float]] = {}
    for event in prof.events():
        if event.device_type != device_type:
            continue
        entry = out.setdefault(event.name, {"calls": 0, "ms": 0.0})
        entry["calls"] += 1
        entry["ms"] += (event.device_time if on_cuda else event.self_cpu_time_total) / 1e3  # us -> ms
    return out


def profile_request(request: Callable[[], None], on_cuda: bool, timed: int) -> dict[str, Any]:
    """`request()` once under the profiler (its wall time and kernels), then `timed` times without it
    (their median: the request's time with the profiler's own overhead left out)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        request()
        if on_cuda:
            torch.cuda.synchronize()
    wall_s = time.perf_counter() - start
    kernels = kernel_times(prof, on_cuda)
    times = []
    for _ in range(timed):
        start = time.perf_counter()
        request()
        times.append(time.perf_counter() - start)
    return {
        "median_s": statistics.median(times) if times else None,
        "timed_s": times,
        "wall_s": wall_s,
        "num_kernels": sum(int(k["calls"]) for k in kernels.values()),
        "kernel_ms": sum(k["ms"] for k in kernels.values()),
        "kernels": kernels,
    }


def compare(before: dict[str, Any], after: dict[str, Any], top: int) -> list[dict[str, Any]]:
    """Kernel names of two runs by how much their device time changed (largest change first)."""
    rows = []
    for name in set(before["kernels"]) | set(after["kernels"]):
        b = before["kernels"].get(name, {"calls": 0, "ms": 0.0})
        a = after["kernels"].get(name, {"calls": 0, "ms": 0.0})
        rows.append(
            {
                "kernel": name,
                "calls_before": int(b["calls"]),
                "calls_after": int(a["calls"]),
                "ms_before": b["ms"],
                "ms_after": a["ms"],
                "delta_ms": a["ms"] - b["ms"],
            }
        )
    rows.sort(key=lambda r: abs(r["delta_ms"]), reverse=True)
    return rows[:top]


def print_changed(rows: list[dict[str, Any]], classify: Callable[[str], str] | None = None) -> None:
    """`compare`'s rows as a markdown table (with a class column when `classify` is given)."""
    cls = "class | " if classify else ""
    print(f"| kernel | {cls}calls before | calls after | ms before | ms after | delta ms |")
    print("|---|" + ("---|" if classify else "") + "---|---|---|---|---|")
    for r in rows:
        cell = f"{classify(r['kernel'])} | " if classify else ""
        print(
            f"| {r['kernel'][:90]} | {cell}{r['calls_before']} | {r['calls_after']} | {r['ms_before']:.2f} "
            f"| {r['ms_after']:.2f} | {r['delta_ms']:+.2f} |"
        )


def request_parser(
    doc: str, size: str, steps: int, warmup: int, timed: int, top: int
) -> argparse.ArgumentParser:
    """The options both profile scripts take (their own defaults); `parse_request_args` reads them."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--model", default="Qwen/Qwen-Image", help="real size (default) or tiny-qwen-image")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--size", default=size, help="WxH of the profiled request")
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--warmup", type=int, default=warmup, help="untimed requests before each profile")
    parser.add_argument("--timed", type=int, default=timed, help="unprofiled requests after it (the median)")
    parser.add_argument("--top", type=int, default=top, help="kernel names listed")
    parser.add_argument("--json-output", default=None)
    return parser


def parse_request_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    args = parser.parse_args(argv)
    size = parse_size(args.size, "--size")
    args.width, args.height = size.width, size.height
    return args


def write_payload(
    args: argparse.Namespace, runs: dict[str, dict[str, Any]], rows: list[dict[str, Any]], **extra: Any
) -> dict[str, Any]:
    """{args, env, `extra`, runs (without their kernels), changed_kernels, kernels}, written to
    `args.json_output` when set; returned."""
    result = {
        "args": dict(vars(args)),
        "env": environment_info(),
        **extra,
        "runs": {k: {m: v for m, v in r.items() if m != "kernels"} for k, r in runs.items()},
        "changed_kernels": rows,
        "kernels": {k: r["kernels"] for k, r in runs.items()},
    }
    if args.json_output:
        write_json(args.json_output, result)
    return result

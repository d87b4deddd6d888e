"""Where an adapter's time goes: the device kernels of one request with and without a LoRA adapter.

    python benchmarks/diffusion/lora_profile.py --json-output $OUT/lora_profile.json     # H200, real size
    python benchmarks/diffusion/lora_profile.py --model tiny-qwen-image --device cpu --size 64x64  # smoke

Issue 27's serving table says what an adapter costs a request (`lora_serving_benchmark.py`); this says
where: the engine as `vllm serve --max-num-seqs 1` builds it (request mode, CUDA graphs, random
real-size weights, a random rank-`--rank` adapter on every attention and MLP linear), one request of
`--size` at `--steps` steps, CFG off, under `torch.profiler` once without and once with the adapter
(after `--warmup` untimed requests of each). Kernels launched from CUDA graphs are recorded one by one.
Per kernel name: calls and device time in each run, and the difference; the table lists the names whose
time changed most, so the adapter's own kernels (shrink / expand) and the base kernels it changes
(a fused path it turns off) both show.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make `benchmarks.diffusion` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.diffusion.common import environment_info, write_json  # noqa: E402
from benchmarks.diffusion.lora_serving_benchmark import write_adapter  # noqa: E402

ADAPTER = "profiled"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="Qwen/Qwen-Image", help="real size (default) or tiny-qwen-image")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--size", default="256x256", help="WxH of the profiled request")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--std", type=float, default=0.02, help="the random adapter's weight std")
    parser.add_argument("--warmup", type=int, default=2, help="untimed requests before each profile")
    parser.add_argument("--top", type=int, default=25, help="kernel names listed")
    parser.add_argument(
        "--timed", type=int, default=5, help="requests timed after each profile, no profiler (the median)"
    )
    parser.add_argument("--json-output", default=None)
    args = parser.parse_args(argv)
    width, _, height = args.size.partition("x")
    args.width, args.height = int(width), int(height)
    return args


def kernel_times(prof, on_cuda: bool) -> dict[str, dict[str, float]]:
    """Kernels of a profile by name: {"calls", "ms"}. On CUDA the device kernels of every thread (the
    engine's loop runs in its own); on CPU (a smoke run) only the calling thread's ops, by CPU time."""
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


def profile_request(omni, args: argparse.Namespace, lora: bool) -> dict[str, Any]:
    """`--warmup` requests, then one under the profiler (its wall time and its kernels), then `--timed`
    requests without it (their median: what the adapter costs, the profiler's own overhead left out)."""
    import statistics

    import torch
    from torch.profiler import ProfilerActivity, profile

    from vllm_omni.lora.request import LoRARequest

    kwargs: dict[str, Any] = dict(
        height=args.height, width=args.width, num_inference_steps=args.steps, true_cfg_scale=1.0, seed=0
    )
    if lora:
        kwargs["lora_request"] = LoRARequest(ADAPTER)
    for _ in range(args.warmup):
        omni.generate("a red apple on a wooden table", use_tqdm=False, **kwargs)
    on_cuda = args.device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        omni.generate("a red apple on a wooden table", use_tqdm=False, **kwargs)
        if on_cuda:
            torch.cuda.synchronize()
    wall_s = time.perf_counter() - start
    kernels = kernel_times(prof, on_cuda)
    timed = []
    for _ in range(args.timed):
        start = time.perf_counter()
        omni.generate("a red apple on a wooden table", use_tqdm=False, **kwargs)
        timed.append(time.perf_counter() - start)
    return {
        "median_s": statistics.median(timed) if timed else None,
        "timed_s": timed,
        "wall_s": wall_s,
        "num_kernels": sum(int(k["calls"]) for k in kernels.values()),
        "kernel_ms": sum(k["ms"] for k in kernels.values()),
        "kernels": kernels,
    }


def compare(base: dict[str, Any], adapter: dict[str, Any], top: int) -> list[dict[str, Any]]:
    """Kernel names by how much their device time changed with the adapter (largest change first)."""
    rows = []
    for name in set(base["kernels"]) | set(adapter["kernels"]):
        b = base["kernels"].get(name, {"calls": 0, "ms": 0.0})
        a = adapter["kernels"].get(name, {"calls": 0, "ms": 0.0})
        rows.append(
            {
                "kernel": name,
                "base_calls": int(b["calls"]),
                "adapter_calls": int(a["calls"]),
                "base_ms": b["ms"],
                "adapter_ms": a["ms"],
                "delta_ms": a["ms"] - b["ms"],
            }
        )
    rows.sort(key=lambda r: abs(r["delta_ms"]), reverse=True)
    return rows[:top]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    from vllm_omni.entrypoints.omni import Omni
    from vllm_omni.lora.config import LoRAConfig, LoRAModulePath

    with tempfile.TemporaryDirectory(prefix="lora_profile_") as tmp:
        adapter = write_adapter(args, Path(tmp))
        print(f"adapter: {adapter}", flush=True)
        lora = LoRAConfig(lora_modules=(LoRAModulePath(ADAPTER, tmp),), max_lora_rank=args.rank)
        engine_args = dict(load_format="dummy", device=args.device, step_execution=False, max_num_seqs=1)
        omni = Omni(args.model, lora=lora, **engine_args)
        try:
            runs = {"base": profile_request(omni, args, lora=False)}
            runs["adapter"] = profile_request(omni, args, lora=True)
        finally:
            omni.close()
    rows = compare(runs["base"], runs["adapter"], args.top)
    steps = args.steps
    print(f"\n{args.size}, {steps} steps, CFG off; per request (the profiled one; median of {args.timed}):")
    for name, run in runs.items():
        median = f"{run['median_s'] * 1e3:8.1f} ms" if run["median_s"] else "-"
        print(
            f"  {name:8s} wall {run['wall_s'] * 1e3:8.1f} ms  kernels {run['num_kernels']:6d} "
            f"({run['num_kernels'] / steps:.0f} a step)  kernel time {run['kernel_ms']:8.1f} ms  "
            f"unprofiled median {median}"
        )
    if runs["base"]["median_s"] and runs["adapter"]["median_s"]:
        ratio = runs["adapter"]["median_s"] / runs["base"]["median_s"]
        print(f"  adapter / base (unprofiled medians): {ratio:.3f}")
    print("\n| kernel | base calls | adapter calls | base ms | adapter ms | delta ms |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['kernel'][:90]} | {r['base_calls']} | {r['adapter_calls']} | {r['base_ms']:.2f} "
            f"| {r['adapter_ms']:.2f} | {r['delta_ms']:+.2f} |"
        )
    result = {
        "args": {k: v for k, v in vars(args).items()},
        "env": environment_info(),
        "adapter": {k: v for k, v in adapter.items() if k != "dir"},
        "runs": {k: {m: v for m, v in r.items() if m != "kernels"} for k, r in runs.items()},
        "changed_kernels": rows,
        "kernels": {k: r["kernels"] for k, r in runs.items()},
    }
    if args.json_output:
        write_json(args.json_output, result)
    return result


if __name__ == "__main__":
    main()

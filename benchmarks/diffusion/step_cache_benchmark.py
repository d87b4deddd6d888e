"""Step caching at real size: denoise time with a static mask, the cached rider, the decision overhead.

    python benchmarks/diffusion/step_cache_benchmark.py --model Qwen/Qwen-Image --load-format dummy \\
        --device cuda --json-output step_cache.json [--quantization fp8]

One engine (`--cache-backend cache_dit`, F8B0 by default), driven step by step; every request is a
1024x1024 CFG request of `--steps` steps and sets its own `extra_args`, so one server serves all:

    uncached        extra_args.cache_backend "none": the graph-replayed step of today
    mask            `steps_computation_mask` computing 12 of 20 steps, policy static (no device read)
    all_ones        a static mask of all 1s: the cached path's forward (eager) that never caches
    never_dynamic   dynamic DBCache whose threshold is never met: each step reads the diff (one sync)
    rider           a computing uncached request packed with a request on cached steps

Each request's denoise time is the sum of the runner's `_denoise` calls (CUDA-synchronised); random
weights cannot judge image quality, so speed is measured with static masks and the dynamic path for
its overhead only (docs/caching.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

MASK_12_OF_20 = [1, 1, 1, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1]
"""Four leading computed steps, then every other step cached: 12 of 20 steps computed."""


def build_engine(args):
    from vllm_omni.config import OmniDiffusionConfig
    from vllm_omni.diffusion.engine import DiffusionEngine

    config = OmniDiffusionConfig.from_env_defaults(
        model=args.model, load_format=args.load_format, dtype=args.dtype, device=args.device,
        max_num_seqs=2, scheduling_policy="skip-ahead", log_stats=False, seed=0,
        mixfusion_min_chunk_tokens=1, cache_backend="cache_dit", quantization=args.quantization,
        cache_config={"Fn_compute_blocks": args.fn, "Bn_compute_blocks": args.bn},
    )  # fmt: skip
    return DiffusionEngine(config, autostart=False)


class DenoiseTimer:
    """Wraps the runner's `_denoise`: (seconds, scheduled requests, cached sequences) per step."""

    def __init__(self, runner):
        import torch

        self.records: list[tuple[float, int, int]] = []
        original = runner._denoise

        sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

        def timed(plan):
            sync()
            start = time.perf_counter()
            result = original(plan)
            sync()
            self.records.append((time.perf_counter() - start, len(plan.states), runner._num_cached_seqs))
            return result

        runner._denoise = timed


def run(engine, timer, extras: list[dict], steps: int, size: int) -> dict:
    """Submit one request per extra_args together, step to completion: per-request outputs and steps."""
    from vllm_omni.diffusion.request import OmniDiffusionRequest
    from vllm_omni.inputs import OmniDiffusionSamplingParams

    handles = []
    for i, extra in enumerate(extras):
        params = OmniDiffusionSamplingParams(
            height=size, width=size, num_inference_steps=steps, true_cfg_scale=4.0, seed=i,
            output_type="latent", extra_args=extra,
        )  # fmt: skip
        request = OmniDiffusionRequest(
            f"r{time.monotonic_ns()}-{i}", prompt="A red fox in fresh snow at dawn, soft light",
            negative_prompt="blurry, low quality", sampling_params=params,
        )  # fmt: skip
        handles.append(engine.add_request(request))
    timer.records.clear()
    start = time.perf_counter()
    while not all(h.done() for h in handles):
        engine.step()
    wall = time.perf_counter() - start
    outputs = [h.result() for h in handles]
    records = list(timer.records)
    return {
        "wall_s": wall,
        "denoise_s": sum(r[0] for r in records),
        "step_s": [r[0] for r in records],
        "step_cached_seqs": [r[2] for r in records],
        "num_cached_steps": [o.timings.num_cached_steps for o in outputs],
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="Qwen/Qwen-Image")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quantization", default=None, help="e.g. fp8: every request on FP8 linears")
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--fn", type=int, default=8)
    parser.add_argument("--bn", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json-output", default=None)
    args = parser.parse_args(argv)
    if args.steps != len(MASK_12_OF_20):
        parser.error(f"--steps must be {len(MASK_12_OF_20)} (the mask's length)")

    t0 = time.perf_counter()
    engine = build_engine(args)
    timer = DenoiseTimer(engine.executor.driver_worker.runner)
    print(f"engine ready in {time.perf_counter() - t0:.1f} s", flush=True)
    static = {"steps_computation_policy": "static"}
    configs = {
        "uncached": {"cache_backend": "none"},
        "mask": {"cache_config": {**static, "steps_computation_mask": MASK_12_OF_20}},
        "all_ones": {"cache_config": {**static, "steps_computation_mask": [1] * args.steps}},
        "never_dynamic": {"cache_config": {"residual_diff_threshold": 1e-9, "max_warmup_steps": 1}},
    }
    run(engine, timer, [configs["uncached"], configs["mask"]], args.steps, args.size)  # warm-up
    results: dict = {"args": vars(args), "mask": MASK_12_OF_20}
    for name, extra in configs.items():
        runs = [run(engine, timer, [extra], args.steps, args.size) for _ in range(args.repeats)]
        best = min(runs, key=lambda r: r["denoise_s"])
        results[name] = best
        print(f"{name:14s} denoise {best['denoise_s'] * 1e3:8.1f} ms  wall {best['wall_s'] * 1e3:8.1f} ms  "
              f"cached {best['num_cached_steps']}", flush=True)  # fmt: skip
    # rider: an uncached request packed with one whose steps 2.. are cached
    rider_mask = [1, 1] + [0] * (args.steps - 2)
    rider = {"cache_config": {**static, "steps_computation_mask": rider_mask}}
    results["rider"] = run(engine, timer, [configs["uncached"], rider], args.steps, args.size)
    alone = results["uncached"]["step_s"][1:-1]
    packed = [t for t, c in zip(results["rider"]["step_s"], results["rider"]["step_cached_seqs"]) if c][:-1]
    uncached_s = results["uncached"]["denoise_s"]
    summary = {
        "mask_denoise_ratio": results["mask"]["denoise_s"] / uncached_s,
        "mask_wall_ratio": results["mask"]["wall_s"] / results["uncached"]["wall_s"],
        "rider_step_ratio": statistics.median(packed) / statistics.median(alone),
        "never_dynamic_overhead": results["never_dynamic"]["denoise_s"] / results["uncached"]["denoise_s"]
        - 1,
        "eager_all_ones_overhead": results["all_ones"]["denoise_s"] / uncached_s - 1,
        "decision_vs_eager": results["never_dynamic"]["denoise_s"] / results["all_ones"]["denoise_s"] - 1,
        "uncached_step_ms": statistics.median(alone) * 1e3,
        "rider_step_ms": statistics.median(packed) * 1e3,
    }
    results["summary"] = summary
    print(json.dumps(summary, indent=2), flush=True)
    if args.json_output:
        with open(args.json_output, "w") as f:
            json.dump(results, f, indent=1)
    engine.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

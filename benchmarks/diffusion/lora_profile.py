"""Where an adapter's time goes: the device kernels of one request with and without a LoRA adapter.

    python benchmarks/diffusion/lora_profile.py --json-output $OUT/lora_profile.json     # H200, real size
    python benchmarks/diffusion/lora_profile.py --model tiny-qwen-image --device cpu --size 64x64  # smoke

The engine as `vllm serve --max-num-seqs 1` builds it (request mode, CUDA graphs, random real-size
weights, a random rank-`--rank` adapter on every attention and MLP linear); one `--size` request,
`--steps` steps, CFG off, under `torch.profiler` without and with the adapter (`kernel_profile.py`):
the kernel names whose time changed most, so the adapter's own kernels and the base kernels it changes
both show.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make `benchmarks.diffusion` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.diffusion import kernel_profile  # noqa: E402
from benchmarks.diffusion.lora_serving_benchmark import write_adapter  # noqa: E402

ADAPTER = "profiled"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = kernel_profile.request_parser(__doc__, "256x256", steps=8, warmup=2, timed=5, top=25)
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--std", type=float, default=0.02, help="the random adapter's weight std")
    return kernel_profile.parse_request_args(parser, argv)


def profile_request(omni, args: argparse.Namespace, lora: bool) -> dict[str, Any]:
    """`--warmup` requests, then one under the profiler and `--timed` without it (`kernel_profile`)."""
    from vllm_omni.lora.request import LoRARequest

    kwargs: dict[str, Any] = dict(
        height=args.height, width=args.width, num_inference_steps=args.steps, true_cfg_scale=1.0, seed=0
    )
    if lora:
        kwargs["lora_request"] = LoRARequest(ADAPTER)

    def request() -> None:
        omni.generate("a red apple on a wooden table", use_tqdm=False, **kwargs)

    for _ in range(args.warmup):
        request()
    return kernel_profile.profile_request(request, args.device.startswith("cuda"), args.timed)


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
    rows = kernel_profile.compare(runs["base"], runs["adapter"], args.top)
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
    print()
    kernel_profile.print_changed(rows)
    adapter_info = {k: v for k, v in adapter.items() if k != "dir"}
    return kernel_profile.write_payload(args, runs, rows, adapter=adapter_info)


if __name__ == "__main__":
    main()

"""Where a request's step time goes, per kernel class, for two engine configurations in one process.

    python benchmarks/diffusion/step_profile.py --json-output $OUT/step_profile.json          # H200
    python benchmarks/diffusion/step_profile.py --model tiny-qwen-image --device cpu --size 64x64  # smoke

Each configuration (`--configs`, default BF16 and every block linear in FP8) is built as `vllm serve
--max-num-seqs 1` builds it, profiled on one request (`kernel_profile.py`) and closed before the next;
kernels are grouped by class (`kernel_class`) per step, and the names whose time changed most between
the first two configurations are listed: which part of the step FP8 did not shrink.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make `benchmarks.diffusion` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.diffusion import kernel_profile  # noqa: E402

FP8_BLOCK_LINEARS = {
    "method": "fp8",
    "ignored_layers": ["img_in", "txt_in", "time_text_embed", "norm_out.linear", "proj_out"],
}
"""Every block linear in FP8 (the fastest set docs/quantization.md documents)."""
DEFAULT_CONFIGS = {
    "bf16": None,
    "fp8_blocks": json.dumps(FP8_BLOCK_LINEARS),
    "fp8_blocks_gelu_fused": {"quantization": json.dumps(FP8_BLOCK_LINEARS), "fuse_gelu_fp8": True},
}
"""name -> quantization (None, "fp8" or a config's JSON), or {"quantization": ..., "fuse_gelu_fp8": bool}
(`GELUTanhProj.fuse_fp8`: the MLP's GELU and its e4m3 quantisation as one kernel)."""

CLASSES = ("fp8 gemm", "bf16 gemm", "attention", "quantise", "norm/modulation", "elementwise", "other")
"""Kernel classes, in the order the table lists them."""


def kernel_class(name: str) -> str:
    """The class of a CUDA kernel by its name (cuBLAS / CUTLASS / Triton / ATen naming)."""
    low = name.lower()
    if "flash" in low or "attn" in low or "fmha" in low:
        return "attention"
    # cuBLASLt's FP8 nvjet kernels are named "qqtst" (e4m3 x e4m3) with "ovscale" (outer-vector scales)
    if any(s in low for s in ("e4m3", "fp8", "f8f8", "scaled_mm", "_qqtst_", "ovscale")):
        return "fp8 gemm"
    if any(s in low for s in ("nvjet", "gemm", "xmma", "cutlass", "sm90_", "sm80_")):
        return "bf16 gemm"
    if "quant" in low or "_q_" in low:
        return "quantise"
    if "norm" in low or "modulat" in low or "qkv" in low:
        return "norm/modulation"
    if "elementwise" in low or "triton_poi" in low or "gelu" in low or "silu" in low:
        return "elementwise"
    return "other"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = kernel_profile.request_parser(__doc__, "1024x1024", steps=4, warmup=1, timed=3, top=20)
    parser.add_argument("--cfg", type=float, default=4.0, help="true_cfg_scale (1.0: CFG off)")
    parser.add_argument(
        "--configs",
        default=json.dumps(DEFAULT_CONFIGS),
        help="JSON {name: spec} (see DEFAULT_CONFIGS); the first two are compared",
    )
    return kernel_profile.parse_request_args(parser, argv)


def profile_config(args: argparse.Namespace, spec: str | dict | None) -> dict[str, Any]:
    """Build the engine of `spec` (a `DEFAULT_CONFIGS` value), profile one request, time `--timed`
    more, close it."""
    from vllm_omni.diffusion.models.qwen_image.layers import GELUTanhProj

    spec = spec if isinstance(spec, dict) else {"quantization": spec}
    quantization, default_fuse = spec.get("quantization"), GELUTanhProj.fuse_fp8
    GELUTanhProj.fuse_fp8 = bool(spec.get("fuse_gelu_fp8", default_fuse))
    try:
        result = _profile_engine(args, quantization)
    finally:
        GELUTanhProj.fuse_fp8 = default_fuse
    return {"spec": spec, **result}


def _profile_engine(args: argparse.Namespace, quantization: str | None) -> dict[str, Any]:
    import torch

    from vllm_omni.entrypoints.omni import Omni

    engine_args: dict[str, Any] = dict(load_format="dummy", device=args.device, step_execution=False)
    if quantization is not None:
        engine_args["quantization"] = quantization
    omni = Omni(args.model, max_num_seqs=1, **engine_args)
    kwargs: dict[str, Any] = dict(
        height=args.height, width=args.width, num_inference_steps=args.steps, true_cfg_scale=args.cfg, seed=0
    )
    if args.cfg > 1.0:
        kwargs["negative_prompt"] = " "
    on_cuda = args.device.startswith("cuda")

    def request() -> None:
        omni.generate("a red apple on a wooden table", use_tqdm=False, **kwargs)
        if on_cuda:
            torch.cuda.synchronize()

    try:
        for _ in range(args.warmup):
            request()
        run = kernel_profile.profile_request(request, on_cuda, args.timed)
    finally:
        omni.close()
    by_class = dict.fromkeys(CLASSES, 0.0)
    for name, k in run["kernels"].items():
        by_class[kernel_class(name)] += k["ms"] / args.steps
    return {**run, "kernel_ms_per_step": run["kernel_ms"] / args.steps, "class_ms_per_step": by_class}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    configs: dict[str, str | dict | None] = json.loads(args.configs)
    runs = {}
    for name, spec in configs.items():
        print(f"== {name}: {spec}", flush=True)
        runs[name] = profile_config(args, spec)
    names = list(runs)
    cfg = "on" if args.cfg > 1.0 else "off"
    print(f"\n{args.size}, {args.steps} steps, CFG {cfg}; ms per step by kernel class (profiled request):")
    print("| class | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for cls in CLASSES + ("total",):
        vals = [
            r["kernel_ms_per_step"] if cls == "total" else r["class_ms_per_step"][cls] for r in runs.values()
        ]
        print(f"| {cls} | " + " | ".join(f"{v:.1f}" for v in vals) + " |")
    medians = [r["median_s"] for r in runs.values()]
    if all(medians):
        print("| request wall, unprofiled median (s) | " + " | ".join(f"{m:.3f}" for m in medians) + " |")
    rows = []
    if len(names) >= 2:
        rows = kernel_profile.compare(runs[names[0]], runs[names[1]], args.top)
        print(f"\nkernels whose time changed most, {names[0]} -> {names[1]} (ms over the request):")
        kernel_profile.print_changed(rows, kernel_class)
    return kernel_profile.write_payload(args, runs, rows)


if __name__ == "__main__":
    main()

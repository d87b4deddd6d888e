"""A GEMM's rate in a burst and when sustained: what a power-capped GPU gives a long run.

    python benchmarks/diffusion/sustained_gemm.py --size 8192 --seconds 20 --json-output gemm.json

The peer comparison's "% of the GEMM rate" divides by a burst: ten `size`^3 bf16 matmuls, about 15 ms
on an H200, too short to heat the GPU to its power limit. A denoise step runs hundreds of
milliseconds of such GEMMs back to back, and a 50-step request tens of seconds. This runs the same
matmul back to back for `--seconds` and reports the rate of every `--window-s` window (CUDA events),
so the burst and the sustained rate of the same kernel sit side by side.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `benchmarks.diffusion` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.diffusion.common import Column, environment_info, format_table, write_json  # noqa: E402
from benchmarks.diffusion.transformer_benchmark import gemm_tflops  # noqa: E402


def sustained_windows(size: int, seconds: float, window_s: float, device, dtype) -> list[dict]:
    """TFLOP/s of back-to-back `size`^3 matmuls in consecutive windows of about `window_s` seconds."""
    import torch

    a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
    out = torch.empty(size, size, device=device, dtype=dtype)
    flop = 2 * size**3
    burst_ms = flop / gemm_tflops(device, dtype, size) / 1e9
    per_window = max(1, round(window_s * 1e3 / burst_ms))
    windows, start_wall = [], time.perf_counter()
    while time.perf_counter() - start_wall < seconds:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(per_window):
            torch.mm(a, b, out=out)
        end.record()
        end.synchronize()
        ms = start.elapsed_time(end)
        windows.append(
            {
                "t_s": time.perf_counter() - start_wall,
                "gemms": per_window,
                "tflops": per_window * flop / ms / 1e9,
            }
        )
    return windows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=int, default=8192)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--window-s", type=float, default=1.0)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json-output", default=None)
    args = parser.parse_args(argv)
    import torch

    dtype = torch.bfloat16
    burst = gemm_tflops(args.device, dtype, args.size)
    windows = sustained_windows(args.size, args.seconds, args.window_s, args.device, dtype)
    later = [w["tflops"] for w in windows[len(windows) // 2 :]]
    result = {
        "env": environment_info(args.device),
        "args": vars(args),
        "burst_tflops": burst,
        "sustained_tflops": sum(later) / len(later),
        "windows": windows,
    }
    print(format_table(windows, [Column("t_s", "t s", ".1f"), Column("tflops", "TFLOP/s", ".0f")]))
    print(
        f"burst {burst:.0f} TFLOP/s; sustained (second half) {result['sustained_tflops']:.0f} TFLOP/s"
        f" = {100 * result['sustained_tflops'] / burst:.0f} % of the burst"
    )
    if args.json_output:
        write_json(args.json_output, result)
    return result


if __name__ == "__main__":
    main()

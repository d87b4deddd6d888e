"""FP8 linears at Qwen-Image's shapes: where the time goes (issue 25's table, with the Triton quantisation).

    python benchmarks/diffusion/fp8_gemm.py --rows 8192,22528 --seconds 1 --json-output fp8_gemm.json

Per rows x GEMM (qkv 3072->9216 merged, out 3072->3072, mlp up 3072->12288, mlp down 12288->3072), the
sustained milliseconds per call (back-to-back calls between CUDA events, for `--seconds`, median of the
windows: what a power-capped H200 gives a long run) of:

    bf16              F.linear(x, W, b)
    fp8_gemm          _scaled_mm on an already-quantised x (the bound a fused producer kernel reaches)
    fp8_gemm_bias     the same with the bias in the GEMM's epilogue (`bias=`; absent if refused)
    torch_quant       quantize_rows(x) alone (about six torch passes)
    triton_quant      fp8_triton.quantize_rows(x) alone (one pass)
    fp8_torch_quant   torch quantisation + GEMM + bias add (the path before the Triton kernel)
    fp8_triton_quant  Triton quantisation + GEMM + bias add (`fp8_linear` on CUDA now)

and, per shape, whether the Triton kernel's e4m3 codes and scales equal torch's bit for bit. On CPU it
runs as a smoke test (host clock, tiny sizes via --rows / --dims).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `benchmarks.diffusion` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.diffusion.common import Column, report_rows  # noqa: E402

GEMMS = {"qkv": (3072, 9216), "out": (3072, 3072), "mlp_up": (3072, 12288), "mlp_down": (12288, 3072)}
"""name -> (in features K, out features N) of Qwen-Image's linears (hidden 3072; q, k, v merged)."""


def sustained_ms(fn, seconds: float, num_windows: int = 5) -> float:
    """Median per-call milliseconds over `num_windows` windows of back-to-back calls, about
    `seconds / num_windows` each, after a warm-up window (CUDA events; host clock on CPU)."""
    import torch

    cuda = torch.cuda.is_available()
    fn()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    fn()
    sync()
    one_ms = max(1e-3, 1e3 * (time.perf_counter() - start))
    calls = max(1, round(seconds * 1e3 / num_windows / one_ms))
    for _ in range(calls):  # warm-up window: clocks and power settle
        fn()
    times = []
    for _ in range(num_windows):
        if cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end) / calls)
        else:
            begin = time.perf_counter()
            for _ in range(calls):
                fn()
            times.append(1e3 * (time.perf_counter() - begin) / calls)
    return statistics.median(times)


def case_fns(rows: int, k: int, n: int, device, dtype) -> tuple[dict, bool]:
    """The timed callables of one (rows, K, N), and whether Triton's quantisation equals torch's."""
    import torch
    import torch.nn.functional as F

    from vllm_omni.diffusion.layers import fp8_triton
    from vllm_omni.diffusion.layers.fp8 import quantize_rows

    gen = torch.Generator(device=device).manual_seed(rows + k + n)
    x = torch.randn(rows, k, device=device, generator=gen).to(dtype)
    w = (torch.randn(n, k, device=device, generator=gen) / k**0.5).to(dtype)
    b = torch.randn(n, device=device, generator=gen).to(dtype)
    w8, sw = quantize_rows(w)
    w8t, sw = w8.t(), sw.view(1, n)  # [K, N] column-major, [1, N]
    x8, sx = quantize_rows(x)

    def gemm(xq, xs, bias=None):
        return torch._scaled_mm(xq, w8t, scale_a=xs, scale_b=sw, bias=bias, out_dtype=dtype)

    use_triton = device.type == "cuda" and fp8_triton.available()
    triton_quant = fp8_triton.quantize_rows if use_triton else quantize_rows
    fns = {
        "bf16": lambda: F.linear(x, w, b),
        "fp8_gemm": lambda: gemm(x8, sx),
        "torch_quant": lambda: quantize_rows(x),
        "triton_quant": lambda: triton_quant(x),
        "fp8_torch_quant": lambda: gemm(*quantize_rows(x)) + b,
        "fp8_triton_quant": lambda: gemm(*triton_quant(x)) + b,
    }
    try:
        gemm(x8, sx, b)
        fns["fp8_gemm_bias"] = lambda: gemm(x8, sx, b)
    except RuntimeError as exc:  # rowwise scales with a bias epilogue: not in every torch build
        print(f"fp8 GEMM with bias= refused ({str(exc).splitlines()[0][:100]})")
    q, s = triton_quant(x)
    bit_equal = torch.equal(q.view(torch.uint8), x8.view(torch.uint8)) and torch.equal(s, sx)
    return fns, bit_equal


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="8192,22528", help="comma-separated row counts")
    parser.add_argument("--dims", default=None, help="K:N pairs instead of Qwen-Image's (CPU smoke)")
    parser.add_argument("--seconds", type=float, default=1.0, help="timed seconds per (case, variant)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json-output", default=None)
    args = parser.parse_args(argv)
    import torch

    device, dtype = torch.device(args.device), torch.bfloat16
    gemms = GEMMS
    if args.dims:
        gemms = {f"{k}x{n}": (int(k), int(n)) for k, n in (p.split(":") for p in args.dims.split(","))}
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        for name, (k, n) in gemms.items():
            fns, bit_equal = case_fns(rows, k, n, device, dtype)
            row = {"rows": rows, "gemm": name, "k": k, "n": n, "triton_bit_equal": bit_equal}
            for variant, fn in fns.items():
                row[f"{variant}_ms"] = sustained_ms(fn, args.seconds)
            for variant in ("fp8_gemm", "fp8_gemm_bias", "fp8_torch_quant", "fp8_triton_quant"):
                if f"{variant}_ms" in row:
                    row[f"{variant}_speedup"] = row["bf16_ms"] / row[f"{variant}_ms"]
            row["tflops_fp8_gemm"] = 2 * rows * k * n / row["fp8_gemm_ms"] / 1e9
            results.append(row)
            del fns
            if device.type == "cuda":
                torch.cuda.empty_cache()
    columns = [
        Column("rows", "rows", "d"),
        Column("gemm", "GEMM", "s"),
        Column("bf16_ms", "bf16 ms", ".3f"),
        Column("fp8_gemm_ms", "fp8 GEMM", ".3f"),
        Column("fp8_gemm_speedup", "x", ".2f"),
        Column("torch_quant_ms", "torch q", ".3f"),
        Column("triton_quant_ms", "triton q", ".3f"),
        Column("fp8_torch_quant_speedup", "+torch q x", ".2f"),
        Column("fp8_triton_quant_speedup", "+triton q x", ".2f"),
        Column("triton_bit_equal", "bits equal", "s"),
    ]
    return report_rows(args, results, columns)


if __name__ == "__main__":
    main()

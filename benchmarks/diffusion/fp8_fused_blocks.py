"""FP8 with the activation quantisation fused into its producer, per block of a Qwen-Image layer (issue 25).

    python benchmarks/diffusion/fp8_fused_blocks.py --rows 8192,22528 --seconds 1 --json-output blocks.json

Per rows x block, the sustained milliseconds per call (fp8_gemm.py's `sustained_ms`) of:

    norm_qkv   bf16         LN kernel + F.linear (3072 -> 9216, q k v merged)
               fp8_unfused  LN kernel + quantisation pass + FP8 GEMM (today's FP8 path)
               fp8_fused    LN kernel emitting e4m3 + scales + FP8 GEMM
    mlp        bf16         GEMM with cuBLASLt's GELU epilogue + F.linear (12288 -> 3072)
               fp8_unfused  FP8 GEMM + F.gelu + quantisation pass + FP8 GEMM
               fp8_fused    FP8 GEMM + GELU/quantisation kernel + FP8 GEMM
    gelu_down  bf16         F.gelu + F.linear
               fp8_unfused  F.gelu + quantisation pass + FP8 GEMM
               fp8_fused    GELU/quantisation kernel + FP8 GEMM
               fp8_two_pass the same with the two-pass chunked kernel (the row not held whole)
    gelu_quant the producer alone: F.gelu (bf16), F.gelu + quantisation pass, the resident and the
               two-pass GELU/quantisation kernels

(the LN kernel is triton_ops.modulated_layer_norm, 3 sequences; mlp starts from the normed rows,
gelu_down from the up projection's output, [rows, 12288]), each block's speedups over bf16 and whether
fp8_fused's output equals fp8_unfused's bit for bit (it must). On CPU, a smoke run (tiny sizes via
--dim; no Triton, so the fused variant is the unfused one and `fused_bit_equal` is trivially true).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `benchmarks.diffusion` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.diffusion.common import Column, report_rows  # noqa: E402
from benchmarks.diffusion.fp8_gemm import sustained_ms  # noqa: E402

BLOCKS = ("norm_qkv", "mlp", "gelu_down", "gelu_quant")


def _fp8_linear(n: int, k: int, device, dtype, gen):
    """A bias-carrying `Linear(k, n)` in `dtype` and its FP8 twin (same weights)."""
    import torch

    from vllm_omni.diffusion.layers.fp8 import Fp8LinearMethod
    from vllm_omni.diffusion.layers.linear import Linear

    plain = Linear(k, n, device=device, dtype=dtype)
    with torch.no_grad():
        plain.weight.copy_(torch.randn(n, k, device=device, generator=gen) / k**0.5)
        plain.bias.copy_(torch.randn(n, device=device, generator=gen) * 0.1)
    fp8 = Linear(k, n, device=device, dtype=dtype)
    fp8.load_state_dict(plain.state_dict())
    fp8.set_quant_method(Fp8LinearMethod())
    return plain, fp8


def block_fns(rows: int, dim: int, device, dtype) -> dict[str, dict]:
    """block -> variant -> callable (each returns the block's output)."""
    import torch
    import torch.nn.functional as F

    from vllm_omni.diffusion.layers import fp8_triton
    from vllm_omni.diffusion.layers.fp8 import Fp8Activation
    from vllm_omni.diffusion.models.qwen_image import fused_ops, triton_ops

    fused = device.type == "cuda" and triton_ops.available()
    ops = triton_ops if fused else fused_ops  # the LN kernel (the torch chain on CPU)
    gen = torch.Generator(device=device).manual_seed(rows + dim)
    x = torch.randn(rows, dim, device=device, generator=gen).to(dtype)
    ids = torch.arange(rows, device=device) * 3 // rows  # three sequences
    mod = torch.randn(3, 6 * dim, device=device, generator=gen).to(dtype)
    shift, scale = mod.chunk(6, dim=-1)[:2]
    qkv, qkv8 = _fp8_linear(3 * dim, dim, device, dtype, gen)
    up, up8 = _fp8_linear(4 * dim, dim, device, dtype, gen)
    down, down8 = _fp8_linear(dim, 4 * dim, device, dtype, gen)
    h = up8(x)  # [rows, 4 * dim]: the up projection's output

    def norm():
        return ops.modulated_layer_norm(x, shift, scale, ids, 1e-6)

    def norm_fp8():
        if not fused:
            return Fp8Activation.quantize(norm())
        return Fp8Activation(*triton_ops.modulated_layer_norm_fp8(x, shift, scale, ids, 1e-6), x.shape, dtype)

    def gelu_fp8(hh, resident=True):
        if not fused:
            return Fp8Activation.quantize(F.gelu(hh, approximate="tanh"))
        return Fp8Activation(*fp8_triton.gelu_tanh_quantize_rows(hh, resident), hh.shape, dtype)

    def codes(act):  # an activation's e4m3 codes as bytes (torch.equal compares them)
        return act.data.view(torch.uint8)

    def mlp_bf16():
        if device.type != "cuda":
            return down(F.gelu(up(x), approximate="tanh"))
        return down(torch._addmm_activation(up.bias, x, up.weight.t(), use_gelu=True))

    return {
        "norm_qkv": {
            "bf16": lambda: qkv(norm()),
            "fp8_unfused": lambda: qkv8(norm()),
            "fp8_fused": lambda: qkv8(norm_fp8()),
        },
        "mlp": {
            "bf16": mlp_bf16,
            "fp8_unfused": lambda: down8(F.gelu(up8(x), approximate="tanh")),
            "fp8_fused": lambda: down8(gelu_fp8(up8(x))),
        },
        "gelu_down": {
            "bf16": lambda: down(F.gelu(h, approximate="tanh")),
            "fp8_unfused": lambda: down8(F.gelu(h, approximate="tanh")),
            "fp8_fused": lambda: down8(gelu_fp8(h)),
            "fp8_two_pass": lambda: down8(gelu_fp8(h, resident=False)),
        },
        "gelu_quant": {  # the producer alone: bf16 is F.gelu without quantising
            "bf16": lambda: F.gelu(h, approximate="tanh"),
            "fp8_unfused": lambda: codes(Fp8Activation.quantize(F.gelu(h, approximate="tanh"))),
            "fp8_fused": lambda: codes(gelu_fp8(h)),
            "fp8_two_pass": lambda: codes(gelu_fp8(h, resident=False)),
        },
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="8192,22528", help="comma-separated row counts")
    parser.add_argument("--dim", type=int, default=3072, help="hidden size (Qwen-Image: 3072)")
    parser.add_argument("--seconds", type=float, default=1.0, help="timed seconds per (case, variant)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json-output", default=None)
    args = parser.parse_args(argv)
    import torch

    device, dtype = torch.device(args.device), torch.bfloat16
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        fns = block_fns(rows, args.dim, device, dtype)
        with torch.inference_mode():
            for block, variants in fns.items():
                row = {"rows": rows, "block": block, "dim": args.dim}
                row["fused_bit_equal"] = torch.equal(variants["fp8_fused"](), variants["fp8_unfused"]())
                for variant, fn in variants.items():
                    row[f"{variant}_ms"] = sustained_ms(fn, args.seconds)
                for variant in ("fp8_unfused", "fp8_fused"):
                    row[f"{variant}_speedup"] = row["bf16_ms"] / row[f"{variant}_ms"]
                results.append(row)
        del fns
        if device.type == "cuda":
            torch.cuda.empty_cache()
    columns = [
        Column("rows", "rows", "d"),
        Column("block", "block", "s"),
        Column("bf16_ms", "bf16 ms", ".3f"),
        Column("fp8_unfused_ms", "fp8 unfused", ".3f"),
        Column("fp8_fused_ms", "fp8 fused", ".3f"),
        Column("fp8_two_pass_ms", "fused 2-pass", ".3f"),
        Column("fp8_unfused_speedup", "unfused x", ".2f"),
        Column("fp8_fused_speedup", "fused x", ".2f"),
        Column("fused_bit_equal", "bits equal", "s"),
    ]
    return report_rows(args, results, columns)


if __name__ == "__main__":
    main()

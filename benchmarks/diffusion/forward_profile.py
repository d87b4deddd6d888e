"""Where one transformer forward's GPU time goes: kernels by category, ours vs diffusers, same weights.

    python benchmarks/diffusion/forward_profile.py --num-layers 16 --cases "1024x1024;2*1024x1024" \
        --json-output profile.json

For every case (common.py mix grammar; `2*1024x1024` is a CFG step's two sequences) and variant, one
forward runs under `torch.profiler` (CUDA activity) after warm-ups; its kernels are summed per
category and reported per block (total / `--num-layers`), next to the CUDA-event time of the eager
forward and, when a CUDA-graph bucket pays for the case, of its replay. Variants:

    ours <stage>        our packed forward (AUTO attention, FA3 when present) in each of `STAGES`,
                        every stage adding one change to the previous one: before/after in one run
    diffusers compiled  diffusers' transformer with `compile_repeated_blocks(fullgraph=True)`

Then the Triton kernels are checked against the torch functions they replace (bf16, real widths),
the GELU epilogue's formula is identified (fp32), and the linears of one block at the case's row
count are timed alone (TFLOP/s against the GEMM rate of the same run), with and without the GELU
epilogue, so the GEMM share can be read off directly.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections import defaultdict
from functools import partial
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `benchmarks.diffusion` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.diffusion.common import (  # noqa: E402
    Column,
    environment_info,
    event_median_ms,
    format_table,
    graph_replay_ms,
    parse_mixes,
    write_json,
)
from benchmarks.diffusion.peer_comparison import (  # noqa: E402
    Case,
    build_models,
    run_diffusers,
)
from benchmarks.diffusion.transformer_benchmark import gemm_tflops  # noqa: E402

CATEGORIES = (
    ("triton (fused)", ("triton",)),
    ("attention", ("flash", "fmha", "attn", "cudnn")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "sm90", "cublas")),
    ("copy/index", ("index", "copy", "cat", "gather", "scatter", "stack")),
)


def category(kernel: str) -> str:
    name = kernel.lower()
    for cat, needles in CATEGORIES:
        if any(n in name for n in needles):
            return cat
    return "other elementwise"


def profile_kernels(fn, num_layers: int) -> tuple[dict[str, float], list[tuple[str, float, int]]]:
    """(ms per block by category, top kernels as (name, ms per block, calls per block)) of one `fn()`."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    per_kernel: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[event.name][0] += event.time_range.elapsed_us() / 1e3
            per_kernel[event.name][1] += 1
    by_cat: dict[str, float] = defaultdict(float)
    for name, (ms, _) in per_kernel.items():
        by_cat[category(name)] += ms / num_layers
    by_cat["total"] = sum(v for k, v in by_cat.items())
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:25]
    return dict(by_cat), [(n[:90], ms / num_layers, calls / num_layers) for n, (ms, calls) in top]


def _linear_gelu(x, w, b):
    import torch.nn.functional as F

    return F.gelu(F.linear(x, w, b), approximate="tanh")


def linear_rates(rows: int, dim: int, device, dtype, gemm: float) -> list[dict]:
    """TFLOP/s of one block's image-stream linears at `rows` rows (F.linear; GELU epilogue variants)."""
    import torch
    import torch.nn.functional as F

    x = torch.randn(rows, dim, device=device, dtype=dtype)
    h = torch.randn(rows, 4 * dim, device=device, dtype=dtype)
    out = []
    shapes = [("qkv (fused)", x, 3 * dim), ("out", x, dim), ("mlp up", x, 4 * dim), ("mlp down", h, dim)]
    for name, inp, n in shapes:
        w = torch.randn(n, inp.shape[1], device=device, dtype=dtype) * 0.02
        b = torch.randn(n, device=device, dtype=dtype) * 0.02
        flop = 2 * rows * n * inp.shape[1]
        variants = {"F.linear": partial(F.linear, inp, w, b)}
        if name == "mlp up":
            variants["F.linear + F.gelu(tanh)"] = partial(_linear_gelu, inp, w, b)
            variants["_addmm_activation(gelu)"] = partial(
                torch._addmm_activation, b, inp, w.t(), use_gelu=True
            )
        for label, fn in variants.items():
            ms = event_median_ms(fn, 3, 10)
            out.append(
                {
                    "linear": f"{name} [{rows}x{inp.shape[1]}] x [{inp.shape[1]}x{n}]",
                    "variant": label,
                    "ms": ms,
                    "tflops": flop / ms / 1e9,
                    "pct_gemm": 100 * flop / ms / 1e9 / gemm,
                }
            )
    return out


def gelu_epilogue_check(device) -> dict[str, float]:
    """max |_addmm_activation(gelu) - F.gelu(F.linear)| in fp32 (no TF32) for both GELU forms, at a
    small and a large row count: tells which GELU the epilogue computes (the two differ by ~1e-3)."""
    import torch
    import torch.nn.functional as F

    tf32, torch.backends.cuda.matmul.allow_tf32 = torch.backends.cuda.matmul.allow_tf32, False
    gen = torch.Generator(device=device).manual_seed(0)
    result = {}
    for rows in (64, 4096):
        x = torch.randn(rows, 256, device=device, generator=gen)
        w, b = torch.randn(1024, 256, device=device, generator=gen) / 8, torch.randn(1024, device=device)
        fused, lin = torch._addmm_activation(b, x, w.t(), use_gelu=True), F.linear(x, w, b)
        for approx in ("tanh", "none"):
            result[f"rows={rows} vs gelu({approx})"] = float(
                (fused - F.gelu(lin, approximate=approx)).abs().max()
            )
    torch.backends.cuda.matmul.allow_tf32 = tf32
    return result


def triton_kernel_checks(device, rows: int = 4160, heads: int = 24, head_dim: int = 128) -> dict:
    """Triton kernels vs the torch functions they replace, bf16 at real widths: max |diff| and the
    fraction of elements that differ (the torch side runs eager, unfused)."""
    import torch

    from vllm_omni.diffusion.models.qwen_image import fused_ops, triton_ops
    from vllm_omni.diffusion.models.qwen_image.packing import SequenceSpec, build_packed_layout

    if not triton_ops.available():
        return {"skipped": "triton not importable or no CUDA"}
    dtype, dim = torch.bfloat16, heads * head_dim
    gen = torch.Generator(device=device).manual_seed(0)
    randn = lambda *shape: torch.randn(*shape, device=device, generator=gen).to(dtype)  # noqa: E731
    specs = [SequenceSpec(64, (1, 64, 64)), SequenceSpec(7, (1, 64, 64))]  # a CFG pair at 1024x1024
    layout = build_packed_layout(specs, (16, 56, 56), device=device)
    src = layout.joint_src()
    weights = tuple(1 + 0.1 * randn(head_dim) for _ in range(4))
    qkv_args = (randn(layout.num_txt_rows, 3 * dim), randn(layout.num_img_rows, 3 * dim), src, weights,
                layout.txt_rope, layout.img_rope, 1e-6)  # fmt: skip
    x, y, mod = randn(rows, dim), randn(rows, dim), 0.1 * randn(2, 6 * dim)
    shift, scale, gate = mod.chunk(6, dim=-1)[:3]
    ids = (torch.arange(rows, device=device) >= rows // 2).long()
    y_rows = torch.arange(rows - 1, -1, -1, device=device)
    pairs = {
        "joint_qkv": (triton_ops.joint_qkv(*qkv_args), fused_ops.joint_qkv(*qkv_args)),
        "modulated_layer_norm": (
            (triton_ops.modulated_layer_norm(x, shift, scale, ids, 1e-6),),
            (fused_ops.modulated_layer_norm(x, shift, scale, ids, 1e-6),),
        ),
        "gated_residual_norm": (
            triton_ops.gated_residual_norm(x, y, gate, shift, scale, ids, 1e-6),
            fused_ops.gated_residual_norm(x, y, gate, shift, scale, ids, 1e-6),
        ),
        "gated_residual_norm_rows": (  # y read by index from rows in another order
            triton_ops.gated_residual_norm_rows(x, y.flip(0), y_rows, gate, shift, scale, ids, 1e-6),
            fused_ops.gated_residual_norm_rows(x, y.flip(0), y_rows, gate, shift, scale, ids, 1e-6),
        ),
    }
    result = {}
    for name, (got, want) in pairs.items():
        diffs = [(a.float() - b.float()).abs() for a, b in zip(got, want, strict=True)]
        result[name] = {
            "max_abs": max(float(d.max()) for d in diffs),
            "frac_differ": sum(float((d > 0).float().mean()) for d in diffs) / len(diffs),
        }
    return result


def norm_kernel_sweep(device, row_counts=(8320, 23040), dim: int = 3072, warps=(2, 4, 8)) -> list[dict]:
    """The LayerNorm kernels' time (and GB/s) at each `triton_ops.NORM_NUM_WARPS` choice."""
    import torch

    from vllm_omni.diffusion.models.qwen_image import triton_ops

    if not triton_ops.available():
        return []
    default, out = triton_ops.NORM_NUM_WARPS, []
    for rows in row_counts:
        x, y = (torch.randn(rows, dim, device=device, dtype=torch.bfloat16) for _ in range(2))
        mod = 0.1 * torch.randn(2, 6 * dim, device=device, dtype=torch.bfloat16)
        shift, scale, gate = mod.chunk(6, dim=-1)[:3]
        ids = (torch.arange(rows, device=device) >= rows // 2).long()
        for num_warps in warps:
            triton_ops.NORM_NUM_WARPS = num_warps
            mln = graph_replay_ms(partial(triton_ops.modulated_layer_norm, x, shift, scale, ids, 1e-6))
            gated = graph_replay_ms(
                partial(triton_ops.gated_residual_norm, x, y, gate, shift, scale, ids, 1e-6)
            )
            row_bytes = rows * dim * 2
            row = {"rows": rows, "num_warps": num_warps, "mln_ms": mln, "gated_norm_ms": gated}
            row.update(mln_gb_s=2 * row_bytes / mln / 1e6, gated_norm_gb_s=4 * row_bytes / gated / 1e6)
            out.append(row)
    triton_ops.NORM_NUM_WARPS = default
    return out


STAGES = {
    # name: (BlockOps fuse_joint, BlockOps use_triton, GELU in the cuBLASLt epilogue,
    #        image out-projection over the joint rows)
    "compiled": (False, False, False, False),
    "+joint": (True, False, False, False),
    "+gelu_epilogue": (True, False, True, False),
    "+triton": (True, True, True, False),
    "+joint_rows": (True, True, True, True),
}
"""Our configurations, each adding one change (the last is the default): compiled elementwise chains
with only row counts dynamic (the gated residual already fused with the next norm), then the joint
q/k/v built straight from the projections (inductor), then GELU in the GEMM epilogue, then the
Triton kernels, then the image out-projection over the joint rows (no copy of the image rows out
of the attention output)."""


def measure(name: str, fn, num_layers: int, graph_fn=None) -> dict:
    """Event time, kernel breakdown and (when `graph_fn`) CUDA-graph replay time of one forward."""
    t0 = time.perf_counter()
    ms = event_median_ms(fn, 3, 5)
    by_cat, top = profile_kernels(fn, num_layers)
    entry = {"event_ms_per_block": ms / num_layers, "kernels_ms_per_block": by_cat["total"]}
    if graph_fn is not None:
        entry["graph_ms_per_block"] = event_median_ms(graph_fn, 3, 5) / num_layers
    entry.update(by_category_ms_per_block=by_cat, top_kernels=top)
    graph = f", graph {entry['graph_ms_per_block']:.3f}" if graph_fn is not None else ""
    took = time.perf_counter() - t0
    print(
        f"\n== {name}: event {ms / num_layers:.3f}, kernels {by_cat['total']:.3f}{graph} ms/block"
        f" ({took:.0f} s)"
    )
    for cat, v in sorted(by_cat.items(), key=lambda kv: -kv[1]):
        print(f"   {cat:<20} {v:7.3f}")
    for kernel, kms, calls in top[:14]:
        print(f"   {kms:7.3f} ms x{calls:4.1f}  {kernel}")
    return entry


def interleaved_event_ms(cases, stages: list[str], apply_stage, ours, args) -> list[dict]:
    """Eager event time per block of every stage, the stages taking turns round after round.

    The per-stage profiles above run one stage after the other, minutes apart; the GPU's clocks drift
    by several percent over that (the same GEMM kernel's time moves with them), more than the later
    changes buy. Alternating the stages every forward exposes them to the same clocks."""
    rows = []
    for case in cases:
        inputs = (case.img_rows, case.txt_rows, case.timestep, case.layout)
        times = {stage: [] for stage in stages}
        for _ in range(args.interleaved_rounds):
            for stage in stages:
                apply_stage(stage)
                times[stage].append(
                    event_median_ms(partial(ours.forward_packed, *inputs), 1, 1) / args.num_layers
                )
        base = statistics.median(times[stages[0]])
        for stage in stages:
            ms = statistics.median(times[stage])
            rows.append(
                {"case": case.mix.name, "stage": stage, "event_ms_per_block": ms, "vs_first": ms / base}
            )
    print(f"\ninterleaved eager event times ({args.interleaved_rounds} rounds, median)")
    columns = [
        Column("case", "case"),
        Column("stage", "stage"),
        Column("event_ms_per_block", "ms/block", ".3f"),
    ]
    print(format_table(rows, [*columns, Column("vs_first", "x first", ".3f")]))
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--num-layers", type=int, default=16)
    parser.add_argument("--text-len", type=int, default=64)
    parser.add_argument("--cases", default="1024x1024;2*1024x1024;2*512x512")
    parser.add_argument("--stages", default=",".join(STAGES), help=f"of {list(STAGES)}")
    parser.add_argument("--diffusers", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument(
        "--graph-img-rows", default=None, help="image-row buckets of the graph runner (default: its own)"
    )
    parser.add_argument("--interleaved-rounds", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json-output", default=None)
    args = parser.parse_args(argv)
    import torch

    from vllm_omni.diffusion.attention.backends.auto import AutoAttentionBackend
    from vllm_omni.diffusion.models.qwen_image import transformer as transformer_module
    from vllm_omni.diffusion.models.qwen_image.fused_ops import BlockOps
    from vllm_omni.diffusion.models.qwen_image.layers import GELUTanhProj

    default_share, NEVER = transformer_module.JOINT_ROWS_MAX_TXT_SHARE, 1 << 40
    from vllm_omni.diffusion.worker.cuda_graphs import CudaGraphConfig, CUDAGraphRunner

    dtype = torch.bfloat16
    graph_config = CudaGraphConfig()
    if args.graph_img_rows:
        rows = tuple(int(n) for n in args.graph_img_rows.split(","))
        graph_config = dataclasses.replace(graph_config, img_rows=rows)
    gemm = gemm_tflops(args.device, dtype, 8192)
    print(f"GEMM 8192^3 bf16: {gemm:.0f} TFLOP/s", flush=True)
    ref, ours = build_models(args.num_layers, args.device, dtype, args.seed)
    ours.attn_backend = AutoAttentionBackend()
    cases = [Case(m, ours, args.text_len, args.device, dtype, args.seed) for m in parse_mixes(args.cases)]
    result = {"env": environment_info(args.device), "gemm_tflops": gemm, "args": vars(args), "profiles": []}
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    block_ops = {}

    def apply_stage(stage: str) -> None:
        fuse_joint, use_triton, GELUTanhProj.cublas_epilogue, joint_rows = STAGES[stage]
        if stage not in block_ops:  # one instance per stage: its compiled chains are reused
            block_ops[stage] = BlockOps(compiled=True, fuse_joint=fuse_joint, use_triton=use_triton)
        ours.block_ops = block_ops[stage]
        transformer_module.JOINT_ROWS_MAX_TXT_SHARE = default_share if joint_rows else NEVER

    with torch.inference_mode():
        for stage in stages:
            apply_stage(stage)
            graphs = CUDAGraphRunner(ours, args.device, dtype, graph_config)
            for case in cases:
                inputs = (case.img_rows, case.txt_rows, case.timestep, case.layout)
                packed, replay = (
                    partial(ours.forward_packed, *inputs),
                    partial(graphs.forward_packed, *inputs),
                )
                replay()  # captures the bucket when one pays
                entry = measure(f"ours {stage} {case.mix.name} ({graphs.last_path})", packed, args.num_layers,
                                replay if graphs.last_path == "graph" else None)  # fmt: skip
                result["profiles"].append({"case": case.mix.name, "variant": f"ours {stage}", **entry})
                if args.json_output:
                    write_json(args.json_output, result)
            del graphs
        result["interleaved"] = interleaved_event_ms(cases, stages, apply_stage, ours, args)
        apply_stage(list(STAGES)[-1])
        if args.diffusers:
            ref.compile_repeated_blocks(fullgraph=True)
            for case in cases:
                entry = measure(
                    f"diffusers compiled {case.mix.name}", partial(run_diffusers, ref, case), args.num_layers
                )
                result["profiles"].append({"case": case.mix.name, "variant": "diffusers compiled", **entry})
    columns = [Column("case", "case"), Column("variant", "variant")] + [
        Column(f"{what}_ms_per_block", f"{what} ms/block", ".3f") for what in ("event", "kernels", "graph")
    ]
    print(format_table(result["profiles"], columns))
    rows_seen = sorted({sum(s.num_img_tokens for s in c.sizes) for c in cases})
    result["triton_kernels"] = triton_kernel_checks(args.device)
    print("Triton kernels vs torch (bf16):", result["triton_kernels"])
    result["norm_kernel_sweep"] = norm_kernel_sweep(args.device)
    print(
        format_table(
            result["norm_kernel_sweep"],
            [Column("rows", "rows"), Column("num_warps", "warps")]
            + [
                Column(k, k, ".3f" if k.endswith("ms") else ".0f")
                for k in ("mln_ms", "mln_gb_s", "gated_norm_ms", "gated_norm_gb_s")
            ],
        )
    )
    result["gelu_epilogue"] = gelu_epilogue_check(args.device)
    print("GELU epilogue (fp32):", result["gelu_epilogue"])
    result["linears"] = []
    for rows in rows_seen:
        result["linears"] += linear_rates(rows, ours.config.inner_dim, args.device, dtype, gemm)
    print(
        format_table(
            result["linears"],
            [
                Column("linear", "linear"),
                Column("variant", "variant"),
                Column("ms", "ms", ".4f"),
                Column("tflops", "TFLOP/s", ".0f"),
                Column("pct_gemm", "% GEMM", ".0f"),
            ],
        )
    )
    if args.json_output:
        write_json(args.json_output, result)
    return result


if __name__ == "__main__":
    main()

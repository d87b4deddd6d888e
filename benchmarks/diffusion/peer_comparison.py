"""Peer comparison: diffusers' QwenImageTransformer2DModel vs ours, same weights, one run, one GPU.

    python benchmarks/diffusion/peer_comparison.py --json-output peer.json --plot peer.png

Builds diffusers' `QwenImageTransformer2DModel` (real Qwen-Image widths, `--num-layers` blocks,
seeded random weights made on the device in bf16) and loads the SAME tensors into ours
(`load_state_dict(assign=True)`: no copy). Every case is one transformer forward, CFG off, text
`--text-len` tokens per image, timed with CUDA events (median of `--iters` after `--warmup`):

    single sizes   256x256, 512x512, 768x1024 (w x h), 1024x1024, 1328x1328, one image each
    mixes          8*256x256 (diffusers: one same-shape batch of 8), 512x512+1024x1024 and the
                   4-mix 1024x1024+1024x768+768x1024+512x512 (diffusers cannot batch different
                   shapes: the sum of its per-image forwards)

Variants, in the order they run (each row of the table is one case):

    diffusers            diffusers eager (no mask: equal text lengths)
    ours_fa2             ours eager, AUTO without FlashAttention-3 (the previous default's kernels)
    ours_eager           ours eager, AUTO with FA3 (dense forward for one shape, packed for mixes)
    ours_compiled        + the blocks' elementwise chains compiled (torch.compile, dynamic shapes)
    ours_graph           + CUDA graph replay of the packed forward in its bucket (default buckets;
                           padding rows included in the timing; eager when no bucket fits)
    ours_dense_graph     + CUDA graph replay of the dense forward (one shape only)
    diffusers_compiled   diffusers with `compile_repeated_blocks(fullgraph=True)` (last: in place)

FLOPs and % of the GEMM rate: `count_flops` of transformer_benchmark.py (real tokens only) over the
time; the rate is a `--gemm-size`^3 bf16 matmul measured in the same run.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make `benchmarks.diffusion` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.diffusion.common import (  # noqa: E402
    BarPanel,
    Column,
    Mix,
    environment_info,
    event_median_ms,
    format_table,
    parse_mixes,
    plot_bar_panels,
    write_json,
)
from benchmarks.diffusion.transformer_benchmark import count_flops, gemm_tflops  # noqa: E402

DEFAULT_CASES = "256x256;512x512;768x1024;1024x1024;1328x1328;8*256x256;512x512+1024x1024;" + (
    "1024x1024+1024x768+768x1024+512x512"
)
VARIANTS = (
    "diffusers",
    "ours_fa2",
    "ours_eager",
    "ours_compiled",
    "ours_graph",
    "ours_dense_graph",
    "diffusers_compiled",
)
TIMESTEP = 0.5


def build_models(num_layers: int, device, dtype, seed: int):
    """(diffusers model, ours) sharing every weight tensor."""
    import torch
    from diffusers import QwenImageTransformer2DModel

    from vllm_omni.diffusion.model_loader import build_empty, randomize_weights_
    from vllm_omni.diffusion.models.qwen_image.transformer import (
        QwenImageTransformer,
        QwenImageTransformerConfig,
    )

    ref = build_empty(lambda: QwenImageTransformer2DModel(num_layers=num_layers), device)
    randomize_weights_(ref, torch.Generator(device=device).manual_seed(seed), device=device, dtype=dtype)
    ref.eval().requires_grad_(False)
    ours = build_empty(
        lambda: QwenImageTransformer(QwenImageTransformerConfig(num_layers=num_layers)), device
    )
    ours.load_state_dict(ref.state_dict(), strict=True, assign=True)
    return ref, ours.eval().requires_grad_(False)


class Case:
    """One workload's inputs: per-image latents/text, the dense batch (one shape) and the packed batch."""

    def __init__(self, mix: Mix, model, text_len: int, device, dtype, seed: int):
        import torch

        from vllm_omni.diffusion.models.qwen_image.packing import SequenceSpec, build_packed_layout

        cfg = model.config
        gen = torch.Generator(device="cpu").manual_seed(seed)
        self.mix, self.sizes = mix, list(mix.sizes)
        self.specs = [SequenceSpec(text_len, s.latent_grid) for s in self.sizes]
        self.latents = [
            torch.randn(s.num_img_tokens, cfg.in_channels, generator=gen).to(device, dtype)
            for s in self.sizes
        ]
        self.texts = [
            torch.randn(text_len, cfg.joint_attention_dim, generator=gen).to(device, dtype)
            for _ in self.sizes
        ]
        self.homogeneous = len({s.latent_grid for s in self.sizes}) == 1
        self.layout = build_packed_layout(self.specs, cfg.axes_dims_rope, device=device)
        self.img_rows, self.txt_rows = torch.cat(self.latents), torch.cat(self.texts)
        self.timestep = torch.full((len(self.sizes),), TIMESTEP, device=device, dtype=dtype)

    def dense_args(self, group: list[int]) -> tuple:
        """(hidden_states, encoder_hidden_states, mask, timestep, img_shapes) of same-shape images."""
        import torch

        grid = self.sizes[group[0]].latent_grid
        return (
            torch.stack([self.latents[i] for i in group]),
            torch.stack([self.texts[i] for i in group]),
            None,
            self.timestep[: len(group)],
            [grid] * len(group),
        )

    def groups(self) -> list[list[int]]:
        """Same-shape groups: one batch for a homogeneous case, else one image per forward."""
        return [list(range(len(self.sizes)))] if self.homogeneous else [[i] for i in range(len(self.sizes))]


def run_diffusers(ref, case: Case):
    outs = []
    for group in case.groups():
        img, txt, _, t, grids = case.dense_args(group)
        outs.append(ref(img, txt, None, t, [[g] for g in grids], return_dict=False)[0])
    return outs


def ours_forward(ours, case: Case):
    """The runner's eager choice: dense for one shape, packed otherwise."""
    if case.homogeneous:
        return ours(*case.dense_args(case.groups()[0]))
    return ours.forward_packed(case.img_rows, case.txt_rows, case.timestep, case.layout)


def measure_cases(args, ref, ours, cases: list[Case], gemm: float, out_path: str | None) -> list[dict]:
    import torch

    from vllm_omni.diffusion.attention import SDPABackend
    from vllm_omni.diffusion.attention.backends.auto import AutoAttentionBackend
    from vllm_omni.diffusion.models.qwen_image.fused_ops import BlockOps
    from vllm_omni.diffusion.worker.cuda_graphs import CUDAGraphRunner

    rows = [{"case": c.mix.name, "tokens": sum(s.seq_len for s in c.specs)} for c in cases]
    for row, case in zip(rows, cases):
        row["tflop"] = count_flops(ours.config, case.specs)["total"] / 1e12

    def timeit(name: str, fn: Callable[[], Any], row: dict) -> None:
        t0 = time.perf_counter()
        row[name] = event_median_ms(fn, args.warmup, args.iters)
        print(
            f"  {row['case']:<40} {name:<20} {row[name]:8.2f} ms  ({time.perf_counter() - t0:.1f} s)",
            flush=True,
        )
        if out_path:
            write_json(out_path, {"partial": True, "rows": rows})

    on_cuda = torch.device(args.device).type == "cuda"  # CPU: smoke runs with SDPA's mask path
    graphs = CUDAGraphRunner(ours, args.device, ours.img_in.weight.dtype)
    compiled_ops = BlockOps(compiled=True)
    plan: list[tuple[str, Callable]] = [
        ("diffusers", lambda case: lambda: run_diffusers(ref, case)),
        ("ours_fa2", lambda case: lambda: ours_forward(ours, case)),
        ("ours_eager", lambda case: lambda: ours_forward(ours, case)),
        ("ours_compiled", lambda case: lambda: ours_forward(ours, case)),
        (
            "ours_graph",
            lambda case: (
                lambda: graphs.forward_packed(case.img_rows, case.txt_rows, case.timestep, case.layout)
            ),
        ),
        ("ours_dense_graph", lambda case: lambda: graphs.forward_dense(*case.dense_args(case.groups()[0]))),
        ("diffusers_compiled", lambda case: lambda: run_diffusers(ref, case)),
    ]
    with torch.inference_mode():
        for name, make in plan:
            if name not in args.variants:
                continue
            print(f"variant {name}", flush=True)
            if name == "ours_fa2":
                ours.attn_backend = AutoAttentionBackend(use_fa3=False) if on_cuda else SDPABackend("mask")
            elif name == "ours_eager":
                ours.attn_backend = AutoAttentionBackend() if on_cuda else SDPABackend("mask")
                print(f"  attention: {ours.attn_backend!r}", flush=True)
            elif name == "ours_compiled":
                ours.block_ops = compiled_ops
            elif name == "diffusers_compiled":
                t0 = time.perf_counter()
                ref.compile_repeated_blocks(fullgraph=True)
                print(f"  compile_repeated_blocks set up in {time.perf_counter() - t0:.1f} s", flush=True)
            for row, case in zip(rows, cases):
                if name == "ours_dense_graph" and not case.homogeneous:
                    continue
                timeit(name, make(case), row)
                if name == "ours_graph":
                    row["graph_path"] = graphs.last_path
    for row in rows:
        ours_best = min(row.get(v, float("inf")) for v in VARIANTS if v.startswith("ours"))
        row["ours_best"] = ours_best
        row["x_vs_diffusers"] = row.get("diffusers", float("nan")) / ours_best
        row["x_vs_diffusers_compiled"] = row.get("diffusers_compiled", float("nan")) / ours_best
        row["ours_tflops"] = row["tflop"] / (ours_best / 1e3)
        row["ours_pct_gemm"] = 100 * row["ours_tflops"] / gemm
    return rows


def plot(path: str, rows: list[dict]) -> None:
    cats = [r["case"] for r in rows]
    series = {v: [r.get(v) for r in rows] for v in VARIANTS if any(v in r for r in rows)}
    speed = {
        "vs diffusers eager": [r.get("x_vs_diffusers") for r in rows],
        "vs diffusers compiled": [r.get("x_vs_diffusers_compiled") for r in rows],
    }
    panels = [
        BarPanel("one forward, CFG off (ms, lower is better)", cats, series, "ms"),
        BarPanel(
            "ours (best variant) speedup", cats, speed, "x", hlines={"1.3x target": 1.3, "1.1x target": 1.1}
        ),
    ]
    plot_bar_panels(path, panels, suptitle="Qwen-Image transformer on H200: diffusers vs ours, same weights")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--num-layers", type=int, default=60)
    parser.add_argument("--text-len", type=int, default=64)
    parser.add_argument("--cases", default=DEFAULT_CASES, help="mixes (common.py grammar), ';'-separated")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--gemm-size", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json-output", default=None)
    parser.add_argument("--plot", default=None)
    args = parser.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown:
        parser.error(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")
    import torch

    dtype = torch.bfloat16
    gemm = gemm_tflops(args.device, dtype, args.gemm_size)
    print(f"GEMM {args.gemm_size}^3 bf16: {gemm:.0f} TFLOP/s", flush=True)
    t0 = time.perf_counter()
    ref, ours = build_models(args.num_layers, args.device, dtype, args.seed)
    print(f"models built in {time.perf_counter() - t0:.1f} s", flush=True)
    cases = [
        Case(m, ours, args.text_len, args.device, dtype, args.seed + i)
        for i, m in enumerate(parse_mixes(args.cases))
    ]
    rows = measure_cases(args, ref, ours, cases, gemm, args.json_output)
    columns = [Column("case", "case"), Column("tokens", "tokens")]
    columns += [Column(v, v, ".1f") for v in args.variants]
    columns += [
        Column("x_vs_diffusers", "x diffusers", ".2f"),
        Column("x_vs_diffusers_compiled", "x compiled", ".2f"),
        Column("ours_pct_gemm", "% GEMM", ".0f"),
    ]
    print(
        f"\nGEMM rate {gemm:.0f} TFLOP/s; ms per forward (median of {args.iters}); ours = best ours variant"
    )
    print(format_table(rows, columns))
    result = {"env": environment_info(args.device), "gemm_tflops": gemm, "args": vars(args), "rows": rows}
    if args.json_output:
        write_json(args.json_output, result)
    if args.plot:
        plot(args.plot, rows)
    return result


if __name__ == "__main__":
    main()

"""A forward's LoRA deltas as the model launches them (vllm_omni/lora/kernels.py), per transformer block.

    python benchmarks/diffusion/lora_forward_deltas.py --json-output lora_forward_deltas.json   # H200

`lora_kernels.py` times one linear's delta replayed many times over the same weights (hot in L2, one
stream). A forward differs: each of the 60 blocks has its own adapter weights, the base GEMMs between
the deltas stream their weights through L2, and the image and text streams' deltas share ONE launch
pair at each block point (`lora_delta_pair`, as diffusion/layers/paired_linear.py launches them). This
builds `--blocks` distinct blocks of Qwen-Image's four adapted points (q/k/v as one group, out, MLP up
with its GELU in the expand, MLP down), image rows `--rows` and text rows `--txt-rows`, one rank
`--rank` adapter on every row, per `--tables` (the streams' exact tile tables, and/or tables padded to
the static size a one-sequence CUDA graph of the server holds, spare entries of no rows), and times,
replayed from one CUDA graph each:

    base_us        every block's base GEMMs (both streams), per block
    delta_us       (GEMMs + deltas) - GEMMs, per block: what the adapter adds to a forward
    cold_us        the deltas alone over the blocks' own weights, per block
    hot_us         the deltas alone over the first block's weights `--blocks` times, per block
    delta_vs_base  delta_us / base_us

A block's outputs are checked first against fp32 math of the same inputs (`max_rel_err`, each point's
largest |error| over its largest |reference|). CUDA only for timing; on CPU (TRITON_INTERPRET=1, tiny
--dims, fp32) it runs once per row count as a smoke test (with numpy >= 2.3, triton 3.6's interpreter
needs `tests/triton_interpreter.py`'s PATCH run first).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `benchmarks.diffusion` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.diffusion.common import Column, report_rows  # noqa: E402
from benchmarks.diffusion.lora_kernels import kernel_dtype, parse_dims  # noqa: E402
from benchmarks.diffusion.lora_kernels import time_ms as kernel_time_ms  # noqa: E402

POINTS = {
    "qkv": (3, 3072, 3072, None),
    "out": (1, 3072, 3072, None),
    "mlp_up": (1, 3072, 12288, "gelu_tanh"),
    "mlp_down": (1, 12288, 3072, None),
}
"""name -> (members, in features K, out features N per member, the expand's activation) of one block's
adapted points, in forward order."""
STREAMS = ("img", "txt")


@dataclasses.dataclass
class Point:
    """One stream's adapted linear at one block point: its base weight and slot stacks."""

    weight: object
    """[M N, K]."""
    lora_a: object
    """[max_loras, M R, K]."""
    lora_b: object
    """[max_loras, M N, R]."""
    scaling: object
    """fp32 [M, max_loras + 1] (a group) or [max_loras + 1]; slot 1 = 1.0."""


class Forward:
    """`num_blocks` blocks of both streams' points over shared activations and outputs (the model
    writes each point's output into a fresh buffer; reusing one per point keeps the L2 state alike)."""

    def __init__(self, args, points: dict, rows: int, tables: str, device, dtype):
        import torch

        from vllm_omni.lora.batch import max_tiles, tile_runs

        gen = torch.Generator(device=device).manual_seed(rows)

        def randn(*shape, std=1.0):
            return (torch.randn(*shape, device=device, generator=gen) * std).to(dtype)

        self.points = points
        self.rows = {"img": rows, "txt": args.txt_rows}
        widths = {k for _, k, _, _ in points.values()}
        self.x = {(s, k): randn(n, k) for s, n in self.rows.items() for k in widths}
        self.out = {
            (s, name): torch.empty(n, m * width, device=device, dtype=dtype)
            for s, n in self.rows.items()
            for name, (m, _, width, _) in points.items()
        }
        self.tables = {}
        for s, n in self.rows.items():
            tiles, scales = tile_runs(((0, n, 1, 1.0),))  # one run of slot 1 over every row
            tiles, scales = torch.from_numpy(tiles), torch.from_numpy(scales)
            if tables == "graph":  # a one-sequence graph's static size; spare entries: slot 0, no rows
                spare = max_tiles(n, 2) - tiles.shape[0]  # the runner's max_runs: num_seqs + 1
                tiles = torch.cat([tiles, torch.zeros(spare, 3, dtype=tiles.dtype)])
                scales = torch.cat([scales, torch.zeros(spare, dtype=scales.dtype)])
            self.tables[s] = (tiles.to(device), scales.to(device))

        def point(m, k, n):
            scaling = torch.zeros(m, args.max_loras + 1, device=device)
            scaling[:, 1] = 1.0
            return Point(
                weight=randn(m * n, k, std=k**-0.5),
                lora_a=randn(args.max_loras, m * args.rank, k, std=0.02),
                lora_b=randn(args.max_loras, m * n, args.rank, std=0.02),
                scaling=scaling if m > 1 else scaling[0],
            )

        self.blocks = [
            {(s, name): point(m, k, n) for name, (m, k, n, _) in points.items() for s in STREAMS}
            for _ in range(args.blocks)
        ]

    def run(self, blocks: list[dict] | None = None, base: bool = True, delta: bool = True) -> None:
        """`blocks` (default: all of them) in order: each point's base GEMMs, then its paired delta."""
        import torch

        from vllm_omni.lora.kernels import KernelDelta, lora_delta_pair

        for block in self.blocks if blocks is None else blocks:
            for name, (_, k, _, activation) in self.points.items():
                segments = []
                for s in STREAMS:
                    p, x, out = block[(s, name)], self.x[(s, k)], self.out[(s, name)]
                    if base:
                        torch.mm(x, p.weight.t(), out=out)
                    tiles, scales = self.tables[s]
                    segments.append(
                        KernelDelta(x, out, p.lora_a, p.lora_b, p.scaling, tiles, scales, activation)
                    )
                if delta:
                    lora_delta_pair(*segments)

    def max_rel_err(self) -> float:
        """The first block through `run`, against fp32 math of the same inputs (each stream's
        x @ W^T + (x @ A_m^T) @ B_m^T per member m, then the point's activation), the worst point's
        relative error."""
        import torch
        import torch.nn.functional as F

        self.run(self.blocks[:1])
        worst = 0.0
        for (s, name), p in self.blocks[0].items():
            members, k, n, activation = self.points[name]
            x, r = self.x[(s, k)].float(), p.lora_a.shape[1] // members
            a, b = p.lora_a[0].float(), p.lora_b[0].float()  # slot 1: [M R, K], [M N, R]
            # member m: its R rows of A, its N rows of B, its N output columns
            delta = [(x @ a[m * r : (m + 1) * r].t()) @ b[m * n : (m + 1) * n].t() for m in range(members)]
            ref = x @ p.weight.float().t() + torch.cat(delta, dim=1)
            if activation == "gelu_tanh":
                ref = F.gelu(ref, approximate="tanh")
            err = (self.out[(s, name)].float() - ref).abs().max() / ref.abs().max().clamp_min(1e-12)
            worst = max(worst, float(err))
        return worst


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="256,1024,4096", help="comma-separated image-stream row counts")
    parser.add_argument("--txt-rows", type=int, default=32, help="text-stream rows (a prompt's tokens)")
    parser.add_argument("--blocks", type=int, default=40, help="distinct transformer blocks")
    parser.add_argument(
        "--dims", default=None, help="name:members:K:N,... instead of Qwen-Image's (CPU smoke; mlp_up: GELU)"
    )
    parser.add_argument(
        "--tables",
        default="exact,graph",
        help="comma-separated: exact (each stream's tiles) and/or graph (padded to a one-sequence CUDA "
        "graph's static table size, as the server replays it)",
    )
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--max-loras", type=int, default=8)
    parser.add_argument("--iters", type=int, default=20, help="graph replays timed (median)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json-output", default=None)
    args = parser.parse_args(argv)
    unknown = set(args.tables.split(",")) - {"exact", "graph"}
    if unknown:
        parser.error(f"--tables: {sorted(unknown)} are not exact / graph")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    import torch
    from tqdm import tqdm

    device = torch.device(args.device)
    dtype = kernel_dtype(device)
    points = POINTS
    if args.dims:  # each point keeps its activation (mlp_up: the GELU)
        points = {
            name: (*dims, POINTS.get(name, (None,) * 4)[3]) for name, dims in parse_dims(args.dims).items()
        }

    def time_ms(fn) -> float:
        return kernel_time_ms(fn, device, calls=1, iters=args.iters)

    results = []
    cases = [(int(r), t) for r in args.rows.split(",") for t in args.tables.split(",")]
    for rows, tables in tqdm(cases, desc="cases", unit="case"):
        forward = Forward(args, points, rows, tables, device, dtype)
        row = {"rows": rows, "tables": tables, "txt_rows": args.txt_rows, "blocks": args.blocks}
        row["max_rel_err"] = forward.max_rel_err()
        per_block_us = 1e3 / args.blocks
        base_ms = time_ms(lambda f=forward: f.run(delta=False))
        both_ms = time_ms(lambda f=forward: f.run())
        row["base_us"] = base_ms * per_block_us
        row["delta_us"] = (both_ms - base_ms) * per_block_us
        row["cold_us"] = time_ms(lambda f=forward: f.run(base=False)) * per_block_us
        hot = [forward.blocks[0]] * args.blocks  # the first block's weights for every block
        row["hot_us"] = time_ms(lambda f=forward, b=hot: f.run(b, base=False)) * per_block_us
        row["delta_vs_base"] = row["delta_us"] / row["base_us"]
        results.append(row)
        del forward
        if device.type == "cuda":
            torch.cuda.empty_cache()
    columns = [
        Column("rows", "rows", "d"),
        Column("tables", "tables", "s"),
        Column("base_us", "base us/block", ".1f"),
        Column("delta_us", "delta us/block", ".1f"),
        Column("cold_us", "deltas alone, cold", ".1f"),
        Column("hot_us", "deltas alone, hot", ".1f"),
        Column("delta_vs_base", "delta/base", ".3f"),
        Column("max_rel_err", "max rel err", ".1e"),
    ]
    return report_rows(args, results, columns)


if __name__ == "__main__":
    main()

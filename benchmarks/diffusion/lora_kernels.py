"""The LoRA delta kernels alone (vllm_omni/lora/kernels.py) at Qwen-Image's shapes, against the base GEMM.

    python benchmarks/diffusion/lora_kernels.py --json-output lora_kernels.json            # H200
    python benchmarks/diffusion/lora_kernels.py --sweep --json-output lora_kernels.json    # + the grid

Per rows x linear (qkv: q, k, v 3072 -> 3072 each, one merged group; out 3072 -> 3072; mlp_up
3072 -> 12288; mlp_down 12288 -> 3072), bf16, one rank-64 adapter on every row (every tile works;
`--max-loras` slots allocated), the GPU milliseconds of one call, replayed from a CUDA graph of
`--calls` calls (as the server's graphs run them; eager timing would time the launches):

    base_ms          F.linear(x, W) over the (merged) weights
    delta_ms         lora_delta with the default plan (plan_delta); qkv: ONE launch pair for the group
    members_ms       qkv only: a launch pair per member over its views of the stacks (before the group)
    delta_vs_base    delta_ms / base_ms
    min_bytes_ms     the delta's unavoidable HBM traffic (x read once, the output read and written once,
                     A and B once) at --hbm-tbps: how far the kernels are from their bound

and the default plan's shapes. `--fold 1,8` adds, per max_loras L of the list, `fold_L_extra_ms`: what
the base GEMM costs more with every slot's A stacked under W as extra output columns (F.linear over
[W; A_1 .. A_L], N + L M R columns, minus base_ms), the price of computing the shrink inside the base
GEMM (no shrink launch; the expand would read those columns) instead of launching it.
`--sweep` also times every (tile rows, split_k, n_chunks) of its grid
per case (a launch plan of `plan_delta` with those overrides, tables cut to the tile rows) and reports
the fastest: what to set the constants in lora/kernels.py (and batch.TILE_ROWS) to. Per rows, a
`block` row sums the four cases: one transformer block's image-stream deltas (rows 256 / 1024 / 4096
are a 256 / 512 / 1024 px image; the text stream adds the same linears at its own, smaller, rows).

CUDA only for timing; on CPU (TRITON_INTERPRET=1, tiny --dims) it runs once per case as a smoke test
(with numpy >= 2.3, triton 3.6's interpreter needs `tests/triton_interpreter.py`'s PATCH run first).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `benchmarks.diffusion` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.diffusion.common import Column, event_median_ms, graph_replay_ms, report_rows  # noqa: E402

LINEARS = {
    "qkv": (3, 3072, 3072),
    "out": (1, 3072, 3072),
    "mlp_up": (1, 3072, 12288),
    "mlp_down": (1, 12288, 3072),
}
"""name -> (members, in features K, out features N per member) of Qwen-Image's LoRA-targeted linears."""
SWEEP = {"tile_rows": (32, 64, 128), "split_k": (1, 2, 4, 8, 12, 16), "n_chunks": (1, 2, 4, 8)}
"""The `--sweep` grid (plan_delta overrides)."""


@dataclasses.dataclass
class Case:
    """One rows x linear: the activations, the slot stacks and the output, on the device."""

    rows: int
    members: int
    k: int
    n: int
    x: object
    weight: object
    out: object
    lora_a: object
    lora_b: object
    scaling: object

    def tables(self, tile_rows: int):
        """(tiles, scales) of one run of slot 1 over every row, cut into `tile_rows`-row tiles."""
        import torch

        from vllm_omni.lora.batch import tile_runs

        tiles, scales = tile_runs(((0, self.rows, 1, 1.0),), tile_rows)
        return torch.from_numpy(tiles).to(self.x.device), torch.from_numpy(scales).to(self.x.device)

    def min_bytes(self) -> int:
        """HBM bytes no delta kernel can avoid: x once, the output read and written, A and B once."""
        size = self.x.element_size()
        rank = self.lora_b.shape[2]
        total_n = self.members * self.n
        return size * (
            self.rows * self.k + 2 * self.rows * total_n + rank * self.members * self.k + total_n * rank
        )


def make_case(rows: int, members: int, k: int, n: int, rank: int, max_loras: int, device, dtype) -> Case:
    import torch

    gen = torch.Generator(device=device).manual_seed(rows + k + n)

    def randn(*shape, std=1.0):
        return (torch.randn(*shape, device=device, generator=gen) * std).to(dtype)

    scaling = torch.zeros(members, max_loras + 1, device=device)
    scaling[:, 1] = 1.0
    return Case(
        rows, members, k, n,
        x=randn(rows, k),
        weight=randn(members * n, k, std=k**-0.5),
        out=randn(rows, members * n),
        lora_a=randn(max_loras, members * rank, k, std=0.02),
        lora_b=randn(max_loras, members * n, rank, std=0.02),
        scaling=scaling if members > 1 else scaling[0],
    )  # fmt: skip


def time_ms(fn, device, calls: int, iters: int = 10) -> float:
    """GPU ms of one `fn()`, `calls` of them replayed from one CUDA graph (median of `iters`); on CPU
    one host-timed call (a smoke run under the interpreter)."""
    if device.type == "cuda":
        return graph_replay_ms(fn, calls=calls, iters=iters)
    return event_median_ms(fn, warmup=0, iters=1)


def parse_dims(spec: str) -> dict[str, tuple[int, ...]]:
    """`--dims` "name:members:K:N,..." -> {name: (members, K, N)} (tiny shapes for CPU smoke runs)."""
    return {name: tuple(map(int, rest)) for name, *rest in (d.split(":") for d in spec.split(","))}


def kernel_dtype(device):
    """bf16 on CUDA (what the server runs), fp32 on CPU (the interpreter's exact reference)."""
    import torch

    return torch.bfloat16 if device.type == "cuda" else torch.float32


def delta_fn(case: Case, tile_rows: int | None = None, **overrides):
    """(a call of the group's delta with plan_delta(**overrides), that plan)."""
    from vllm_omni.lora.batch import TILE_ROWS
    from vllm_omni.lora.kernels import lora_delta, plan_delta

    tile_rows = tile_rows or TILE_ROWS
    tiles, scales = case.tables(tile_rows)
    rank = case.lora_b.shape[2]
    plan = plan_delta(
        tiles.shape[0],
        case.members,
        case.k,
        case.n,
        rank,
        case.x.element_size(),
        block_m=tile_rows,
        **overrides,
    )
    stacks = (case.lora_a, case.lora_b, case.scaling, tiles, scales, plan)
    return (lambda: lora_delta(case.x, case.out, *stacks)), plan


def members_fn(case: Case):
    """Each member's own launch pair over its views of the stacks (the path before the group)."""
    from vllm_omni.lora.batch import TILE_ROWS
    from vllm_omni.lora.kernels import lora_delta

    tiles, scales = case.tables(TILE_ROWS)
    rank, n = case.lora_b.shape[2], case.n
    views = [
        (
            case.out[:, i * n : (i + 1) * n],
            case.lora_a[:, i * rank : (i + 1) * rank],
            case.lora_b[:, i * n : (i + 1) * n],
            case.scaling[i],
        )
        for i in range(case.members)
    ]

    def run():
        for out, a, b, s in views:
            lora_delta(case.x, out, a, b, s, tiles, scales)

    return run


def sweep(case: Case, device, calls: int) -> dict:
    """The fastest plan of the SWEEP grid for `case` (and every point's time)."""
    points = []
    for tile_rows, split_k, n_chunks in itertools.product(*SWEEP.values()):
        fn, plan = delta_fn(case, tile_rows, split_k=split_k, n_chunks=n_chunks)
        if (plan.split_k, plan.n_chunks) != (split_k, n_chunks):
            continue  # clamped to an already timed point
        try:
            ms = time_ms(fn, device, calls)
        except Exception as exc:  # noqa: BLE001  (e.g. out of shared memory at 128-row tiles)
            print(f"  sweep {tile_rows}/{split_k}/{n_chunks}: {type(exc).__name__}: {str(exc)[:120]}")
            continue
        points.append({"tile_rows": tile_rows, "split_k": split_k, "n_chunks": n_chunks, "ms": ms})
    best = min(points, key=lambda p: p["ms"]) if points else None
    return {"best": best, "points": points}


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="256,1024,4096,8192", help="comma-separated row counts")
    parser.add_argument(
        "--dims", default=None, help="name:members:K:N,... instead of Qwen-Image's (CPU smoke)"
    )
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--max-loras", type=int, default=8)
    parser.add_argument("--calls", type=int, default=20, help="calls per captured graph")
    parser.add_argument("--hbm-tbps", type=float, default=4.8, help="HBM bandwidth for min_bytes_ms (H200)")
    parser.add_argument("--sweep", action="store_true", help="also time the SWEEP grid per case")
    parser.add_argument(
        "--fold", default="", help="comma-separated max_loras: the base GEMM with L slots' A as extra columns"
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json-output", default=None)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    import torch
    import torch.nn.functional as F

    device = torch.device(args.device)
    dtype = kernel_dtype(device)
    linears = parse_dims(args.dims) if args.dims else LINEARS
    fold_loras = [int(v) for v in args.fold.split(",") if v]
    # what a `block` row sums over the four linears
    summed = ("base_ms", "delta_ms", "min_bytes_ms", *(f"fold_{v}_extra_ms" for v in fold_loras))
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        block = {"rows": rows, "linear": "block", **dict.fromkeys(summed, 0.0)}
        for name, (members, k, n) in linears.items():
            case = make_case(rows, members, k, n, args.rank, args.max_loras, device, dtype)
            fn, plan = delta_fn(case)
            row = {"rows": rows, "linear": name, "plan": dataclasses.asdict(plan)}
            row["base_ms"] = time_ms(lambda c=case: F.linear(c.x, c.weight), device, args.calls)
            row["delta_ms"] = time_ms(fn, device, args.calls)
            if members > 1:
                row["members_ms"] = time_ms(members_fn(case), device, args.calls)
            row["delta_vs_base"] = row["delta_ms"] / row["base_ms"]
            for loras in fold_loras:
                # [N M + L M R, K]: the base weight, then slots 1 .. L's stacked A (one slot = M R rows)
                a = case.lora_a[:1].expand(loras, -1, -1).reshape(-1, k)
                w_ext = torch.cat([case.weight, a])
                ext_ms = time_ms(lambda c=case, w=w_ext: F.linear(c.x, w), device, args.calls)
                row[f"fold_{loras}_extra_ms"] = ext_ms - row["base_ms"]
                del w_ext
            row["min_bytes_ms"] = case.min_bytes() / (args.hbm_tbps * 1e9)
            if args.sweep:
                row["sweep"] = sweep(case, device, args.calls)
                best = row["sweep"]["best"]
                if best:
                    row["best_ms"] = best["ms"]
                    row["best"] = f"{best['tile_rows']}/{best['split_k']}/{best['n_chunks']}"
            for key in summed:
                block[key] += row[key]
            results.append(row)
            del case
            if device.type == "cuda":
                torch.cuda.empty_cache()
        block["delta_vs_base"] = block["delta_ms"] / block["base_ms"]
        results.append(block)
    columns = [
        Column("rows", "rows", "d"),
        Column("linear", "linear", "s"),
        Column("base_ms", "base ms", ".4f"),
        Column("delta_ms", "delta ms", ".4f"),
        Column("delta_vs_base", "delta/base", ".3f"),
        Column("members_ms", "per-member ms", ".4f"),
        Column("min_bytes_ms", "bytes bound", ".4f"),
    ]
    columns += [Column(f"fold_{v}_extra_ms", f"fold L={v} extra ms", ".4f") for v in fold_loras]
    if args.sweep:
        columns += [Column("best_ms", "best ms", ".4f"), Column("best", "tile/split/chunks", "s")]
    return report_rows(args, results, columns)


if __name__ == "__main__":
    main()

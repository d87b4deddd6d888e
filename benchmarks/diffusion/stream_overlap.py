"""Can the weight-bound GEMMs of a block hide behind its compute-bound ones? (a micro-benchmark)

    python benchmarks/diffusion/stream_overlap.py --json-output overlap.json

A Qwen-Image block runs two kinds of GEMMs. The image stream's (thousands of rows) are compute
bound. The text stream's (tens to hundreds of rows) and the AdaLN modulation (one row per sequence)
read ~450 MB of weights per block and are bound by memory bandwidth. This script times, for the
row counts of real steps, the block's linears (and one attention call of the step's sequences)
over `--blocks` blocks:

    serial      everything on one stream, in the block's order
    side        text-stream GEMMs on a second stream, joined where the block needs them
                (before attention, before the residual), modulation too
    side+mod    as `side`, but every block's modulation is issued first on the side stream
                (it depends only on the timestep embedding), one event per block

each eager and replayed from a CUDA graph (multi-stream capture). Then two ways to merge the small
GEMMs into others: each linear of both streams as one `torch._grouped_mm` over [img; txt] rows
against two cuBLAS GEMMs, and the modulation of 60 blocks as one GEMM against 120 (or 60 with both
streams fused). Last, every linear shape alone (TFLOP/s or GB/s) under cuBLAS and cuBLASLt. First
of all (alone with `--skinny-only`), the weight-bound linears at 2, 38 and 128 rows under cuBLAS,
GPU time from graph replays: how close they already are to the memory's rate.
Results and what was kept: performance_dashboard/qwen_image_issue12.md, "Round 3".
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `benchmarks.diffusion` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.diffusion.common import (  # noqa: E402
    Column,
    capture_graph,
    environment_info,
    event_median_ms,
    format_table,
    graph_replay_ms,
    write_json,
)

HIDDEN = 3072
CASES = {  # name: (image rows, text rows, sequences with their lengths for attention)
    "512x512 CFG": (2048, 128, [1088, 1088]),
    "1024x1024 CFG": (8192, 128, [4160, 4160]),
    "512+1024 CFG": (10240, 256, [1088, 1088, 4160, 4160]),
    "4-mix CFG": (22528, 512, [4160, 4160, 3136, 3136, 3136, 3136, 1088, 1088]),
}


class Block:
    """Random bf16 weights of one block's linears (the shapes of Qwen-Image)."""

    def __init__(self, torch, device):
        def w(out_f, in_f):
            return torch.randn(out_f, in_f, device=device, dtype=torch.bfloat16) * 0.02

        self.img = {"qkv": w(3 * HIDDEN, HIDDEN), "out": w(HIDDEN, HIDDEN)}
        self.img |= {"up": w(4 * HIDDEN, HIDDEN), "down": w(HIDDEN, 4 * HIDDEN)}
        self.txt = {k: w(*v.shape) for k, v in self.img.items()}
        self.mod = (w(6 * HIDDEN, HIDDEN), w(6 * HIDDEN, HIDDEN))
        self.bias = torch.zeros(4 * HIDDEN, device=device, dtype=torch.bfloat16)


def make_step(torch, blocks, x_img, x_txt, temb, attn, mode: str):
    """One 'forward' over the blocks in `mode` (serial, side, side+mod); returns a callable."""
    side = torch.cuda.Stream()

    def linear(x, w):
        return x @ w.t()

    def run():
        main = torch.cuda.current_stream()  # the capture stream while a graph is captured
        mods = [None] * len(blocks)
        mod_ready = [torch.cuda.Event() for _ in blocks]
        if mode == "side+mod":
            side.wait_stream(main)
            with torch.cuda.stream(side):
                for i, b in enumerate(blocks):
                    mods[i] = (linear(temb, b.mod[0]), linear(temb, b.mod[1]))
                    mod_ready[i].record(side)
        for i, b in enumerate(blocks):
            if mode == "serial":
                mods[i] = (linear(temb, b.mod[0]), linear(temb, b.mod[1]))
                qkv_i, qkv_t = linear(x_img, b.img["qkv"]), linear(x_txt, b.txt["qkv"])
                attn()
                out_i, out_t = (
                    linear(qkv_i[:, :HIDDEN], b.img["out"]),
                    linear(qkv_t[:, :HIDDEN], b.txt["out"]),
                )
                up_i = torch._addmm_activation(b.bias, out_i, b.img["up"].t(), use_gelu=True)
                linear(up_i, b.img["down"])
                up_t = torch._addmm_activation(b.bias, out_t, b.txt["up"].t(), use_gelu=True)
                linear(up_t, b.txt["down"])
                continue
            side.wait_stream(main)
            with torch.cuda.stream(side):
                if mode == "side":
                    mods[i] = (linear(temb, b.mod[0]), linear(temb, b.mod[1]))
                    mod_ready[i].record(side)
                qkv_t = linear(x_txt, b.txt["qkv"])
            main.wait_event(mod_ready[i])
            qkv_i = linear(x_img, b.img["qkv"])
            main.wait_stream(side)
            attn()
            side.wait_stream(main)
            with torch.cuda.stream(side):
                out_t = linear(qkv_t[:, :HIDDEN], b.txt["out"])
                up_t = torch._addmm_activation(b.bias, out_t, b.txt["up"].t(), use_gelu=True)
                linear(up_t, b.txt["down"])
            out_i = linear(qkv_i[:, :HIDDEN], b.img["out"])
            up_i = torch._addmm_activation(b.bias, out_i, b.img["up"].t(), use_gelu=True)
            linear(up_i, b.img["down"])
            main.wait_stream(side)

    return run


def shape_rates(torch, rows: dict[str, int], blocks, iters: int) -> list[dict]:
    """Each linear shape alone under cuBLAS and cuBLASLt: ms and TFLOP/s (compute) or GB/s (weights)."""
    out = []
    b = blocks[0]
    for stream, m in rows.items():
        weights = b.mod[0:1] if stream == "mod" else list(b.img.values())
        names = ["mod"] if stream == "mod" else list(b.img)
        for name, w in zip(names, weights):
            x = torch.randn(m, w.shape[1], device=w.device, dtype=w.dtype)
            row = {"stream": stream, "linear": name, "m": m, "n": w.shape[0], "k": w.shape[1]}
            for lib in ("cublas", "cublaslt"):
                torch.backends.cuda.preferred_blas_library(lib)
                ms = event_median_ms(partial(torch.matmul, x, w.t()), 3, iters)
                row[f"{lib}_ms"] = ms
                row[f"{lib}_tflops"] = 2 * m * w.shape[0] * w.shape[1] / ms / 1e9
                row[f"{lib}_weight_gbs"] = w.numel() * w.element_size() / ms / 1e6
            torch.backends.cuda.preferred_blas_library("cublas")
            out.append(row)
    return out


def grouped_rates(torch, img_rows: int, txt_rows: int, num_seqs: int, block, iters: int) -> list[dict]:
    """Each linear of both streams: two cuBLAS GEMMs vs one `torch._grouped_mm` over [img; txt] rows."""
    out = []
    for name, w_img in block.img.items():
        w_txt = block.txt[name]
        stacked = torch.stack([w_img, w_txt])  # [2, N, K]
        x = torch.randn(img_rows + txt_rows, w_img.shape[1], device=w_img.device, dtype=w_img.dtype)
        x_img, x_txt = x[:img_rows], x[img_rows:]
        offs = torch.tensor([img_rows, img_rows + txt_rows], device=x.device, dtype=torch.int32)

        def two(x_img=x_img, x_txt=x_txt, w_img=w_img, w_txt=w_txt):
            return x_img @ w_img.t(), x_txt @ w_txt.t()

        def grouped(x=x, stacked=stacked, offs=offs):
            return torch._grouped_mm(x, stacked.transpose(-2, -1), offs=offs)

        row = {"linear": name, "img_rows": img_rows, "txt_rows": txt_rows}
        row["two_gemms_ms"] = event_median_ms(two, 3, iters)
        try:
            ref = torch.cat(two())
            got = grouped()
            row["grouped_ms"] = event_median_ms(grouped, 3, iters)
            row["grouped_max_abs"] = (got.float() - ref.float()).abs().max().item()
        except Exception as exc:  # not every build has the SM90 grouped kernels
            row["grouped_error"] = repr(exc)[:200]
        out.append(row)
    # modulation: per block (two GEMMs of [S, 3072] x [3072, 18432]) vs all blocks in one GEMM
    temb = torch.randn(num_seqs, HIDDEN, device=block.bias.device, dtype=torch.bfloat16)
    blocks = 60
    every = torch.randn(blocks * 12 * HIDDEN, HIDDEN, device=temb.device, dtype=temb.dtype) * 0.02
    per_block = every.view(blocks, 2, 6 * HIDDEN, HIDDEN)

    def mod_per_block():
        for b in range(blocks):
            temb @ per_block[b, 0].t(), temb @ per_block[b, 1].t()

    def mod_per_block_fused():
        for b in range(blocks):
            temb @ per_block[b].flatten(0, 1).t()

    row = {"linear": "mod x60", "img_rows": num_seqs, "txt_rows": 0}
    row["two_gemms_ms"] = event_median_ms(mod_per_block, 2, iters)
    row["one_per_block_ms"] = event_median_ms(mod_per_block_fused, 2, iters)
    row["grouped_ms"] = event_median_ms(lambda: temb @ every.t(), 2, iters)  # all blocks, one GEMM
    row["weight_tb_s_one_gemm"] = every.numel() * 2 / row["grouped_ms"] / 1e9
    out.append(row)
    return out


def skinny_rates(torch, iters: int) -> list[dict]:
    """Weight-bound linears (modulation rows, text rows of a step) under cuBLAS, GPU time from graph
    replays: ms and GB/s of weights read. (Timed eager one call at a time, their launch cost would
    hide that cuBLAS reads the weight at 3-3.7 TB/s.)"""
    import torch.nn.functional as F

    out = []
    device = torch.device("cuda")
    shapes = {"mod": (6 * HIDDEN, HIDDEN), "qkv": (3 * HIDDEN, HIDDEN), "up": (4 * HIDDEN, HIDDEN)}
    shapes |= {"out": (HIDDEN, HIDDEN), "down": (HIDDEN, 4 * HIDDEN)}
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
        b = torch.zeros(n, device=device, dtype=torch.bfloat16)
        for m in (2, 38, 128):
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            ms = graph_replay_ms(partial(F.linear, x, w, b), iters=iters)
            out.append(
                {"linear": name, "m": m, "n": n, "k": k, "ms": ms, "weight_gb_s": w.numel() * 2 / ms / 1e6}
            )
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated names of CASES")
    parser.add_argument("--skinny-only", action="store_true", help="only the weight-bound linears")
    parser.add_argument("--json-output")
    args = parser.parse_args(argv)

    import torch
    import torch.nn.functional as F

    device = torch.device("cuda")
    torch.manual_seed(0)
    blocks = [Block(torch, device) for _ in range(args.blocks)]
    rows, shapes, grouped = [], [], []
    skinny = skinny_rates(torch, args.iters)
    skinny_cols = [Column(c, c) for c in ("linear", "m", "n", "k")]
    skinny_cols += [Column("ms", "ms", ".4f"), Column("weight_gb_s", "weight GB/s", ".0f")]
    print("weight-bound linears (cuBLAS, graph replay)\n" + format_table(skinny, skinny_cols), flush=True)
    for name in [] if args.skinny_only else args.cases.split(","):
        img_rows, txt_rows, seq_lens = CASES[name]
        x_img = torch.randn(img_rows, HIDDEN, device=device, dtype=torch.bfloat16)
        x_txt = torch.randn(txt_rows, HIDDEN, device=device, dtype=torch.bfloat16)
        temb = torch.randn(len(seq_lens), HIDDEN, device=device, dtype=torch.bfloat16)
        qkv = [torch.randn(3, 1, 24, n, 128, device=device, dtype=torch.bfloat16) for n in seq_lens]

        def attn(qkv=qkv):  # one SDPA call per sequence (flash), the attention's share of the block
            for q, k, v in qkv:
                F.scaled_dot_product_attention(q, k, v)

        row = {"case": name, "img_rows": img_rows, "txt_rows": txt_rows, "num_seqs": len(seq_lens)}
        for mode in ("serial", "side", "side+mod"):
            step = make_step(torch, blocks, x_img, x_txt, temb, attn, mode)
            row[f"{mode}_eager_ms"] = event_median_ms(step, 2, args.iters) / args.blocks
            replay = capture_graph(step)
            row[f"{mode}_graph_ms"] = event_median_ms(replay, 2, args.iters) / args.blocks
            del replay
        row["attn_ms"] = event_median_ms(attn, 2, args.iters)
        rows.append(row)
        print(row, flush=True)
        grouped += grouped_rates(torch, img_rows, txt_rows, len(seq_lens), blocks[0], args.iters)
        print(grouped[-5:], flush=True)
        shapes += shape_rates(
            torch, {"img": img_rows, "txt": txt_rows, "mod": len(seq_lens)}, blocks, args.iters
        )

    cols = [Column("case", "case"), Column("attn_ms", "attn ms", ".3f")]
    cols += [
        Column(f"{m}_{k}_ms", f"{m} {k}", ".3f")
        for k in ("eager", "graph")
        for m in ("serial", "side", "side+mod")
    ]
    print("\nms per block (linears + attention)\n" + format_table(rows, cols))
    shape_cols = [Column(c, c) for c in ("stream", "linear", "m", "n", "k")]
    shape_cols += [
        Column(f"{lib}_{k}", f"{lib} {k}", ".3f" if k == "ms" else ".0f")
        for lib in ("cublas", "cublaslt")
        for k in ("ms", "tflops", "weight_gbs")
    ]
    print("\nlinears alone\n" + format_table(shapes, shape_cols))
    grouped_cols = [Column(c, c) for c in ("linear", "img_rows", "txt_rows")]
    grouped_cols += [Column(c, c, ".3f") for c in ("two_gemms_ms", "grouped_ms", "one_per_block_ms")]
    print("\nboth streams' linear: two GEMMs vs one grouped GEMM\n" + format_table(grouped, grouped_cols))
    result = {"env": environment_info("cuda"), "args": vars(args), "rows": rows, "shapes": shapes}
    result["grouped"], result["skinny"] = grouped, skinny
    if args.json_output:
        write_json(args.json_output, result)
    return result


if __name__ == "__main__":
    main()

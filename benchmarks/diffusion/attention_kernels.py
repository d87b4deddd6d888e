"""Attention kernels on packed layouts: FA2 varlen (torch), FA3 varlen (fa3-fwd), per-sequence SDPA.

    python benchmarks/diffusion/attention_kernels.py --json-output attn.json

Random bf16 q/k/v `[total_tokens, 24, 128]` per layout (a list of sequence lengths, Qwen-Image's
joint text+image sequences); each kernel is timed eager and, for the varlen kernels, replayed from a
CUDA graph (CUDA events, median of `--iters`). TFLOP/s counts `4 * sum(L_i^2) * H * D`. The fastest
eager kernel per layout is what AUTO's thresholds (attention/backends/auto.py) follow; `rel_err`
is FA3 against FA2 (max |diff| / max |FA2|).
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
    write_json,
)

LAYOUTS = {
    "16x320": [320] * 16,
    "8x320": [320] * 8,
    "2x1088": [1088] * 2,
    "4x1088": [1088] * 4,
    "2x1600": [1600] * 2,
    "2x2100": [2100] * 2,
    "2x3136": [3136] * 2,
    "1104+4156": [1104, 4156],
    "2x4160": [4160] * 2,
    "4-mix": [4160, 3136, 3136, 1088],
    "4-mix CFG": [4160, 4110, 3136, 3086, 3136, 3086, 1088, 1038],
    "1x6953": [6953],
    "1x16512": [16512],
}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--heads", type=int, default=24)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--json-output", default=None)
    args = parser.parse_args(argv)
    import torch

    from vllm_omni.diffusion.attention import SDPABackend, build_varlen_metadata
    from vllm_omni.diffusion.attention.backends.fa3 import FlashAttn3Backend
    from vllm_omni.diffusion.attention.backends.flash_attn import FlashAttnBackend

    device = torch.device("cuda")
    has_fa3 = FlashAttn3Backend.is_available(device)
    kernels = {"fa2": FlashAttnBackend(), "sdpa_per_seq": SDPABackend("per_seq")}
    if has_fa3:
        kernels["fa3"] = FlashAttn3Backend()
    rows = []
    with torch.inference_mode():
        for name, lens in LAYOUTS.items():
            total = sum(lens)
            q, k, v = (
                torch.randn(total, args.heads, args.head_dim, device=device, dtype=torch.bfloat16)
                for _ in range(3)
            )
            meta = build_varlen_metadata(lens, device)
            flop = 4 * sum(n * n for n in lens) * args.heads * args.head_dim
            row = {"layout": name, "seqs": len(lens), "mean_len": total / len(lens)}
            outs = {}
            for kname, kernel in kernels.items():
                outs[kname] = kernel(q, k, v, meta)
                ms = event_median_ms(partial(kernel, q, k, v, meta), 3, args.iters)
                row[f"{kname}_tflops"] = flop / ms / 1e9
                if kname != "sdpa_per_seq":
                    replay = capture_graph(partial(kernel, q, k, v, meta))
                    row[f"{kname}_graph_tflops"] = flop / event_median_ms(replay, 3, args.iters) / 1e9
            eager = {kn: row[f"{kn}_tflops"] for kn in kernels}
            row["fastest_eager"] = max(eager, key=eager.get)
            if has_fa3:
                ref = outs["fa2"].float()
                row["fa3_rel_err"] = float((outs["fa3"].float() - ref).abs().max() / ref.abs().max())
            rows.append(row)
            print(row, flush=True)
    columns = [Column("layout", "layout"), Column("mean_len", "mean len", ".0f")]
    for kname in kernels:
        columns.append(Column(f"{kname}_tflops", f"{kname} eager", ".0f"))
        if kname != "sdpa_per_seq":
            columns.append(Column(f"{kname}_graph_tflops", f"{kname} graph", ".0f"))
    columns += [Column("fastest_eager", "fastest eager"), Column("fa3_rel_err", "fa3 rel err", ".1e")]
    print("\nTFLOP/s, bf16, heads x dim =", args.heads, "x", args.head_dim)
    print(format_table(rows, columns))
    result = {"env": environment_info(device), "fa3_available": has_fa3, "rows": rows}
    if args.json_output:
        write_json(args.json_output, result)
    return result


if __name__ == "__main__":
    main()

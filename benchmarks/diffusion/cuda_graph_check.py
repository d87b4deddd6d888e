"""CUDA graphs of our transformer on the GPU: replay == eager of the same padded batch, and timings.

    python benchmarks/diffusion/cuda_graph_check.py --num-layers 60 --json-output graphs.json

Real-width Qwen-Image transformer (`--num-layers` blocks, seeded random bf16 weights). For eager and
compiled fused ops, every case runs through `CUDAGraphRunner` (default buckets):

    max_abs_padded    |replay - eager forward of the same padded bucket batch|: must be 0
    max_abs_unpadded  |replay - eager forward of the batch as it is| (GEMM tiling differs with the
                      row count: small, not 0), and rel_err = max |diff| / max |eager|
    eager_ms / graph_ms  CUDA-event medians (graph_ms includes loading the static buffers)

Dense cases compare the dense graph with the dense eager forward (no padding: max_abs must be 0).
`--capture-all` then captures the whole default bucket grid and reports its time and memory.
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `benchmarks.diffusion` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.diffusion.common import Column, environment_info, event_median_ms, format_table, write_json  # noqa: E402
from benchmarks.diffusion.transformer_benchmark import build_transformer  # noqa: E402

# name -> [(width, height, text tokens), ...] sequences (a CFG request: two entries, same size)
PACKED = {
    "256 CFG": [(256, 256, 64), (256, 256, 12)],
    "8x256 CFG": [seq for i in range(8) for seq in ((256, 256, 64 - i), (256, 256, 12))],
    "512+1024": [(512, 512, 64), (1024, 1024, 40)],
    "1024 CFG": [(1024, 1024, 64), (1024, 1024, 12)],
    "1328": [(1328, 1328, 64)],
    "4-mix (eager)": [(1024, 1024, 64), (1024, 768, 64), (768, 1024, 64), (512, 512, 64)],
}
DENSE = {
    "256 B=2 masked": (256, 256, 2, True),
    "512 B=2": (512, 512, 2, False),
    "1024 B=1": (1024, 1024, 1, False),
}


def packed_inputs(seqs, model, device, dtype, gen):
    import torch

    from vllm_omni.diffusion.models.qwen_image.packing import SequenceSpec, build_packed_layout

    cfg = model.config
    specs = [SequenceSpec(t, (1, h // 16, w // 16)) for w, h, t in seqs]
    layout = build_packed_layout(specs, cfg.axes_dims_rope, device=device)
    img = torch.randn(layout.num_img_rows, cfg.in_channels, generator=gen).to(device, dtype)
    txt = torch.randn(layout.num_txt_rows, cfg.joint_attention_dim, generator=gen).to(device, dtype)
    t = torch.rand(len(specs), generator=gen).to(device, dtype)
    return img, txt, t, layout


def dense_inputs(case, model, device, dtype, gen):
    import torch

    w, h, batch, masked = case
    cfg, grid = model.config, (1, h // 16, w // 16)
    img = torch.randn(batch, grid[1] * grid[2], cfg.in_channels, generator=gen).to(device, dtype)
    txt = torch.randn(batch, 64, cfg.joint_attention_dim, generator=gen).to(device, dtype)
    mask = None
    if masked:
        mask = torch.ones(batch, 64, dtype=torch.long, device=device)
        mask[1:, 12:] = 0
    return img, txt, mask, torch.rand(batch, generator=gen).to(device, dtype), [grid] * batch


def check(model, compiled: bool, args, device, dtype) -> list[dict]:
    import torch

    from vllm_omni.diffusion.models.qwen_image.fused_ops import BlockOps
    from vllm_omni.diffusion.worker.cuda_graphs import CUDAGraphRunner, select_bucket

    model.block_ops = BlockOps(compiled=compiled)
    runner = CUDAGraphRunner(model, device, dtype)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for name, seqs in PACKED.items():
        img, txt, t, layout = packed_inputs(seqs, model, device, dtype, gen)
        eager = model.forward_packed(img, txt, t, layout)
        start = time.perf_counter()
        out = runner.forward_packed(img, txt, t, layout)
        first_s = time.perf_counter() - start
        row = {"case": name, "compiled": compiled, "path": runner.last_path, "first_call_s": first_s}
        bucket = select_bucket(runner.buckets, layout.num_img_rows, layout.num_txt_rows, layout.num_seqs)
        if bucket is not None:
            row["bucket"] = f"{bucket.num_img_rows}/{bucket.num_txt_rows}/{bucket.num_seqs}"
            padded = runner._packed[bucket, False].run_eager()[: layout.num_img_rows]
            row["max_abs_padded"] = float((out - padded).abs().max())
        row["max_abs_unpadded"] = float((out - eager).abs().max())
        row["rel_err"] = row["max_abs_unpadded"] / float(eager.abs().max())
        row["eager_ms"] = event_median_ms(partial(model.forward_packed, img, txt, t, layout), 1, args.iters)
        row["graph_ms"] = event_median_ms(partial(runner.forward_packed, img, txt, t, layout), 1, args.iters)
        rows.append(row)
        print(row, flush=True)
    for name, case in DENSE.items():
        inputs = dense_inputs(case, model, device, dtype, gen)
        eager = model(*inputs)
        out = runner.forward_dense(*inputs)
        row = {"case": f"dense {name}", "compiled": compiled, "path": runner.last_path}
        row["max_abs_padded"] = row["max_abs_unpadded"] = float((out - eager).abs().max())
        row["rel_err"] = row["max_abs_unpadded"] / float(eager.abs().max())
        row["eager_ms"] = event_median_ms(partial(model, *inputs), 1, args.iters)
        row["graph_ms"] = event_median_ms(partial(runner.forward_dense, *inputs), 1, args.iters)
        rows.append(row)
        print(row, flush=True)
    del runner
    torch.cuda.empty_cache()
    return rows


def capture_all(model, device, dtype) -> dict:
    import torch

    from vllm_omni.diffusion.worker.cuda_graphs import CUDAGraphRunner

    runner = CUDAGraphRunner(model, device, dtype)
    torch.cuda.synchronize()
    free = torch.cuda.mem_get_info()[0]
    start = time.perf_counter()
    runner.capture_all()
    torch.cuda.synchronize()
    result = {
        "buckets": len(runner.buckets),
        "capture_s": time.perf_counter() - start,
        "memory_gib": (free - torch.cuda.mem_get_info()[0]) / 2**30,
    }
    print("capture_all:", result, flush=True)
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-layers", type=int, default=60)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--capture-all", action="store_true")
    parser.add_argument("--json-output", default=None)
    args = parser.parse_args(argv)
    import torch

    from vllm_omni.diffusion.models.qwen_image import configs

    device, dtype = torch.device("cuda"), torch.bfloat16
    model = build_transformer(dict(configs.REAL_TRANSFORMER_CONFIG), args.num_layers, device, dtype, seed=0)
    with torch.inference_mode():
        rows = check(model, False, args, device, dtype) + check(model, True, args, device, dtype)
        capture = capture_all(model, device, dtype) if args.capture_all else None
    columns = [Column(k, k, f) for k, f in (
        ("case", ""), ("compiled", ""), ("path", ""), ("bucket", ""), ("max_abs_padded", ".1e"),
        ("max_abs_unpadded", ".1e"), ("rel_err", ".1e"), ("eager_ms", ".1f"), ("graph_ms", ".1f"),
    )]  # fmt: skip
    print(format_table(rows, columns))
    ok = all(r.get("max_abs_padded", 0.0) == 0.0 for r in rows)
    print("replay == eager of the same padded batch on every case:", ok)
    result = {"env": environment_info(device), "rows": rows, "capture_all": capture, "all_bit_equal": ok}
    if args.json_output:
        write_json(args.json_output, result)
    return result


if __name__ == "__main__":
    main()

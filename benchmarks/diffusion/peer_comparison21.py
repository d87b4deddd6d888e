"""Peer comparison for Qwen-Image-2.1: diffusers' QwenImage21Transformer2DModel vs ours, same weights.

    python benchmarks/diffusion/peer_comparison21.py --json-output peer21.json

Builds diffusers' `QwenImage21Transformer2DModel` (the released widths, `--num-layers` blocks, seeded
random weights on the device in bf16) and loads the SAME tensors into ours. Every case is one denoise
step's forward with the prefix cached, CFG off, a `--text-len`-token prompt per image, timed with
CUDA events (median of `--iters` after `--warmup`; the host clock on a CPU):

    diffusers            diffusers eager with its KV cache (`kv_cache_mode="cached"`, after one
                         "extract" forward per image, untimed); different shapes cannot share a
                         forward there: a mix is the sum of its per-image forwards
    ours                 `forward_packed` over every image's rows, each after its cached prefix (filled
                         once by `prefill`, untimed): one varlen attention call per layer; the blocks'
                         elementwise chains eager (`--enforce-eager`'s path without graphs)
    ours_compiled        + the chains as fused kernels (`enable_compile()`: torch.compile, rows dynamic,
                         fused_ops.py); eager launches. First call per case untimed (compiles)
    ours_graph           + the packed step replayed from a CUDA graph in its bucket (the worker's
                         `CUDAGraphRunner`, default buckets, through 2.1's `PackedStepGraphs`): the path
                         the server runs. Padding rows are timed; a batch no bucket takes runs
                         ours_compiled's path (`graph_path` says which). CUDA only: skipped on a CPU
    diffusers_compiled   diffusers with `compile_repeated_blocks(fullgraph=True)` (last: in place)

Per ours variant v the report gives its speed-up over diffusers eager and over diffusers compiled
(`x_diffusers` / `x_compiled` for ours, `{v}_x_diffusers` / `{v}_x_compiled` for the others) and its
largest per-image relative difference to diffusers' velocity (`max_rel_diff`, `{v}_max_rel_diff`).
The issue's targets: ours at least 1.3x diffusers eager and 1.1x diffusers compiled at 512x512,
1024x1024 and 2048x2048. `--tiny` runs the tiny checkpoint's widths (CPU smoke runs).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make `benchmarks.diffusion` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.diffusion.common import (  # noqa: E402
    Column,
    Mix,
    environment_info,
    event_median_ms,
    format_table,
    parse_mixes,
    positive_int,
    progress,
    ratio,
    write_json,
)

DEFAULT_CASES = "512x512;1024x1024;2048x2048;4*512x512;512x512+1024x1024+1024x768+768x1024"
VARIANTS = ("diffusers", "ours", "ours_compiled", "ours_graph", "diffusers_compiled")
OURS_VARIANTS = ("ours", "ours_compiled", "ours_graph")
TIMESTEP = 0.5
EXTRACT_TIMESTEP = 0.97


def build_models(args, device, dtype):
    """(diffusers model, ours) sharing every weight tensor."""
    import torch
    from diffusers import QwenImage21Transformer2DModel

    from vllm_omni.diffusion.model_loader import build_empty, randomize_weights_
    from vllm_omni.diffusion.models.qwen_image21 import configs
    from vllm_omni.diffusion.models.qwen_image21.transformer import (
        QwenImage21Transformer,
        QwenImage21TransformerConfig,
    )

    base = configs.TINY_TRANSFORMER_CONFIG if args.tiny else configs.REAL_TRANSFORMER_CONFIG
    config = {**base, "num_layers": args.num_layers or base["num_layers"]}
    ref = build_empty(lambda: QwenImage21Transformer2DModel(**config), device)
    randomize_weights_(ref, torch.Generator(device=device).manual_seed(args.seed), device=device, dtype=dtype)
    ref.eval().requires_grad_(False)
    ours = build_empty(lambda: QwenImage21Transformer(QwenImage21TransformerConfig.from_dict(config)), device)
    ours.load_state_dict(ref.state_dict(), strict=True, assign=True)
    return ref, ours.eval().requires_grad_(False)


class Case:
    """One workload: per image, its text rows, latent rows and grid; our packed layout."""

    def __init__(self, mix: Mix, ours, text_len: int, device, dtype, seed: int):
        import torch

        from vllm_omni.diffusion.layout import SequenceSpec, build_packed_layout

        cfg = ours.config
        gen = torch.Generator(device="cpu").manual_seed(seed)
        self.mix = mix
        # 2.1's latents are unpatched: one row per 16x16 pixels
        self.grids = [(1, s.height // 16, s.width // 16) for s in mix.sizes]
        self.texts = [
            torch.randn(text_len, cfg.context_in_dim, generator=gen).to(device, dtype) for _ in self.grids
        ]
        self.latents = [
            torch.randn(g[1] * g[2], cfg.in_channels, generator=gen).to(device, dtype) for g in self.grids
        ]
        self.req_ids = [f"{mix.name}-{i}" for i in range(len(self.grids))]
        specs = [SequenceSpec(text_len, g, req_id=r) for g, r in zip(self.grids, self.req_ids)]
        self.layout = build_packed_layout(specs, ours.position_tables, device=device)
        self.img_rows, self.txt_rows = torch.cat(self.latents), torch.cat(self.texts)
        self.timestep = torch.full((len(self.grids),), TIMESTEP, device=device, dtype=dtype)

    @property
    def num_img_rows(self) -> int:
        return int(self.img_rows.shape[0])


def diffusers_step(ref, case: Case):
    """diffusers' cached-prefix forward of every image (one extract forward each first, untimed):
    returns a callable that runs the timed part."""
    import torch
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

    calls = []
    for txt, img, grid in zip(case.texts, case.latents, case.grids):
        n = img.shape[0]
        # the VLM sequence: the text, then the target's slots (one per 2x2 latent rows)
        img_mask = torch.cat(
            [torch.zeros(txt.shape[0], dtype=torch.bool), torch.ones(n // 4, dtype=torch.bool)]
        )
        kwargs = dict(
            encoder_hidden_states=txt[None],
            img_shapes=[[grid]],
            img_mask=img_mask[None].to(txt.device),
            return_dict=False,
        )
        cache = QwenImage21KVCache(len(ref.transformer_blocks))
        t_extract = torch.tensor([EXTRACT_TIMESTEP], device=txt.device, dtype=txt.dtype)
        with torch.inference_mode():
            ref(
                hidden_states=img[None], timestep=t_extract, kv_cache=cache, kv_cache_mode="extract", **kwargs
            )
        calls.append(
            lambda img=img, cache=cache, kwargs=kwargs, t=case.timestep[:1]: ref(
                hidden_states=img[None], timestep=t, kv_cache=cache, kv_cache_mode="cached", **kwargs
            )
        )

    def run():
        with torch.inference_mode():
            return [call()[0] for call in calls]

    return run


def cache_prefixes(ours, case: Case) -> None:
    """Every image's prefix into our prefix cache (prefilled once, untimed), as at admission."""
    for req_id, txt in zip(case.req_ids, case.texts):
        ours.prefix_cache.put(req_id, False, ours.prefill(txt))


def ours_step(ours, case: Case, graphs=None):
    """Our packed step over every image after its cached prefix; through the CUDA graph runner
    (`graphs`) when given."""
    import torch

    forward = ours.forward_packed if graphs is None else graphs.forward_packed

    def run():
        with torch.inference_mode():
            return forward(case.img_rows, case.txt_rows, case.timestep, case.layout)

    return run


def max_rel_diff(ours_out, ref_outs, case: Case) -> float:
    """Largest per-image relative difference of our velocity against diffusers' (same weights)."""
    worst = 0.0
    for got, want in zip(case.layout.split_img(ours_out), ref_outs):
        want = want[0, -got.shape[0] :].float()
        worst = max(worst, ((got.float() - want).norm() / want.norm().clamp_min(1e-12)).item())
    return worst


def key(variant: str, what: str) -> str:
    """A row key of an ours variant: `what` for ours, `{variant}_{what}` for the others."""
    return what if variant == "ours" else f"{variant}_{what}"


def prepare_ours(ours, variant: str, device, dtype):  # -> CUDAGraphRunner | None
    """Switch ours to `variant`'s path; the CUDA graph runner for ours_graph (else None)."""
    if variant == "ours":
        ours.disable_compile()
        return None
    if not ours.block_ops.compiled:
        ours.enable_compile()
    if variant == "ours_compiled":
        return None
    from vllm_omni.diffusion.worker.cuda_graphs import CUDAGraphRunner

    return CUDAGraphRunner(ours, device, dtype)


def measure(args, ref, ours, cases: list[Case], device, dtype) -> tuple[list[dict[str, Any]], int]:
    """The table's rows (one per case) and the compiled ops' eager fallbacks (0 expected)."""
    import torch

    rows = [{"case": c.mix.name, "img_rows": c.num_img_rows} for c in cases]

    def save() -> None:  # after every timing: a run cut short still leaves its numbers
        if args.json_output:
            write_json(args.json_output, {"partial": True, "rows": rows})

    run_refs = [diffusers_step(ref, c) for c in cases]
    for case in cases:
        cache_prefixes(ours, case)
    ours_variants = [v for v in OURS_VARIANTS if v in args.variants]
    if "ours_graph" in ours_variants and device.type != "cuda":
        print("ours_graph: skipped (CUDA graphs need a CUDA device)", flush=True)
        ours_variants.remove("ours_graph")
    ref_outs = [run_ref() for run_ref in run_refs] if ours_variants else []
    bar = progress(len(cases) * len(args.variants), "peer 2.1", disable=args.no_progress)
    if "diffusers" in args.variants:
        for row, run_ref in zip(rows, run_refs):
            row["diffusers"] = event_median_ms(run_ref, args.warmup, args.iters)
            bar.update()
            save()
    for variant in ours_variants:
        graphs = prepare_ours(ours, variant, device, dtype)
        warmup = args.warmup if variant == "ours" else args.warmup + 1  # compiles, captures untimed
        for i, (row, case) in enumerate(zip(rows, cases)):
            run = ours_step(ours, case, graphs)
            row[variant] = event_median_ms(run, warmup, args.iters)
            row[key(variant, "max_rel_diff")] = max_rel_diff(run(), ref_outs[i], case)
            if graphs is not None:
                row["graph_path"] = graphs.last_path
            bar.update()
            save()
    num_fallbacks = ours.num_compile_fallbacks
    ours.disable_compile()
    if "diffusers_compiled" in args.variants:
        ref.compile_repeated_blocks(fullgraph=True)
        for row, run_ref in zip(rows, run_refs):
            row["diffusers_compiled"] = event_median_ms(run_ref, args.warmup + 1, args.iters)
            bar.update()
            save()
    bar.close()
    for row in rows:
        for variant in ours_variants:
            row[key(variant, "x_diffusers")] = ratio(row.get("diffusers"), row.get(variant))
            row[key(variant, "x_compiled")] = ratio(row.get("diffusers_compiled"), row.get(variant))
    for case in cases:
        ours.prefix_cache.release(case.req_ids)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows, num_fallbacks


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="auto", help="auto: cuda when available, else cpu")
    p.add_argument("--num-layers", type=int, default=None, help="blocks (default: the config's, 32 released)")
    p.add_argument("--tiny", action="store_true", help="the tiny checkpoint's widths (CPU smoke runs)")
    p.add_argument("--text-len", type=int, default=128, help="prompt rows per image")
    p.add_argument("--cases", default=DEFAULT_CASES, help="mixes (common.py grammar), ';'-separated")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-output", default=None)
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown:
        p.error(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")
    for name in ("text_len", "iters"):
        positive_int(f"--{name.replace('_', '-')}", getattr(args, name))
    positive_int("--warmup", args.warmup, 0)
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import torch

    args = parse_args(argv)
    device = torch.device(
        ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    )
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    ref, ours = build_models(args, device, dtype)
    cases = [
        Case(m, ours, args.text_len, device, dtype, args.seed + i)
        for i, m in enumerate(parse_mixes(args.cases))
    ]
    rows, num_fallbacks = measure(args, ref, ours, cases, device, dtype)
    columns = [Column("case", "case"), Column("img_rows", "image rows")]
    columns += [Column(v, f"{v} ms", ".2f") for v in args.variants if any(v in r for r in rows)]
    for v in OURS_VARIANTS:
        if any(v in r for r in rows):
            columns += [
                Column(key(v, "x_diffusers"), f"{v} x diffusers", ".2f"),
                Column(key(v, "x_compiled"), f"{v} x compiled", ".2f"),
                Column(key(v, "max_rel_diff"), f"{v} rel diff", ".1e"),
            ]
    if any("graph_path" in r for r in rows):
        columns.append(Column("graph_path", "graph path"))
    print(format_table(rows, columns))
    print(f"compiled ops' eager fallbacks: {num_fallbacks}")
    payload = {
        "env": environment_info(device),
        "args": vars(args),
        "rows": rows,
        "num_compile_fallbacks": num_fallbacks,
    }
    if args.json_output:
        write_json(args.json_output, payload)
        print(f"wrote {args.json_output}")
    return payload


if __name__ == "__main__":
    main()

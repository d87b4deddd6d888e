"""Peer comparison: diffusers' transformer against ours, same weights, one forward, one GPU.

    python benchmarks/diffusion/peer_comparison.py --json-output peer.json --plot peer.png
    python benchmarks/diffusion/peer_comparison.py --model Qwen/Qwen-Image-2.1 --json-output peer21.json
    python benchmarks/diffusion/peer_comparison.py --model Qwen/Qwen-Image-2.1 --tiny --device cpu   # smoke

diffusers' transformer of `--model` (the released widths, `--num-layers` blocks, seeded random weights
made on the device in bf16; fp32 on a CPU) and ours hold the SAME tensors (`load_state_dict(assign=True)`).
Every case (common.py's mix grammar) is one forward, CFG off, `--text-len` prompt rows per image, timed
with CUDA events (median of `--iters` after `--warmup`; the host clock on a CPU); diffusers runs a mix
as the sum of its per-image forwards. Qwen-Image's variants: diffusers, ours_fa2, ours_eager,
ours_compiled, ours_graph, ours_dense_graph, diffusers_compiled, with FLOPs (`count_flops`) over the
time against a `--gemm-size`^3 bf16 matmul's rate. Qwen-Image-2.1's, each image's prefix cached on both
sides (diffusers' KV cache): diffusers, ours, ours_compiled, ours_graph (CUDA only), diffusers_compiled,
with each ours variant's speed-up over both diffusers variants and its largest relative difference to
diffusers' velocity. docs/benchmarks.md describes each variant.
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
    positive_int,
    progress,
    ratio,
    write_json,
)
from benchmarks.diffusion.transformer_setup import count_flops, gemm_tflops  # noqa: E402

QWEN_IMAGE, QWEN_IMAGE_21 = "Qwen/Qwen-Image", "Qwen/Qwen-Image-2.1"
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
DEFAULT_CASES_21 = "512x512;1024x1024;2048x2048;4*512x512;512x512+1024x1024+1024x768+768x1024"
VARIANTS_21 = ("diffusers", "ours", "ours_compiled", "ours_graph", "diffusers_compiled")
OURS_VARIANTS_21 = ("ours", "ours_compiled", "ours_graph")
TIMESTEP = 0.5
EXTRACT_TIMESTEP = 0.97
FAMILY_DEFAULTS = {  # --model -> (cases, variants, prompt rows per image, blocks: None = the config's)
    QWEN_IMAGE: (DEFAULT_CASES, VARIANTS, 64, 60),
    QWEN_IMAGE_21: (DEFAULT_CASES_21, VARIANTS_21, 128, None),
}


# ---- Qwen-Image ---------------------------------------------------------------------------------


def build_models(num_layers: int, device, dtype, seed: int):  # Qwen-Image
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
        if not args.no_progress:
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


def main_qwen_image(args: argparse.Namespace) -> dict:
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


# ---- Qwen-Image-2.1 ------------------------------------------------------------------------------


def build_models21(args, device, dtype):
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


class Case21:
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


def diffusers_step(ref, case: Case21):
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


def cache_prefixes(ours, case: Case21) -> None:
    """Every image's prefix into our prefix cache (prefilled once, untimed), as at admission."""
    for req_id, txt in zip(case.req_ids, case.texts):
        ours.prefix_cache.put(req_id, False, ours.prefill(txt))


def ours_step(ours, case: Case21, graphs=None):
    """Our packed step over every image after its cached prefix; through the CUDA graph runner
    (`graphs`) when given."""
    import torch

    forward = ours.forward_packed if graphs is None else graphs.forward_packed

    def run():
        with torch.inference_mode():
            return forward(case.img_rows, case.txt_rows, case.timestep, case.layout)

    return run


def max_rel_diff(ours_out, ref_outs, case: Case21) -> float:
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


def measure21(args, ref, ours, cases: list[Case21], device, dtype) -> tuple[list[dict[str, Any]], int]:
    """The table's rows (one per case) and the compiled ops' eager fallbacks (0 expected)."""
    import torch

    rows = [{"case": c.mix.name, "img_rows": c.num_img_rows} for c in cases]

    def save() -> None:  # after every timing: a run cut short still leaves its numbers
        if args.json_output:
            write_json(args.json_output, {"partial": True, "rows": rows})

    run_refs = [diffusers_step(ref, c) for c in cases]
    for case in cases:
        cache_prefixes(ours, case)
    ours_variants = [v for v in OURS_VARIANTS_21 if v in args.variants]
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


def main21(args: argparse.Namespace, device) -> dict[str, Any]:
    import torch

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    ref, ours = build_models21(args, device, dtype)
    cases = [
        Case21(m, ours, args.text_len, device, dtype, args.seed + i)
        for i, m in enumerate(parse_mixes(args.cases))
    ]
    rows, num_fallbacks = measure21(args, ref, ours, cases, device, dtype)
    columns = [Column("case", "case"), Column("img_rows", "image rows")]
    columns += [Column(v, f"{v} ms", ".2f") for v in args.variants if any(v in r for r in rows)]
    for v in OURS_VARIANTS_21:
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


# ---- command line -------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=QWEN_IMAGE, choices=(QWEN_IMAGE, QWEN_IMAGE_21))
    p.add_argument("--device", default="auto", help="auto: cuda when available, else cpu")
    p.add_argument("--num-layers", type=int, default=None, help="blocks (default: Qwen-Image 60, 2.1 its 32)")
    p.add_argument("--tiny", action="store_true", help="2.1: the tiny checkpoint's widths (CPU smoke runs)")
    p.add_argument("--text-len", type=int, default=None, help="prompt rows per image (default 64; 2.1 128)")
    p.add_argument("--cases", default=None, help="mixes (common.py grammar), ';'-separated")
    p.add_argument("--variants", default=None, help="comma list (default: every variant of the model)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--gemm-size", type=int, default=None, help="Qwen-Image: the GEMM rate's matmul (8192)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-output", default=None)
    p.add_argument("--plot", default=None, help="Qwen-Image: a PNG of the table")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    is_21 = args.model == QWEN_IMAGE_21
    if not is_21 and args.tiny:
        p.error("--tiny: only with --model Qwen/Qwen-Image-2.1")
    for flag, value in (("--plot", args.plot), ("--gemm-size", args.gemm_size)):
        if is_21 and value is not None:
            p.error(f"{flag}: only with --model Qwen/Qwen-Image")
    if not is_21 and args.gemm_size is None:
        args.gemm_size = 8192
    cases, known, text_len, num_layers = FAMILY_DEFAULTS[args.model]
    args.cases = args.cases or cases
    args.text_len = text_len if args.text_len is None else args.text_len
    args.num_layers = num_layers if args.num_layers is None else args.num_layers
    args.variants = [v.strip() for v in (args.variants or ",".join(known)).split(",") if v.strip()]
    unknown = sorted(set(args.variants) - set(known))
    if unknown:
        p.error(f"--variants: unknown {unknown}; choose from {list(known)}")
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
    args.device = str(device)
    return main21(args, device) if args.model == QWEN_IMAGE_21 else main_qwen_image(args)


if __name__ == "__main__":
    main()

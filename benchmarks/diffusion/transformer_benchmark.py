"""Transformer benchmark: one packed forward vs the per-request dense forwards, on the same requests.

    python benchmarks/diffusion/transformer_benchmark.py --backends FLASH_ATTN,SDPA --cfg-modes off,on \
        --json-output tf.json --plot tf.png                       # real size (60 layers, bf16, random)
    python benchmarks/diffusion/transformer_benchmark.py --model tiny-qwen-image --device cpu ...

The transformer (`QwenImageTransformer`, real or tiny config, `--num-layers` blocks) is built directly on
the device with seeded random weights; inputs are random latents and random text embeddings of
`--text-len` tokens (`--neg-text-len` for negative prompts). For every attention backend, CFG mode and
mix (grammar in common.py):

    packed   one `forward_packed` over every sequence of every request (a CFG request has two)
             (the packing layout is built once outside the timed region, as the runner caches it)
    dense    one `forward` per request, as a request running alone takes its steps: [1, S, 64], or
             [2, S, 64] with CFG (positive and negative together, text padded, key mask as the runner
             passes it)

Times are device-synchronised wall times (median over `--iters` after `--warmup`). The GEMM ceiling
is a `--gemm-size`^3 matmul in the model dtype timed with CUDA events in the same run.

FLOPs (useful work only: real tokens, no padding; elementwise ops such as norms, RoPE, GELU, gates
and biases are not counted). With d = heads * head_dim (3072), J = joint_attention_dim (3584),
n = num layers, and per sequence s with T_s text tokens, I_s image tokens, L_s = T_s + I_s:

    linear      2 * 12 d^2 * L_s * n         per-token linears of both streams: q, k, v, out (4 d^2)
                                             and the 4x GELU MLP (8 d^2); image rows use the image
                                             stream's weights, text rows the text stream's
    attention   4 * L_s^2 * d * n            QK^T and PV, 2 L^2 d each (joint text+image sequence)
    modulation  2 * 12 d^2 * n + 2 * (256 d + d^2) + 2 * 2 d^2     once per sequence: img_mod and
                                             txt_mod (d -> 6d each), timestep MLP, norm_out (d -> 2d)
    embed       2 * (64 d + 64 d) * I_s + 2 * J d * T_s            img_in, proj_out, txt_in

    TFLOP/s = total FLOPs / time; % GEMM = TFLOP/s / GEMM ceiling.

Attention share: the same attention backend called alone on random q/k/v of the forward's shapes
(packed: one varlen call over [total_tokens, H, D]; dense: one call per request over [B, S, H, D] with
the key mask), times n layers, divided by the forward's time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make `benchmarks.diffusion` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.diffusion.common import (  # noqa: E402
    BarPanel,
    CfgMode,
    Column,
    Mix,
    add_mix_args,
    add_output_args,
    environment_info,
    format_table,
    mixes_from_args,
    plot_bar_panels,
    positive_int,
    progress,
    ratio,
    resolve_cfg_modes,
    sync,
    timed,
    write_json,
)

TIMESTEP = 0.5
"""Transformer timestep (already / 1000) of every sequence; the value does not change the cost."""


# ---- model --------------------------------------------------------------------------------------


def transformer_config_dict(model: str) -> dict:
    """transformer/config.json contents: tiny for `tiny-qwen-image`, a local dir's, else the real size."""
    from vllm_omni.config import TINY_MODEL_NAME
    from vllm_omni.diffusion.models.qwen_image import configs

    if model == TINY_MODEL_NAME:
        return dict(configs.TINY_TRANSFORMER_CONFIG)
    path = Path(model).expanduser() / "transformer" / "config.json"
    if path.is_file():
        import json

        return json.loads(path.read_text())
    return dict(configs.REAL_TRANSFORMER_CONFIG)


def build_transformer(config_dict: dict, num_layers: int | None, device, dtype, seed: int):
    """`QwenImageTransformer` with `num_layers` blocks (None: the config's), seeded random weights made
    directly on `device` in `dtype` (the model loader's dummy path: no host copy)."""
    import torch

    from vllm_omni.diffusion.model_loader import build_empty, randomize_weights_
    from vllm_omni.diffusion.models.qwen_image.transformer import (
        QwenImageTransformer,
        QwenImageTransformerConfig,
    )

    if num_layers is not None:
        config_dict = {**config_dict, "num_layers": num_layers}
    config = QwenImageTransformerConfig.from_dict(config_dict)
    model = build_empty(lambda: QwenImageTransformer(config), device)
    randomize_weights_(model, torch.Generator(device=device).manual_seed(seed), device=device, dtype=dtype)
    return model.eval().requires_grad_(False)


# ---- workload -----------------------------------------------------------------------------------


def request_specs(mix: Mix, cfg: CfgMode, text_len: int, neg_text_len: int) -> list[list]:
    """Per request, its packed sequences: positive, plus negative when CFG is on."""
    from vllm_omni.diffusion.models.qwen_image.packing import SequenceSpec

    out = []
    for i, size in enumerate(mix.sizes):
        seqs = [SequenceSpec(text_len, size.latent_grid, f"req-{i}", False)]
        if cfg.enabled:
            seqs.append(SequenceSpec(neg_text_len, size.latent_grid, f"req-{i}", True))
        out.append(seqs)
    return out


def count_flops(config, specs: list) -> dict[str, float]:
    """Useful FLOPs of one forward over `specs` (formula in the module docstring)."""
    d, n = config.inner_dim, config.num_layers
    c_in, c_out = config.in_channels, config.patch_size**2 * config.out_channels
    linear = attention = modulation = embed = 0.0
    for s in specs:
        num_txt, num_img = s.num_txt_tokens, s.num_img_tokens
        length = num_txt + num_img
        linear += 2 * 12 * d * d * length * n
        attention += 4 * length * length * d * n
        modulation += 2 * 12 * d * d * n + 2 * (256 * d + d * d) + 2 * 2 * d * d
        embed += 2 * (c_in * d + d * c_out) * num_img + 2 * config.joint_attention_dim * d * num_txt
    total = linear + attention + modulation + embed
    return {
        "linear": linear,
        "attention": attention,
        "modulation": modulation,
        "embed": embed,
        "total": total,
    }


class Inputs:
    """Random inputs of one case, built once on the device: packed rows + layout, dense batches."""

    def __init__(self, model, per_request: list[list], device, dtype, seed: int):
        import torch

        from vllm_omni.diffusion.models.qwen_image.packing import build_packed_layout

        cfg = model.config
        gen = torch.Generator(device="cpu").manual_seed(seed)
        self.specs = [s for seqs in per_request for s in seqs]

        def rand(*shape):
            return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

        latents = [rand(seqs[0].num_img_tokens, cfg.in_channels) for seqs in per_request]  # one per request
        texts = [[rand(s.num_txt_tokens, cfg.joint_attention_dim) for s in seqs] for seqs in per_request]
        start = time.perf_counter()
        self.layout = build_packed_layout(self.specs, cfg.axes_dims_rope, device=device)
        sync(device)
        self.layout_build_s = time.perf_counter() - start
        self.img_rows = torch.cat([latents[r] for r, seqs in enumerate(per_request) for _ in seqs])
        self.txt_rows = torch.cat([t for ts in texts for t in ts])
        self.timestep = torch.full((len(self.specs),), TIMESTEP, device=device, dtype=dtype)
        self.dense = [
            self._dense_batch(lat, ts, seqs, device, dtype)
            for lat, ts, seqs in zip(latents, texts, per_request)
        ]

    @staticmethod
    def _dense_batch(latents, texts, seqs, device, dtype) -> dict[str, Any]:
        """The runner's dense inputs for one request alone: text zero-padded, mask always passed."""
        import torch

        batch, max_len = len(texts), max(t.shape[0] for t in texts)
        txt = latents.new_zeros(batch, max_len, texts[0].shape[1])
        mask = torch.zeros(batch, max_len, dtype=torch.long, device=device)
        for i, t in enumerate(texts):
            txt[i, : t.shape[0]], mask[i, : t.shape[0]] = t, 1
        return {
            "hidden_states": latents[None].expand(batch, -1, -1).contiguous(),
            "encoder_hidden_states": txt,
            "encoder_hidden_states_mask": mask,
            "timestep": torch.full((batch,), TIMESTEP, device=device, dtype=dtype),
            "img_shapes": [seqs[0].img_shape] * batch,
        }

    def run_packed(self, model):
        return model.forward_packed(self.img_rows, self.txt_rows, self.timestep, self.layout)

    def run_dense(self, model):
        return [model(**batch) for batch in self.dense]


# ---- timing -------------------------------------------------------------------------------------


def median_time(fn: Callable[[], Any], device, warmup: int, iters: int) -> float:
    """Median device-synchronised seconds of `fn()` over `iters` calls after `warmup` calls."""
    for _ in range(warmup):
        timed(fn, device)
    return statistics.median(timed(fn, device)[1] for _ in range(iters))


def gemm_tflops(device, dtype, size: int, iters: int = 10) -> float:
    """TFLOP/s of a size^3 matmul in `dtype` (CUDA events on CUDA, perf_counter elsewhere)."""
    import torch

    a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
    out = torch.empty(size, size, device=device, dtype=dtype)
    for _ in range(3):
        torch.mm(a, b, out=out)
    sync(device)
    if torch.device(device).type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            torch.mm(a, b, out=out)
        end.record()
        torch.cuda.synchronize(device)
        seconds = start.elapsed_time(end) / 1e3 / iters
    else:
        seconds = median_time(lambda: torch.mm(a, b, out=out), device, 0, iters)
    return 2 * size**3 / seconds / 1e12


def attention_seconds(model, inputs: Inputs, device, dtype, warmup: int, iters: int) -> tuple[float, float]:
    """(packed, dense) seconds of the attention calls alone for one forward (all layers)."""
    import torch

    from vllm_omni.diffusion.attention import AttentionMetadata

    cfg = model.config
    backend = model.attn_backend  # resolved by measure_case
    heads, head_dim = cfg.num_attention_heads, cfg.attention_head_dim

    def qkv(*lead):
        return [torch.randn(*lead, heads, head_dim, device=device, dtype=dtype) for _ in range(3)]

    packed_qkv = qkv(inputs.layout.total_tokens)
    dense_calls = []
    for batch in inputs.dense:
        num_img = batch["hidden_states"].shape[1]
        img_mask = torch.ones(batch["hidden_states"].shape[0], num_img, dtype=torch.bool, device=device)
        mask = torch.cat([batch["encoder_hidden_states_mask"].bool(), img_mask], dim=1)  # [B, S_txt + S_img]
        dense_calls.append((qkv(*mask.shape), AttentionMetadata(is_varlen=False, attn_mask=mask)))
    packed = median_time(lambda: backend(*packed_qkv, inputs.layout.attn), device, warmup, iters)
    dense = median_time(lambda: [backend(*q, meta) for q, meta in dense_calls], device, warmup, iters)
    return packed * cfg.num_layers, dense * cfg.num_layers


def output_diff(packed_out, dense_outs) -> tuple[float, float]:
    """(max |packed - dense|, that / max |dense|) over every sequence: a sanity check of the packing.
    NaN when either output holds a non-finite value."""
    import torch

    dense_rows = [row for out in dense_outs for row in out.unbind(0)]  # per sequence [S_img, C]
    start, max_abs, max_ref = 0, 0.0, 0.0
    for row in dense_rows:
        piece = packed_out[start : start + row.shape[0]].float()
        if not (torch.isfinite(piece).all() and torch.isfinite(row).all()):
            return float("nan"), float("nan")
        max_abs = max(max_abs, float((piece - row.float()).abs().max()))
        max_ref = max(max_ref, float(row.float().abs().max()))
        start += row.shape[0]
    return max_abs, (max_abs / max_ref if max_ref > 0 else float("nan"))


# ---- cases --------------------------------------------------------------------------------------


def measure_case(model, backend: str, mix: Mix, cfg: CfgMode, args, device, dtype, gemm: float) -> dict:
    """Time one (backend, CFG mode, mix) case: packed vs dense forward, attention alone, FLOPs."""
    from vllm_omni.diffusion.attention import get_attn_backend

    head_dim = model.config.attention_head_dim
    model.attn_backend = get_attn_backend(backend, device, head_dim, for_packed=True, dtype=dtype)
    per_request = request_specs(mix, cfg, args.text_len, args.neg_text_len or args.text_len)
    inputs = Inputs(model, per_request, device, dtype, args.seed)
    packed_s = median_time(lambda: inputs.run_packed(model), device, args.warmup, args.iters)
    dense_s = median_time(lambda: inputs.run_dense(model), device, args.warmup, args.iters)
    packed_attn_s, dense_attn_s = attention_seconds(model, inputs, device, dtype, args.warmup, args.iters)
    max_abs, max_rel = output_diff(inputs.run_packed(model), inputs.run_dense(model))
    flops = count_flops(model.config, inputs.specs)
    packed_tflops, dense_tflops = flops["total"] / packed_s / 1e12, flops["total"] / dense_s / 1e12
    return {
        "backend": backend,
        "cfg": cfg.label,
        "mix": mix.name,
        "num_reqs": len(mix),
        "num_seqs": len(inputs.specs),
        "num_tokens": inputs.layout.total_tokens,
        "max_seq_len": max(s.seq_len for s in inputs.specs),
        "packed_ms": packed_s * 1e3,
        "dense_ms": dense_s * 1e3,
        "speedup": ratio(dense_s, packed_s),
        "layout_build_ms": inputs.layout_build_s * 1e3,
        "gflop": flops["total"] / 1e9,
        "flops": flops,
        "attention_flop_share": flops["attention"] / flops["total"],
        "packed_tflops": packed_tflops,
        "dense_tflops": dense_tflops,
        "packed_pct_gemm": 100 * packed_tflops / gemm,
        "dense_pct_gemm": 100 * dense_tflops / gemm,
        "packed_attn_ms": packed_attn_s * 1e3,
        "dense_attn_ms": dense_attn_s * 1e3,
        "packed_attn_share": packed_attn_s / packed_s,
        "dense_attn_share": dense_attn_s / dense_s,
        "max_abs_diff": max_abs,
        "max_rel_diff": max_rel,
    }


TABLE_COLUMNS = [
    Column("ops", "ops"),
    Column("backend", "backend"),
    Column("cfg", "cfg"),
    Column("mix", "mix"),
    Column("num_seqs", "seqs"),
    Column("num_tokens", "tokens"),
    Column("dense_ms", "dense ms", ".2f"),
    Column("packed_ms", "packed ms", ".2f"),
    Column("speedup", "packed x", ".2f"),
    Column("dense_tflops", "dense TF/s", ".3g"),
    Column("packed_tflops", "packed TF/s", ".3g"),
    Column("packed_pct_gemm", "% GEMM", ".1f"),
    Column("packed_attn_share", "attn share", ".2f"),
    Column("dense_attn_share", "dense attn", ".2f"),
    Column("max_rel_diff", "max rel diff", ".2g"),
]


def plot_results(path: str, cases: list[dict], gemm: float) -> Path:
    """ms per forward and TFLOP/s per case, one bar per (path, backend)."""
    labels = list(dict.fromkeys(f"{c['mix']} cfg {c['cfg']}" for c in cases))
    backends = list(dict.fromkeys(c["backend"] for c in cases))
    by_key = {(f"{c['mix']} cfg {c['cfg']}", c["backend"]): c for c in cases}

    def series(metric: str) -> dict[str, list]:
        return {
            f"{kind} {b}": [by_key.get((label, b), {}).get(f"{kind}_{metric}") for label in labels]
            for b in backends
            for kind in ("dense", "packed")
        }

    panels = [
        BarPanel("time per forward (lower is better)", labels, series("ms"), "ms"),
        BarPanel(
            "achieved TFLOP/s",
            labels,
            series("tflops"),
            "TFLOP/s",
            {f"GEMM ceiling {gemm:.3g}": gemm, "75% of GEMM (target)": 0.75 * gemm},
        ),
    ]
    return plot_bar_panels(path, panels, "Qwen-Image transformer: packed vs per-request dense")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model", default="Qwen/Qwen-Image", help="real size (default), tiny-qwen-image or a dir"
    )
    parser.add_argument("--num-layers", type=int, default=None, help="blocks to build (default: all)")
    add_mix_args(parser)
    parser.add_argument("--text-len", type=int, default=128, help="prompt tokens per request")
    parser.add_argument(
        "--neg-text-len", type=int, default=None, help="negative prompt tokens (default: --text-len)"
    )
    parser.add_argument(
        "--backends", default=None, help="comma list (default: FLASH_ATTN,SDPA on CUDA, SDPA on CPU)"
    )
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--gemm-size", type=int, default=None, help="GEMM ceiling size (default 8192, CPU 512)"
    )
    parser.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU), bfloat16, float32")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--compile-modes",
        default="eager",
        help="'eager', 'compiled' or 'eager,compiled': block elementwise chains eager or torch.compile'd",
    )
    add_output_args(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; print the table, write JSON / plot when asked, return the JSON payload."""
    import torch

    from vllm_omni.config import OmniDiffusionConfig

    args = parse_args(argv)
    mixes = mixes_from_args(args)
    cfg_modes = resolve_cfg_modes(args.cfg_modes, args.true_cfg_scale, args.negative_prompt)
    for name in ("text_len", "iters"):
        positive_int(f"--{name.replace('_', '-')}", getattr(args, name))
    positive_int("--warmup", args.warmup, 0)
    if args.num_layers is not None:
        positive_int("--num-layers", args.num_layers)
    engine_cfg = OmniDiffusionConfig(dtype=args.dtype, device=args.device)
    device, dtype = torch.device(engine_cfg.resolve_device()), engine_cfg.resolve_dtype()
    backends = [
        b.strip()
        for b in (args.backends or ("FLASH_ATTN,SDPA" if device.type == "cuda" else "SDPA")).split(",")
        if b.strip()
    ]

    gemm_size = args.gemm_size or (8192 if device.type == "cuda" else 512)
    gemm = gemm_tflops(device, dtype, gemm_size)
    print(f"GEMM ceiling ({gemm_size}^3, {dtype}): {gemm:.3g} TFLOP/s", file=sys.stderr)
    model = build_transformer(transformer_config_dict(args.model), args.num_layers, device, dtype, args.seed)
    compile_modes = [m.strip() for m in args.compile_modes.split(",") if m.strip()]
    if not set(compile_modes) <= {"eager", "compiled"}:
        raise ValueError(f"--compile-modes must list 'eager' and/or 'compiled', got {args.compile_modes!r}")
    cases = []
    total = len(compile_modes) * len(backends) * len(cfg_modes) * len(mixes)
    with progress(total, "transformer", args.no_progress) as bar, torch.inference_mode():
        for mode in compile_modes:
            if mode == "compiled":
                model.enable_compile()
            for backend in backends:
                for cfg in cfg_modes:
                    for mix in mixes:
                        bar.set_postfix_str(f"{mode} {backend} cfg={cfg.label} {mix.name}")
                        case = measure_case(model, backend, mix, cfg, args, device, dtype, gemm)
                        cases.append({"ops": mode, **case})
                        bar.update(1)

    print(format_table(cases, TABLE_COLUMNS))
    print(f"GEMM ceiling: {gemm:.3g} TFLOP/s ({gemm_size}^3 {dtype}); {model.config.num_layers} layers")
    payload = {
        "benchmark": "transformer_benchmark",
        "env": environment_info(device),
        "config": {
            **vars(args),
            "device": str(device),
            "dtype": str(dtype),
            "num_layers": model.config.num_layers,
        },
        "gemm": {"size": gemm_size, "tflops": gemm},
        "results": cases,
    }
    if args.json_output:
        print(f"wrote {write_json(args.json_output, payload)}", file=sys.stderr)
    if args.plot:
        print(f"wrote {plot_results(args.plot, cases, gemm)}", file=sys.stderr)
    return payload


if __name__ == "__main__":
    main()

"""Batch-invariance check: is a batched request bit-identical to the same request alone, and at what cost?

    python benchmarks/diffusion/batch_invariance_check.py --model Qwen/Qwen-Image --load-format dummy \
        --device cuda --dtype bfloat16 [--quantization fp8] --steps 4 --json-output bi.json
    python benchmarks/diffusion/batch_invariance_check.py --device cpu --steps 2 --pairs 32+48   # smoke

For every pair of image sizes (`--pairs`, default 512+512,512+768,512+1024; `N` means NxN), CFG on, one
model loaded once, in the default mode and with `make_batch_invariant` applied: the largest difference
batched vs alone (0 = bit-identical) of one packed forward against each sequence's own
(`transformer_max_abs`), of the final latents and of the decoded images, the median pure-denoise step
time of the pair together, and `step_time_ratio` (batch-invariant over default: the guarantee's
price). `--quantization fp8` runs the FP8 transformer in both modes (`fp8_linear` and its invariant
twin). `--transformer-only` skips the engine: the transformer alone with random weights, its packed
forward timed (median of `--iters`), text lengths from `--text-lens`. docs/batch_invariance.md reads
the output.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make `benchmarks.diffusion` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.diffusion.common import (  # noqa: E402
    DEFAULT_NEGATIVE_PROMPT,
    DEFAULT_PROMPTS,
    Column,
    ImageSize,
    environment_info,
    format_cell,
    parse_size,
    positive_int,
    ratio,
    timed,
    write_json,
)

DEFAULT_PAIRS = "512+512,512+768,512+1024"
TIMESTEPS = (0.9, 0.55)
"""Per-request timesteps (already / 1000) of the direct transformer check."""


def parse_pairs(text: str) -> list[tuple[ImageSize, ...]]:
    """'512+768,1024x768+512' -> [(512x512, 768x768), (1024x768, 512x512)]; ValueError naming --pairs."""
    pairs = []
    for item in text.split(","):
        parts = [p.strip() for p in item.split("+") if p.strip()]
        if len(parts) < 2:
            raise ValueError(f"--pairs: {item!r} must list at least two sizes joined by '+' (e.g. 512+768)")
        pairs.append(tuple(parse_size(p if "x" in p.lower() else f"{p}x{p}", "--pairs") for p in parts))
    return pairs


def _max_abs(a, b) -> float:
    import numpy as np
    import torch

    if isinstance(a, torch.Tensor):
        return float((a.float() - b.float()).abs().max())
    return float(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)).max())


# ---- the transformer alone ----------------------------------------------------------------------


def _pair_inputs(transformer, sizes, text_lens: list[tuple[int, int]], device, dtype, seed: int):
    """Packed inputs of the pair: per request a positive and a negative sequence on the same latents."""
    import torch

    from vllm_omni.diffusion.models.qwen_image.packing import SequenceSpec

    cfg = transformer.config
    gen = torch.Generator().manual_seed(seed)
    specs, img, txt, timesteps = [], [], [], []
    for i, size in enumerate(sizes):
        latents = torch.randn(size.num_img_tokens, cfg.in_channels, generator=gen).to(device, dtype)
        for is_negative, num_txt in zip((False, True), text_lens[i]):
            specs.append(SequenceSpec(num_txt, size.latent_grid, f"req{i}", is_negative))
            img.append(latents)
            txt.append(torch.randn(num_txt, cfg.joint_attention_dim, generator=gen).to(device, dtype))
            timesteps.append(TIMESTEPS[i % len(TIMESTEPS)])
    return specs, img, txt, torch.tensor(timesteps, dtype=dtype, device=device)


def transformer_check(transformer, sizes, text_lens, device, dtype, seed: int, iters: int = 0) -> dict:
    """Max |packed - alone| over the sequences of one packed forward of the pair, and (iters > 0) the
    median time of that packed forward."""
    import torch

    from vllm_omni.diffusion.models.qwen_image.packing import build_packed_layout

    specs, img, txt, t = _pair_inputs(transformer, sizes, text_lens, device, dtype, seed)
    axes = transformer.config.axes_dims_rope
    with torch.inference_mode():
        layout = build_packed_layout(specs, axes, device=device)
        img_rows, txt_rows = torch.cat(img), torch.cat(txt)
        packed = transformer.forward_packed(img_rows, txt_rows, t, layout).split([x.shape[0] for x in img])
        diffs = []
        for i, spec in enumerate(specs):
            alone = transformer.forward_packed(
                img[i], txt[i], t[i : i + 1], build_packed_layout([spec], axes, device=device)
            )
            diffs.append(_max_abs(alone, packed[i]))
        times = [
            timed(lambda: transformer.forward_packed(img_rows, txt_rows, t, layout), device)[1]
            for _ in range(iters)
        ]
    return {"max_abs": max(diffs), "time_s": statistics.median(times) if times else None}


# ---- the engine ---------------------------------------------------------------------------------


def _requests(sizes, args, tag: str, output_type: str) -> list:
    from vllm_omni.diffusion.request import OmniDiffusionRequest
    from vllm_omni.inputs import OmniDiffusionSamplingParams

    requests = []
    for i, size in enumerate(sizes):
        params = OmniDiffusionSamplingParams(
            height=size.height,
            width=size.width,
            num_inference_steps=args.steps,
            true_cfg_scale=args.true_cfg_scale,
            seed=args.seed + i,
            output_type=output_type,
        )
        prompt = DEFAULT_PROMPTS[i % len(DEFAULT_PROMPTS)]
        requests.append(OmniDiffusionRequest(f"{tag}-{i}", prompt, args.negative_prompt, params))
    return requests


def _run(engine, requests) -> tuple[list, list]:
    """Submit `requests` together, step until done; return (their outputs, the step stats)."""
    futures = [engine.add_request(r) for r in requests]
    steps = []
    while not all(f.done() for f in futures):
        stats = engine.step()
        if stats is not None:
            steps.append(stats)
    return [f.result().images for f in futures], steps


def _together_vs_alone(engine, sizes, args, output_type: str) -> dict[str, Any]:
    tag = f"{output_type}-{time.monotonic_ns()}"
    alone = [_run(engine, [r])[0][0] for r in _requests(sizes, args, f"alone-{tag}", output_type)]
    together, steps = _run(engine, _requests(sizes, args, f"together-{tag}", output_type))
    pure = steps[1:-1] or steps  # the first step encodes the prompts, the last one decodes
    return {
        "max_abs": max(_max_abs(a, b) for a, b in zip(alone, together)),
        "step_time_s": statistics.median(s.step_time_s for s in pure),
        "num_seqs_batched": max(s.num_seqs for s in steps),
        "path": getattr(pure[len(pure) // 2].path, "value", pure[len(pure) // 2].path),
    }


def _measure_engine(engine, sizes, args, with_images: bool) -> dict[str, Any]:
    pipeline = engine.executor.driver_worker.pipeline
    prompts = [DEFAULT_PROMPTS[i % len(DEFAULT_PROMPTS)] for i in range(len(sizes))]

    def num_tokens(text: str) -> int:
        return engine.prompts.count("prompt", text).num_embedded_tokens

    text_lens = [(num_tokens(p), num_tokens(args.negative_prompt)) for p in prompts]
    check = transformer_check(
        pipeline.transformer, sizes, text_lens, pipeline.device, pipeline.dtype, args.seed
    )
    latent = _together_vs_alone(engine, sizes, args, "latent")
    return {
        "transformer_max_abs": check["max_abs"],
        "latent_max_abs": latent["max_abs"],
        "image_max_abs": _together_vs_alone(engine, sizes, args, "np")["max_abs"] if with_images else None,
        "step_time_s": latent["step_time_s"],
        "num_seqs_batched": latent["num_seqs_batched"],
        "path": latent["path"],
    }


def _engine_config(args, batch_invariant: bool):
    from vllm_omni.config import OmniDiffusionConfig

    return OmniDiffusionConfig(
        model=args.model,
        load_format=args.load_format,
        dtype=args.dtype,
        device=args.device,
        batch_invariant=batch_invariant,
        quantization=args.quantization,  # the second engine finds its pipeline quantized already
        max_num_seqs=8,
        scheduling_policy="skip-ahead",  # a mix is measured as one packed step
        mixfusion_min_chunk_tokens=1,  # every pair shares its steps: the check is about bits, not policy
        seed=args.seed,
        log_stats=False,
    )


def _run_engine_modes(args, pairs) -> tuple[list, list, Any, Any]:
    """(default rows, batch-invariant rows, patch summary, pipeline): one pipeline, patched in between."""
    from vllm_omni.diffusion.batch_invariant import make_batch_invariant
    from vllm_omni.diffusion.engine import DiffusionEngine

    default_engine = DiffusionEngine(_engine_config(args, batch_invariant=False), autostart=False)
    pipeline = default_engine.executor.driver_worker.pipeline
    default_rows = [_measure_engine(default_engine, sizes, args, with_images=False) for sizes in pairs]
    summary = make_batch_invariant(pipeline.transformer)  # in place: the same weights from here on
    engine = DiffusionEngine(_engine_config(args, batch_invariant=True), pipeline=pipeline, autostart=False)
    invariant_rows = [_measure_engine(engine, sizes, args, with_images=True) for sizes in pairs]
    return default_rows, invariant_rows, summary, pipeline


def _run_transformer_modes(args, pairs) -> tuple[list, list, Any, Any]:
    """Like `_run_engine_modes` with the transformer alone (`--transformer-only`)."""
    from benchmarks.diffusion.transformer_setup import build_transformer, transformer_config_dict
    from vllm_omni.diffusion.batch_invariant import make_batch_invariant

    config = _engine_config(args, batch_invariant=False)
    device, dtype = config.resolve_device(), config.resolve_dtype()
    transformer = build_transformer(transformer_config_dict(args.model), None, device, dtype, args.seed)
    if config.quantization.is_enabled:  # as the worker: quantize, then (below) batch-invariant mode
        from vllm_omni.diffusion.layers.quantization import quantize_transformer

        quantize_transformer(transformer, config.quantization)
    rows: dict[bool, list] = {}
    summary = None
    for invariant in (False, True):
        if invariant:
            summary = make_batch_invariant(transformer)
        rows[invariant] = []
        for sizes in pairs:
            text_lens = [(args.text_lens[0] + 8 * i, args.text_lens[1]) for i in range(len(sizes))]
            transformer_check(transformer, sizes, text_lens, device, dtype, args.seed, iters=1)  # warm-up
            check = transformer_check(
                transformer, sizes, text_lens, device, dtype, args.seed, iters=args.iters
            )
            rows[invariant].append(
                {
                    "transformer_max_abs": check["max_abs"],
                    "latent_max_abs": None,
                    "image_max_abs": None,
                    "step_time_s": check["time_s"],
                    "num_seqs_batched": 2 * len(sizes),
                    "path": "packed",
                }
            )
    return rows[False], rows[True], summary, transformer


# ---- report -------------------------------------------------------------------------------------

COLUMNS = [
    Column("pair", "pair"),
    Column("mode", "mode"),
    Column("path", "path"),
    Column("transformer_max_abs", "transformer max_abs", ".3g"),
    Column("latent_max_abs", "latent max_abs", ".3g"),
    Column("image_max_abs", "image max_abs", ".3g"),
    Column("step_ms", "step ms", ".1f"),
    Column("ratio", "step time ratio", ".2f"),
]


def markdown_table(results: list[dict[str, Any]]) -> str:
    """One row per (pair, mode), as a markdown table."""
    rows = []
    for res in results:
        for mode, key in (("default", "default"), ("batch-invariant", "batch_invariant")):
            m = res[key]
            step_ms = m["step_time_s"] * 1e3 if m["step_time_s"] is not None else None
            is_inv = key == "batch_invariant"
            rows.append(
                {
                    **m,
                    "pair": res["pair"],
                    "mode": mode,
                    "step_ms": step_ms,
                    "ratio": res["step_time_ratio"] if is_inv else None,
                }
            )
    lines = [
        "| " + " | ".join(c.header for c in COLUMNS) + " |",
        "|" + "|".join("---" for _ in COLUMNS) + "|",
    ]
    lines += ["| " + " | ".join(format_cell(row.get(c.key), c.fmt) for c in COLUMNS) + " |" for row in rows]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pairs", default=DEFAULT_PAIRS, help="comma-separated pairs of sizes, e.g. 512+768")
    parser.add_argument("--steps", type=int, default=4, help="denoise steps per request")
    parser.add_argument(
        "--model", default="tiny-qwen-image", help="tiny-qwen-image, a local dir or a repo id"
    )
    parser.add_argument(
        "--load-format", default="dummy", choices=("auto", "dummy"), help="dummy: random weights"
    )
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU), bfloat16, float32")
    parser.add_argument(
        "--quantization", default=None, help="fp8: FP8 (W8A8) linears in both modes (default: none)"
    )
    parser.add_argument("--true-cfg-scale", type=float, default=4.0)
    parser.add_argument("--negative-prompt", default=DEFAULT_NEGATIVE_PROMPT)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--transformer-only", action="store_true", help="no engine: transformer checks only")
    parser.add_argument(
        "--text-lens", default="32,12", help="--transformer-only: positive,negative text tokens"
    )
    parser.add_argument("--iters", type=int, default=5, help="--transformer-only: timed forwards per mode")
    parser.add_argument("--json-output", default=None, help="write the results as JSON to this path")
    return parser


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the check; print a markdown table; return (and optionally write) the JSON payload."""
    args = build_parser().parse_args(argv)
    positive_int("--steps", args.steps)
    positive_int("--iters", args.iters)
    pairs = parse_pairs(args.pairs)
    if args.true_cfg_scale <= 1.0:
        raise ValueError(
            f"--true-cfg-scale must be > 1 (CFG on: two sequences per request), got {args.true_cfg_scale}"
        )
    try:
        args.text_lens = tuple(int(n) for n in args.text_lens.split(","))
    except ValueError:
        args.text_lens = ()
    if len(args.text_lens) != 2 or min(args.text_lens) < 1:
        raise ValueError(f"--text-lens must be two positive ints 'POS,NEG', got {args.text_lens!r}")

    run_modes = _run_transformer_modes if args.transformer_only else _run_engine_modes
    default_rows, invariant_rows, summary, model = run_modes(args, pairs)
    results = [
        {
            "pair": "+".join(s.label for s in sizes),
            "default": default,
            "batch_invariant": invariant,
            "step_time_ratio": ratio(invariant["step_time_s"], default["step_time_s"]),
        }
        for sizes, default, invariant in zip(pairs, default_rows, invariant_rows)
    ]
    param = next(model.transformer.parameters() if hasattr(model, "transformer") else model.parameters())
    payload = {
        "benchmark": "batch_invariance_check",
        "environment": environment_info(param.device),
        "config": {
            "model": args.model,
            "load_format": args.load_format,
            "device": str(param.device),
            "dtype": str(param.dtype).removeprefix("torch."),
            "quantization": args.quantization,
            "steps": args.steps,
            "true_cfg_scale": args.true_cfg_scale,
            "timing": "packed forward" if args.transformer_only else "engine denoise step",
            "patched": {"linears": summary.num_linears, "rms_norms": summary.num_rms_norms},
            "attention_backend": summary.attention_backend,
        },
        "results": results,
    }
    print(markdown_table(results))
    if args.json_output:
        write_json(args.json_output, payload)
    return payload


if __name__ == "__main__":
    main()

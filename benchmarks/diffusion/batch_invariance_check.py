"""Batch-invariance check: is a batched request bit-identical to the same request alone, and at what cost?

    python benchmarks/diffusion/batch_invariance_check.py --model Qwen/Qwen-Image --load-format dummy \
        --device cuda --dtype bfloat16 --steps 4 --json-output bi.json     # real size, random bf16 weights
    python benchmarks/diffusion/batch_invariance_check.py --device cpu --steps 2 --pairs 32+48   # smoke

For every pair of image sizes (`--pairs`, default 512+512,512+768,512+1024; `N` means NxN, `WxH` also
works), with CFG on (two sequences per request) and one pipeline loaded once:

    default mode      the engine as it runs without VLLM_BATCH_INVARIANT (dense path for one shape)
    batch-invariant   `make_batch_invariant(transformer)` applied in place, engine with batch_invariant=True

and for each mode:

    transformer_max_abs   one packed forward of both requests vs each request's own packed forward
                          (random latents / text rows of the prompts' token counts, own timesteps)
    latent_max_abs        final latents of the pair run batched (one engine) vs each run alone
    image_max_abs         decoded images (output_type "np"), batched vs alone (batch-invariant mode only)
    step_time_s           median engine step time of the batched run over the steps that neither admit
                          nor finish a request (pure denoise steps; all steps when --steps <= 2)

`step_time_ratio` = batch-invariant step time / default step time: the price of the guarantee.
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


def _requests(engine, sizes, args, tag: str, output_type: str) -> list:
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


def _max_abs(a, b) -> float:
    import numpy as np
    import torch

    if isinstance(a, torch.Tensor):
        return float((a.float() - b.float()).abs().max())
    return float(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)).max())


def _denoise_step_time(steps: list) -> float:
    pure = steps[1:-1] or steps  # the first step encodes prompts, the last one decodes
    return statistics.median(s.step_time_s for s in pure)


def _batched_vs_alone(engine, sizes, args, output_type: str) -> dict[str, Any]:
    tag = f"{output_type}-{time.monotonic_ns()}"
    alone = [_run(engine, [r])[0][0] for r in _requests(engine, sizes, args, f"alone-{tag}", output_type)]
    batched, steps = _run(engine, _requests(engine, sizes, args, f"batched-{tag}", output_type))
    return {
        "max_abs": max(_max_abs(a, b) for a, b in zip(alone, batched)),
        "step_time_s": _denoise_step_time(steps),
        "num_seqs_batched": max(s.num_seqs for s in steps),
        "path": steps[len(steps) // 2].path,
    }


def _transformer_check(pipeline, sizes, args) -> float:
    """Max |packed - alone| over the sequences of one packed forward of the whole pair (CFG: pos, neg)."""
    import torch

    from vllm_omni.diffusion.models.qwen_image.packing import SequenceSpec, build_packed_layout

    transformer, device, dtype = pipeline.transformer, pipeline.device, pipeline.dtype
    cfg = transformer.config
    gen = torch.Generator().manual_seed(args.seed)
    specs, img, txt, timesteps = [], [], [], []
    for i, size in enumerate(sizes):
        prompts = (DEFAULT_PROMPTS[i % len(DEFAULT_PROMPTS)], args.negative_prompt)
        latents = torch.randn(size.num_img_tokens, cfg.in_channels, generator=gen).to(device, dtype)
        for is_negative, prompt in zip((False, True), prompts):
            num_txt = max(1, pipeline.count_prompt_tokens(prompt))
            specs.append(SequenceSpec(num_txt, size.latent_grid, f"req{i}", is_negative))
            img.append(latents)
            txt.append(torch.randn(num_txt, cfg.joint_attention_dim, generator=gen).to(device, dtype))
            timesteps.append(TIMESTEPS[i % len(TIMESTEPS)])
    t = torch.tensor(timesteps, dtype=dtype, device=device)
    with torch.inference_mode():
        layout = build_packed_layout(specs, cfg.axes_dims_rope, device=device)
        packed = transformer.forward_packed(torch.cat(img), torch.cat(txt), t, layout)
        packed = packed.split([x.shape[0] for x in img])
        diffs = []
        for i, spec in enumerate(specs):
            alone_layout = build_packed_layout([spec], cfg.axes_dims_rope, device=device)
            alone = transformer.forward_packed(img[i], txt[i], t[i : i + 1], alone_layout)
            diffs.append(_max_abs(alone, packed[i]))
    return max(diffs)


def _measure(engine, sizes, args, with_images: bool) -> dict[str, Any]:
    latent = _batched_vs_alone(engine, sizes, args, "latent")
    row = {
        "transformer_max_abs": _transformer_check(engine.pipeline, sizes, args),
        "latent_max_abs": latent["max_abs"],
        "image_max_abs": _batched_vs_alone(engine, sizes, args, "np")["max_abs"] if with_images else None,
        "step_time_s": latent["step_time_s"],
        "num_seqs_batched": latent["num_seqs_batched"],
        "path": latent["path"],
    }
    return row


def _engine_config(args, batch_invariant: bool):
    from vllm_omni.config import OmniDiffusionConfig

    return OmniDiffusionConfig(
        model=args.model,
        load_format=args.load_format,
        dtype=args.dtype,
        device=args.device,
        batch_invariant=batch_invariant,
        max_num_seqs=8,
        mixfusion_min_chunk_tokens=1,  # every pair shares its steps: the check is about bits, not policy
        seed=args.seed,
        log_stats=False,
    )


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
    parser.add_argument("--true-cfg-scale", type=float, default=4.0)
    parser.add_argument("--negative-prompt", default=DEFAULT_NEGATIVE_PROMPT)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json-output", default=None, help="write the results as JSON to this path")
    return parser


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
            rows.append(
                {
                    **m,
                    "pair": res["pair"],
                    "mode": mode,
                    "step_ms": m["step_time_s"] * 1e3,
                    "ratio": res["step_time_ratio"] if key == "batch_invariant" else None,
                }
            )
    lines = [
        "| " + " | ".join(c.header for c in COLUMNS) + " |",
        "|" + "|".join("---" for _ in COLUMNS) + "|",
    ]
    lines += ["| " + " | ".join(format_cell(row.get(c.key), c.fmt) for c in COLUMNS) + " |" for row in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the check; print a markdown table; return (and optionally write) the JSON payload."""
    args = build_parser().parse_args(argv)
    positive_int("--steps", args.steps)
    pairs = parse_pairs(args.pairs)
    if args.true_cfg_scale <= 1.0:
        raise ValueError(
            f"--true-cfg-scale must be > 1 (CFG on: two sequences per request), got {args.true_cfg_scale}"
        )

    from vllm_omni.diffusion.batch_invariant import make_batch_invariant
    from vllm_omni.diffusion.engine import DiffusionEngine

    default_engine = DiffusionEngine(_engine_config(args, batch_invariant=False), autostart=False)
    pipeline = default_engine.pipeline
    default_rows = [_measure(default_engine, sizes, args, with_images=False) for sizes in pairs]

    summary = make_batch_invariant(pipeline.transformer)  # in place: the same weights from here on
    invariant_engine = DiffusionEngine(
        _engine_config(args, batch_invariant=True), pipeline=pipeline, autostart=False
    )
    results = []
    for sizes, default in zip(pairs, default_rows):
        invariant = _measure(invariant_engine, sizes, args, with_images=True)
        results.append(
            {
                "pair": "+".join(s.label for s in sizes),
                "default": default,
                "batch_invariant": invariant,
                "step_time_ratio": ratio(invariant["step_time_s"], default["step_time_s"]),
            }
        )
    payload = {
        "benchmark": "batch_invariance_check",
        "environment": environment_info(pipeline.device),
        "config": {
            "model": args.model,
            "load_format": args.load_format,
            "device": str(pipeline.device),
            "dtype": str(pipeline.dtype).removeprefix("torch."),
            "steps": args.steps,
            "true_cfg_scale": args.true_cfg_scale,
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

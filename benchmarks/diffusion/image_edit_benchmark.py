"""Image-edit step batching: Qwen-Image-Edit requests run serially vs submitted together, and the
transformer time diffusers' `QwenImageTransformer2DModel` needs for the same shapes.

    python benchmarks/diffusion/image_edit_benchmark.py --model Qwen/Qwen-Image-Edit --load-format dummy \
        --mixes "1024x1024+1024x1024;1024x1024+1024x768+768x1024+1024x576" --steps 8 --iters 3 \
        --json-output benchmarks/diffusion/performance_dashboard/h200_results/image_edit_benchmark.json

A mix lists INPUT image sizes (common.py grammar); each request edits a random image of that size
with CFG on (negative prompt, `--true-cfg-scale`) and, as diffusers does by default, outputs at the
input's aspect at about 1024 x 1024 (`calculate_dimensions`); so a 1024x1024 request puts 4096
target + 4096 condition image rows in each of its two sequences. Phases and numbers are those of
step_batching_benefit.py (`run_phase`: e2e wall, steady-state denoise step, serial / batched).

The diffusers column times, per denoise step, diffusers' transformer forward of every request alone
(batch 1, `img_shapes=[[target, condition]]`, positive and negative) with the same config and
weights (the engine's own tensors, assigned; `--skip-diffusers` leaves it out).
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
    Column,
    Mix,
    add_output_args,
    environment_info,
    format_table,
    mean,
    parse_mixes,
    positive_int,
    progress,
    ratio,
    timed,
    write_json,
)
from benchmarks.diffusion.step_batching_benefit import MIN_STEPS, run_phase  # noqa: E402

DEFAULT_MIXES = "1024x1024+1024x1024;1024x1024+1024x768+768x1024+1024x576"
EDIT_PROMPTS = (
    "Turn the scene into a watercolor painting",
    "Replace the sky with a dramatic sunset and add birds",
    "Make it winter: snow on every surface, soft cold light",
    "Add a small red boat on the water",
)


def _pipeline(engine):
    """The driver worker's step pipeline (the engine process's model)."""
    return engine.executor.driver_worker.pipeline


def make_edit_requests(mix: Mix, args: argparse.Namespace, tag: str) -> list:
    """One CFG edit request per input size; request i edits random image i with prompt i (cycled)."""
    import numpy as np
    from PIL import Image

    from vllm_omni.diffusion.models.qwen_image_edit.pipeline import edit_output_size
    from vllm_omni.diffusion.request import OmniDiffusionRequest
    from vllm_omni.inputs import OmniDiffusionSamplingParams

    requests = []
    for i, size in enumerate(mix.sizes):
        rng = np.random.default_rng(args.seed + i)
        image = Image.fromarray(rng.integers(0, 256, (size.height, size.width, 3), dtype=np.uint8))
        height, width = edit_output_size(image)
        params = OmniDiffusionSamplingParams(
            height=height,
            width=width,
            num_inference_steps=args.steps,
            true_cfg_scale=args.true_cfg_scale,
            seed=args.seed + i,
            output_type="latent",
        )
        prompt = EDIT_PROMPTS[i % len(EDIT_PROMPTS)]
        requests.append(OmniDiffusionRequest(f"{tag}-{i}", prompt, args.negative_prompt, params, image=image))
    return requests


def diffusers_step_s(engine, requests: list, args: argparse.Namespace, reference) -> float:
    """Median time of one denoise step done by diffusers' transformer, each request alone (+ CFG)."""
    import torch

    from vllm_omni.diffusion.models.qwen_image_edit.pipeline import edit_output_size

    device, dtype = _pipeline(engine).device, _pipeline(engine).dtype
    cfg = _pipeline(engine).transformer.config
    inputs = []
    for req in requests:
        sp = req.sampling_params
        cond_h, cond_w = edit_output_size(req.image)
        grids = [(1, sp.height // 16, sp.width // 16), (1, cond_h // 16, cond_w // 16)]
        num_rows = sum(f * h * w for f, h, w in grids)
        img = torch.randn(2, num_rows, cfg.in_channels, device=device, dtype=dtype)  # positive, negative
        txt = torch.randn(2, args.text_tokens, cfg.joint_attention_dim, device=device, dtype=dtype)
        inputs.append((img, txt, grids))

    def one_step():
        with torch.inference_mode():
            for img, txt, grids in inputs:
                for k in range(2):  # positive and negative forward, as the pipeline runs them
                    reference(
                        hidden_states=img[k : k + 1],
                        encoder_hidden_states=txt[k : k + 1],
                        timestep=torch.full((1,), 0.5, device=device, dtype=dtype),
                        img_shapes=[grids],
                        return_dict=False,
                    )

    one_step()  # warm-up
    return statistics.median(timed(one_step, device)[1] for _ in range(args.iters))


def build_reference(engine):
    """diffusers' transformer sharing the engine's weight tensors (assigned, not copied: no extra memory)."""
    import dataclasses

    from diffusers import QwenImageTransformer2DModel

    from vllm_omni.diffusion.model_loader import build_empty

    ours = _pipeline(engine).transformer
    config = dataclasses.asdict(ours.config)  # field names are diffusers' config keys
    reference = build_empty(lambda: QwenImageTransformer2DModel(**config), _pipeline(engine).device)
    reference.load_state_dict(ours.state_dict(), strict=True, assign=True)
    return reference.eval()


def measure_mix(engine, mix: Mix, args: argparse.Namespace, reference, bar) -> dict[str, Any]:
    device = _pipeline(engine).device
    runs = []
    for it in range(args.warmup + args.iters):
        tag = f"{mix.name}-{it}"
        serial = [run_phase(engine, [r], device) for r in make_edit_requests(mix, args, f"{tag}-serial")]
        batched = run_phase(engine, make_edit_requests(mix, args, f"{tag}-batched"), device)
        per_req = [p.denoise_step_s() for p in serial]
        if it >= args.warmup:
            runs.append(
                {
                    "serial_e2e_s": sum(p.wall_s for p in serial),
                    "batched_e2e_s": batched.wall_s,
                    "serial_denoise_step_s": None if None in per_req else sum(per_req),
                    "batched_denoise_step_s": batched.denoise_step_s(),
                    "max_reqs_per_step": max(s.num_reqs for s in batched.steps),
                    "tokens_per_step": max(s.num_tokens for s in batched.steps),
                    "paths": sorted({s.path for s in batched.steps}),
                }
            )
        bar.update(1)

    def avg(key):
        values = [r[key] for r in runs]
        return None if None in values else mean(values)

    case = {
        "mix": mix.name,
        "input_sizes": [s.label for s in mix.sizes],
        "num_reqs": len(mix),
        "tokens_per_step": runs[-1]["tokens_per_step"],
        "max_reqs_per_step": runs[-1]["max_reqs_per_step"],
        "batched_path": "/".join(runs[-1]["paths"]),
        "serial_e2e_s": avg("serial_e2e_s"),
        "batched_e2e_s": avg("batched_e2e_s"),
        "serial_denoise_step_ms": (avg("serial_denoise_step_s") or 0) * 1e3 or None,
        "batched_denoise_step_ms": (avg("batched_denoise_step_s") or 0) * 1e3 or None,
        "iterations": runs,
    }
    if reference is not None:
        requests = make_edit_requests(mix, args, f"{mix.name}-diffusers")
        case["diffusers_transformer_step_ms"] = diffusers_step_s(engine, requests, args, reference) * 1e3
    case["e2e_speedup"] = ratio(case["serial_e2e_s"], case["batched_e2e_s"])
    case["denoise_speedup"] = ratio(case["serial_denoise_step_ms"], case["batched_denoise_step_ms"])
    case["vs_diffusers"] = ratio(case.get("diffusers_transformer_step_ms"), case["batched_denoise_step_ms"])
    return case


TABLE_COLUMNS = [
    Column("mix", "inputs"),
    Column("num_reqs", "reqs"),
    Column("tokens_per_step", "tok/step"),
    Column("max_reqs_per_step", "reqs/step"),
    Column("batched_path", "path"),
    Column("serial_e2e_s", "serial e2e s", ".3f"),
    Column("batched_e2e_s", "batched e2e s", ".3f"),
    Column("e2e_speedup", "e2e x", ".2f"),
    Column("serial_denoise_step_ms", "serial step ms", ".2f"),
    Column("batched_denoise_step_ms", "batched step ms", ".2f"),
    Column("diffusers_transformer_step_ms", "diffusers step ms", ".2f"),
    Column("vs_diffusers", "vs diffusers x", ".2f"),
]


def build_engine(args: argparse.Namespace, max_num_seqs: int):
    from vllm_omni.config import OmniDiffusionConfig
    from vllm_omni.diffusion.engine import DiffusionEngine

    config = OmniDiffusionConfig.from_env_defaults(
        model=args.model,
        load_format=args.load_format,
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=max_num_seqs,
        scheduling_policy="skip-ahead",  # a mix is measured as one packed step
        attention_backend=args.attention_backend,
        seed=args.seed,
        log_stats=False,
        enforce_eager=args.enforce_eager,
        # the varlen packed forward needs no MixFusion chunk plan: let every size share a step
        mixfusion_min_chunk_tokens=1,
        mixfusion_max_chunks=1 << 30,
    )
    engine = DiffusionEngine(config, autostart=False)
    if not engine.supports_image_input:
        raise ValueError(f"--model {args.model!r} is not an image-edit checkpoint (QwenImageEditPipeline)")
    return engine


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny-qwen-image-edit", help="edit checkpoint dir / repo id")
    parser.add_argument("--load-format", choices=("auto", "dummy"), default="auto")
    parser.add_argument(
        "--mixes", default=DEFAULT_MIXES, help=f"input sizes per mix (default {DEFAULT_MIXES!r})"
    )
    parser.add_argument("--steps", type=int, default=8, help=f"denoise steps per request (>= {MIN_STEPS})")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--true-cfg-scale", type=float, default=4.0)
    parser.add_argument("--negative-prompt", default="blurry, low quality")
    parser.add_argument("--text-tokens", type=int, default=96, help="text rows of the diffusers timing")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--attention-backend", default=None)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--skip-diffusers", action="store_true", help="no diffusers transformer timing")
    add_output_args(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; print the table, write JSON when asked, return the JSON payload."""
    args = parse_args(argv)
    mixes = parse_mixes(args.mixes)
    positive_int("--steps", args.steps, MIN_STEPS)
    positive_int("--iters", args.iters)
    positive_int("--warmup", args.warmup, 0)
    load_start = time.perf_counter()
    engine = build_engine(args, max(len(m) for m in mixes))
    load_s = time.perf_counter() - load_start
    print(f"loaded {args.model} ({args.load_format}) in {load_s:.1f} s", file=sys.stderr)
    reference = None if args.skip_diffusers else build_reference(engine)
    cases = []
    with progress(len(mixes) * (args.warmup + args.iters), "image edit", args.no_progress) as bar:
        for mix in mixes:
            cases.append(measure_mix(engine, mix, args, reference, bar))
    print(format_table(cases, TABLE_COLUMNS))
    payload = {
        "benchmark": "image_edit_benchmark",
        "env": environment_info(_pipeline(engine).device),
        "config": {**vars(args), "device": str(_pipeline(engine).device), "load_s": load_s},
        "results": cases,
    }
    if args.json_output:
        print(f"wrote {write_json(args.json_output, payload)}", file=sys.stderr)
    return payload


if __name__ == "__main__":
    main()

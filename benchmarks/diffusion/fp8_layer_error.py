"""Which Qwen-Image linears to keep in high precision under FP8, by the error each choice adds and
the weight memory it costs.

    python benchmarks/diffusion/fp8_layer_error.py --num-layers 4 --size 256 --device cpu      # ~2 min
    python benchmarks/diffusion/fp8_layer_error.py --num-layers 60 --size 1024 --device cuda   # H200

A transformer at the released widths (hidden 3072, MLP 12288, `--num-layers` of the 60 blocks) with
the random weights of `--load-format dummy` (seeded, so every configuration sees the same model) runs
one dense forward of one `--size` image and a 32-token prompt at t = 0.5, unquantized and then with
each kept-layer set below in FP8 (W8A8, per-channel weight and per-token activation scales). Reported:
the output's relative error against the unquantized forward (max |diff| / max |ref| and RMS / RMS),
and the transformer's weights in GiB at the full 60 blocks (FP8: 1 byte per element plus a 4-byte
scale per output channel; kept layers, biases and norms in bf16):

    default            the family's `plans.quant_kept_layers` (SGLang's list: embedders, modulation, final
                       projection, the image MLP's down projection)
    default + mod FP8  the same with the modulation linears (img_mod, txt_mod) quantized
    img_mlp kept       vLLM-Omni's recommendation (`ignored_layers: ["img_mlp"]`)
    every block linear the fastest set docs/quantization.md documents (embedders and final projection
                       kept: `ignored_layers` = EMBEDDERS)
    mod + embedders kept  the default with the image MLP's down projection quantized (its GEMM is
                       the FP8 step's speed; the modulation's, at one row per sequence, is not)
    all                every linear in FP8
    only <group>       one group in FP8, everything else unquantized: its own share of the error

With `--steps N` each configuration also denoises from the same noise for N Euler steps of the flow
(sigma 1 -> 0, the model's output as velocity), alone, as a request does: the transformer output's
error at each step against the unquantized run's (each on its own trajectory: the errors compound)
and the final latent's (end to end; the VAE decode is left out).

Random weights say how FP8's rounding propagates through this architecture, not how an image looks:
real weights have outliers random ones lack. The choice it supports is recorded in
docs/quantization.md with that caveat.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file: make `vllm_omni` and `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.diffusion.common import Column, environment_info, format_table, write_json  # noqa: E402
from vllm_omni.diffusion.layers.linear import linears  # noqa: E402
from vllm_omni.diffusion.layers.quant_config import QuantizationConfig  # noqa: E402
from vllm_omni.diffusion.layers.quantization import layers_to_quantize, quantize_transformer  # noqa: E402
from vllm_omni.diffusion.model_loader import randomize_weights_  # noqa: E402
from vllm_omni.diffusion.models.qwen_image import configs  # noqa: E402
from vllm_omni.diffusion.models.qwen_image.transformer import (  # noqa: E402
    QwenImageTransformer,
    QwenImageTransformerConfig,
)

KEPT_DEFAULT = QwenImageTransformer.plans.quant_kept_layers
EMBEDDERS = ("img_in", "txt_in", "time_text_embed", "norm_out.linear", "proj_out")
GROUPS = {
    "modulation": ("img_mod", "txt_mod"),
    "attention q/k/v": ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"),
    "attention out": ("to_out", "to_add_out"),
    "image MLP up": ("img_mlp.net.0",),
    "image MLP down": ("img_mlp.net.2",),
    "text MLP": ("txt_mlp",),
    "embedders + final": EMBEDDERS,
}
"""Groups of linears by module-path fragment, for the one-group-at-a-time rows."""


def kept_sets() -> dict[str, tuple[str, ...]]:
    """Configuration name -> `ignored_layers` (the linears kept in high precision)."""
    sets = {
        "default": KEPT_DEFAULT,
        "default + mod FP8": tuple(p for p in KEPT_DEFAULT if p not in GROUPS["modulation"]),
        "img_mlp kept": ("img_mlp",),
        "every block linear": EMBEDDERS,
        "mod + embedders kept": EMBEDDERS + GROUPS["modulation"],
        "all": (),
    }
    everything = tuple(p for group in GROUPS.values() for p in group)
    for name, group in GROUPS.items():
        sets[f"only {name}"] = tuple(p for p in everything if p not in group)
    return sets


def on_meta(num_layers: int) -> QwenImageTransformer:
    """The released widths with `num_layers` blocks, on the meta device (shapes, no memory)."""
    fields = {k: v for k, v in configs.REAL_TRANSFORMER_CONFIG.items() if not k.startswith("_")}
    with torch.device("meta"):
        return QwenImageTransformer(QwenImageTransformerConfig(**{**fields, "num_layers": num_layers}))


def build(num_layers: int, device, dtype, seed: int) -> QwenImageTransformer:
    """The released widths with `num_layers` blocks and dummy-load random weights (seeded)."""
    model = on_meta(num_layers)
    generator = torch.Generator(device=device).manual_seed(seed)
    randomize_weights_(model, generator, device=device, dtype=dtype)
    return model.eval()


def weight_gib(model: QwenImageTransformer, kept: tuple[str, ...], dtype_bytes: int = 2) -> float:
    """`model`'s weights (the 60-block one on meta) with `kept` in bf16 and every other linear in FP8."""
    quantized = layers_to_quantize(model, QuantizationConfig("fp8", ignored_layers=kept))
    total = 0
    for name, param in model.named_parameters():
        owner, _, leaf = name.rpartition(".")
        if leaf == "weight" and owner in quantized:
            total += param.numel() + 4 * param.shape[0]  # e4m3 + a fp32 scale per output channel
        else:
            total += param.numel() * dtype_bytes
    return total / 2**30


def inputs(size: int, device, dtype, seed: int):
    """One image of `size` x `size` (latent rows of 2x2 patches) and a 32-token prompt, t = 0.5."""
    side = size // 16
    gen = torch.Generator().manual_seed(seed + 1)
    hidden = torch.randn(1, side * side, 64, generator=gen).to(device, dtype)
    text = torch.randn(1, 32, configs.REAL_TRANSFORMER_CONFIG["joint_attention_dim"], generator=gen)
    return hidden, text.to(device, dtype), None, torch.tensor([0.5], device=device), [(1, side, side)]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(max |diff| / max |want|, RMS(diff) / RMS(want)), in float32."""
    diff = got.float() - want.float()
    want = want.float()
    return float(diff.abs().max() / want.abs().max()), float(
        diff.pow(2).mean().sqrt() / want.pow(2).mean().sqrt()
    )


def denoise(model: QwenImageTransformer, x, steps: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """`steps` Euler steps of the flow from x's latents at sigma 1 to 0 (float32 latents, as diffusers'
    scheduler keeps them): every step's transformer output and the final latents."""
    latents, text, mask, _, shapes = x
    sigmas = torch.linspace(1.0, 0.0, steps + 1).tolist()
    state, outputs = latents.float(), []
    for k in range(steps):
        t = torch.full((1,), sigmas[k], device=latents.device)
        velocity = model(state.to(latents.dtype), text, mask, t, shapes).float()
        outputs.append(velocity)
        state = state + (sigmas[k + 1] - sigmas[k]) * velocity
    return outputs, state


@torch.inference_mode()
def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--size", type=int, default=256, help="image side in pixels (multiple of 16)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", default=None, help="comma list of configuration names (default: all)")
    parser.add_argument(
        "--steps", type=int, default=0, help="also denoise this many steps per configuration (0: one forward)"
    )
    parser.add_argument("--json-output", default=None)
    args = parser.parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    sets = kept_sets()
    if args.only:
        sets = {name: sets[name] for name in args.only.split(",")}
    x = inputs(args.size, device, dtype, args.seed)
    model = build(args.num_layers, device, dtype, args.seed)
    reference = model(*x).float()
    if args.steps:
        ref_outputs, ref_latents = denoise(model, x, args.steps)
    del model
    released = on_meta(60)  # the weights' GiB are the full transformer's
    rows = []
    for name, kept in sets.items():
        start = time.perf_counter()
        model = build(args.num_layers, device, dtype, args.seed)
        quantize_transformer(model, QuantizationConfig("fp8", ignored_layers=kept))
        num_fp8 = sum(1 for m in linears(model).values() if m.quant_method.name == "fp8")
        max_rel, rms_rel = rel_err(model(*x), reference)
        row = {
            "config": name,
            "kept": list(kept),
            "fp8_linears": num_fp8,
            "max_rel": max_rel,
            "rms_rel": rms_rel,
            "weights_gib_60": weight_gib(released, kept),
        }
        if args.steps:
            outputs, latents = denoise(model, x, args.steps)
            row["step_output_rms_rel"] = [rel_err(o, r)[1] for o, r in zip(outputs, ref_outputs, strict=True)]
            row["last_output_rms_rel"] = row["step_output_rms_rel"][-1]
            row["final_latent_max_rel"], row["final_latent_rms_rel"] = rel_err(latents, ref_latents)
        del model
        row["seconds"] = time.perf_counter() - start
        rows.append(row)
        print(f"{name}: max rel {max_rel:.4f}, rms rel {rms_rel:.4f}", flush=True)
    bf16_gib = sum(p.numel() for p in released.parameters()) * 2 / 2**30
    columns = [
        Column("config", "configuration", "s"),
        Column("fp8_linears", "FP8 linears", "d"),
        Column("max_rel", "max rel err", ".4f"),
        Column("rms_rel", "RMS rel err", ".4f"),
        Column("weights_gib_60", "weights GiB (60 blocks)", ".1f"),
    ]
    if args.steps:
        columns += [
            Column("last_output_rms_rel", f"step {args.steps} output RMS rel", ".4f"),
            Column("final_latent_rms_rel", "final latent RMS rel", ".4f"),
        ]
    print(format_table(rows, columns))
    print(f"unquantized bf16 weights: {bf16_gib:.1f} GiB")
    result = {
        "env": environment_info(args.device),
        "args": vars(args),
        "bf16_weights_gib_60": bf16_gib,
        "rows": rows,
    }
    if args.json_output:
        write_json(args.json_output, result)
    return result


if __name__ == "__main__":
    main()

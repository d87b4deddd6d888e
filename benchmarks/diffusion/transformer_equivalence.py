"""Our Qwen-Image transformer (dense and packed varlen) vs diffusers', at real width.

Builds diffusers' `QwenImageTransformer2DModel` with Qwen-Image's real widths (a configurable
number of blocks) and random weights, loads the same weights into ours, and runs a mix of
requests (different resolutions, text lengths, timesteps, one CFG pair) through:

- diffusers, each request alone, in the test dtype (the "same-precision baseline");
- ours dense, each request alone; ours packed, all sequences in ONE forward;
- diffusers in fp32, each request alone (the reference).

Following flash-attention's test rule, our error vs the fp32 reference must be at most twice
diffusers' own error in the same precision (plus a tiny absolute floor).

    python benchmarks/diffusion/transformer_equivalence.py --device cuda --dtype bfloat16 \
        --num-layers 8 --attention-backend FLASH_ATTN --json-output eq.json
"""

from __future__ import annotations

import argparse
import copy
import json

import torch

from vllm_omni.diffusion.model_loader import randomize_weights_
from vllm_omni.diffusion.models.qwen_image.packing import SequenceSpec, build_packed_layout
from vllm_omni.diffusion.models.qwen_image.transformer import QwenImageTransformer, QwenImageTransformerConfig

# (height, width, positive text tokens, negative text tokens or None)
REQUESTS = [
    (512, 512, 37, 12),
    (1024, 768, 120, None),
    (768, 1024, 64, None),
    (256, 256, 200, None),
    (512, 256, 5, 9),
]


def build_models(num_layers: int, dtype: torch.dtype, device: str, backend: str | None, seed: int):
    from diffusers import QwenImageTransformer2DModel

    with torch.device(device):
        ref = QwenImageTransformer2DModel(num_layers=num_layers)
    randomize_weights_(ref, torch.Generator(device).manual_seed(seed))
    ref.eval().requires_grad_(False)
    theirs = copy.deepcopy(ref).to(dtype)
    ours = QwenImageTransformer(QwenImageTransformerConfig(num_layers=num_layers), attn_backend=backend)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    return ref.float(), theirs, ours.to(device=device, dtype=dtype).eval().requires_grad_(False)


def make_sequences(device: str, seed: int):
    """One entry per sequence: (img [S, 64], txt [T, 3584], timestep, (1, h, w), req index, is_neg)."""
    gen = torch.Generator(device).manual_seed(seed)
    seqs = []
    for i, (h, w, txt, neg_txt) in enumerate(REQUESTS):
        grid = (1, h // 16, w // 16)
        img = torch.randn(grid[1] * grid[2], 64, generator=gen, device=device)
        t = torch.rand((), generator=gen, device=device)
        seqs.append((img, torch.randn(txt, 3584, generator=gen, device=device), t, grid, i, False))
        if neg_txt:
            seqs.append((img, torch.randn(neg_txt, 3584, generator=gen, device=device), t, grid, i, True))
    return seqs


def run_alone(model, seq, dtype):
    img, txt, t, grid, _, _ = seq
    out = model(
        hidden_states=img[None].to(dtype),
        encoder_hidden_states=txt[None].to(dtype),
        encoder_hidden_states_mask=torch.ones(1, txt.shape[0], dtype=torch.long, device=img.device),
        timestep=t[None].to(dtype),
        img_shapes=[[grid]] if hasattr(model, "pos_embed") else [grid],
    )
    return (out[0] if isinstance(out, tuple) else getattr(out, "sample", out))[0].float()


def run_packed(model, seqs, dtype, device):
    specs = [SequenceSpec(s[1].shape[0], s[3], req_id=str(s[4]), is_negative=s[5]) for s in seqs]
    layout = build_packed_layout(specs, axes_dims_rope=model.config.axes_dims_rope, device=device)
    out = model.forward_packed(
        torch.cat([s[0] for s in seqs]).to(dtype),
        torch.cat([s[1] for s in seqs]).to(dtype),
        torch.stack([s[2] for s in seqs]).to(dtype),
        layout,
    )
    return [o.float() for o in out.split([s[0].shape[0] for s in seqs])]


class GraphedModel:
    """Ours through a `CUDAGraphRunner`, with the transformer's call signatures."""

    def __init__(self, graphs):
        self.graphs, self.config = graphs, graphs.transformer.config

    def __call__(
        self, hidden_states, encoder_hidden_states, encoder_hidden_states_mask, timestep, img_shapes
    ):
        return self.graphs.forward_dense(
            hidden_states, encoder_hidden_states, encoder_hidden_states_mask, timestep, img_shapes
        )

    def forward_packed(self, img_rows, txt_rows, timestep, layout):
        return self.graphs.forward_packed(img_rows, txt_rows, timestep, layout)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x - ref).abs().max() / ref.abs().max())


@torch.inference_mode()
def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--attention-backend", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile", action="store_true", help="our blocks' fused ops via torch.compile")
    parser.add_argument(
        "--graphs", action="store_true", help="ours through CUDAGraphRunner (packed buckets, dense graphs)"
    )
    parser.add_argument("--json-output", default=None)
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    ref, theirs, ours = build_models(args.num_layers, dtype, args.device, args.attention_backend, args.seed)
    if args.compile:
        ours.enable_compile()
    runner = ours
    if args.graphs:
        from vllm_omni.diffusion.worker.cuda_graphs import CUDAGraphRunner

        runner = GraphedModel(CUDAGraphRunner(ours, args.device, dtype))
    seqs = make_sequences(args.device, args.seed + 1)
    packed = run_packed(runner, seqs, dtype, args.device)
    rows = []
    for seq, ours_packed in zip(seqs, packed):
        want = run_alone(ref, seq, torch.float32)
        baseline = run_alone(theirs, seq, dtype)
        ours_dense = run_alone(runner, seq, dtype)
        h, w = seq[3][1] * 16, seq[3][2] * 16
        row = {
            "request": f"{w}x{h}" + (" (neg)" if seq[5] else ""),
            "text_tokens": seq[1].shape[0],
            "diffusers_rel_err": rel_err(baseline, want),
            "ours_dense_rel_err": rel_err(ours_dense, want),
            "ours_packed_rel_err": rel_err(ours_packed, want),
            "packed_vs_diffusers_max_abs": float((ours_packed - baseline).abs().max()),
            "dense_vs_diffusers_max_abs": float((ours_dense - baseline).abs().max()),
        }
        floor = 1e-6 if dtype == torch.float32 else 1e-3
        row["pass"] = (
            max(row["ours_dense_rel_err"], row["ours_packed_rel_err"]) <= 2 * row["diffusers_rel_err"] + floor
        )
        rows.append(row)
    backend = type(ours.attn_backend).__name__ if ours.attn_backend is not None else None
    result = {"device": args.device, "dtype": args.dtype, "num_layers": args.num_layers, "backend": backend}
    result["compiled"] = args.compile
    result["graphs"] = args.graphs
    result["rows"] = rows
    print(
        f"backend={backend} compiled={args.compile} graphs={args.graphs} dtype={args.dtype} "
        f"layers={args.num_layers} device={args.device}"
    )
    header = list(rows[0])
    print(" | ".join(header))
    for row in rows:
        print(" | ".join(f"{v:.3e}" if isinstance(v, float) else str(v) for v in row.values()))
    if args.json_output:
        with open(args.json_output, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()

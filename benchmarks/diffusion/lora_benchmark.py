"""LoRA benchmark: one packed step of requests with different adapters vs the same step without adapters.

    python benchmarks/diffusion/lora_benchmark.py --json-output lora.json        # H200: real size, bf16
    python benchmarks/diffusion/lora_benchmark.py --model tiny-qwen-image --device cpu --iters 1   # smoke

The transformer (`QwenImageTransformer`, real-size config unless `--model` says otherwise) is built on the
device with seeded random weights (the `--load-format dummy` path). `--num-adapters` random adapters of
rank `--rank` target every attention and MLP linear of every block (q, k, v, out and the text stream's
add_q/k/v and to_add_out; both MLPs' up and down projections: 12 linears per block). The workload is
`--mix` (default four 1024x1024-class requests of different shapes), CFG on (two sequences each),
request i using adapter i mod --num-adapters. Timed (median of `--iters` after `--warmup`, device
synchronised), each one `forward_packed` over every sequence:

    base       the model with no adapter loaded (plain linears, fused QKV GEMMs): the step without LoRA
    unused     adapters loaded, no request uses one (a LoRA server's base-only step)
    mixed      adapters loaded, every request its own adapter, all in ONE forward
    split      the same work as one packed forward per adapter, one after another (what a batching
               key holding the adapter, as vLLM-Omni's does, runs)
    ratio      mixed / base   (target <= 1.15 on the H200); split_ratio = split / base

Unless `--no-check`, it also reports the largest difference between the mixed forward's rows and the
split forwards' (each adapter's requests without the others: the packed-vs-alone check, at real size).
On CUDA the blocks' elementwise chains are torch.compile'd as the engine does unless `--enforce-eager`.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make `benchmarks.diffusion` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.diffusion.common import (  # noqa: E402
    CfgMode,
    environment_info,
    parse_mix,
    ratio,
    sync,
    write_json,
)
from benchmarks.diffusion.transformer_setup import (  # noqa: E402
    Inputs,
    build_transformer,
    median_time,
    request_specs,
    transformer_config_dict,
)

DEFAULT_MIX = "1024x1024+1024x768+768x1024+512x512"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model", default="Qwen/Qwen-Image", help="real size (default), tiny-qwen-image, or a dir"
    )
    parser.add_argument("--num-layers", type=int, default=None, help="blocks to build (default: all)")
    parser.add_argument("--mix", default=DEFAULT_MIX, help=f"requests of the step (default {DEFAULT_MIX})")
    parser.add_argument("--num-adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--no-cfg", action="store_true", help="one sequence per request instead of two")
    parser.add_argument("--text-len", type=int, default=128)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--no-check", action="store_true", help="skip the mixed-vs-alone comparison")
    parser.add_argument("--enforce-eager", action="store_true", help="no torch.compile of the fused ops")
    parser.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU), bfloat16, float32")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json-output", default=None)
    return parser.parse_args(argv)


def _device_dtype(args):
    import torch

    device = torch.device(
        args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    )
    names = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    dtype = names.get(args.dtype) or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    return device, dtype


def load_adapters(model, num_adapters: int, rank: int, seed: int):
    """A LoRAManager with `num_adapters` random adapters on every attention and MLP linear; their ids."""
    from vllm_omni.lora import LoRAConfig
    from vllm_omni.lora.manager import LoRAManager
    from vllm_omni.lora.random_adapter import block_targets, random_lora_adapter

    manager = LoRAManager(model, LoRAConfig(enabled=True, max_loras=num_adapters, max_lora_rank=rank))
    targets = block_targets(model.plans, model.config.num_layers)
    ids = [
        manager.add_adapter(f"adapter-{i}", random_lora_adapter(model, targets, rank, seed + i), "<random>")
        for i in range(num_adapters)
    ]
    return manager, ids


@dataclass
class AdapterGroup:
    """The sequences of one adapter as their own packed forward (a batch split at the adapter)."""

    seq_ids: list[int]
    img: Any
    txt: Any
    timestep: Any
    layout: Any
    mapping: Any

    def run(self, model, manager):
        with manager.activate(self.mapping):
            return model.forward_packed(self.img, self.txt, self.timestep, self.layout)


def adapter_groups(model, inputs: Inputs, seq_loras, device) -> list[AdapterGroup]:
    """One `AdapterGroup` per adapter, with the same rows as the mixed forward."""
    import torch

    from vllm_omni.diffusion.models.qwen_image.packing import build_packed_layout
    from vllm_omni.lora.layers import LoRAMapping

    layout = inputs.layout
    img_of, txt_off = layout.split_img(inputs.img_rows), layout.txt_row_offsets
    by_adapter: dict[int, list[int]] = {}
    for i, seq in enumerate(seq_loras):
        by_adapter.setdefault(seq.lora_int_id, []).append(i)
    groups = []
    for seq_ids in by_adapter.values():
        sub = build_packed_layout(
            [inputs.specs[i] for i in seq_ids], model.config.axes_dims_rope, device=device
        )
        groups.append(
            AdapterGroup(
                seq_ids=seq_ids,
                img=torch.cat([img_of[i] for i in seq_ids]),
                txt=torch.cat([inputs.txt_rows[txt_off[i] : txt_off[i + 1]] for i in seq_ids]),
                timestep=inputs.timestep[: len(seq_ids)],
                layout=sub,
                mapping=LoRAMapping.for_packed([seq_loras[i] for i in seq_ids], sub),
            )
        )
    return groups


def max_diff_vs_groups(model, manager, groups, inputs: Inputs, mixed_out) -> float:
    """Largest |mixed - alone| over all image rows, each adapter's sequences run as their own forward."""
    mixed_of, worst = inputs.layout.split_img(mixed_out), 0.0
    for group in groups:
        out = group.layout.split_img(group.run(model, manager))
        for got, i in zip(out, group.seq_ids):
            worst = max(worst, float((got.float() - mixed_of[i].float()).abs().max()))
    return worst


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import torch

    from vllm_omni.lora.layers import LoRAMapping, SeqLoRA

    args = parse_args(argv)
    device, dtype = _device_dtype(args)
    model = build_transformer(transformer_config_dict(args.model), args.num_layers, device, dtype, args.seed)
    if device.type == "cuda" and not args.enforce_eager:
        model.enable_compile()
    mix = parse_mix(args.mix, "--mix")
    cfg = CfgMode(False, 1.0, None) if args.no_cfg else CfgMode(True, 4.0, "negative")
    per_request = request_specs(mix, cfg, args.text_len, args.text_len)
    inputs = Inputs(model, per_request, device, dtype, args.seed)
    with torch.inference_mode():
        base_s = median_time(lambda: inputs.run_packed(model), device, args.warmup, args.iters)
        manager, ids = load_adapters(model, args.num_adapters, args.rank, args.seed)
        seq_loras = [SeqLoRA(ids[r % len(ids)], 1.0) for r, seqs in enumerate(per_request) for _ in seqs]
        mixed = LoRAMapping.for_packed(seq_loras, inputs.layout)

        def run_mixed():
            with manager.activate(mixed):
                return inputs.run_packed(model)

        groups = adapter_groups(model, inputs, seq_loras, device)
        unused_s = median_time(lambda: inputs.run_packed(model), device, args.warmup, args.iters)
        mixed_s = median_time(run_mixed, device, args.warmup, args.iters)
        split_s = median_time(
            lambda: [g.run(model, manager) for g in groups], device, args.warmup, args.iters
        )
        mixed_out = run_mixed()
        check = None if args.no_check else max_diff_vs_groups(model, manager, groups, inputs, mixed_out)
        sync(device)
    result = {
        "mix": mix.name,
        "cfg": cfg.enabled,
        "num_seqs": len(seq_loras),
        "num_adapters": args.num_adapters,
        "rank": args.rank,
        "num_layers": model.config.num_layers,
        "dtype": str(dtype).removeprefix("torch."),
        "base_ms": base_s * 1e3,
        "unused_ms": unused_s * 1e3,
        "mixed_ms": mixed_s * 1e3,
        "split_per_adapter_ms": split_s * 1e3,
        "ratio": ratio(mixed_s, base_s),
        "split_ratio": ratio(split_s, base_s),
        "unused_ratio": ratio(unused_s, base_s),
        "max_abs_diff_vs_split": check,
        "environment": environment_info(device),
    }
    print(
        f"{mix.name} cfg={cfg.enabled} seqs={len(seq_loras)} adapters={args.num_adapters} rank={args.rank} "
        f"{result['dtype']} on {device}: base {result['base_ms']:.1f} ms, adapters loaded unused "
        f"{result['unused_ms']:.1f} ms ({result['unused_ratio']:.3f}x), "
        f"mixed adapters {result['mixed_ms']:.1f} ms "
        f"({result['ratio']:.3f}x; target <= 1.15x); "
        f"one forward per adapter {result['split_per_adapter_ms']:.1f} ms "
        f"({result['split_ratio']:.3f}x); max |mixed - split| {check}"
    )
    if args.json_output:
        write_json(args.json_output, {"lora_benchmark": result})
    return result


if __name__ == "__main__":
    main()

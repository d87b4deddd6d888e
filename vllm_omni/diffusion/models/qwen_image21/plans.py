"""Qwen-Image-2.1's plans (`models/plans.py`): its module names, for the runtime's LoRA, batch-invariant
mode, FP8 and block code. No tensor-parallel plan: 2.1 refuses the parallel flags
(`loader.QwenImage21Family.capabilities`)."""

from __future__ import annotations

from vllm_omni.diffusion.models.plans import LoRAPlan, TransformerPlans
from vllm_omni.diffusion.models.qwen_image.layers import RMSNorm

ATTENTION_AND_MLP = (
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "img_mlp.gate_layer",
    "img_mlp.proj",
    "img_mlp.out",
)
"""Per-block linears of the attention and the SwiGLU MLP (the usual LoRA targets)."""

LORA_PLAN = LoRAPlan(
    # the shared modulation [scale1 | gate1 | scale2 | gate2], the final norm's scale and the timestep
    # embedding run on the timestep embedding: one row per sequence (as Qwen-Image's img_mod / txt_mod)
    seq_modules=("modulation", "norm_out", "time_text_embed"),
    # the text projection runs on a prefix's text rows (prefill only; `pipeline.admit`)
    txt_modules=("txt_in",),
    block_targets=ATTENTION_AND_MLP,
)
"""Every other linear (img_in, the blocks, proj_out) sees the image rows of a step, or the prefix rows
of a prefill (single-stream blocks: a prefix row goes through the same linears as an image row)."""

QWEN_IMAGE21_PLANS = TransformerPlans(
    blocks="transformer_blocks",
    lora=LORA_PLAN,
    # the blocks' per-head q / k norms (a step's rows). The text projection's `ZeroCenterRMSNorm` runs
    # in a request's own prefill only, never on a packed batch: invariant as it is.
    invariant_norms=(RMSNorm,),
    # the Qwen-Image list mapped onto 2.1's modules (embedders, the shared modulation, the final
    # projection, the MLP's down projection); docs/quantization.md
    quant_kept_layers=(
        "img_in",
        "txt_in",
        "time_text_embed",
        "modulation",
        "norm_out.linear",
        "proj_out",
        "img_mlp.out",
    ),
)
"""`QwenImage21Transformer.plans`."""

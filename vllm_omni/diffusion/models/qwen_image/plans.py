"""Qwen-Image's plans (`models/plans.py`): its module names, for the runtime's LoRA, tensor
parallelism, batch-invariant mode, FP8 and block code. Qwen-Image-Edit shares the transformer."""

from __future__ import annotations

from vllm_omni.diffusion.models.plans import BlockShard, LoRAPlan, TensorParallelPlan, TransformerPlans
from vllm_omni.diffusion.models.qwen_image.layers import RMSNorm

ATTENTION_AND_MLP = (
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
    "img_mlp.net.0.proj",
    "img_mlp.net.2",
    "txt_mlp.net.0.proj",
    "txt_mlp.net.2",
)
"""Per-block linears of both streams' attention and MLP (the usual Qwen-Image LoRA targets)."""

LORA_PLAN = LoRAPlan(
    # AdaLN modulation of both streams, the final norm's and the timestep embedding: one row per sequence
    seq_modules=("img_mod", "txt_mod", "norm_out", "time_text_embed"),
    # the text stream's input projection, its q / k / v and output projection, its MLP
    txt_modules=("txt_in", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out", "txt_mlp"),
    block_targets=ATTENTION_AND_MLP,
)

TP_PLAN = TensorParallelPlan(
    shards=(
        # both streams' q, k, v: column, whole heads (RMS QK-norm and RoPE are per head: unchanged;
        # the joint attention's heads per rank follow from the shards' shapes)
        *(BlockShard(f"attn.{n}", "column", per_head=True) for n in ("to_q", "to_k", "to_v")),
        *(
            BlockShard(f"attn.{n}", "column", per_head=True)
            for n in ("add_q_proj", "add_k_proj", "add_v_proj")
        ),
        # output projections: row, partial sums over the owned heads, all-reduced
        BlockShard("attn.to_out.0", "row", per_head=True),
        BlockShard("attn.to_add_out", "row", per_head=True),
        # both MLPs: up projection column (GELU per unit), down projection row
        BlockShard("img_mlp.net.0.proj", "column"),
        BlockShard("img_mlp.net.2", "row"),
        BlockShard("txt_mlp.net.0.proj", "column"),
        BlockShard("txt_mlp.net.2", "row"),
    )
)
"""Two all-reduces per stream per block; img_in, txt_in, txt_norm, the time embedding, AdaLN
modulation, norm_out and proj_out stay replicated."""

QWEN_IMAGE_PLANS = TransformerPlans(
    blocks="transformer_blocks",
    lora=LORA_PLAN,
    tensor_parallel=TP_PLAN,
    invariant_norms=(RMSNorm,),
    # SGLang's list for Qwen-Image FP8: embedders, modulation, final projection, the image MLP's down
    # projection (docs/quantization.md)
    quant_kept_layers=(
        "img_in",
        "txt_in",
        "time_text_embed",
        "norm_out.linear",
        "proj_out",
        "img_mod",
        "txt_mod",
        "img_mlp.net.2",
    ),
    # ComfyUI-TeaCache's coefficients for Qwen-Image, the ones vLLM-Omni's TeaCache uses for it
    tea_cache_coefficients=(-450.0, 280.0, -45.0, 3.2, -0.02),
)
"""`QwenImageTransformer.plans`."""

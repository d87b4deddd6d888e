"""Configs of Qwen-Image-2.1: the tiny random checkpoint's components, the released layout, and the
real-size components `--load-format dummy` builds for `Qwen/Qwen-Image-2.1` without a local copy.

The tiny model keeps every structural feature of the released one (single-stream blocks, one shared
modulation, zero-centred text norm, 3-axis RoPE, a Qwen3-VL text encoder with a vision tower, a 4-channel
RGBA VAE with 16x spatial compression) at widths that run in milliseconds on a CPU.
"""

from __future__ import annotations

from vllm_omni.diffusion.models.qwen_image import configs as qwen_image_configs

PIPELINE_CLASS_NAME = "QwenImage21Pipeline"

MODEL_INDEX: dict = {
    "_class_name": PIPELINE_CLASS_NAME,
    "processor": ["transformers", "Qwen3VLProcessor"],
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    "text_encoder": ["transformers", "Qwen3VLForConditionalGeneration"],
    "transformer": ["diffusers", "QwenImage21Transformer2DModel"],
    "vae": ["diffusers", "AutoencoderKLQwenImage21"],
    "sample_sigmas": None,
}
"""`model_index.json` (without `_diffusers_version`). `sample_sigmas` None: the pipeline's linspace grid."""

TINY_LATENT_CHANNELS = 16
"""z_dim of the tiny VAE = in/out channels of the tiny transformer (released: 64)."""

TINY_TRANSFORMER_CONFIG: dict = {
    "patch_size": 1,
    "in_channels": TINY_LATENT_CHANNELS,
    "out_channels": TINY_LATENT_CHANNELS,
    "num_layers": 2,
    "attention_head_dim": 16,
    "num_attention_heads": 2,
    "context_in_dim": 32,  # = the tiny text encoder's hidden size
    "mlp_ratio": 3,
    "axes_dims_rope": [4, 6, 6],  # sums to attention_head_dim
    "eps": 1e-6,
    "causal_condition": True,
}

TINY_VAE_CONFIG: dict = {
    "base_dim": 8,
    "decoder_base_dim": 8,
    "z_dim": TINY_LATENT_CHANNELS,
    "dim_mult": [1, 1, 1, 1, 1],  # four 2x spatial downsamples: 16x, as released
    "num_res_blocks": 1,
    "attn_scales": [],
    "temperal_downsample": [False, True, True, True],
    "in_channels": 4,  # RGBA
    "out_channels": 4,
    "latents_mean": [0.05 * (i - 8) for i in range(TINY_LATENT_CHANNELS)],
    "latents_std": [1.0 + 0.05 * i for i in range(TINY_LATENT_CHANNELS)],
}

_tok = qwen_image_configs._tiny_token_id

TINY_TEXT_ENCODER_CONFIG: dict = {
    "image_token_id": _tok("<|image_pad|>"),
    "video_token_id": _tok("<|video_pad|>"),
    "vision_start_token_id": _tok("<|vision_start|>"),
    "vision_end_token_id": _tok("<|vision_end|>"),
    "tie_word_embeddings": False,
    "text_config": {
        "vocab_size": 1088,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        # head_dim 16 -> 8 rotary frequencies split over (t, h, w)
        "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [2, 3, 3]},
        "bos_token_id": _tok("<|endoftext|>"),
        "eos_token_id": _tok("<|im_end|>"),
        "pad_token_id": _tok("<|endoftext|>"),
    },
    "vision_config": {
        "depth": 2,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_heads": 2,
        "out_hidden_size": 32,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "num_position_embeddings": 64,
        "deepstack_visual_indexes": [0],
    },
}
"""Qwen3VLConfig kwargs of the tiny text encoder (the tiny Qwen-Image tokenizer's special-token ids)."""

TINY_SCHEDULER_CONFIG: dict = dict(qwen_image_configs.REAL_SCHEDULER_CONFIG)
"""FlowMatchEulerDiscreteScheduler config: Qwen-Image's released one (dynamic shift from the image rows,
base 0.5 .. max 0.9 over 256 .. 8192 rows, exponential time shift, terminal 0.02)."""

TINY_PREPROCESSOR_CONFIG: dict = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen3VLProcessor",
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "merge_size": 2,
    "patch_size": 16,
    "resample": 3,
    "rescale_factor": 0.00392156862745098,
    "temporal_patch_size": 2,
    "size": {"shortest_edge": 4096, "longest_edge": 2**21},
}
"""`processor/preprocessor_config.json`: Qwen3-VL's 16-pixel patches. The pixel cap admits a reference
image at the pipeline's 1024 x 1024 area unresized, so its slots match its VAE latents 1:4."""

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for c in message['content'] %}{% if c['type'] == 'text' %}{{ c['text'] }}"
    "{% elif c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% endif %}{% endfor %}"
    "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""Qwen3-VL's chat template, reduced to what the pipeline renders (system / user text and images)."""


# ---- real size (`vllm serve Qwen/Qwen-Image-2.1 --load-format dummy`: random weights, no download) ----

REAL_TRANSFORMER_CONFIG: dict = {
    "patch_size": 1,
    "in_channels": 64,
    "out_channels": 64,
    "num_layers": 32,
    "attention_head_dim": 128,
    "num_attention_heads": 32,  # width 4096
    "context_in_dim": 4096,  # = the Qwen3-VL-8B text encoder's hidden size
    "mlp_ratio": 3,
    "axes_dims_rope": [16, 56, 56],
    "eps": 1e-6,
    "causal_condition": True,
}
"""The released transformer (7.1B: 32 single-stream blocks, 32 x 128 heads, SwiGLU x3, 64 latent
channels), as diffusers 0.42.1's `QwenImage21Transformer2DModel` defaults give it."""

REAL_VAE_CONFIG: dict = {
    "base_dim": 96,
    "decoder_base_dim": 144,
    "z_dim": 64,
    "dim_mult": [1, 2, 4, 8, 8],
    "num_res_blocks": 2,
    "in_channels": 4,  # RGBA
    "out_channels": 4,
}
"""`AutoencoderKLQwenImage21` kwargs: 64 channels, 16x; the rest (latent statistics, temporal
downsampling) are diffusers 0.42.1's class defaults."""

REAL_TEXT_ENCODER_CONFIG: dict = {
    **{k: v for k, v in TINY_TEXT_ENCODER_CONFIG.items() if k not in ("text_config", "vision_config")},
    "text_config": {
        **TINY_TEXT_ENCODER_CONFIG["text_config"],
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 262144,
        "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [24, 20, 20]},
    },
    "vision_config": {
        "depth": 27,
        "hidden_size": 1152,
        "intermediate_size": 4304,
        "num_heads": 16,
        "out_hidden_size": 4096,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "num_position_embeddings": 2304,
        "deepstack_visual_indexes": [8, 16, 24],
    },
}
"""Qwen3VLConfig kwargs of a Qwen3-VL-8B-size text encoder (36 layers, hidden 4096, GQA 32/8, a 27-layer
vision tower). Its special-token ids are the tiny tokenizer's: without network the tiny tokenizer
stands in for the real one (as for Qwen-Image 1.0's dummy), so the encoder must look for ITS ids."""

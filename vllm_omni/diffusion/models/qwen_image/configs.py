"""Config dicts for Qwen-Image: the released sizes (REAL_*) and the tiny test model (TINY_*).

REAL_* mirror the `config.json` files of the released `Qwen/Qwen-Image` checkpoint (diffusers layout) and
are what `--load-format dummy` builds when no local directory gives the configs. TINY_* are what
`qwen_image/tiny.py` writes: the same architecture, shrunk to a few MB.

Each dict uses the key names of the `config.json` it stands for, so it can be passed to the matching
diffusers / transformers class (`QwenImageTransformer2DModel(**d)`, `AutoencoderKLQwenImage(**d)`,
`Qwen2_5_VLConfig(**d)`, `FlowMatchEulerDiscreteScheduler(**d)`).
"""

from __future__ import annotations

# ---------------------------------------------------------------------------------------------------------
# Shared by real and tiny
# ---------------------------------------------------------------------------------------------------------

LATENTS_MEAN = [
    -0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
    0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921,
]  # fmt: skip
"""Per-channel latent mean of the released VAE (vae/config.json `latents_mean`), 16 channels."""

LATENTS_STD = [
    2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
    3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160,
]  # fmt: skip
"""Per-channel latent std of the released VAE (vae/config.json `latents_std`), 16 channels."""

REAL_SCHEDULER_CONFIG: dict = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "invert_sigmas": False,
    "max_image_seq_len": 8192,
    "max_shift": 0.9,
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "shift_terminal": 0.02,
    "stochastic_sampling": False,
    "time_shift_type": "exponential",
    "use_beta_sigmas": False,
    "use_dynamic_shifting": True,
    "use_exponential_sigmas": False,
    "use_karras_sigmas": False,
}
"""`scheduler/scheduler_config.json` of Qwen/Qwen-Image. The tiny model uses the same values, so it has
the real sigma schedule for every resolution."""

MODEL_INDEX: dict = {
    "_class_name": "QwenImagePipeline",
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
    "tokenizer": ["transformers", "Qwen2Tokenizer"],
    "transformer": ["diffusers", "QwenImageTransformer2DModel"],
    "vae": ["diffusers", "AutoencoderKLQwenImage"],
}
"""`model_index.json` of Qwen/Qwen-Image (without `_diffusers_version`)."""

# ---------------------------------------------------------------------------------------------------------
# Real sizes (Qwen/Qwen-Image)
# ---------------------------------------------------------------------------------------------------------

REAL_TRANSFORMER_CONFIG: dict = {
    "_class_name": "QwenImageTransformer2DModel",
    "patch_size": 2,
    "in_channels": 64,
    "out_channels": 16,
    "num_layers": 60,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 3584,
    "guidance_embeds": False,
    "axes_dims_rope": [16, 56, 56],
}
"""`transformer/config.json`: 60 dual-stream blocks, hidden 24 x 128 = 3072, about 20B parameters."""

REAL_VAE_CONFIG: dict = {
    "_class_name": "AutoencoderKLQwenImage",
    "attn_scales": [],
    "base_dim": 96,
    "dim_mult": [1, 2, 4, 4],
    "dropout": 0.0,
    "latents_mean": LATENTS_MEAN,
    "latents_std": LATENTS_STD,
    "num_res_blocks": 2,
    "temperal_downsample": [False, True, True],
    "z_dim": 16,
}
"""`vae/config.json` (= the `AutoencoderKLQwenImage` defaults): 8x spatial compression, 16 latent channels."""

REAL_TEXT_ENCODER_CONFIG: dict = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"],
    "model_type": "qwen2_5_vl",
    "image_token_id": 151655,
    "video_token_id": 151656,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "tie_word_embeddings": False,
    "text_config": {
        "model_type": "qwen2_5_vl_text",
        "vocab_size": 152064,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "hidden_act": "silu",
        "max_position_embeddings": 128000,
        "max_window_layers": 28,
        "rms_norm_eps": 1e-6,
        "use_sliding_window": False,
        "sliding_window": 32768,
        "attention_dropout": 0.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    # NOTE(loader): the released vision tower is 32 blocks x 1280 wide (~0.7B parameters). Text-to-image
    # never runs it, so the dummy real-size model gets a one-block tower with the real output width.
    "vision_config": {
        "model_type": "qwen2_5_vl_vision",
        "depth": 1,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_heads": 2,
        "in_channels": 3,
        "out_hidden_size": 3584,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "tokens_per_second": 2,
        "window_size": 112,
        "fullatt_block_indexes": [0],
    },
}
"""`text_encoder/config.json`: the Qwen2.5-VL-7B language model (28 layers, hidden 3584, GQA 28/4 heads,
M-RoPE sections 16/24/24, theta 1e6) with a small stand-in vision tower."""

# ---------------------------------------------------------------------------------------------------------
# Tiny sizes (tests, CPU demo)
# ---------------------------------------------------------------------------------------------------------

TINY_TRANSFORMER_CONFIG: dict = {
    "_class_name": "QwenImageTransformer2DModel",
    "patch_size": 2,
    "in_channels": 64,  # 16 latent channels x 2 x 2 patch: fixed by the VAE's z_dim
    "out_channels": 16,
    "num_layers": 2,
    "attention_head_dim": 16,
    "num_attention_heads": 2,
    "joint_attention_dim": 32,  # = TINY text encoder hidden_size
    "guidance_embeds": False,
    "axes_dims_rope": [4, 6, 6],  # sum = attention_head_dim, each even
}
"""Tiny transformer: 2 blocks, hidden 2 x 16 = 32."""

TINY_VAE_CONFIG: dict = {
    "_class_name": "AutoencoderKLQwenImage",
    "attn_scales": [],
    "base_dim": 8,
    "dim_mult": [1, 2, 4, 4],
    "dropout": 0.0,
    "latents_mean": LATENTS_MEAN,
    "latents_std": LATENTS_STD,
    "num_res_blocks": 1,
    "temperal_downsample": [False, True, True],  # 3 stages: 8x spatial compression, as released
    "z_dim": 16,  # must stay 16: transformer in_channels 64 = 16 x 2 x 2
}
"""Tiny VAE (~0.7M parameters) with the real compression, latent width and latent mean/std."""

TINY_TOKENIZER_BASE_VOCAB = 1024
"""Byte-level BPE tokens (256 bytes + 768 merges) of the tiny tokenizer; special tokens follow, in the
released order (`<|endoftext|>` = base, `<|im_start|>` = base + 1, `<|im_end|>` = base + 2, ...)."""

TINY_SPECIAL_TOKENS: list[tuple[str, bool]] = [
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
]
"""Qwen2.5 added tokens, (content, is_special), in id order after the base vocab (151643 + i released)."""


def _tiny_token_id(content: str) -> int:
    names = [name for name, _ in TINY_SPECIAL_TOKENS]
    return TINY_TOKENIZER_BASE_VOCAB + names.index(content)


TINY_TEXT_ENCODER_CONFIG: dict = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"],
    "model_type": "qwen2_5_vl",
    "image_token_id": _tiny_token_id("<|image_pad|>"),
    "video_token_id": _tiny_token_id("<|video_pad|>"),
    "vision_start_token_id": _tiny_token_id("<|vision_start|>"),
    "vision_end_token_id": _tiny_token_id("<|vision_end|>"),
    "tie_word_embeddings": False,
    "text_config": {
        "model_type": "qwen2_5_vl_text",
        "vocab_size": 1088,  # base 1024 + 22 added tokens, padded to a multiple of 64 (as 152064 is)
        "hidden_size": 32,  # = TINY transformer joint_attention_dim
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "max_window_layers": 2,
        "rms_norm_eps": 1e-6,
        "use_sliding_window": False,
        "attention_dropout": 0.0,
        # head_dim 16 -> 8 rotary frequencies split over (t, h, w)
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]},
        "bos_token_id": _tiny_token_id("<|endoftext|>"),
        "eos_token_id": _tiny_token_id("<|im_end|>"),
    },
    "vision_config": {
        "model_type": "qwen2_5_vl_vision",
        "depth": 1,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_heads": 2,
        "in_channels": 3,
        "out_hidden_size": 32,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "tokens_per_second": 2,
        "window_size": 112,
        "fullatt_block_indexes": [0],
    },
}
"""Tiny Qwen2.5-VL: 2 text layers of hidden 32 (GQA 2/1 heads), a one-block vision tower."""

TINY_SCHEDULER_CONFIG: dict = dict(REAL_SCHEDULER_CONFIG)
"""The tiny model keeps the released scheduler config (real sigma schedules)."""


REAL_PREPROCESSOR_CONFIG: dict = {
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "merge_size": 2,
    "patch_size": 14,
    "resample": 3,
    "rescale_factor": 0.00392156862745098,
    "temporal_patch_size": 2,
    "size": {"shortest_edge": 3136, "longest_edge": 12845056},
}
"""`processor/preprocessor_config.json` of Qwen/Qwen-Image-Edit (min / max pixels 3136 / 12845056)."""

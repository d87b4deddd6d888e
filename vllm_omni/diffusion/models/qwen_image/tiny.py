"""Build a tiny random Qwen-Image checkpoint in the released diffusers layout, offline.

    python -m vllm_omni.diffusion.models.qwen_image.tiny DIR --seed 0

writes

    DIR/model_index.json                  same class names as Qwen/Qwen-Image
    DIR/transformer/                      diffusers QwenImageTransformer2DModel (2 blocks, hidden 32)
    DIR/vae/                              diffusers AutoencoderKLQwenImage (base_dim 8, z_dim 16)
    DIR/text_encoder/                     transformers Qwen2_5_VLForConditionalGeneration (hidden 32)
    DIR/tokenizer/                        byte-level BPE trained here on a built-in corpus (Qwen2Tokenizer)
    DIR/scheduler/scheduler_config.json   the released scheduler config (real sigma schedules)

The same seed gives the same bytes. Every weight is re-drawn from a seeded generator at a scale that
keeps activations alive (diffusers/transformers initialise norms to exactly 1 and some layers to
constants), so an implementation that reads a weight wrongly gives a visibly different output.
`ensure_tiny_checkpoint()` builds it once into a cache folder and returns the path.
"""

from __future__ import annotations

from pathlib import Path

import torch

from vllm_omni.diffusion.model_loader import randomize_weights_
from vllm_omni.diffusion.models.qwen_image import configs
from vllm_omni.diffusion.models.qwen_image.pipeline import PROMPT_TEMPLATE
from vllm_omni.diffusion.models.tiny_cache import (
    VERSION_FILE,
    empty_output_dir,
    ensure_built,
    run_checkpoint_cli,
    save_scheduler_and_index,
    write_json,
)

TINY_CHECKPOINT_VERSION = 1
"""Bumped whenever the tiny checkpoint's content changes, so stale caches are rebuilt."""


# Qwen2's pre-tokenizer split (transformers' tokenization_qwen2.PRETOKENIZE_REGEX).
_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"""
    r"""|\s+(?!\S)|\s+"""
)

_CORPUS = """\
A red cube sits on a wooden table next to a blue sphere and a small green pyramid.
A photo of a cat sleeping on a soft gray sofa in a bright living room with large windows.
A dog runs across a green park under a clear blue sky, chasing a yellow ball.
An astronaut riding a horse on the surface of the moon, digital art, high detail.
A bowl of fresh fruit: apples, oranges, bananas and grapes on a kitchen counter.
A mountain landscape at sunset with snow on the peaks and a calm lake below.
A city street at night, neon signs reflecting on wet pavement after the rain.
A coffee shop entrance with a chalkboard sign that reads "Fresh coffee, 2 dollars".
Three white birds flying over the ocean waves near a rocky beach in the morning.
A portrait of an old man with a long beard, wearing a brown hat and a warm coat.
A child builds a sandcastle on the beach while the tide slowly comes in.
A vintage car parked in front of a small house with a garden full of flowers.
A forest path covered with autumn leaves in orange, red and golden colors.
A glass of water on a desk beside an open book, a pen and a laptop computer.
A large poster on the wall shows the words "Hello World" in bold black letters.
Two people walking together along a river bridge, holding hands at dawn.
A simple logo of a circle inside a square, flat design, minimal, vector style.
A close-up of a flower with purple petals and drops of dew in soft light.
An ancient castle on a hill, surrounded by fog, dramatic clouds overhead.
A bicycle leaning against a brick wall in a narrow street of an old town.
A plate of pasta with tomato sauce, basil leaves and grated cheese on top.
A robot reading a newspaper in a quiet library, cinematic lighting, 4k.
The quick brown fox jumps over the lazy dog near the edge of the field.
A watercolor painting of a sailboat drifting on a peaceful blue lake.
Four colorful umbrellas hang above a market square filled with people.
A snowy village at night with warm lights glowing through every window.
A desert scene with tall cactus plants, sand dunes and a bright orange sun.
A wooden cabin by the river, smoke rising from the chimney in winter.
A train crossing a long stone bridge between green hills in the summer.
A modern kitchen with white cabinets, a marble island and hanging lamps.
A tiger resting in the tall grass, its striped fur glowing in the light.
A hand-drawn map of a fantasy island with mountains, rivers and a harbor.
One blue square, two red circles and three yellow triangles on paper.
A lighthouse standing on a cliff while stormy waves crash on the rocks.
A girl in a red dress dancing in a field of sunflowers on a windy day.
A shelf full of books, plants and a small clock in a cozy reading corner.
"""


# ---------------------------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------------------------


def _build_transformer(generator: torch.Generator):
    from diffusers import QwenImageTransformer2DModel

    kwargs = {k: v for k, v in configs.TINY_TRANSFORMER_CONFIG.items() if not k.startswith("_")}
    model = QwenImageTransformer2DModel(**kwargs)
    randomize_weights_(model, generator)
    return model


def _build_vae(generator: torch.Generator):
    from diffusers import AutoencoderKLQwenImage

    kwargs = {k: v for k, v in configs.TINY_VAE_CONFIG.items() if not k.startswith("_")}
    vae = AutoencoderKLQwenImage(**kwargs)
    randomize_weights_(vae, generator)
    return vae


def _build_text_encoder(generator: torch.Generator):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = Qwen2_5_VLConfig(**_config_kwargs(configs.TINY_TEXT_ENCODER_CONFIG))
    model = Qwen2_5_VLForConditionalGeneration(config)
    randomize_weights_(model, generator)
    return model


def _config_kwargs(config: dict) -> dict:
    return {k: v for k, v in config.items() if k not in ("architectures", "model_type")}


# ---------------------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------------------


def _train_bpe():
    """Byte-level BPE with Qwen2's normaliser / pre-tokenizer, trained on the built-in corpus."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    # The template (without its special tokens) weighs most, so each of its words becomes one token,
    # as in the released tokenizer: the template prefix is then exactly 34 tokens.
    template_text = PROMPT_TEMPLATE.replace("<|im_start|>", "").replace("<|im_end|>", "")
    corpus = [template_text.format(line) for line in _CORPUS.splitlines()] + [_CORPUS] * 2
    trainer = trainers.BpeTrainer(
        vocab_size=configs.TINY_TOKENIZER_BASE_VOCAB,
        min_frequency=1,
        show_progress=False,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(corpus, trainer)
    if tokenizer.get_vocab_size() != configs.TINY_TOKENIZER_BASE_VOCAB:
        raise RuntimeError(
            f"tiny tokenizer trained to {tokenizer.get_vocab_size()} tokens, "
            f"expected {configs.TINY_TOKENIZER_BASE_VOCAB}: enlarge the built-in corpus"
        )
    return tokenizer


def save_tiny_tokenizer(out_dir: Path) -> None:
    """Write a Qwen2Tokenizer-compatible tokenizer (tokenizer.json, vocab.json, merges.txt, config)."""
    from tokenizers import AddedToken

    tokenizer = _train_bpe()
    tokenizer.add_tokens(
        [
            AddedToken(content, special=special, normalized=False, lstrip=False, rstrip=False)
            for content, special in configs.TINY_SPECIAL_TOKENS
        ]
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    tokenizer.model.save(str(out_dir))  # vocab.json + merges.txt
    added = {}
    for content, special in configs.TINY_SPECIAL_TOKENS:
        token_id = tokenizer.token_to_id(content)
        added[str(token_id)] = {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
    tokenizer_config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [c for c, special in configs.TINY_SPECIAL_TOKENS if special][1:],
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    write_json(out_dir / "tokenizer_config.json", tokenizer_config)


# ---------------------------------------------------------------------------------------------------------
# Checkpoint
# ---------------------------------------------------------------------------------------------------------


def make_tiny_checkpoint(out_dir: str | Path, seed: int = 0) -> Path:
    """Write the tiny random Qwen-Image pipeline to `out_dir` (created; must be empty or absent)."""
    out_dir = empty_output_dir(out_dir, "make_tiny_checkpoint")

    generator = torch.Generator("cpu").manual_seed(seed)
    # Components in a fixed order: each draws from the same generator.
    _build_transformer(generator).save_pretrained(out_dir / "transformer", safe_serialization=True)
    _build_vae(generator).save_pretrained(out_dir / "vae", safe_serialization=True)
    _build_text_encoder(generator).save_pretrained(out_dir / "text_encoder", safe_serialization=True)
    save_tiny_tokenizer(out_dir / "tokenizer")
    save_scheduler_and_index(out_dir, configs.TINY_SCHEDULER_CONFIG, configs.MODEL_INDEX)
    write_json(out_dir / VERSION_FILE, {"version": TINY_CHECKPOINT_VERSION, "seed": seed})
    return out_dir


def ensure_tiny_checkpoint(cache_dir: Path | None = None, seed: int = 0) -> Path:
    """Return `<cache_dir>/tiny-qwen-image-seed<seed>`, building it first if absent or stale.

    `cache_dir` defaults to `tiny_cache.default_cache_dir()`. See `ensure_built` for concurrency.
    """
    return ensure_built("tiny-qwen-image", make_tiny_checkpoint, TINY_CHECKPOINT_VERSION, cache_dir, seed)


def main(argv: list[str] | None = None) -> None:
    """CLI entry point: `python -m vllm_omni.diffusion.models.qwen_image.tiny DIR [--seed N]`."""
    run_checkpoint_cli(make_tiny_checkpoint, "Qwen-Image", __doc__.split("\n\n")[0], argv)


if __name__ == "__main__":
    main()

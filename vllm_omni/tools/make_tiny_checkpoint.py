"""Build a tiny random Qwen-Image checkpoint in the released diffusers layout, offline.

    python -m vllm_omni.tools.make_tiny_checkpoint DIR --seed 0

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

import argparse
import json
import math
import os
import shutil
import tempfile
import uuid
from pathlib import Path

import torch

from vllm_omni.diffusion.models.qwen_image import configs

TINY_CHECKPOINT_VERSION = 1
"""Bumped whenever the tiny checkpoint's content changes, so stale caches are rebuilt."""

VERSION_FILE = "vllm_omni_tiny.json"
CACHE_ENV = "VLLM_OMNI_CACHE_DIR"

QWEN_IMAGE_PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
"""diffusers' `QwenImagePipeline.prompt_template_encode`; its prefix must give 34 tokens."""

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


def _is_norm_scale(module: torch.nn.Module, param_name: str) -> bool:
    return "norm" in type(module).__name__.lower() and param_name in ("weight", "gamma")


@torch.no_grad()
def randomize_weights_(
    module: torch.nn.Module,
    generator: torch.Generator,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
) -> None:
    """Replace every parameter of `module` by seeded random values that keep a signal alive.

    Norm scales get `1 + 0.25 * N(0, 1)`, embeddings `N(0, 1)`, other matrices / conv kernels
    `N(0, 1 / fan_in)`, biases and other vectors `N(0, 0.2^2)`. Parameters are visited in
    `named_modules()` order, so a seed fixes every value. Parameters on the meta device are materialised
    on `device` (required then) in `dtype` (default: the parameter's dtype); `generator` must live on
    that device. Tied parameters stay tied. Buffers are left alone.
    """
    replaced: dict[int, torch.nn.Parameter] = {}
    for _, mod in module.named_modules():
        for name, param in list(mod._parameters.items()):
            if param is None:
                continue
            if id(param) in replaced:
                mod._parameters[name] = replaced[id(param)]
                continue
            target_device = param.device if device is None else torch.device(device)
            if target_device.type == "meta":
                raise ValueError("randomize_weights_: parameters are on the meta device; pass device=")
            target_dtype = param.dtype if dtype is None or not param.is_floating_point() else dtype
            value = torch.empty(param.shape, dtype=target_dtype, device=target_device)
            if _is_norm_scale(mod, name):
                value.normal_(0.0, 0.25, generator=generator).add_(1.0)
            elif isinstance(mod, torch.nn.Embedding):
                value.normal_(0.0, 1.0, generator=generator)
            elif value.dim() >= 2:
                fan_in = value[0].numel()
                value.normal_(0.0, 1.0 / math.sqrt(fan_in), generator=generator)
            else:
                value.normal_(0.0, 0.2, generator=generator)
            new_param = torch.nn.Parameter(value, requires_grad=False)
            replaced[id(param)] = new_param
            mod._parameters[name] = new_param


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
    template_text = QWEN_IMAGE_PROMPT_TEMPLATE.replace("<|im_start|>", "").replace("<|im_end|>", "")
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
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)


# ---------------------------------------------------------------------------------------------------------
# Checkpoint
# ---------------------------------------------------------------------------------------------------------


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def make_tiny_checkpoint(out_dir: str | Path, seed: int = 0) -> Path:
    """Write the tiny random Qwen-Image pipeline to `out_dir` (created; must be empty or absent)."""
    import diffusers
    from diffusers import FlowMatchEulerDiscreteScheduler

    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ValueError(f"make_tiny_checkpoint: output directory {out_dir} is not empty")
    out_dir.mkdir(parents=True, exist_ok=True)

    generator = torch.Generator("cpu").manual_seed(seed)
    # Components in a fixed order: each draws from the same generator.
    _build_transformer(generator).save_pretrained(out_dir / "transformer", safe_serialization=True)
    _build_vae(generator).save_pretrained(out_dir / "vae", safe_serialization=True)
    _build_text_encoder(generator).save_pretrained(out_dir / "text_encoder", safe_serialization=True)
    save_tiny_tokenizer(out_dir / "tokenizer")
    scheduler_kwargs = {k: v for k, v in configs.TINY_SCHEDULER_CONFIG.items() if not k.startswith("_")}
    FlowMatchEulerDiscreteScheduler(**scheduler_kwargs).save_pretrained(out_dir / "scheduler")
    _write_json(
        out_dir / "model_index.json", {**configs.MODEL_INDEX, "_diffusers_version": diffusers.__version__}
    )
    _write_json(out_dir / VERSION_FILE, {"version": TINY_CHECKPOINT_VERSION, "seed": seed})
    return out_dir


def default_cache_dir() -> Path:
    """`$VLLM_OMNI_CACHE_DIR`, else `~/.cache/vllm_omni`."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "vllm_omni"


def _is_current(path: Path, seed: int, version: int = TINY_CHECKPOINT_VERSION) -> bool:
    try:
        info = json.loads((path / VERSION_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return info == {"version": version, "seed": seed}


def ensure_tiny_checkpoint(cache_dir: Path | None = None, seed: int = 0) -> Path:
    """Return `<cache_dir>/tiny-qwen-image-seed<seed>`, building it first if absent or stale.

    `cache_dir` defaults to `default_cache_dir()`. See `ensure_built` for concurrency.
    """
    return ensure_built("tiny-qwen-image", make_tiny_checkpoint, TINY_CHECKPOINT_VERSION, cache_dir, seed)


def ensure_built(name: str, build, version: int, cache_dir: Path | None = None, seed: int = 0) -> Path:
    """Return `<cache_dir>/<name>-seed<seed>`, running `build(dir, seed=seed)` first if absent or stale.

    `build` must write `VERSION_FILE` with `{"version": version, "seed": seed}`. The checkpoint is built
    in a private temporary folder and moved into place with one atomic rename, so concurrent callers
    (server workers, pytest-xdist) each either see a complete checkpoint or build their own and keep
    the first one that landed.
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = cache_dir / f"{name}-seed{seed}"
    if _is_current(final, seed, version):
        return final
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=cache_dir))
    try:
        build(tmp, seed=seed)
        if final.exists() and not _is_current(final, seed, version):
            # Stale version: move it aside (atomic), then delete it.
            stale = cache_dir / f".{final.name}.stale-{uuid.uuid4().hex}"
            try:
                os.rename(final, stale)
                shutil.rmtree(stale, ignore_errors=True)
            except OSError:
                pass  # someone else moved it first
        try:
            os.rename(tmp, final)
        except OSError:
            if not _is_current(final, seed, version):  # lost the race to a complete checkpoint: fine
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def run_checkpoint_cli(make, what: str, description: str, argv: list[str] | None) -> None:
    """`DIR [--seed N]`: build the checkpoint `make(out_dir, seed=...)` writes and report its size."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("out_dir", type=Path, help="output directory (created; must be empty)")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    args = parser.parse_args(argv)
    try:
        path = make(args.out_dir, seed=args.seed)
    except ValueError as exc:
        parser.error(str(exc))
    total = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    print(f"wrote tiny {what} checkpoint to {path} ({total / 2**20:.1f} MiB)")


def main(argv: list[str] | None = None) -> None:
    """CLI entry point: `python -m vllm_omni.tools.make_tiny_checkpoint DIR [--seed N]`."""
    run_checkpoint_cli(make_tiny_checkpoint, "Qwen-Image", __doc__.split("\n\n")[0], argv)


if __name__ == "__main__":
    main()

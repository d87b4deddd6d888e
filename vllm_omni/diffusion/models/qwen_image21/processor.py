"""The prompt side of Qwen-Image-2.1: the chat template, its token counts, and a text-only processor.

diffusers' `QwenImage21Pipeline` renders every prompt in one chat template and drops the system turn
from the encoder output:

    <|im_start|>system\\nComprehend and analyze the provided prompt.<|im_end|>\\n     <- dropped
    <|im_start|>user\\n{prompt}<|im_end|>\\n<|im_start|>assistant\\n                  <- the prompt's rows

`TextProcessor` stands in for `Qwen3VLProcessor` where only text is processed: it is the processor's
tokenizer with the processor's call signature, and builds without torchvision (which the real
processor's video half imports).
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from vllm_omni.inputs import MAX_SEQUENCE_LENGTH_LIMIT, InvalidRequestError

SYSTEM_PROMPT = "Comprehend and analyze the provided prompt."
SYSTEM_TURN = f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n"
PROMPT_TEMPLATE_T2I = SYSTEM_TURN + "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
"""diffusers' `prompt_template_t2i`."""
IMAGE_TOKEN = "<|image_pad|>"
PROMPT_TEMPLATE_TI2I = (
    SYSTEM_TURN + "<|im_start|>user\n<image1><|vision_start|><|image_pad|><|vision_end|>{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
"""diffusers' `prompt_template_ti2i` (one reference image; `ti2i_template` for several)."""
MAX_REFERENCE_IMAGES = 10
"""Reference images one Qwen-Image-2.1 edit may carry (the model's documented limit)."""
OUTPUT_RESOLUTION = 1024
"""diffusers' `output_resolution`: a reference image is resized to about this squared area."""
PIXELS_PER_SLOT = 32
"""Pixels per side of one vision-language image slot (16-pixel patches, 2x2 merged)."""
ROWS_PER_SLOT = 4
"""Latent rows (16-pixel) one slot stands for in the transformer's prefix: a 2x2 group."""


def reference_size(image) -> tuple[int, int]:
    """(width, height) diffusers resizes a reference image to: its aspect at `OUTPUT_RESOLUTION`^2 area,
    sides rounded to multiples of 32 (`calculate_dimensions`)."""
    ratio = image.size[0] / image.size[1]
    width = math.sqrt(OUTPUT_RESOLUTION * OUTPUT_RESOLUTION * ratio)
    height = width / ratio
    return round(width / 32) * 32, round(height / 32) * 32


def ti2i_template(num_images: int) -> str:
    """The edit template for `num_images` reference images, as diffusers builds it: image i's vision
    block `<imagei><|vision_start|><|image_pad|><|vision_end|>`, the blocks joined by one space, in
    place of the single block of `PROMPT_TEMPLATE_TI2I`."""
    blocks = " ".join(
        f"<image{i}><|vision_start|>{IMAGE_TOKEN}<|vision_end|>" for i in range(1, num_images + 1)
    )
    return PROMPT_TEMPLATE_TI2I.replace(f"<image1><|vision_start|>{IMAGE_TOKEN}<|vision_end|>", blocks)


def num_image_slots(size: tuple[int, int]) -> int:
    """Vision-language slots of a reference image of (width, height) (a multiple of 32 each)."""
    return (size[0] // PIXELS_PER_SLOT) * (size[1] // PIXELS_PER_SLOT)


def image_processor_config(processor_dir: Path) -> dict:
    """The image processor's settings in `processor_dir`, from either layout transformers writes:
    `preprocessor_config.json` (the released checkpoint, transformers 4), or `processor_config.json` with
    the image processor nested under `image_processor` (transformers 5's `save_pretrained`). ValueError
    naming both files when neither holds one: without it every edit would fail at its first prompt."""
    flat = processor_dir / "preprocessor_config.json"
    if flat.is_file():
        return json.loads(flat.read_text(encoding="utf-8"))
    nested = processor_dir / "processor_config.json"
    config = json.loads(nested.read_text(encoding="utf-8")) if nested.is_file() else None
    if isinstance(config, dict) and isinstance(config.get("image_processor"), dict):
        return config["image_processor"]
    raise ValueError(
        f"{processor_dir}: Qwen-Image-2.1's processor needs an image processor: preprocessor_config.json, "
        "or processor_config.json with an 'image_processor' entry (transformers 5's save_pretrained); "
        "neither is there"
    )


class TextProcessor:
    """`Qwen3VLProcessor`'s text half: `processor(text=..., padding=..., return_tensors=...)`,
    `apply_chat_template` and `.tokenizer`, over the checkpoint's `processor/` tokenizer files."""

    def __init__(self, tokenizer, image_processor=None):
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        """Qwen2-VL's PIL image processor (16-pixel patches, 2x2 merge); None only for a processor built
        by hand for text (`from_pretrained` always reads one)."""

    @classmethod
    def from_pretrained(cls, processor_dir: str | Path) -> TextProcessor:
        """The tokenizer (and chat template) saved in `processor_dir`, and its image processor (read from
        either layout `image_processor_config` accepts; ValueError naming the files when neither holds
        one)."""
        from transformers import AutoTokenizer
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        config = image_processor_config(Path(processor_dir))
        keys = ("patch_size", "merge_size", "temporal_patch_size", "size", "image_mean", "image_std")
        image_processor = Qwen2VLImageProcessorPil(**{k: config[k] for k in keys if k in config})
        return cls(AutoTokenizer.from_pretrained(processor_dir), image_processor)

    def apply_chat_template(self, messages, **kwargs):
        """As the processor: a single conversation is answered as a batch of one."""
        out = self.tokenizer.apply_chat_template(messages, **kwargs)
        is_single = bool(messages) and isinstance(messages[0], dict)
        return [out] if is_single and kwargs.get("tokenize") and not kwargs.get("return_dict") else out

    def __call__(self, text, images=None, **kwargs):
        """Tokenise `text`; with `images`, each `<|image_pad|>` (in order) becomes the image's slots, as
        `Qwen3VLProcessor` expands them, and `pixel_values` / `image_grid_thw` join the output."""
        if images is None:
            return self._with_token_types(self.tokenizer(text, **kwargs))
        vision = self.image_processor(images=images, return_tensors=kwargs.get("return_tensors"))
        merge = self.image_processor.merge_size**2
        counts = iter((vision["image_grid_thw"].prod(-1) // merge).tolist())
        expanded = []
        for t in [text] if isinstance(text, str) else text:
            while IMAGE_TOKEN in t:
                t = t.replace(IMAGE_TOKEN, "<|placeholder|>" * next(counts), 1)
            expanded.append(t.replace("<|placeholder|>", IMAGE_TOKEN))
        tokens = self._with_token_types(self.tokenizer(expanded, **kwargs))
        tokens.update(vision)
        return tokens

    def _with_token_types(self, tokens):
        """Add `mm_token_type_ids` (1 at image tokens, else 0), as `Qwen3VLProcessor` returns them."""
        image_id = self.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
        ids = tokens["input_ids"]
        if isinstance(ids, torch.Tensor):
            tokens["mm_token_type_ids"] = (ids == image_id).to(ids.dtype)
        return tokens


@dataclass(frozen=True)
class PromptTokens:
    """Token counts of one prompt, from one tokenisation of its chat-templated text."""

    num_embedded_tokens: int
    """Encoder rows the prompt keeps after the system turn is dropped: its prefix length."""
    num_user_tokens: int
    """Tokens of the user text (what the 1024 limit counts)."""
    num_prefix_rows: int
    """Rows of the transformer's prefix (what the prefix KV cache holds): the embedded tokens with each
    image slot replaced by the `ROWS_PER_SLOT` latent rows it stands for."""


class PromptCounter:
    """Counts and checks prompts with the tokenizer alone (the engine's side; no text encoder)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._lock = threading.Lock()
        """Fast tokenizers are not safe to call from several threads at once ("Already borrowed")."""
        self.num_dropped = self._num_tokens(SYSTEM_TURN)
        """Tokens of the system turn, dropped from the encoder output (diffusers' `_drop_idx`)."""
        self._empty = self._num_embedded("")

    def _num_tokens(self, text: str) -> int:
        with self._lock:
            return len(self.tokenizer(text, add_special_tokens=False).input_ids)

    def _num_embedded(self, text: str) -> int:
        return self._num_tokens(PROMPT_TEMPLATE_T2I.format(text)) - self.num_dropped

    def count(self, name: str, text: str, references: Sequence = ()) -> PromptTokens:
        """Count `text` (empty -> " ", as diffusers), with the slots of its reference images (PIL, in
        order) when given; ValueError naming `name` over the limit."""
        num_embedded = self._num_embedded(text or " ")
        num_user = num_embedded - self._empty
        if references:  # the template with one image token per image, expanded to each image's slots
            template = ti2i_template(len(references))
            with_images = self._num_tokens(template.format(text or " ")) - self.num_dropped
            num_slots = sum(num_image_slots(reference_size(image)) for image in references)
            num_embedded = with_images - len(references) + num_slots
        else:
            num_slots = 0
        if num_user > MAX_SEQUENCE_LENGTH_LIMIT:
            raise InvalidRequestError(
                f"{name} is {num_user} tokens long; the limit is {MAX_SEQUENCE_LENGTH_LIMIT} tokens", name
            )
        return PromptTokens(
            num_embedded_tokens=num_embedded,
            num_user_tokens=num_user,
            num_prefix_rows=num_embedded + (ROWS_PER_SLOT - 1) * num_slots,
        )

"""The Qwen2-VL processor of Qwen-Image-Edit, without the video half.

transformers' `Qwen2VLProcessor` always builds a video processor, which needs torchvision; the
image-edit prompt never holds a video. `QwenImageEditProcessor` is the same processor with only the
image processor and the tokenizer (its `get_attributes()` lists those two), and the image processor is
transformers' PIL implementation (`Qwen2VLImageProcessorPil`), so it runs wherever PIL does. It reads
the released `processor/` folder (preprocessor_config.json + tokenizer files) of Qwen-Image-Edit.
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase, Qwen2VLImageProcessorPil, Qwen2VLProcessor


class QwenImageEditProcessor(Qwen2VLProcessor):
    """`Qwen2VLProcessor` with an image processor and a tokenizer only (no video processor)."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    @classmethod
    def get_attributes(cls) -> list[str]:
        return ["image_processor", "tokenizer"]


def _tokenizer(source):
    """A loaded tokenizer as is; a folder loaded with `AutoTokenizer`."""
    return source if isinstance(source, PreTrainedTokenizerBase) else AutoTokenizer.from_pretrained(source)


def load_edit_processor(processor_dir: str | Path, tokenizer=None):
    """Build the processor from `processor_dir`'s image processor config and a tokenizer.

    Both layouts load, as transformers reads them: `preprocessor_config.json` (the released checkpoint)
    or `processor_config.json` with a nested `image_processor` (transformers 5's `save_pretrained`).

    `tokenizer`: a tokenizer folder or an already-loaded tokenizer; defaults to `processor_dir` (the
    released layout keeps tokenizer files there too).
    """
    processor_dir = Path(processor_dir)
    image_processor = Qwen2VLImageProcessorPil.from_pretrained(processor_dir)
    tokenizer = _tokenizer(tokenizer or processor_dir)
    return QwenImageEditProcessor(image_processor=image_processor, tokenizer=tokenizer)


def build_edit_processor(preprocessor_config: dict, tokenizer) -> QwenImageEditProcessor:
    """The processor from a preprocessor_config.json dict (e.g. the released values) and a tokenizer
    (a folder or an already-loaded tokenizer)."""
    kwargs = {
        k: v for k, v in preprocessor_config.items() if k not in ("image_processor_type", "processor_class")
    }
    image_processor = Qwen2VLImageProcessorPil(**kwargs)
    return QwenImageEditProcessor(image_processor=image_processor, tokenizer=_tokenizer(tokenizer))

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

import threading
from dataclasses import dataclass
from pathlib import Path

from vllm_omni.inputs import MAX_SEQUENCE_LENGTH_LIMIT, InvalidRequestError

SYSTEM_PROMPT = "Comprehend and analyze the provided prompt."
SYSTEM_TURN = f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n"
PROMPT_TEMPLATE_T2I = SYSTEM_TURN + "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
"""diffusers' `prompt_template_t2i`."""


class TextProcessor:
    """`Qwen3VLProcessor`'s text half: `processor(text=..., padding=..., return_tensors=...)`,
    `apply_chat_template` and `.tokenizer`, over the checkpoint's `processor/` tokenizer files."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    @classmethod
    def from_pretrained(cls, processor_dir: str | Path) -> TextProcessor:
        """The tokenizer (and chat template) saved in `processor_dir`."""
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(processor_dir))

    def apply_chat_template(self, messages, **kwargs):
        """As the processor: a single conversation is answered as a batch of one."""
        out = self.tokenizer.apply_chat_template(messages, **kwargs)
        is_single = bool(messages) and isinstance(messages[0], dict)
        return [out] if is_single and kwargs.get("tokenize") and not kwargs.get("return_dict") else out

    def __call__(self, text, images=None, **kwargs):
        if images is not None:
            raise ValueError("TextProcessor takes no images (reference images need Qwen3VLProcessor)")
        return self.tokenizer(text, **kwargs)


@dataclass(frozen=True)
class PromptTokens:
    """Token counts of one prompt, from one tokenisation of its chat-templated text."""

    num_embedded_tokens: int
    """Encoder rows the prompt keeps after the system turn is dropped: its prefix length."""
    num_user_tokens: int
    """Tokens of the user text (what the 1024 limit counts)."""


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

    def count(self, name: str, text: str) -> PromptTokens:
        """Count `text` (empty -> " ", as diffusers); ValueError naming `name` over the limit."""
        num_embedded = self._num_embedded(text or " ")
        num_user = num_embedded - self._empty
        if num_user > MAX_SEQUENCE_LENGTH_LIMIT:
            raise InvalidRequestError(
                f"{name} is {num_user} tokens long; the limit is {MAX_SEQUENCE_LENGTH_LIMIT} tokens", name
            )
        return PromptTokens(num_embedded_tokens=num_embedded, num_user_tokens=num_user)

"""LoRA adapters: the per-request `LoRARequest` (vLLM's name); loading and applying them."""

from vllm_omni.lora.request import LoRARequest

__all__ = ["LoRARequest"]

"""LoRA adapters: the per-request `LoRARequest` (vLLM's name); loading and applying them."""

from vllm_omni.lora.config import LoRAConfig, LoRAModulePath
from vllm_omni.lora.layers import LoRAMapping, SeqLoRA
from vllm_omni.lora.manager import LoRAInUseError, LoRAManager, LoRANotFoundError
from vllm_omni.lora.request import LoRARequest

__all__ = [
    "LoRAConfig",
    "LoRAInUseError",
    "LoRAManager",
    "LoRAMapping",
    "LoRAModulePath",
    "LoRANotFoundError",
    "LoRARequest",
    "SeqLoRA",
]

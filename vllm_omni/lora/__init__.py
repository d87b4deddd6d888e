"""LoRA adapters per request, many in one packed step (docs/lora.md).

    request.py         LoRARequest: the adapter a request names (vLLM's name)
    errors.py          LoRANotFoundError, LoRAInUseError (torch-free, for the API's error handlers)
    config.py          LoRAConfig: --lora-modules, --max-loras, --max-lora-rank, --lora-runtime-dir
    weights.py         reading and checking diffusers-format adapter files
    layers.py          LoRA linears: base GEMM + one delta per run of rows sharing an adapter
    manager.py         LoRAManager: loaded adapters, per-request refcounts, the per-step mapping
    random_adapter.py  random adapters in diffusers' format (tests, benchmarks)

This package root imports no torch (the CLI and config import it).
"""

from vllm_omni.lora.config import LoRAConfig, LoRAModulePath
from vllm_omni.lora.request import LoRARequest

__all__ = ["LoRAConfig", "LoRAModulePath", "LoRARequest"]

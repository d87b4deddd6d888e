"""LoRA adapters per request, many in one packed step (docs/lora.md).

    request.py         LoRARequest: the adapter a request names (vLLM's name)
    errors.py          LoRANotFoundError, LoRAInUseError (torch-free, for the API's error handlers)
    config.py          LoRAConfig: --lora-modules, --max-loras, --max-lora-rank, --lora-runtime-dir
    weights.py         reading and checking diffusers-format adapter files
    batch.py           LoRAMapping (per sequence) -> LoRABatch (per row stream: runs, device tile tables)
    layers.py          LoRA linears: adapters in fixed device slots, base GEMM + the slot deltas
    kernels.py         the Triton shrink / expand kernels of the deltas on CUDA (graph-safe)
    manager.py         LoRAManager: loaded adapters and their slots, refcounts, the per-step batch
    random_adapter.py  random adapters in diffusers' format (tests, benchmarks)

This package root imports no torch (the CLI and config import it).
"""

from vllm_omni.lora.config import LoRAConfig, LoRAModulePath
from vllm_omni.lora.request import LoRARequest

__all__ = ["LoRAConfig", "LoRAModulePath", "LoRARequest"]

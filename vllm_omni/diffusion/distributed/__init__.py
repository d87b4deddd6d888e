"""Multi-process execution of one model replica: tensor, sequence (Ulysses, ring) and CFG parallelism.

See docs/design/parallelism.md. Only the torch-free `ParallelConfig` is imported here; the rest lives in
`parallel_state`, `tensor_parallel`, `sequence_parallel`, `ring_attention`, `cfg_parallel`,
`parallel_transformer` and `executor`.
"""

from vllm_omni.diffusion.distributed.parallel_config import ParallelConfig

__all__ = ["ParallelConfig"]

"""Multi-process execution of one model replica: tensor, sequence (Ulysses, ring) and CFG parallelism.

See docs/design/parallelism.md. `ParallelConfig` (torch-free) is in `vllm_omni/config.py`; the rest
lives in `parallel_state`, `tensor_parallel`, `sequence_parallel`, `ring_attention`, `cfg_parallel`,
`parallel_transformer` and `executor`.
"""

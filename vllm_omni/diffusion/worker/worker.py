"""`Worker(config, rank)`: one device's model, built the same way on every rank.

Start-up, in order (nano-vllm's habit): load the pipeline onto this rank's device; apply
batch-invariant mode or compile the fused block ops; warm up (so compilation happens before the
first request); shard the transformer when there are parallel groups; build the model runner;
report memory. The executor calls `load()` then `prepare(groups)`: loading needs no process group,
sharding does.
"""

from __future__ import annotations

import logging
import time

import torch

from vllm_omni.config import OmniDiffusionConfig
from vllm_omni.diffusion.sched.interface import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


def load_pipeline(config: OmniDiffusionConfig):
    """The step pipeline for `config` on its device (weights, or random with 'dummy'), of the family
    the checkpoint's model_index.json names (`models/registry.py`)."""
    from vllm_omni.diffusion.models.registry import load_step_pipeline

    if config.seed is not None:
        torch.manual_seed(config.seed)
    device, dtype = torch.device(config.resolve_device()), config.resolve_dtype()
    return load_step_pipeline(
        config.model,
        device=device,
        dtype=dtype,
        load_format=config.load_format,
        seed=config.seed,
        attn_backend=config.attention_backend,
        quantization=config.quantization,
    )


class Worker:
    """Owns one rank's pipeline and model runner; the executor drives it step by step."""

    def __init__(self, config: OmniDiffusionConfig, rank: int = 0, pipeline=None):
        """`pipeline`: an already-built pipeline to use instead of loading one (tests, tools)."""
        self.config = config
        self.rank = rank
        self.pipeline = pipeline
        self.runner = None
        self.lora = None
        """`LoRAManager` of this rank's transformer when LoRA is enabled (built in `load`)."""
        self.prompt_cache = None
        """The pipeline's `PromptEmbedCache` (built in `load`; None when off or not applicable)."""

    @property
    def device(self) -> torch.device:
        return self.pipeline.device

    @property
    def supports_mixfusion(self) -> bool:
        """The pipeline can run mixed shapes in one step (a packed varlen forward)."""
        return self.pipeline.supports_mixfusion

    def load(self) -> None:
        """Load the pipeline and make the transformer ready to run (invariant or compiled ops, warm-up)."""
        start = time.perf_counter()
        device = torch.device(self.config.resolve_device())
        if device.type == "cuda" and device.index is not None:  # "cuda" alone: the current device
            torch.cuda.set_device(device)
        if self.pipeline is None:
            self.pipeline = load_pipeline(self.config)
        self.pipeline.configure_vae(self.config.vae_use_slicing, self.config.vae_use_tiling)
        self.pipeline.max_decode_pixels = self.config.max_decode_pixels
        from vllm_omni.diffusion.models import registry
        from vllm_omni.diffusion.prompt_cache import install_prompt_cache

        self.prompt_cache = install_prompt_cache(
            self.pipeline,
            registry.family_of(self.pipeline).capabilities.prompt_embed_cache,
            self.config.prompt_embed_cache_size,
            self.config.enable_prompt_embed_cache,
        )
        transformer = self.pipeline.transformer
        if self.config.quantization.is_enabled:  # before everything that reads the linears' method
            from vllm_omni.diffusion.layers.quantization import quantize_transformer

            summary = quantize_transformer(transformer, self.config.quantization)
            logger.info("rank %d: quantization: %s", self.rank, summary)
        if self.config.batch_invariant:
            from vllm_omni.diffusion.batch_invariant import make_batch_invariant

            logger.info("rank %d: batch-invariant mode: %s", self.rank, make_batch_invariant(transformer))
        elif not self.config.enforce_eager and self.device.type == "cuda":
            transformer.enable_compile()
            logger.info(
                "rank %d: transformer blocks run fused elementwise kernels via torch.compile "
                "(--enforce-eager to disable)",
                self.rank,
            )
            self._warm_up()
        if self.config.lora.is_enabled:  # after batch invariance: LoRA wraps the invariant linears
            from vllm_omni.lora.manager import LoRAManager

            self.lora = LoRAManager(transformer, self.config.lora)
            self.pipeline.lora = self.lora  # a family whose encoding runs the transformer (prefill)
        logger.info(
            "rank %d: model ready in %.1f s; %s", self.rank, time.perf_counter() - start, self.memory()
        )

    def prepare(self, groups=None) -> None:
        """Shard the transformer over `groups` (parallel ranks) and build the model runner."""
        from vllm_omni.diffusion.worker.model_runner import DiffusionModelRunner

        if groups is not None:
            from vllm_omni.diffusion.distributed.parallel_transformer import parallelize

            self.pipeline.transformer = parallelize(self.pipeline.transformer, groups)
        self.runner = DiffusionModelRunner(self.pipeline, self.config, lora_manager=self.lora)

    def _warm_up(self) -> None:
        """Small dense and packed forwards, so compilation happens before the first request.

        Covers the shapes the compiled ops specialise on: one and several sequences, dense and packed.
        """
        from vllm_omni.diffusion.layout import SequenceSpec, build_packed_layout

        transformer, device, dtype = self.pipeline.transformer, self.device, self.pipeline.dtype
        cfg = transformer.config
        start = time.perf_counter()
        with torch.inference_mode():
            for grids in ([(1, 2, 2)], [(1, 2, 2), (1, 3, 2)]):
                specs = [SequenceSpec(num_txt_tokens=3 + i, img_shape=g) for i, g in enumerate(grids)]
                layout = build_packed_layout(specs, transformer.position_tables, device=device)
                img = torch.randn(layout.num_img_rows, cfg.in_channels, device=device, dtype=dtype)
                txt = torch.randn(layout.num_txt_rows, cfg.joint_attention_dim, device=device, dtype=dtype)
                transformer.forward_packed(img, txt, torch.rand(len(specs), device=device), layout)
            for batch in (1, 2):
                img = torch.randn(batch, 4, cfg.in_channels, device=device, dtype=dtype)
                txt = torch.randn(batch, 3, cfg.joint_attention_dim, device=device, dtype=dtype)
                mask = torch.ones(batch, 3, dtype=torch.long, device=device)
                mask[0, -1] = 0
                transformer(img, txt, mask, torch.rand(batch, device=device), [(1, 2, 2)] * batch)
        logger.info(
            "rank %d: transformer warm-up (compile) took %.1f s", self.rank, time.perf_counter() - start
        )

    def memory(self) -> str:
        """One line: parameter memory, and the device's peak allocation on CUDA."""
        modules = (self.pipeline.transformer, self.pipeline.text_encoder, self.pipeline.vae)
        num_bytes = sum(p.numel() * p.element_size() for m in modules for p in m.parameters())
        line = f"weights {num_bytes / 2**30:.2f} GiB on {self.device}"
        if self.device.type == "cuda":
            line += f", peak allocated {torch.cuda.max_memory_allocated(self.device) / 2**30:.2f} GiB"
        return line

    # ---- the executor's calls ---------------------------------------------------------------

    def execute_step(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_step(sched_out)

    def execute_request(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_request(sched_out)

    def free(self, req_ids) -> None:
        self.runner.free(req_ids)

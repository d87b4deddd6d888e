"""The tiny Qwen-Image-2.1 engine the 2.1 tests share: CPU, fp32, 8 requests a step, no MixFusion chunk
limit (every mix packs), built without its engine thread (tests drive `engine.step()`)."""

from __future__ import annotations

from vllm_omni.config import OmniDiffusionConfig
from vllm_omni.diffusion.engine import DiffusionEngine
from vllm_omni.diffusion.models.qwen_image21.tiny import TINY_MODEL_NAME


def tiny21_engine(**config) -> DiffusionEngine:
    """`config` adds to or overrides the shared settings (e.g. `scheduling_policy="skip-ahead"`)."""
    settings = dict(
        model=TINY_MODEL_NAME, dtype="float32", device="cpu", max_num_seqs=8, mixfusion_min_chunk_tokens=1
    )
    return DiffusionEngine(OmniDiffusionConfig(**{**settings, **config}), autostart=False)

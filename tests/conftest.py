"""Shared pytest fixtures.

`tiny_model_dir`: the tiny random Qwen-Image checkpoint (seed 0, diffusers layout), built once per test
session. Tests never write to ~/.cache: unless VLLM_OMNI_CACHE_DIR is already set, it points at a
session temporary folder, so `tiny-qwen-image` (the model name) resolves to the same directory as the
fixture, in this process and in servers it starts.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from vllm_omni.diffusion.models.qwen_image.tiny import ensure_tiny_checkpoint
from vllm_omni.diffusion.models.qwen_image_edit.tiny import ensure_tiny_edit_checkpoint
from vllm_omni.diffusion.models.tiny_cache import CACHE_ENV


@pytest.fixture(scope="session", autouse=True)
def _session_cache_dir(tmp_path_factory) -> Path:
    """VLLM_OMNI_CACHE_DIR for the session (the user's own value wins)."""
    previous = os.environ.get(CACHE_ENV)
    if previous is None:
        os.environ[CACHE_ENV] = str(tmp_path_factory.mktemp("vllm_omni_cache"))
    yield Path(os.environ[CACHE_ENV])
    if previous is None:
        os.environ.pop(CACHE_ENV, None)


@pytest.fixture(scope="session")
def tiny_model_dir(_session_cache_dir) -> Path:
    """Directory of the tiny random Qwen-Image checkpoint (seed 0), built once per session."""
    return ensure_tiny_checkpoint(_session_cache_dir, seed=0)


@pytest.fixture(scope="session")
def tiny_edit_model_dir(_session_cache_dir) -> Path:
    """Directory of the tiny random Qwen-Image-Edit checkpoint (seed 0), built once per session."""
    return ensure_tiny_edit_checkpoint(_session_cache_dir, seed=0)


SLOW_MODULES = frozenset(
    {
        "test_batch_invariance.py",
        "test_batch_invariance_fp8.py",
        "test_benchmarks_smoke.py",
        "test_distributed_engine.py",
        "test_engine_vs_diffusers.py",
        "test_image_edit_engine.py",
        "test_lora_engine.py",
        "test_lora_server.py",
        "test_lora_serving_benchmark_smoke.py",
        "test_qwen_image21_engine.py",
        "test_server_engine.py",
    }
)
"""Files whose tests run whole pipelines against diffusers, several engines, worker processes or the
benchmark tools end to end: marked `slow` here as a whole (single slow tests elsewhere carry the mark
themselves). `make test` runs everything, as CI does; `make test-fast` (`-m "not slow"`) leaves them out."""


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)

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

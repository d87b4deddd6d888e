"""Batch-invariant mode on Qwen-Image-2.1 (tiny checkpoint, fp32, CPU): a request's image has the same
bits whether its steps run packed with others or alone, and still equals diffusers'
`QwenImage21Pipeline` (the plan's invariant norms, the invariant linears, and one SDPA call per
sequence over its cached prefix and its image rows)."""

from __future__ import annotations

import numpy as np
import pytest
from tiny21 import CASES, assert_matches, diffusers_images_21, make_request, tiny21_engine
from utils import run_to_completion

from vllm_omni.diffusion.batch_invariant import is_batch_invariant


@pytest.fixture(scope="module")
def diffusers_images():
    return diffusers_images_21()


@pytest.fixture(scope="module")
def reference_images(diffusers_images):
    return [diffusers_images(case) for case in CASES]


def test_packed_bits_equal_alone_bits_and_match_diffusers(reference_images):  # noqa: F811
    engine = tiny21_engine(scheduling_policy="skip-ahead", batch_invariant=True)
    assert is_batch_invariant(engine.executor.driver_worker.pipeline.transformer)
    alone = []
    for i, case in enumerate(CASES):
        alone += run_to_completion(engine, [engine.add_request(make_request(engine, 600 + i, case)).future])
    steps = []
    futures = [engine.add_request(make_request(engine, 700 + i, case)).future for i, case in enumerate(CASES)]
    packed = run_to_completion(engine, futures, steps)
    assert max(s.num_reqs for s in steps) == len(CASES), "every request shared a packed step"
    for i, (a, p) in enumerate(zip(alone, packed, strict=True)):
        assert np.array_equal(a, p), f"case {i}: packed bits differ from alone, max {np.abs(a - p).max()}"
    assert_matches(packed, reference_images)

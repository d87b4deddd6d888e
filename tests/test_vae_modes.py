"""Per-request VAE memory modes (`vae_use_tiling`, `vae_use_slicing`) against diffusers' pipeline.

A request that asks for tiling gets the image diffusers gives with `pipe.vae.enable_tiling()` (which
differs from the untiled one: the flag is honoured, not dropped), in a step shared with an untiled
request that keeps its own untiled image, and the server's own modes are back afterwards.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_omni.config import OmniDiffusionConfig
from vllm_omni.diffusion.engine import DiffusionEngine
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.inputs import InvalidRequestError, OmniDiffusionSamplingParams

SIZE = 320  # above the tiny VAE's 256-pixel tile: tiling changes the decode
PROMPT, SEED, STEPS = "a lighthouse at dusk", 21, 2


def _request(label: str, **modes) -> OmniDiffusionRequest:
    params = OmniDiffusionSamplingParams(
        height=SIZE, width=SIZE, num_inference_steps=STEPS, seed=SEED, output_type="np", **modes
    )
    return OmniDiffusionRequest(label, prompt=PROMPT, sampling_params=params)


@pytest.fixture(scope="module")
def diffusers_images(tiny_model_dir):
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    images = {}
    for tiled in (False, True):
        pipe.vae.enable_tiling() if tiled else pipe.vae.disable_tiling()
        out = pipe(
            prompt=PROMPT,
            height=SIZE,
            width=SIZE,
            num_inference_steps=STEPS,
            generator=torch.Generator("cpu").manual_seed(SEED),
            output_type="np",
        )
        images[tiled] = out.images
    assert np.abs(images[True] - images[False]).max() > 1e-4, "tiling must change this image"
    return images


def test_tiling_per_request_matches_diffusers_in_a_shared_step(tiny_model_dir, diffusers_images):
    engine = DiffusionEngine(
        OmniDiffusionConfig(model=str(tiny_model_dir), dtype="float32", device="cpu", max_num_seqs=4),
        autostart=False,
    )
    futures = [
        engine.add_request(_request("tiled", vae_use_tiling=True)).future,
        engine.add_request(_request("server default")).future,
        engine.add_request(_request("sliced", vae_use_slicing=True)).future,
    ]
    while not all(f.done() for f in futures):
        engine.step()
    tiled, plain, sliced = (f.result().images for f in futures)
    assert np.abs(tiled - diffusers_images[True]).max() <= 1e-4
    assert np.abs(plain - diffusers_images[False]).max() <= 1e-4
    assert np.abs(sliced - diffusers_images[False]).max() <= 1e-4  # slicing never changes pixels
    vae = engine.executor.driver_worker.pipeline.vae
    assert not vae.use_tiling and not vae.use_slicing, "the server's modes are restored"


def test_a_request_can_turn_the_servers_tiling_off(tiny_model_dir, diffusers_images):
    engine = DiffusionEngine(
        OmniDiffusionConfig(model=str(tiny_model_dir), dtype="float32", device="cpu", vae_use_tiling=True),
        autostart=False,
    )
    futures = [engine.add_request(_request("off", vae_use_tiling=False)).future]
    futures.append(engine.add_request(_request("server tiling")).future)
    while not all(f.done() for f in futures):
        engine.step()
    off, server = (f.result().images for f in futures)
    assert np.abs(off - diffusers_images[False]).max() <= 1e-4
    assert np.abs(server - diffusers_images[True]).max() <= 1e-4
    assert engine.executor.driver_worker.pipeline.vae.use_tiling


def test_modes_must_be_bools():
    with pytest.raises(InvalidRequestError, match="vae_use_tiling must be a bool"):
        OmniDiffusionSamplingParams(vae_use_tiling="yes").validate()

"""Decode beside the denoise steps (decode_worker.py): a finishing request's VAE decode never holds
the step loop, its slot is free at hand-over, its images arrive later and equal the inline decode's,
a failed decode fails only its request, and shutdown answers every client."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from vllm_omni.config import OmniDiffusionConfig
from vllm_omni.diffusion.engine import DiffusionEngine
from vllm_omni.diffusion.errors import RequestAbortedError, RequestFailedError
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.inputs import OmniDiffusionSamplingParams


def _request(label: str, size: int, steps: int, seed: int) -> OmniDiffusionRequest:
    params = OmniDiffusionSamplingParams(
        height=size, width=size, num_inference_steps=steps, seed=seed, true_cfg_scale=4.0, output_type="np"
    )
    return OmniDiffusionRequest(label, prompt="a red cat", negative_prompt=" ", sampling_params=params)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    config = OmniDiffusionConfig(
        model=str(tiny_model_dir),
        dtype="float32",
        device="cpu",
        max_num_seqs=4,
        scheduling_policy="skip-ahead",  # every request in every step
        mixfusion_min_chunk_tokens=1,
        log_stats=False,
    )
    return DiffusionEngine(config, autostart=False)


def _drain(engine, handles) -> None:
    while not all(h.done() for h in handles):
        engine.step()


@pytest.fixture
def gated_decode(engine, monkeypatch):
    """The pipeline's decode, held until the test opens the gate (records which threads decoded)."""
    pipeline = engine.executor.driver_worker.pipeline
    real, gate, threads = pipeline.decode, threading.Event(), []

    def decode(*args, **kwargs):
        threads.append(threading.current_thread().name)
        assert gate.wait(60), "the test never opened the gate"
        return real(*args, **kwargs)

    monkeypatch.setattr(pipeline, "decode", decode)
    yield gate, threads
    gate.set()


def test_steps_run_while_a_finished_request_decodes(engine, gated_decode):
    """A short request finishes while a long one runs: the long one keeps stepping although the short
    one's decode is held, the short one's slot is free at once, and both images equal their own run
    alone with the decode unblocked."""
    gate, threads = gated_decode
    short = engine.add_request(_request("short", 32, 2, 1))
    long = engine.add_request(_request("long", 48, 6, 2))
    engine.step()
    engine.step()  # the short one's last step: handed to the decode worker
    runner = engine.executor.driver_worker.runner
    assert runner.batch.get(short.req_id) is None, "the slot is free while the decode runs"
    for _ in range(4):
        stats = engine.step()  # would block on the gate if the decode ran inside the step
        assert stats is not None and stats.num_reqs == 1
    assert not short.done() and not long.done()
    gate.set()
    got_short, got_long = short.result(timeout=60).images, long.result(timeout=60).images
    assert set(threads) == {"diffusion-decode"}
    alone = []
    for label, size, steps, seed in (("a", 32, 2, 1), ("b", 48, 6, 2)):
        handle = engine.add_request(_request(label, size, steps, seed))
        _drain(engine, [handle])
        alone.append(handle.result().images)
    # packed beside another request vs alone: fp32 on CPU agrees to rounding (test_engine_identity.py)
    np.testing.assert_allclose(got_short, alone[0], atol=1e-5)
    np.testing.assert_allclose(got_long, alone[1], atol=1e-5)


def test_a_failed_decode_fails_only_its_request(engine, monkeypatch):
    pipeline = engine.executor.driver_worker.pipeline
    real = pipeline.decode

    def decode(latents, height, width, *args, **kwargs):
        if height == 48:
            raise RuntimeError("simulated VAE failure")
        return real(latents, height, width, *args, **kwargs)

    monkeypatch.setattr(pipeline, "decode", decode)
    bad = engine.add_request(_request("bad", 48, 2, 3))
    good = engine.add_request(_request("good", 32, 2, 4))
    _drain(engine, [bad, good])
    with pytest.raises(RequestFailedError, match="simulated VAE failure") as info:
        bad.result()
    assert info.value.output.error_kind.value == "decode"
    assert good.result().num_images == 1


def test_shutdown_answers_a_request_whose_decode_is_under_way(tiny_model_dir, monkeypatch):
    config = OmniDiffusionConfig(model=str(tiny_model_dir), dtype="float32", device="cpu", log_stats=False)
    engine = DiffusionEngine(config, autostart=False)
    pipeline = engine.executor.driver_worker.pipeline
    real, started = pipeline.decode, threading.Event()

    def slow_decode(*args, **kwargs):
        started.set()
        time.sleep(0.5)  # still decoding when shutdown starts
        return real(*args, **kwargs)

    monkeypatch.setattr(pipeline, "decode", slow_decode)
    handle = engine.add_request(_request("last", 32, 2, 5))
    engine.step()
    engine.step()
    assert started.wait(30)
    engine.shutdown()  # waits for the decode under way: the client gets its image
    assert handle.result(timeout=1).num_images == 1
    queued = DiffusionEngine(config, autostart=False)
    waiting = queued.add_request(_request("never ran", 32, 2, 6))
    queued.shutdown()
    with pytest.raises(RequestAbortedError):
        waiting.result(timeout=1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the decode stream exists on CUDA only")
def test_cuda_decode_stream_gives_the_images_of_a_decode_on_the_compute_stream(tiny_model_dir):
    """On CUDA the decode runs on its own stream, ordered by an event after the latents' copy: the
    images of requests finishing while others step equal the pipeline's decode of the same latents
    on the caller's stream; a streamed request's previews arrive before its final image."""
    config = OmniDiffusionConfig(
        model=str(tiny_model_dir), dtype="float32", device="cuda", log_stats=False, enforce_eager=True
    )
    engine = DiffusionEngine(config, autostart=False)
    pipeline = engine.executor.driver_worker.pipeline
    handles, by_id, previews = [], {}, []

    def on_partial(partial) -> None:  # the decode thread: the final image is not out yet
        previews.append((partial.req_id, by_id[partial.req_id].done()))

    for i, steps in enumerate((2, 3, 4, 6)):
        for output_type in ("np", "latent"):
            request = _request(f"{i}-{output_type}", 32 + 16 * (i % 2), steps, seed=10 + i)
            request.sampling_params.output_type = output_type
            request.sampling_params.partial_images = 1 if steps >= 4 else 0
            handles.append(engine.add_request(request, on_partial=on_partial))
            by_id[handles[-1].req_id] = handles[-1]
    _drain(engine, handles)
    for np_handle, latent_handle in zip(handles[0::2], handles[1::2]):
        out = latent_handle.result()
        want = pipeline.decode(out.images.to("cuda"), out.height, out.width, "np")
        np.testing.assert_allclose(np_handle.result().images, want, atol=1e-4)
    # previews only for the requests that asked (a preview overtaken by its final may be skipped)
    asked = {h.req_id for h in handles[4:]}
    assert all(req_id in asked and not done for req_id, done in previews)
    engine.shutdown()

"""Memory-bounded requests (issue 26, item 5): n images decode in slices (same pixels, bounded peak),
and admission counts a request's peak memory against what the server has: a request that can never
fit is refused (400 naming `n` / `size`), one that does not fit next to the admitted ones waits.

On the tiny model (CPU fp32); the budget is set small so the tests need no large memory.
"""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest
import torch
from utils import run_to_completion

from vllm_omni.config import OmniDiffusionConfig
from vllm_omni.diffusion.engine import DiffusionEngine
from vllm_omni.diffusion.errors import RequestAbortedError
from vllm_omni.diffusion.memory import MemoryBudget, TensorPeak, decode_slices, host_available_bytes
from vllm_omni.diffusion.models.interface import RequestGeometry
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.entrypoints.openai.api_server import ServerArgs, build_app
from vllm_omni.inputs import InvalidRequestError, OmniDiffusionSamplingParams

MIB = 2**20


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    config = OmniDiffusionConfig(model=str(tiny_model_dir), dtype="float32", device="cpu", max_num_seqs=4)
    return DiffusionEngine(config, autostart=False)


@pytest.fixture()
def budget(engine):
    """Restore the engine's real budget after a test shrinks it."""
    real = engine.memory
    yield real
    engine.memory = real


def _params(n=1, side=64, seed=0) -> OmniDiffusionSamplingParams:
    return OmniDiffusionSamplingParams(
        height=side, width=side, num_inference_steps=2, num_outputs_per_prompt=n, seed=seed, output_type="np"
    )


def _rows(params: OmniDiffusionSamplingParams) -> RequestGeometry:
    """A Qwen-Image text-to-image request's geometry (16 px per latent row, 8 text tokens)."""
    grid = (1, params.height // 16, params.width // 16)
    return RequestGeometry(16, grid, 8, num_images=params.num_outputs_per_prompt)


def _small_budget(engine, real: MemoryBudget, free_bytes: int) -> MemoryBudget:
    return MemoryBudget(
        real.device,
        torch.float32,
        real.decode_bytes_per_pixel,
        real.max_decode_pixels,
        (free_bytes, free_bytes),
        latent_row_width=real.latent_row_width,
    )


def test_decode_slices():
    assert decode_slices(10, 2048, 2048, 2048 * 2048) == [1] * 10
    assert decode_slices(10, 1024, 1024, 2048 * 2048) == [4, 4, 2]
    assert decode_slices(3, 4096, 4096, 2048 * 2048) == [1, 1, 1]  # one image is never split
    assert decode_slices(2, 64, 64, 2048 * 2048) == [2]


def test_sliced_decode_gives_the_same_pixels_with_a_bounded_peak(engine):
    pipeline = engine.executor.driver_worker.pipeline
    latents = torch.randn(4, 16, 64, generator=torch.Generator().manual_seed(0))
    peaks, images = {}, {}
    for name, max_pixels in (("all at once", 4 * 64 * 64), ("one by one", 64 * 64)):
        pipeline.max_decode_pixels = max_pixels
        try:
            with TensorPeak() as tracker:
                images[name] = pipeline.decode(latents, 64, 64, "np")
        finally:
            pipeline.max_decode_pixels = engine.config.max_decode_pixels
        peaks[name] = tracker.peak
    # the same pixels up to fp32 rounding (a conv's algorithm may differ with the batch size)
    assert float(np.abs(images["all at once"] - images["one by one"]).max()) <= 1e-5
    assert peaks["one by one"] < 0.5 * peaks["all at once"], peaks


def test_decode_cost_is_measured_at_start_up(engine):
    """The probe decode gives the VAE's bytes per pixel (the tiny VAE in fp32: a few hundred)."""
    assert 50 < engine.memory.decode_bytes_per_pixel < 5000
    need = engine.memory.estimate(_params(n=10, side=2048), _rows(_params(n=10, side=2048)))
    # sliced: one 2048x2048 decode at a time, not ten
    assert need.device_bytes < 1.2 * engine.memory.decode_bytes_per_pixel * 2048 * 2048 + 64 * MIB


def test_a_request_that_can_never_fit_is_refused_naming_n(engine, budget):
    engine.memory = _small_budget(engine, budget, 64 * MIB)
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request(
            OmniDiffusionRequest("big", prompt="a cat", sampling_params=_params(n=10, side=1024))
        )
    assert info.value.param == "num_outputs_per_prompt" and "fewer images (n" in str(info.value)
    assert "GiB" in str(info.value) and engine.num_waiting == 0
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request(
            OmniDiffusionRequest("big", prompt="a cat", sampling_params=_params(n=1, side=2048))
        )
    assert info.value.param == "height*width"


def test_http_refusal_is_a_400_naming_n(engine, budget):
    engine.memory = _small_budget(engine, budget, 64 * MIB)

    async def go():
        app = build_app(engine, ServerArgs(model="tiny", api_key=None))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return await client.post(
                "/v1/images/generations", json={"prompt": "p", "size": "1024x1024", "n": 10}
            )

    resp = asyncio.run(go())
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "n"


def test_requests_over_the_free_memory_wait_for_the_admitted_ones(engine, budget):
    """Two requests that fit one at a time: the second waits in the engine (not swapping), then runs,
    and each gets the image it gets alone; a waiting request can be aborted."""
    alone = []
    for i in range(2):
        handle = engine.add_request(OmniDiffusionRequest(f"a{i}", "a cat", None, _params(2, seed=i)))
        alone += run_to_completion(engine, [handle])
    one = budget.estimate(
        _params(2), _rows(_params(2))
    )  # its decode is counted once, its latents and images per request
    room = one.device_bytes + one.host_bytes + (one.latent_bytes + one.host_bytes) // 2  # one, not two
    engine.memory = _small_budget(engine, budget, int(room / 0.9) + 1)
    first = engine.add_request(OmniDiffusionRequest("w0", "a cat", None, _params(2, seed=0)))
    second = engine.add_request(OmniDiffusionRequest("w1", "a cat", None, _params(2, seed=1)))
    third = engine.add_request(OmniDiffusionRequest("w2", "a cat", None, _params(2, seed=2)))
    # one in the scheduler, two held for memory (all three count as waiting)
    assert engine.scheduler.num_waiting + engine.scheduler.num_running == 1 and engine.num_waiting == 3
    engine.abort(third.req_id)
    with pytest.raises(RequestAbortedError):
        third.result(timeout=5)
    steps = []
    while not (first.done() and second.done()):
        stats = engine.step()
        if stats is not None:
            steps.append(stats.num_reqs)
    assert max(steps) == 1, "the second request ran only after the first released its memory"
    for handle, want in zip((first, second), alone):
        assert np.array_equal(handle.result().images, want)
    assert engine.memory.num_reserved == 0 and engine.num_waiting == 0


def test_split_pools_on_a_gpu_count_decode_once_and_outputs_on_the_host():
    """CUDA: latents and one decode slice against the device's free memory, images against the host's."""
    budget = MemoryBudget(
        torch.device("cuda"), torch.bfloat16, 1000.0, 2048 * 2048, (10 * 2**30, 2**30), latent_row_width=64
    )

    def p(n: int, side: int) -> tuple:
        return _params(n, side), _rows(_params(n, side))

    for i in range(3):  # three 4.2 GB decodes would not fit 9 GiB together, but decodes run one at a time
        assert budget.try_reserve(f"d{i}", *p(1, 2048))
    with pytest.raises(InvalidRequestError):  # 1.7 GiB of images > 0.9 GiB of host memory
        budget.check(*p(20, 2048))
    assert not budget.try_reserve("n10", *p(10, 2048))  # 0.86 GiB of images next to 3 x 0.09 held
    for i in range(3):
        budget.release(f"d{i}")
    assert budget.try_reserve("n10", *p(10, 2048)) and budget.num_reserved == 1


def test_host_available_memory_without_psutil():
    """/proc/meminfo's MemAvailable (cgroup v2 limit applied): more than nothing, less than the machine."""
    import os

    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert 0 < host_available_bytes() <= total


def test_a_request_is_charged_its_own_decode_not_a_full_slice(engine):
    """One 64x64 image decodes 4096 pixels, not the --max-decode-pixels slice (2048 x 2048); same-size
    requests finishing in one step share a call, so together they are charged up to the slice."""
    budget, small = engine.memory, _params(1, 64)
    need = budget.estimate(small, _rows(small))
    decode = need.device_bytes - need.latent_bytes
    assert decode == pytest.approx(budget.decode_bytes_per_pixel * 64 * 64, abs=1)
    assert need.latent_bytes == 2 * 16 * 64 * 4  # 16 latent rows of 64 fp32 values, and the velocity
    many = [budget.estimate(small, _rows(small)) for _ in range(8)]
    assert budget._decode_peak(many) == pytest.approx(8 * decode, abs=8)  # one call of 8 images
    big = _params(1, 2048)
    assert budget._decode_peak([*many, budget.estimate(big, _rows(big))]) == pytest.approx(
        budget.decode_bytes_per_pixel * 2048 * 2048, abs=1
    )


def test_a_64x64_request_is_admitted_with_little_free_memory(engine, budget):
    """32 MiB free: the 64x64 image needs about 3 MiB (charged a full 2048x2048 decode slice, it
    needed 2.8 GiB and every request was refused). It runs and gives the image it gives alone."""
    handle = engine.add_request(OmniDiffusionRequest("alone", "a cat", None, _params(1, 64, seed=3)))
    (want,) = run_to_completion(engine, [handle])
    engine.memory = _small_budget(engine, budget, 32 * MIB)
    engine.check_health()  # healthy: the smallest request fits
    handle = engine.add_request(OmniDiffusionRequest("small", "a cat", None, _params(1, 64, seed=3)))
    (got,) = run_to_completion(engine, [handle])
    assert np.array_equal(got, want)


def test_a_refusal_names_the_flags_and_the_numbers(engine, budget):
    engine.memory = _small_budget(engine, budget, 32 * MIB)
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request(OmniDiffusionRequest("big", "a cat", None, _params(n=4, side=1024)))
    message = str(info.value)
    assert "--gpu-memory-utilization" in message and "--max-decode-pixels" in message, message
    assert "0.9 of the 0.03 GiB free" in message and "GiB of latents" in message, message


def test_health_is_degraded_when_not_even_the_smallest_request_fits(engine, budget):
    engine.memory = _small_budget(engine, budget, 64 * 1024)  # a 16x16 image needs about 0.2 MiB
    with pytest.raises(RuntimeError, match="degraded: no request can be admitted.*--gpu-memory-utilization"):
        engine.check_health()


def test_the_budget_follows_the_free_memory_while_idle(monkeypatch):
    """Measured again whenever no request holds memory; never while one does (its allocations are
    missing from the free memory then)."""
    import vllm_omni.diffusion.memory as memory

    free = {"now": 100 * MIB}
    monkeypatch.setattr(memory, "free_memory_bytes", lambda device: (free["now"], free["now"]))
    budget = MemoryBudget(torch.device("cpu"), torch.float32, 700.0, latent_row_width=64, utilization=0.5)
    assert budget.device_bytes == 50 * MIB
    free["now"] = 200 * MIB
    small = _params(1, 64)
    assert budget.try_reserve("a", small, _rows(small)) and budget.device_bytes == 100 * MIB
    free["now"] = 10 * MIB
    assert budget.try_reserve("b", small, _rows(small)) and budget.device_bytes == 100 * MIB
    budget.release("a")
    budget.release("b")
    assert not budget.could_ever_fit(_params(1, 1024), _rows(_params(1, 1024)))  # 5 MiB now
    assert budget.device_bytes == 5 * MIB


def test_metrics_export_the_memory_budget(engine):
    from vllm_omni.entrypoints.openai.metrics import PrometheusStatLogger

    metrics = PrometheusStatLogger(engine.config, "tiny")
    metrics.describe_engine(engine)
    text = metrics.render().decode()
    budget_line = next(line for line in text.splitlines() if 'memory_budget_bytes{kind="budget"}' in line)
    assert float(budget_line.split()[-1]) == pytest.approx(engine.memory.request_bytes, rel=0.5)


def test_the_input_processor_copies_once_snaps_then_measures_once(engine, monkeypatch):
    """A 70x50 request: the caller's params are untouched, the engine's copy is 64x48 (multiples of
    16, as diffusers), and the family's geometry is computed once, for the snapped size."""
    engine.inputs.process(OmniDiffusionRequest("first", "a cat", None, _params(1, 64)))  # learns the multiple
    calls = []
    family = engine.inputs.family
    monkeypatch.setattr(
        engine.inputs,
        "family",
        type(
            "Counting",
            (),
            {"request_geometry": lambda _, p, r: calls.append(r) or family.request_geometry(p, r)},
        )(),
    )
    params = OmniDiffusionSamplingParams(height=50, width=70, num_inference_steps=2, seed=0)
    request = OmniDiffusionRequest("odd", "a cat", None, params)
    processed = engine.inputs.process(request)
    assert (params.height, params.width) == (50, 70) and request.sampling_params is params
    sp = processed.request.sampling_params
    assert (sp.height, sp.width) == (48, 64) and processed.requested_size == (70, 50)
    assert len(calls) == 1 and processed.geometry.latent_grid == (1, 3, 4)


def test_on_cuda_only_the_cache_grown_since_start_up_counts_as_free(monkeypatch):
    """The driver counts blocks in PyTorch's cache as used: those finished requests left there serve
    the next ones, those cached at start-up (CUDA graphs' pools) are not request memory."""
    import vllm_omni.diffusion.memory as memory

    gib = 2**30
    now = {"free": 10 * gib, "cached": 2 * gib}
    monkeypatch.setattr(memory, "free_memory_bytes", lambda device: (now["free"], 100 * gib))
    monkeypatch.setattr(memory, "allocator_cached_bytes", lambda device: now["cached"])
    budget = MemoryBudget(torch.device("cuda"), torch.bfloat16, 1000.0, latent_row_width=64, utilization=1.0)
    assert budget.device_bytes == 10 * gib
    now.update(free=7 * gib, cached=5 * gib)  # a finished request's 3 GiB stayed in the cache
    assert budget.refresh() and budget.device_bytes == 10 * gib

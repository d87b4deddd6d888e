"""The whole engine on tiny-qwen-image-2.1 against diffusers' `QwenImage21Pipeline` (CPU, fp32).

Every request must get the image diffusers gives it alone (diffusers with its KV cache on, its default),
whether it runs alone, packed with others of different sizes, prompt lengths and CFG, or admitted while
others are mid-denoise; its prefix KV cache is prefilled at admission and freed when it ends.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny21 import (
    ATOL,
    CASES,
    assert_matches,
    diffusers_images_21,
    make_request,
    tiny21_engine,
)
from utils import run_to_completion

from vllm_omni.config import OmniDiffusionConfig
from vllm_omni.diffusion.engine import DiffusionEngine
from vllm_omni.diffusion.models import registry
from vllm_omni.diffusion.models.qwen_image21.tiny import TINY_MODEL_NAME
from vllm_omni.diffusion.sched.cost_model import StepCostModel
from vllm_omni.inputs import OmniDiffusionSamplingParams


@pytest.fixture(scope="module")
def diffusers_images():
    return diffusers_images_21()


@pytest.fixture(scope="module")
def reference_images(diffusers_images):
    return [diffusers_images(case) for case in CASES]


@pytest.fixture(scope="module")
def engine():
    return tiny21_engine(scheduling_policy="skip-ahead")


def _prefix_cache(engine):
    return engine.executor.driver_worker.pipeline.transformer.prefix_cache


def test_model_defaults(engine):
    defaults = engine.default_sampling_params
    assert defaults["num_inference_steps"] == 40
    assert defaults["true_cfg_scale"] == 1.0
    assert defaults["cfg_normalize"] is False


def test_each_request_alone_matches_diffusers(engine, reference_images, caplog):
    images = []
    with caplog.at_level(logging.INFO, logger="vllm_omni.diffusion.models.qwen_image21.pipeline"):
        for i, case in enumerate(CASES):
            images += run_to_completion(engine, [engine.add_request(make_request(engine, i, case)).future])
    assert_matches(images, reference_images)
    admitted = [r for r in caplog.records if "prefix cache:" in r.getMessage()]
    assert len(admitted) == len(CASES), "one admission line (with its size) per request"
    assert len(_prefix_cache(engine)) == 0, "every prefix is freed when its request finishes"


def test_all_together_packed_matches_diffusers(engine, reference_images):
    steps = []
    futures = [engine.add_request(make_request(engine, 100 + i, c)).future for i, c in enumerate(CASES)]
    images = run_to_completion(engine, futures, steps)
    assert_matches(images, reference_images)
    first = steps[0]
    assert first.num_reqs == len(CASES)
    assert first.num_seqs == 2 * 2 + 2, "two CFG requests (two sequences each) and two without"
    assert first.path == "packed"
    assert len(set(first.shapes)) >= 3
    assert len(_prefix_cache(engine)) == 0


def test_staggered_arrival_matches_diffusers(engine, reference_images):
    steps = []
    futures = [engine.add_request(make_request(engine, 200 + i, c)).future for i, c in enumerate(CASES[:2])]
    engine.step()
    assert len(_prefix_cache(engine)) == 3, "admitted: a CFG request (2 prefixes) and one without"
    futures += [
        engine.add_request(make_request(engine, 200 + i, c)).future for i, c in enumerate(CASES[2:], start=2)
    ]
    images = run_to_completion(engine, futures, steps)
    assert_matches(images, reference_images)
    assert any(s.num_reqs == 4 and len(set(s.shapes)) >= 3 for s in steps)
    assert len(_prefix_cache(engine)) == 0


def test_abort_frees_the_prefix_cache(engine):
    handle = engine.add_request(make_request(engine, 300, CASES[0]))
    engine.step()
    assert _prefix_cache(engine).req_bytes(handle.req_id) > 0
    engine.abort(handle.req_id)
    for _ in range(3):
        engine.step()
    assert len(_prefix_cache(engine)) == 0


def test_unsupported_settings_are_refused_at_start_up():
    """The refusals come from the family's declared capabilities (LoRA and batch-invariant mode are
    declared: not refused)."""
    capabilities = registry.family("QwenImage21Pipeline").capabilities
    base = dict(model=TINY_MODEL_NAME, dtype="float32", device="cpu")
    parallel = OmniDiffusionConfig(**base, parallel_config={"tensor_parallel_size": 2})
    with pytest.raises(ValueError, match="parallel flags .* not supported for Qwen-Image-2.1"):
        DiffusionEngine(parallel, autostart=False)
    (error,) = capabilities.refusals(parallel)
    assert "--tensor-parallel-size" in error and "one device" in error
    assert capabilities.refusals(OmniDiffusionConfig(**base)) == []
    assert capabilities.lora and capabilities.batch_invariant and not capabilities.parallel


def test_configured_sample_sigmas_give_diffusers_schedule(engine):
    """A checkpoint's `sample_sigmas` grid runs as diffusers runs it (when the step counts agree)."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import calculate_shift

    pipeline = engine.executor.driver_worker.pipeline
    grid = [1.0, 0.8, 0.5, 0.2]
    params = OmniDiffusionSamplingParams(height=64, width=32, num_inference_steps=4)
    default = pipeline.sigma_schedule(params)
    pipeline.sample_sigmas = grid
    try:
        ours = pipeline.sigma_schedule(params)
    finally:
        pipeline.sample_sigmas = None
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(
        registry.resolve_model_path(TINY_MODEL_NAME) / "scheduler"
    )
    cfg = scheduler.config
    mu = calculate_shift(8, cfg.base_image_seq_len, cfg.max_image_seq_len, cfg.base_shift, cfg.max_shift)
    scheduler.set_timesteps(sigmas=grid, mu=mu)
    torch.testing.assert_close(ours.sigmas, scheduler.sigmas.float(), rtol=0, atol=0)
    assert not torch.equal(default.sigmas, ours.sigmas)


def test_several_images_of_one_request_share_its_prefix(engine, diffusers_images):
    """n = 2: one prefix (two with CFG) serves both images; each image as diffusers gives it."""
    case = ("a tiny house", "blurry", 32, 32, 2, 3.0, 21)
    want = diffusers_images(case, num_images_per_prompt=2)
    request = make_request(engine, 400, case)
    request.sampling_params.num_outputs_per_prompt = 2
    handle = engine.add_request(request)
    engine.step()
    assert len(_prefix_cache(engine)) == 2, "the prompt and the negative prompt, shared by both images"
    (got,) = run_to_completion(engine, [handle.future])
    assert got.shape == want.shape == (2, 32, 32, 4)
    assert float(np.abs(got - want).max()) <= ATOL


def _reference_image(mode: str = "RGB"):
    from PIL import Image

    grid = np.linspace(0, 255, 48 * 32 * 4).reshape(32, 48, 4) % 256
    image = Image.fromarray(grid.astype(np.uint8), mode="RGBA")
    return image if mode == "RGBA" else image.convert(mode)


@pytest.mark.parametrize(("negative", "scale", "mode"), [(None, 1.0, "RGB"), ("blurry", 3.0, "RGBA")])
def test_edit_with_a_reference_image_matches_diffusers(engine, diffusers_images, negative, scale, mode):
    """A reference image's slots and VAE latents in the prefix (prefilled once), CFG off and on, packed
    with a text-to-image request."""
    image = _reference_image(mode)
    case = ("make it red", negative, 32, 64, 2, scale, 5)
    want = diffusers_images(case, image=image)
    request = make_request(engine, 500, case)
    request.image = image
    edit = engine.add_request(request)
    futures = [edit.future, engine.add_request(make_request(engine, 501, CASES[1])).future]
    engine.step()
    prefix = _prefix_cache(engine).get(edit.req_id, False)
    assert prefix.num_rows > 4 * 1000, "the reference's ~1024 slots, 4 rows each"
    got, _ = run_to_completion(engine, futures)
    assert got.shape == want.shape == (1, 32, 64, 4)
    diff = float(np.abs(got - want).max())
    print(f"edit, max abs vs diffusers: {diff:.2e}")
    assert diff <= ATOL
    assert len(_prefix_cache(engine)) == 0


def _transformers5_copy(tmp_path) -> str:
    """The tiny checkpoint as transformers 5 saves a processor: the image processor only nested in
    `processor/processor_config.json` (no `preprocessor_config.json`)."""
    import shutil

    root = tmp_path / "tiny-2.1-transformers5"
    shutil.copytree(registry.resolve_model_path(TINY_MODEL_NAME), root)
    (root / "processor" / "preprocessor_config.json").unlink()
    return str(root)


def test_edit_on_a_transformers5_processor_matches_diffusers(diffusers_images, tmp_path):
    """A checkpoint whose processor was saved by transformers 5 serves edits (the image processor read
    from the nested layout) with the image diffusers gives on the released layout."""
    model = _transformers5_copy(tmp_path)
    engine = tiny21_engine(model=model)
    case = ("make it red", None, 32, 32, 2, 1.0, 5)
    image = _reference_image()
    want = diffusers_images(case, image=image)
    request = make_request(engine, 600, case)
    request.image = image
    (got,) = run_to_completion(engine, [engine.add_request(request).future])
    assert got.shape == want.shape
    assert float(np.abs(got - want).max()) <= ATOL


def test_a_processor_without_an_image_processor_fails_at_load_naming_the_file(tmp_path):
    model = _transformers5_copy(tmp_path)
    no_image_processor = '{"processor_class": "Qwen3VLProcessor"}'
    (Path(model) / "processor" / "processor_config.json").write_text(no_image_processor)
    with pytest.raises(ValueError, match="preprocessor_config.json, or processor_config.json"):
        tiny21_engine(model=model)


def test_preempted_requests_keep_their_prefix_and_match_diffusers(reference_images):
    """The latency policy, one request per step: later, shorter requests preempt earlier ones between
    steps. A paused request's prefix KV cache stays resident and its image still equals diffusers'."""
    config = OmniDiffusionConfig(
        model=TINY_MODEL_NAME,
        dtype="float32",
        device="cpu",
        max_num_seqs=1,
        scheduling_policy="latency",
        scheduling_aging_factor=1e9,  # remaining work alone decides
        scheduling_deadline_factor=None,
    )
    engine = DiffusionEngine(config, autostart=False)
    prior = StepCostModel()  # the proportional prior, not the CPU's noisy start-up measurement
    prior.observe = lambda num_tokens, seconds: None
    engine.scheduler.cost_model = engine.scheduler.latency_policy.cost_model = prior
    futures = [engine.add_request(make_request(engine, 0, CASES[0])).future]  # 3 steps, 64x32
    engine.step()
    futures.append(engine.add_request(make_request(engine, 1, CASES[1])).future)  # 2 steps, 32x32: preempts
    steps = []
    images = run_to_completion(engine, futures, steps)
    assert any(s.num_paused for s in steps), "the first request sat out while the second ran"
    assert_matches(images, reference_images[:2])
    assert len(_prefix_cache(engine)) == 0


def _reference_images(num: int) -> list:
    """`num` different reference images of different sizes and aspects (the last sets the default size)."""
    from PIL import Image

    images = []
    for i in range(num):
        h, w = 32 + 16 * (i % 2), 48 - 8 * i
        grid = (np.arange(h * w * 3).reshape(h, w, 3) * (i + 3)) % 251
        images.append(Image.fromarray(grid.astype(np.uint8)))
    return images


@pytest.mark.parametrize("num_refs", [1, 3])
def test_edit_with_several_reference_images_matches_diffusers(engine, diffusers_images, num_refs):
    """Each reference's vision block in the template and its latent rows in the prefix, in order: alone,
    then packed in the same steps with a text-to-image request and a one-image edit."""
    images = _reference_images(num_refs)
    case = ("put them in one scene", "blurry", 32, 64, 2, 2.0, 8)
    one_ref_case = ("make it blue", None, 64, 32, 2, 1.0, 9)
    want = diffusers_images(case, image=images)
    want_one = diffusers_images(one_ref_case, image=images[:1])
    request = make_request(engine, 600, case)
    request.image = images
    geometry = engine.validate_request(request)
    alone_steps = []
    (alone,) = run_to_completion(engine, [engine.add_request(request).future], alone_steps)
    assert alone_steps[0].num_tokens == geometry.num_step_tokens, "the runner counts what the budget charged"

    edit = engine.add_request(request)
    one = make_request(engine, 601, one_ref_case)
    one.image = images[0]
    futures = [
        edit.future,
        engine.add_request(one).future,
        engine.add_request(make_request(engine, 602, CASES[1])).future,
    ]
    steps = []
    engine.step()
    cache = _prefix_cache(engine)
    num_rows = cache.get(edit.req_id, False).num_rows + cache.get(edit.req_id, True).num_rows
    assert geometry.num_prefix_cache_rows == num_rows, "the geometry counts every reference's prefix rows"
    packed, packed_one, t2i = run_to_completion(engine, futures, steps)
    assert any(s.num_reqs == 3 for s in steps), "the three requests shared steps"
    for got, ref in (
        (alone, want),
        (packed, want),
        (packed_one, want_one),
        (t2i, diffusers_images(CASES[1])),
    ):
        assert got.shape == ref.shape
        diff = float(np.abs(got - ref).max())
        print(f"{num_refs} references, max abs vs diffusers: {diff:.2e}")
        assert diff <= ATOL
    assert len(cache) == 0


def test_offline_omni_takes_several_references_and_refuses_eleven(diffusers_images):
    from vllm_omni import Omni

    images = _reference_images(2)
    case = ("side by side", None, 32, 32, 2, 1.0, 13)
    want = diffusers_images(case, image=images)
    with Omni(model=TINY_MODEL_NAME, device="cpu", dtype="float32") as omni:
        prompt = {"prompt": case[0], "multi_modal_data": {"image": images}}
        (out,) = omni.generate(prompt, height=32, width=32, num_inference_steps=2, seed=13, output_type="np")
        assert float(np.abs(out.images - want).max()) <= ATOL
        with pytest.raises(ValueError, match=r"takes at most 10 input images, got 11"):
            omni.generate({"prompt": "p", "multi_modal_data": {"image": _reference_images(1) * 11}})


def test_engine_refuses_more_references_than_the_model_takes(engine):
    request = make_request(engine, 700, CASES[1])
    request.image = _reference_images(1) * 11
    with pytest.raises(ValueError, match=r"image: Qwen-Image-2.1 takes at most 10 reference images, got 11"):
        engine.add_request(request)


def test_a_size_off_the_latent_grid_is_rounded_as_diffusers_and_packs(engine, diffusers_images):
    """48 pixels wide is not a multiple of 2.1's 32: the engine rounds it down as diffusers does, and
    the request's geometry (latent grid, rows) is the rounded size's, so it packs with another size
    (before: the geometry kept 48 and the packed step failed on mismatched rows)."""
    cases = [("a teapot", None, 32, 48, 2, 1.0, 21), ("a red fox", None, 64, 32, 2, 1.0, 22)]
    futures = [engine.add_request(make_request(engine, 900 + i, c)).future for i, c in enumerate(cases)]
    images = run_to_completion(engine, futures)
    assert images[0].shape[1:3] == (32, 32)
    assert_matches(images, [diffusers_images(c) for c in cases])


def _gemm_rows(profile) -> set[int]:
    """Rows (M) of every matrix product the profiled CPU ops ran (`aten::mm`: the linears' GEMMs)."""
    return {e.input_shapes[0][0] for e in profile.events() if e.name == "aten::mm" and e.input_shapes}


def test_steps_after_the_first_do_no_prefix_compute(engine):
    """Issue 24's profile check: the prefix (prompt) rows are prefilled once, in the request's first
    step; every later step's GEMMs see only its image rows (and per-sequence modulation rows), never
    a prefix row. CFG on, so the negative prompt's prefix too."""
    from torch.profiler import ProfilerActivity, profile

    _, _, h, w, steps, _, _ = CASES[0]  # CFG on, 64x32: 4x2 latent rows per sequence
    handle = engine.add_request(make_request(engine, 400, CASES[0]))
    image_rows = 2 * (h // 16) * (w // 16)  # both CFG sequences
    rows_per_step = []
    while not handle.done():
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            engine.step()
        if rows := _gemm_rows(prof):  # a step after the last one only waits for the decode worker
            rows_per_step.append(rows)
    assert len(rows_per_step) == steps
    # the first step encodes the prompts and prefills their K/V: GEMMs over prompt rows
    assert max(rows_per_step[0]) > image_rows
    for k, rows in enumerate(rows_per_step[1:], start=2):
        assert max(rows) == image_rows, f"step {k}: GEMM rows {sorted(rows)} (image rows {image_rows})"

"""`RequestGeometry`: a request's rows, computed once at admission by its family and carried on the
scheduler's profile and `NewRequestData`; the token cost is one function of it (`step_token_cost`)."""

from __future__ import annotations

import pytest
from PIL import Image

from vllm_omni.config import OmniDiffusionConfig
from vllm_omni.diffusion.engine import DiffusionEngine
from vllm_omni.diffusion.models import registry
from vllm_omni.diffusion.models.interface import RequestGeometry, step_token_cost
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.inputs import OmniDiffusionSamplingParams


def _request(prompt="a red cat", negative="blurry", height=48, width=32, n=1, image=None):
    params = OmniDiffusionSamplingParams(
        height=height, width=width, num_inference_steps=2, seed=1, num_outputs_per_prompt=n, output_type="np"
    )
    return OmniDiffusionRequest(
        "r", prompt=prompt, negative_prompt=negative, sampling_params=params, image=image
    )


def test_step_token_cost_counts_cfg_twice_and_every_image():
    geometry = RequestGeometry(
        16, (1, 3, 2), num_txt_tokens=9, num_neg_txt_tokens=4, num_cond_rows=5, num_images=2
    )
    assert geometry.num_img_tokens == 6
    assert geometry.num_step_tokens == 2 * ((9 + 6 + 5) + (4 + 6 + 5)) == step_token_cost(6, 5, 9, 4, 2)
    assert geometry.text_rows == (9 + 5, 4 + 5)
    no_cfg = RequestGeometry(16, (1, 3, 2), num_txt_tokens=9)
    assert (no_cfg.num_step_tokens, no_cfg.text_rows) == (9 + 6, (9, 0))


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    config = OmniDiffusionConfig(model=str(tiny_model_dir), dtype="float32", device="cpu", log_stats=False)
    return DiffusionEngine(config, autostart=False)


def test_the_family_geometry_travels_to_the_runner_and_its_cost_is_the_steps(engine):
    request = _request(height=50, width=37, n=2)  # rounded down to 48 x 32 at admission
    geometry = engine.validate_request(request)
    assert (geometry.pixel_multiple, geometry.latent_grid, geometry.num_images) == (16, (1, 3, 2), 2)
    handle = engine.add_request(request)
    (state,) = engine.scheduler._requests.values()
    assert state.profile.geometry == geometry
    assert state.profile.num_step_tokens == geometry.num_step_tokens
    sched_out = engine.scheduler.schedule()
    (new,) = sched_out.scheduled_new_reqs
    assert new.geometry == geometry
    engine.step_once(sched_out)
    # the runner counts its real rows with the same function: the same number
    assert engine.recent_steps()[-1].num_tokens == geometry.num_step_tokens
    while not handle.done():
        engine.step()
    assert handle.result().images.shape == (2, 48, 32, 3)


def test_the_edit_family_counts_vision_tokens_and_condition_rows(tiny_edit_model_dir):
    from vllm_omni.diffusion.models.qwen_image_edit.pipeline import edit_output_size

    family = registry.family_for(str(tiny_edit_model_dir))
    prompts = family.load_prompt_counter(str(tiny_edit_model_dir))
    image = Image.new("RGB", (80, 48))
    geometry = family.request_geometry(prompts, _request(height=64, width=96, image=image))
    cond_h, cond_w = edit_output_size(image)
    num_vision = prompts.num_vision_tokens(image)
    assert geometry.latent_grid == (1, 4, 6) and geometry.num_cond_rows == (cond_h // 16) * (cond_w // 16)
    assert geometry.num_txt_tokens == prompts.count("prompt", "a red cat").num_embedded_tokens + num_vision
    assert geometry.num_neg_txt_tokens == prompts.count("n", "blurry").num_embedded_tokens + num_vision
    assert prompts.num_image_rows(image) == num_vision + geometry.num_cond_rows  # the counter's own sum


@pytest.mark.parametrize("model", sorted(registry.TINY_MODELS))
def test_a_side_below_the_family_multiple_is_refused_naming_size_and_multiple(model):
    """Every family: a side that would round down to 0 pixels is an `InvalidRequestError` naming the size
    and the family's multiple, at admission (never a division by zero past it); the multiple itself works."""
    from vllm_omni.inputs import InvalidRequestError

    config = OmniDiffusionConfig(model=model, dtype="float32", device="cpu", log_stats=False)
    engine = DiffusionEngine(config, autostart=False)
    image = Image.new("RGB", (48, 32), "red") if engine.family.image_input is not None else None
    multiple = engine.family.request_geometry(engine.prompts, _request(height=64, width=64, image=image))
    multiple = multiple.pixel_multiple
    for height, width in ((multiple - 1, 64), (64, multiple // 2), (8, 8)):
        with pytest.raises(InvalidRequestError) as refused:
            engine.add_request(_request(height=height, width=width, image=image))
        message = str(refused.value)
        assert refused.value.param in ("height", "width"), message
        if min(height, width) >= 16:  # below 16 every family's floor answers: "must be in [16, 65536]"
            assert f"size {width}x{height}" in message and f"multiple of {multiple}" in message, message
    engine.add_request(_request(height=multiple, width=multiple, image=image))
    assert engine.num_running + engine.num_waiting == 1

"""The engine serving Qwen-Image-Edit-2509 against diffusers' `QwenImageEditPlusPipeline` (tiny checkpoint,
CPU fp32): 1, 2 and 3 input images of different sizes, CFG on and off, packed in the same steps (other
image counts and output sizes), and a three-image edit alone, within 1e-4 of diffusers. (Every input
image is VAE-encoded at about 1024 x 1024, as diffusers does: a few seconds each here.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from utils import assert_matches as _assert_matches
from utils import run_to_completion as _run_to_completion

from vllm_omni.config import OmniDiffusionConfig
from vllm_omni.diffusion.engine import DiffusionEngine
from vllm_omni.diffusion.models import registry
from vllm_omni.diffusion.models.qwen_image_edit_plus.pipeline import MAX_INPUT_IMAGES
from vllm_omni.diffusion.models.qwen_image_edit_plus.tiny import TINY_MODEL_NAME
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.inputs import InvalidRequestError, OmniDiffusionSamplingParams


def _image(seed: int, width: int, height: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


# (input images ((seed, w, h), ...), prompt, negative prompt, out height, out width, steps, cfg, seed)
CASES = [
    (((1, 80, 48),), "make the sky red", "blurry", 48, 64, 2, 4.0, 11),  # 1 image, CFG on
    (((2, 40, 72), (3, 64, 64)), "put the boat in the lake", None, 64, 32, 2, 4.0, 12),  # 2, CFG off
    (((4, 64, 32), (5, 48, 48), (6, 32, 80)), "a collage of the three", " ", 32, 48, 2, 2.5, 13),  # 3, CFG on
]


def _images(case) -> list[Image.Image]:
    return [_image(*spec) for spec in case[0]]


def _request(i: int, case) -> OmniDiffusionRequest:
    _, prompt, negative, height, width, steps, scale, seed = case
    params = OmniDiffusionSamplingParams(
        height=height,
        width=width,
        num_inference_steps=steps,
        true_cfg_scale=scale,
        seed=seed,
        output_type="np",
        extra_args={"mixfusion_min_chunk_tokens": 1},  # tiny grids: let every size share a step
    )
    images = _images(case)
    return OmniDiffusionRequest(
        f"plus-{i}",
        prompt,
        negative_prompt=negative,
        sampling_params=params,
        image=images[0] if len(images) == 1 else images,
    )


def reference_pipeline(model_dir):
    """diffusers' QwenImageEditPlusPipeline from components loaded one by one (the processor is ours:
    `Qwen2VLProcessor` without its video half, which needs torchvision)."""
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImageEditPlusPipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    from vllm_omni.diffusion.models.qwen_image_edit.processor import load_edit_processor

    pipe = QwenImageEditPlusPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(model_dir / "scheduler"),
        vae=AutoencoderKLQwenImage.from_pretrained(model_dir / "vae"),
        text_encoder=Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir / "text_encoder"),
        tokenizer=AutoTokenizer.from_pretrained(model_dir / "tokenizer"),
        processor=load_edit_processor(model_dir / "processor"),
        transformer=QwenImageTransformer2DModel.from_pretrained(model_dir / "transformer"),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def model_dir():
    return registry.resolve_model_path(TINY_MODEL_NAME)


@pytest.fixture(scope="module")
def reference_images(model_dir):
    pipe = reference_pipeline(model_dir)
    images = []
    for case in CASES:
        _, prompt, negative, height, width, steps, scale, seed = case
        out = pipe(
            image=_images(case),
            prompt=prompt,
            negative_prompt=negative,
            true_cfg_scale=scale,
            height=height,
            width=width,
            num_inference_steps=steps,
            generator=torch.Generator("cpu").manual_seed(seed),
            output_type="np",
        )
        images.append(out.images)
    return images


@pytest.fixture(scope="module")
def engine(model_dir):
    config = OmniDiffusionConfig(
        model=str(model_dir),
        dtype="float32",
        device="cpu",
        max_num_seqs=8,
        scheduling_policy="skip-ahead",  # every request in every step: the packed-step identity
    )
    return DiffusionEngine(config, autostart=False)


def test_a_three_image_edit_alone_matches_diffusers(engine, reference_images):
    images = _run_to_completion(engine, [engine.add_request(_request(0, CASES[2]))])
    _assert_matches(images, reference_images[2:])


def test_edits_of_other_image_counts_packed_match_diffusers(engine, reference_images):
    """1, 2 and 3 images, CFG on and off, three output sizes: one packed forward per step."""
    steps = []
    futures = [engine.add_request(_request(10 + i, case)) for i, case in enumerate(CASES)]
    images = _run_to_completion(engine, futures, steps)
    _assert_matches(images, reference_images)
    assert steps[0].num_reqs == len(CASES) and steps[0].path == "packed"


def test_too_many_images_and_no_image_are_refused_naming_the_limit(engine):
    case = ((tuple((i, 32, 32) for i in range(MAX_INPUT_IMAGES + 1))), *CASES[0][1:])
    with pytest.raises(InvalidRequestError, match=f"at most {MAX_INPUT_IMAGES} input images, got 5"):
        engine.add_request(_request(30, case))
    request = _request(31, CASES[0])
    request.image = None
    with pytest.raises(InvalidRequestError) as refused:
        engine.add_request(request)
    assert refused.value.param == "image"


def test_2511_is_refused_at_start_up_naming_zero_cond_t():
    config = OmniDiffusionConfig(model="Qwen/Qwen-Image-Edit-2511", load_format="dummy", device="cpu")
    with pytest.raises(ValueError, match="zero_cond_t"):
        DiffusionEngine(config, autostart=False)


def test_the_multipart_and_chat_routes_with_two_images_match_diffusers(model_dir, reference_images):
    """`POST /v1/images/edits` with an `image` and an `image[]` part, and chat completions with two
    `image_url` parts (vLLM-Omni's form): the two pictures, in order, give diffusers' image."""
    import asyncio
    import base64
    import io

    import httpx

    from vllm_omni.entrypoints.openai.api_server import ServerArgs, build_app

    engine = DiffusionEngine(OmniDiffusionConfig(model=str(model_dir), dtype="float32", device="cpu"))
    _, prompt, _, height, width, steps, _, seed = CASES[1]
    pngs = []
    for image in _images(CASES[1]):
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        pngs.append(buf.getvalue())
    files = [("image[]" if k else "image", (f"in{k}.png", png, "image/png")) for k, png in enumerate(pngs)]
    data = {
        "prompt": prompt,
        "size": f"{width}x{height}",
        "num_inference_steps": str(steps),
        "seed": str(seed),
    }
    urls = ["data:image/png;base64," + base64.b64encode(png).decode() for png in pngs]
    parts = [{"type": "text", "text": prompt}] + [
        {"type": "image_url", "image_url": {"url": u}} for u in urls
    ]
    chat = {
        "messages": [{"role": "user", "content": parts}],
        "size": f"{width}x{height}",
        "num_inference_steps": steps,
        "seed": seed,
    }

    async def post():
        app = build_app(engine, ServerArgs(model="tiny", api_key=None))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=300) as client:
            edit = await client.post("/v1/images/edits", data=data, files=files)
            return edit, await client.post("/v1/chat/completions", json=chat)

    try:
        edit, chat_resp = asyncio.run(post())
    finally:
        engine.shutdown()
    assert edit.status_code == 200, edit.text
    assert chat_resp.status_code == 200, chat_resp.text
    url = chat_resp.json()["choices"][0]["message"]["content"][0]["image_url"]["url"]
    want = (reference_images[1][0] * 255).round()
    for b64 in (edit.json()["data"][0]["b64_json"], url.split(",", 1)[1]):
        png = Image.open(io.BytesIO(base64.b64decode(b64)))
        got = np.asarray(png.convert("RGB"), dtype=np.float32)
        assert got.shape == want.shape
        assert float(np.abs(got - want).max()) <= 1.0

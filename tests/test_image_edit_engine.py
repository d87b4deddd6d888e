"""The engine serving Qwen-Image-Edit against diffusers' QwenImageEditPipeline (tiny checkpoint, CPU fp32).

Each edit request's image must equal what diffusers gives for the same input image, prompt, negative
prompt, seed, steps and CFG scale: alone, packed with other edit requests of other input and output
sizes (CFG on and off) in the same steps, and admitted while others are mid-denoise. diffusers'
pipeline is built from components loaded one by one: `from_pretrained` type-checks the processor,
and ours is a `Qwen2VLProcessor` subclass without the video half (torchvision cannot load here).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from utils import assert_matches, run_to_completion, tiny_engine

from vllm_omni.config import OmniDiffusionConfig
from vllm_omni.diffusion.engine import DiffusionEngine
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.inputs import OmniDiffusionSamplingParams


def _image(seed: int, width: int, height: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


# (input image (seed, w, h), prompt, negative prompt, out height, out width, steps, true_cfg_scale, seed)
CASES = [
    ((1, 80, 48), "make the sky red", "blurry", 48, 64, 3, 4.0, 11),  # CFG on, wide input
    ((2, 40, 72), "add a small boat on the water", None, 64, 32, 2, 4.0, 12),  # CFG off, tall input
    ((3, 64, 64), "turn it into a watercolor painting", " ", 32, 48, 2, 2.5, 13),  # CFG on, other scale
]


def _request(i: int, case) -> OmniDiffusionRequest:
    (img_seed, w, h), prompt, negative, height, width, steps, scale, seed = case
    params = OmniDiffusionSamplingParams(
        height=height,
        width=width,
        num_inference_steps=steps,
        true_cfg_scale=scale,
        seed=seed,
        output_type="np",
        extra_args={"mixfusion_min_chunk_tokens": 1},  # tiny grids: let every size share a step
    )
    return OmniDiffusionRequest(
        f"edit-{i}", prompt, negative_prompt=negative, sampling_params=params, image=_image(img_seed, w, h)
    )


def reference_pipeline(model_dir):
    """diffusers' QwenImageEditPipeline from components loaded one by one."""
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImageEditPipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    from vllm_omni.diffusion.models.qwen_image_edit.processor import load_edit_processor

    pipe = QwenImageEditPipeline(
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
def reference_images(tiny_edit_model_dir):
    pipe = reference_pipeline(tiny_edit_model_dir)
    images = []
    for (img_seed, w, h), prompt, negative, height, width, steps, scale, seed in CASES:
        out = pipe(
            image=_image(img_seed, w, h),
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
def engine(tiny_edit_model_dir):
    # skip-ahead: every request in every step (the packed-step identity)
    return tiny_engine(tiny_edit_model_dir, scheduling_policy="skip-ahead")


def test_edit_request_alone_matches_diffusers(engine, reference_images):
    images = run_to_completion(engine, [engine.add_request(_request(0, CASES[0]))])
    assert_matches(images, reference_images[:1])


def test_edits_of_other_sizes_packed_and_staggered_match_diffusers(engine, reference_images):
    steps = []
    futures = [engine.add_request(_request(10, CASES[0]))]
    engine.step()  # the first is one step into its schedule when the others arrive
    futures += [engine.add_request(_request(10 + i, c)) for i, c in enumerate(CASES[1:], start=1)]
    images = run_to_completion(engine, futures, steps)
    assert_matches(images, reference_images)
    packed = [s for s in steps if s.num_reqs == 3]
    assert packed and packed[0].path == "packed" and packed[0].num_seqs == 2 + 1 + 2
    assert len(set(packed[0].shapes)) == 3, "three output sizes in one step"


def test_input_image_and_prompt_move_the_output(engine, reference_images):
    """The tiny checkpoint is sensitive: another input image or prompt moves the output far beyond 1e-4."""
    other_image, other_prompt = _request(20, CASES[0]), _request(21, CASES[0])
    other_image.image = _image(99, 80, 48)
    other_prompt.prompt = "a dog in the snow"
    moved = run_to_completion(engine, [engine.add_request(other_image), engine.add_request(other_prompt)])
    for images in moved:
        assert float(np.abs(images - reference_images[0]).mean()) > 2e-3


def test_text_only_request_to_edit_model_and_image_to_text_to_image_model_are_refused(engine, tiny_model_dir):
    text_only = _request(30, CASES[0])
    text_only.image = None
    with pytest.raises(ValueError, match="image-edit model .* needs an input image"):
        engine.add_request(text_only)
    elongated = _request(32, CASES[0])
    elongated.image = _image(3, 4096, 1)  # its condition size has a height of 0 (a 500 before)
    with pytest.raises(ValueError, match="200:1 aspect ratio") as refused:
        engine.add_request(elongated)
    assert refused.value.param == "image"
    elongated.image = Image.new("RGB", (0, 64))  # a ZeroDivisionError before
    with pytest.raises(ValueError, match="has no pixels"):
        engine.add_request(elongated)
    t2i = DiffusionEngine(
        OmniDiffusionConfig(model=str(tiny_model_dir), dtype="float32", device="cpu"), autostart=False
    )
    with pytest.raises(ValueError, match="text-to-image and takes no input image"):
        t2i.validate_request(_request(31, CASES[0]))


def test_openai_sdk_edit_and_chat_equal_the_same_request_offline(engine):
    """images.edit (multipart) and chat.completions (image_url data URL) through the OpenAI SDK give the
    engine's own image for that request."""
    import base64
    import io

    from fastapi.testclient import TestClient
    from openai import OpenAI

    from vllm_omni.entrypoints.openai.api_server import ServerArgs, build_app

    (img_seed, w, h), prompt, negative = CASES[1][:3]
    offline = _request(40, CASES[1])
    offline.sampling_params.output_type = "pil"
    offline.sampling_params.num_inference_steps = 2
    (expected,) = run_to_completion(engine, [engine.add_request(offline)])[0]
    buf = io.BytesIO()
    _image(img_seed, w, h).save(buf, format="PNG")
    engine.start()
    try:
        with TestClient(build_app(engine, ServerArgs(model="tiny-edit"))) as http:
            client = OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http)
            result = client.images.edit(
                image=("in.png", buf.getvalue(), "image/png"),
                prompt=prompt,
                size="32x64",
                extra_body={"num_inference_steps": 2, "seed": 12, "true_cfg_scale": 4.0},
            )
            data_url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
            chat = client.chat.completions.create(
                model="tiny-edit",
                messages=[
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": prompt},
                            {"type": "image_url", "image_url": {"url": data_url}},
                        ],
                    }
                ],
                extra_body={"size": "32x64", "num_inference_steps": 2, "seed": 12},
            )
    finally:
        engine.shutdown()
    got = Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json)))
    assert got.size == (32, 64) and negative is None
    assert np.array_equal(np.asarray(got), np.asarray(expected))
    chat_url = chat.choices[0].message.content[0]["image_url"]["url"]
    via_chat = Image.open(io.BytesIO(base64.b64decode(chat_url.split(",", 1)[1])))
    assert np.array_equal(np.asarray(via_chat), np.asarray(expected))


def test_engine_counts_edit_prompt_rows_exactly_and_refuses_long_prompts(engine):
    """The token budget's text rows (template tail + vision tokens) equal the encoder's real rows."""
    from vllm_omni.diffusion.models.qwen_image_edit.pipeline import edit_output_size

    pipeline = engine.executor.driver_worker.pipeline
    image = _image(5, 80, 48)
    height, width = edit_output_size(image)
    (rows,) = pipeline.encode_edit_prompts(
        ["make the sky red"], [pipeline.image_processor.resize(image, height, width)]
    )
    counted = engine.prompts.count("prompt", "make the sky red").num_embedded_tokens
    assert counted + engine.prompts.num_vision_tokens(image) == rows.shape[0]
    request = _request(49, CASES[0])
    request.image = image
    num_pos, num_neg = engine.validate_request(request).text_rows  # CFG on: both sequences carry the image
    num_cond = (height // 16) * (width // 16)
    assert num_pos - engine.prompts.count("prompt", request.prompt).num_embedded_tokens == (
        engine.prompts.num_vision_tokens(image) + num_cond
    )
    assert num_neg > num_cond
    long_prompt = _request(50, CASES[0])
    long_prompt.prompt = "a red boat " * 30
    long_prompt.sampling_params.max_sequence_length = 16
    with pytest.raises(ValueError, match="edit models do not truncate prompts"):
        engine.validate_request(long_prompt)

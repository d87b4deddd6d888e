"""Schedules per request (`extra_args`' scheduler config fields) and an adapter's `default_sampling_params`:
a Qwen-Image-Lightning-style request (a random LoRA + the distilled schedule, 4 steps, CFG off) packed with
plain requests, each equal to diffusers' `QwenImagePipeline` with
`FlowMatchEulerDiscreteScheduler.from_config(config, **those fields)` (+ peft for the adapter), fp32 CPU."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from vllm_omni.config import OmniDiffusionConfig
from vllm_omni.diffusion.engine import DiffusionEngine
from vllm_omni.diffusion.models.qwen_image.transformer import QwenImageTransformer
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.entrypoints.omni import sampling_params_from_kwargs
from vllm_omni.inputs import InvalidRequestError, OmniDiffusionSamplingParams
from vllm_omni.lora import LoRAConfig, LoRAModulePath, LoRARequest
from vllm_omni.lora.random_adapter import block_targets, random_lora_state_dict, save_lora_dir

pytest.importorskip("peft")

LIGHTNING = {"base_shift": math.log(3), "max_shift": math.log(3), "shift_terminal": None}
"""The Lightning recipe's scheduler fields (diffusers' `shift_terminal=None`)."""
ADAPTER_DEFAULTS = {"num_inference_steps": 4, "true_cfg_scale": 1.0, **LIGHTNING}

# (prompt, negative, height, width, seed, lora?, request kwargs, diffusers scheduler fields, steps, cfg)
CASES = [
    ("a red fox", None, 32, 48, 3, True, {}, LIGHTNING, 4, 1.0),  # the adapter's defaults, all of them
    ("a cat", "blurry", 48, 32, 4, True, {"num_inference_steps": 3}, LIGHTNING, 3, 1.0),  # steps overridden
    ("a bowl of fruit", "dark", 32, 32, 5, False, {}, {}, 3, 4.0),  # plain: the checkpoint's schedule
    (
        "mountains",
        "ugly",
        48,
        48,
        6,
        False,
        {"extra_args": {"max_shift": 1.6, "time_shift_type": "linear", "shift_terminal": 0.1}},
        {"max_shift": 1.6, "time_shift_type": "linear", "shift_terminal": 0.1},
        2,
        2.5,
    ),
]


@pytest.fixture(scope="module")
def adapter_dir(tiny_model_dir, tmp_path_factory):
    from diffusers import QwenImageTransformer2DModel

    model = QwenImageTransformer2DModel.from_pretrained(tiny_model_dir, subfolder="transformer")
    targets = block_targets(QwenImageTransformer.plans, model.config.num_layers)
    state = random_lora_state_dict(model, targets, 4, 7, std=0.3)
    return str(save_lora_dir(tmp_path_factory.mktemp("lightning") / "lightning", state))


@pytest.fixture(scope="module")
def reference(tiny_model_dir, adapter_dir):
    """diffusers' images per case: its scheduler rebuilt with the case's fields, the adapter on or off."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(adapter_dir, adapter_name="lightning")
    config = pipe.scheduler.config
    images = []
    for prompt, negative, h, w, seed, lora, _, fields, steps, cfg in CASES:
        pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_config(config, **fields)
        pipe.enable_lora() if lora else pipe.disable_lora()
        images.append(
            pipe(
                prompt=prompt,
                negative_prompt=negative,
                true_cfg_scale=cfg,
                height=h,
                width=w,
                num_inference_steps=steps,
                generator=torch.Generator("cpu").manual_seed(seed),
                output_type="np",
            ).images
        )
    return images


@pytest.fixture(scope="module")
def engine(tiny_model_dir, adapter_dir):
    entry = json.dumps(
        {"name": "lightning", "path": adapter_dir, "default_sampling_params": ADAPTER_DEFAULTS}
    )
    config = OmniDiffusionConfig(
        model=str(tiny_model_dir),
        dtype="float32",
        device="cpu",
        max_num_seqs=8,
        scheduling_policy="skip-ahead",  # every request in every step: the packed-step identity
        mixfusion_min_chunk_tokens=1,
        lora=LoRAConfig(lora_modules=(LoRAModulePath.parse(entry),)),
    )
    return DiffusionEngine(config, autostart=False)


def _request(engine, i: int) -> OmniDiffusionRequest:
    """The case as `Omni.generate(**kwargs)` builds it: the adapter's defaults under the keywords."""
    prompt, negative, h, w, seed, lora, kwargs, *_ = CASES[i]
    kwargs = dict(kwargs, height=h, width=w, seed=seed, output_type="np")
    if lora:
        kwargs["lora_request"] = LoRARequest("lightning")
    else:
        kwargs.setdefault("num_inference_steps", CASES[i][8])
        kwargs["true_cfg_scale"] = CASES[i][9]
    config = engine.config
    params = sampling_params_from_kwargs(config.default_sampling_params, kwargs, config.lora.adapter_defaults)
    return OmniDiffusionRequest(f"light-{i}", prompt=prompt, negative_prompt=negative, sampling_params=params)


def test_lightning_and_plain_requests_share_packed_steps_and_match_diffusers(engine, reference):
    futures = [engine.add_request(_request(engine, i)).future for i in range(len(CASES))]
    steps = []
    while not all(f.done() for f in futures):
        stats = engine.step()
        if stats is not None:
            steps.append(stats)
    assert steps[0].num_reqs == len(CASES) and steps[0].path == "packed"
    for i, (future, want) in enumerate(zip(futures, reference, strict=True)):
        got = future.result().images
        diff = float(np.abs(got - want).max())
        assert diff <= 1e-4, f"case {i}: max abs diff {diff} vs diffusers"


def test_the_schedule_fields_change_the_schedule(engine):
    """Each field reaches the schedule (else the comparison above could pass by accident)."""
    pipeline = engine.executor.driver_worker.pipeline
    base = OmniDiffusionSamplingParams(height=32, width=32, num_inference_steps=4)
    plain = pipeline.sigma_schedule(base).sigmas
    for extra in (
        {"base_shift": 0.2},
        {"max_shift": 2.0},
        {"shift_terminal": 0},
        {"time_shift_type": "linear"},
    ):
        sp = OmniDiffusionSamplingParams(height=32, width=32, num_inference_steps=4, extra_args=extra)
        sp.validate()
        assert not torch.allclose(pipeline.sigma_schedule(sp).sigmas, plain), extra
    static = {"use_dynamic_shifting": False, "shift": 3.0}
    sp = OmniDiffusionSamplingParams(height=32, width=32, num_inference_steps=4, extra_args=static)
    assert not torch.allclose(pipeline.sigma_schedule(sp).sigmas, plain)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"shift": 0}, "extra_args.shift"),
        ({"base_shift": "ln3"}, "extra_args.base_shift"),
        ({"max_shift": float("nan")}, "extra_args.max_shift"),
        ({"use_dynamic_shifting": 1}, "extra_args.use_dynamic_shifting"),
        ({"shift_terminal": 1.0}, "extra_args.shift_terminal"),
        ({"time_shift_type": "cosine"}, "extra_args.time_shift_type"),
    ],
)
def test_bad_schedule_fields_are_refused_naming_them(extra, param):
    with pytest.raises(InvalidRequestError) as refused:
        OmniDiffusionSamplingParams(extra_args=extra).validate()
    assert refused.value.param == param and param.split(".")[1] in str(refused.value)


def test_flow_shift_and_shift_together_are_refused():
    with pytest.raises(InvalidRequestError, match="flow_shift .* not both"):
        OmniDiffusionSamplingParams(flow_shift=3.0, extra_args={"shift": 2.0}).validate()


def test_adapter_defaults_are_checked_at_start_up():
    bad = {"name": "l", "path": "/x", "default_sampling_params": {"guidance": 1}}
    with pytest.raises(ValueError, match="unknown keys \\['guidance'\\]"):
        LoRAModulePath.parse(json.dumps(bad))
    bad["default_sampling_params"] = {"max_shift": 99}
    with pytest.raises(ValueError, match="max_shift must be in"):
        LoRAModulePath.parse(json.dumps(bad))


def test_http_request_gets_the_adapter_defaults_under_its_own_fields():
    from vllm_omni.entrypoints.openai.protocol import ImageGenerationRequest
    from vllm_omni.entrypoints.openai.request_normalize import merge_extension_fields, to_engine_request

    entry = {"name": "lightning", "path": "/x", "default_sampling_params": ADAPTER_DEFAULTS}
    adapters = LoRAConfig(lora_modules=(LoRAModulePath.parse(json.dumps(entry)),)).adapter_defaults
    server = {"num_inference_steps": 30, "extra_args": {"enable_mixfusion": True}}

    def params(body):
        req = ImageGenerationRequest(**merge_extension_fields(body))
        return to_engine_request(req, "r", server, adapter_defaults=adapters).sampling_params

    sp = params({"prompt": "p", "lora": {"name": "lightning"}})
    assert (sp.num_inference_steps, sp.true_cfg_scale) == (4, 1.0)
    assert sp.extra_args == {
        "enable_mixfusion": True,
        "base_shift": math.log(3),
        "max_shift": math.log(3),
        "shift_terminal": 0.0,
    }
    sp = params(
        {
            "prompt": "p",
            "lora": {"name": "lightning"},
            "num_inference_steps": 8,
            "extra_args": {"shift_terminal": 0.02},
        }
    )
    assert (sp.num_inference_steps, sp.extra_args["shift_terminal"]) == (8, 0.02)
    sp = params({"prompt": "p"})
    assert (sp.num_inference_steps, sp.extra_args) == (30, {"enable_mixfusion": True})

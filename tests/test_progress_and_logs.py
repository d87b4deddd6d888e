"""Following a request: the step log (DEBUG per step, INFO every `--log-step-interval` steps, each with
the request ids and sizes of the step), the offline progress bars (requests and denoise steps), and
the flags that set them. The tiny model on CPU."""

from __future__ import annotations

import logging
import re

import pytest
from utils import capture_server_start, serve_cli

from vllm_omni.inputs import OmniDiffusionSamplingParams

ENGINE_LOGGER = "vllm_omni.diffusion.engine"


@pytest.fixture()
def captured(monkeypatch):
    return capture_server_start(monkeypatch, config_first=True)


@pytest.fixture(scope="module")
def omni(tiny_model_dir):
    from vllm_omni import Omni

    with Omni(model=str(tiny_model_dir), dtype="float32", device="cpu", log_step_interval=2) as omni:
        yield omni


def _params(steps: int, seed: int) -> OmniDiffusionSamplingParams:
    return OmniDiffusionSamplingParams(height=32, width=48, num_inference_steps=steps, seed=seed)


def test_step_lines_carry_request_ids_at_debug_and_every_nth_at_info(omni, caplog):
    caplog.set_level(logging.DEBUG, logger=ENGINE_LOGGER)
    first = len(omni.engine.recent_steps())
    omni.generate(["a red fox", "a blue boat"], [_params(3, 1), _params(2, 2)], use_tqdm=False)
    steps = omni.engine.recent_steps()[first:]
    lines = [r for r in caplog.records if r.name == ENGINE_LOGGER and re.match(r"step \d+:", r.getMessage())]
    assert len(lines) == len(steps)  # one line per step
    ids = {req_id for step in steps for req_id in step.req_ids}
    assert len(ids) == 2 and all(i.startswith("req-") for i in ids)
    for record, step in zip(lines, steps):
        step_id = int(re.match(r"step (\d+):", record.getMessage()).group(1))
        assert record.levelno == (logging.INFO if step_id % 2 == 0 else logging.DEBUG)
        for req_id in step.req_ids:  # every request of the step, with its size
            assert f"{req_id} 48x32" in record.getMessage()


def test_offline_bars_count_requests_and_denoise_steps(omni, capsys):
    omni.generate(["a red fox", "a blue boat"], [_params(3, 1), _params(2, 2)], use_tqdm=True)
    err = capsys.readouterr().err
    assert re.search(r"Generating: 100%.*2/2", err), err
    assert re.search(r"Denoising: 100%.*5/5", err), err


def test_flags_reach_the_config(captured):  # noqa: F811 - the fixture
    assert serve_cli(["--omni", "--log-step-interval", "10", "--gpu-memory-utilization", "0.5"]) == 0
    config, _ = captured[0]
    assert (config.log_step_interval, config.gpu_memory_utilization) == (10, 0.5)
    assert serve_cli(["--omni", "--gpu-memory-utilization", "1.5"]) != 0  # refused, naming the field


def test_long_server_side_work_is_announced_at_info(omni):
    """A step that encodes large reference images says so before it runs (and a step that decodes
    large images: the same check)."""
    from PIL import Image

    from vllm_omni.diffusion.sched.interface import NewRequestData, SchedulerOutput

    big = Image.new("RGB", (1024, 1024))
    new = NewRequestData("req-x", "p", None, _params(2, 1), image=[big, big])
    work = omni.engine._long_work(SchedulerOutput(step_id=7, scheduled_new_reqs=[new]))
    assert work == ["encoding 2 reference image(s) of req-x (2.1 MP)"]
    small = NewRequestData("req-y", "p", None, _params(2, 1), image=Image.new("RGB", (64, 64)))
    assert omni.engine._long_work(SchedulerOutput(step_id=8, scheduled_new_reqs=[small])) == []

"""One validation, in one place: the three bugs of issue 23 (each test here failed before the fix).

- `--flow-shift 0.0005` was accepted at start-up (`> 0`), then every request was refused (`>= 1e-3`):
  the server's defaults are now checked after merging, by `OmniDiffusionSamplingParams.validate`.
- A chat request to an edit model sending `height`/`width` (no `size`) was refused with "give either
  size or height/width, not both": the edit route wrote its computed size back as a "WxH" string.
- A Qwen-Image-Edit checkpoint whose processor was saved by transformers 5's `save_pretrained`
  (`processor/processor_config.json`, image processor nested; no `preprocessor_config.json`) was refused.
"""

from __future__ import annotations

import base64
import json
import shutil

import pytest
from utils import AUTH, MODEL, capture_server_start, make_client, png_bytes

from vllm_omni.config import OmniDiffusionConfig
from vllm_omni.entrypoints.cli import main as cli_main
from vllm_omni.entrypoints.openai.protocol import ImageGenerationRequest
from vllm_omni.inputs import OmniDiffusionSamplingParams

# ---- flow_shift: one rule ----------------------------------------------------------------------------


@pytest.fixture()
def captured_config(monkeypatch):
    return capture_server_start(monkeypatch)


def test_flow_shift_the_requests_refuse_is_refused_at_startup():
    with pytest.raises(ValueError, match=r"flow_shift must be in \[0.001, 100.0\], got 0.0005"):
        OmniDiffusionConfig(flow_shift=0.0005)


def test_cli_refuses_a_flow_shift_every_request_would_be_refused_for(captured_config, capsys):  # noqa: F811
    assert cli_main.main(["serve", "--flow-shift", "0.0005"], prog="vllm-omni") == 2
    assert "flow_shift must be in" in capsys.readouterr().err
    assert not captured_config


@pytest.mark.parametrize("flow_shift", [0.001, 3.0, 100.0])
def test_accepted_server_defaults_pass_the_request_check(flow_shift):
    config = OmniDiffusionConfig(flow_shift=flow_shift, default_sampling_params={"num_inference_steps": 9})
    OmniDiffusionSamplingParams(**config.default_sampling_params).validate(config.sampling_limits)


def test_pydantic_checks_types_and_the_request_check_checks_ranges():
    """Ranges live once, in `validate`: the request model takes any integer; the engine refuses it."""
    api_request = ImageGenerationRequest(prompt="p", n=1000, flow_shift=0.0005, num_inference_steps=0)
    assert (api_request.n, api_request.flow_shift) == (1000, 0.0005)
    with pytest.raises(ValueError, match="num_inference_steps must be in"):
        OmniDiffusionSamplingParams(num_inference_steps=0).validate()


# ---- sizes travel as height, width ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "want_hw"),
    [
        ({"height": 64, "width": 96}, (64, 96)),
        ({"size": "96x64"}, (64, 96)),
        ({"height": 64}, (64, 1312)),  # the other side: the edit's default for the input's aspect
        ({}, (800, 1312)),
    ],
)
def test_chat_edit_takes_height_and_width_like_vllm_omni(fields, want_hw):
    client, engine = make_client(edit_model=True)
    data_url = "data:image/png;base64," + base64.b64encode(png_bytes(80, 48)).decode()
    content = [{"type": "text", "text": "make it red"}, {"type": "image_url", "image_url": {"url": data_url}}]
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], **fields}
    with client:
        resp = client.post("/v1/chat/completions", json=body, headers=AUTH)
    assert resp.status_code == 200, resp.text
    sp = engine.generated[0].sampling_params
    assert (sp.height, sp.width) == want_hw


# ---- the edit processor, in both layouts transformers reads ---------------------------------------------


def test_edit_checkpoint_saved_by_transformers_save_pretrained_loads(tiny_edit_model_dir, tmp_path):
    from vllm_omni.diffusion.models.qwen_image_edit.loader import load_edit_processor_for

    released = load_edit_processor_for(str(tiny_edit_model_dir))
    saved = tmp_path / "saved"
    shutil.copytree(tiny_edit_model_dir, saved)
    shutil.rmtree(saved / "processor")
    released.save_pretrained(saved / "processor")  # transformers 5.17: the nested layout
    assert not (saved / "processor" / "preprocessor_config.json").exists()
    nested = json.loads((saved / "processor" / "processor_config.json").read_text())
    assert "image_processor" in nested

    loaded = load_edit_processor_for(str(saved))
    assert loaded.image_processor.size == released.image_processor.size
    assert loaded.image_processor.to_dict() == released.image_processor.to_dict()
    assert loaded.tokenizer("a red cat")["input_ids"] == released.tokenizer("a red cat")["input_ids"]


def test_edit_checkpoint_without_an_image_processor_config_is_refused(tiny_edit_model_dir, tmp_path):
    from vllm_omni.diffusion.models.qwen_image_edit.loader import load_edit_processor_for

    broken = tmp_path / "broken"
    shutil.copytree(tiny_edit_model_dir, broken)
    (broken / "processor" / "preprocessor_config.json").unlink()
    with pytest.raises(ValueError, match="processor_config.json"):
        load_edit_processor_for(str(broken))

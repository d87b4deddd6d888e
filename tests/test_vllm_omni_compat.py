"""vLLM-Omni users' requests and command lines, written from vLLM-Omni's documented behaviour.

Against the stub engine of `test_server_api.py` (fast): the request shapes vLLM-Omni's
images and chat routes accept (`extra_body` / `extra_args` / `extra_params`, `null` as
default, `flow_shift`, `generator_device`, `lora`, `vae_*`), `/v1/images/edits`, and
vLLM-Omni's `vllm serve` flags (every one accepted; honoured ones reach the config,
the others log one warning line each; unknown flags still fail).
"""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from utils import AUTH, MODEL, assert_error_shape, decode_png, make_app, post

from vllm_omni.entrypoints.cli import main as cli_main
from vllm_omni.entrypoints.cli.compat_flags import NO_EFFECT_FLAGS


@pytest.fixture()
def server():
    app, engine = make_app()
    with TestClient(app) as client:
        yield client, engine


def chat(client, body, headers=AUTH):
    return client.post("/v1/chat/completions", json=body, headers=headers)


def user(text) -> list[dict]:
    return [{"role": "user", "content": text}]


# ---- images API request shapes ---------------------------------------------------------------------


def test_extra_params_is_another_container(server):
    client, engine = server
    body = {
        "prompt": "p",
        "size": "32x32",
        "extra_params": {"seed": 9, "enable_mixfusion": False},
        "extra_body": {"extra_params": {"num_inference_steps": 3}},
    }
    assert post(client, body).status_code == 200
    sp = engine.generated[0].sampling_params
    assert (sp.seed, sp.num_inference_steps, sp.extra_args) == (9, 3, {"enable_mixfusion": False})


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "p", "seed": 1, "extra_params": {"seed": 2}},
        {"prompt": "p", "extra_args": {"seed": 1}, "extra_params": {"seed": 2}},
        {"prompt": "p", "extra_params": {"enable_mixfusion": True}, "extra_args": {"enable_mixfusion": True}},
    ],
)
def test_a_key_in_two_containers_is_refused(server, body):
    client, engine = server
    error = assert_error_shape(post(client, body), 400)
    assert "given twice" in error["message"] and not engine.generated


def test_null_means_default_everywhere(server):
    client, engine = server
    body = {
        "prompt": "p",
        "size": "32x32",
        "seed": None,
        "n": None,
        "negative_prompt": None,
        "extra_body": {"num_inference_steps": None, "extra_args": None},
        "extra_args": {"true_cfg_scale": None, "enable_mixfusion": None},
        "extra_params": {"guidance_scale": None},
    }
    assert post(client, body).status_code == 200, post(client, body).text
    sp = engine.generated[0].sampling_params
    assert (sp.num_inference_steps, sp.true_cfg_scale, sp.num_outputs_per_prompt) == (50, 4.0, 1)
    assert sp.extra_args == {} and engine.generated[0].negative_prompt is None


def test_flow_shift_and_generator_device_and_vae_fields(server):
    client, engine = server
    body = {"prompt": "p", "size": "32x32", "flow_shift": 3.0, "generator_device": "cpu"}
    body["extra_args"] = {"vae_use_slicing": True, "vae_use_tiling": False}
    assert post(client, body).status_code == 200
    sp = engine.generated[0].sampling_params
    assert (sp.flow_shift, sp.generator_device) == (3.0, "cpu")
    assert (sp.vae_use_slicing, sp.vae_use_tiling) == (True, False)  # per request (tests/test_vae_modes.py)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "p", "generator_device": "cuda"}, "generator_device"),
        ({"prompt": "p", "flow_shift": 0}, "flow_shift"),
        ({"prompt": "p", "flow_shift": "3"}, "flow_shift"),
        ({"prompt": "p", "size": "32x32", "height": 32}, "size"),
        ({"prompt": "p", "lora": {"path": "/x"}}, "lora"),
        ({"prompt": "p", "lora": {"name": "a", "bogus": 1}}, "lora.bogus"),
        ({"prompt": "p", "lora": {"name": "a"}, "lora_scale": 0.5}, "lora"),
    ],
)
def test_vllm_omni_fields_with_bad_values_are_400(server, body, param):
    client, engine = server
    error = assert_error_shape(post(client, body), 400)
    assert error["param"] == param, error
    assert not engine.generated


@pytest.mark.parametrize(
    "lora",
    [
        {"lora": {"name": "style", "path": "/adapters/style", "scale": 0.7, "int_id": 3}},
        {
            "lora": {
                "lora_name": "style",
                "local_path": "/adapters/style",
                "lora_scale": 0.7,
                "lora_int_id": 3,
            }
        },
        {"lora": {"adapter": "style", "lora_path": "/adapters/style", "scale": 0.7, "int_id": 3}},
        {"lora_name": "style", "lora_path": "/adapters/style", "lora_scale": 0.7, "lora_int_id": 3},
        {
            "extra_args": {
                "lora_name": "style",
                "local_path": "/adapters/style",
                "lora_scale": 0.7,
                "lora_int_id": 3,
            }
        },
    ],
)
def test_lora_spellings_parse_into_one_typed_field(server, lora):
    client, engine = server
    assert post(client, {"prompt": "p", "size": "32x32", **lora}).status_code == 200
    sp = engine.generated[0].sampling_params
    req = sp.lora_request
    assert (req.lora_name, req.lora_path, req.lora_int_id, sp.lora_scale) == (
        "style",
        "/adapters/style",
        3,
        0.7,
    )


def test_images_edits_is_400_naming_the_limitation(server):
    client, _ = server
    error = assert_error_shape(client.post("/v1/images/edits", headers=AUTH, files={"image": b"x"}), 400)
    assert "text-to-image" in error["message"] and error["code"] == "unsupported_endpoint"


# ---- chat completions -----------------------------------------------------------------------------------


def test_chat_completion_shape_and_same_request_as_images(server):
    client, engine = server
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "a cat"}]}],
        "height": 32,
        "width": 64,
        "num_inference_steps": 3,
        "negative_prompt": "dark",
        "true_cfg_scale": 2.0,
        "seed": 11,
        "extra_body": {"extra_args": {"enable_mixfusion": False}},
    }
    resp = chat(client, body)
    assert resp.status_code == 200, resp.text
    answer = resp.json()
    assert answer["object"] == "chat.completion" and answer["model"] == MODEL
    assert isinstance(answer["created"], int) and answer["id"].startswith("chatcmpl-")
    (choice,) = answer["choices"]
    assert (choice["index"], choice["finish_reason"], choice["message"]["role"]) == (0, "stop", "assistant")
    (part,) = choice["message"]["content"]
    assert part["type"] == "image_url" and part["image_url"]["url"].startswith("data:image/png;base64,")
    image = decode_png(part["image_url"]["url"].split(",", 1)[1])
    assert image.size == (64, 32) and image.getpixel((0, 0)) == (11, 0, 7)
    images_body = {
        "prompt": "a cat",
        "size": "64x32",
        **{k: body[k] for k in ("num_inference_steps", "seed")},
    }
    images_body.update(negative_prompt="dark", true_cfg_scale=2.0, extra_args={"enable_mixfusion": False})
    assert post(client, images_body).status_code == 200
    via_chat, via_images = (r.sampling_params for r in engine.generated)
    assert via_chat == via_images
    assert engine.generated[0].negative_prompt == engine.generated[1].negative_prompt == "dark"


def test_chat_string_content_and_n(server):
    client, engine = server
    resp = chat(client, {"messages": user("a dog"), "extra_body": {"height": 32, "width": 32}, "n": 2})
    assert resp.status_code == 200
    assert len(resp.json()["choices"][0]["message"]["content"]) == 2
    assert engine.generated[0].prompt == "a dog"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": user("p"), "stream": True}, "stream"),
        ({"messages": user("p"), "num_inference_step": 3}, "num_inference_step"),
        ({"messages": user("p"), "height": 8, "width": 64}, "size"),
        ({"messages": user("p"), "seed": -1}, "seed"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "system", "content": "x"}, *user("p")]}, "messages"),
        ({"messages": [{"role": "user", "content": "   "}]}, "messages"),
        ({"messages": [{"role": "robot", "content": "p"}]}, "messages.0.role"),
        ({"prompt": "p"}, "messages"),
        # found by fuzzing: a trailing dot, and the content union's "str" branch named instead of the part
        ({"messages": None}, "messages"),
        ({"messages": "p"}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "audio"}]}]}, "messages.0.content.0"),
        (  # pydantic names the part's type tag, then its field
            {"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]},
            "messages.0.content.0.text.text",
        ),
        ({"messages": user("p"), "stream": "no"}, "stream"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "make it blue"},
                            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                        ],
                    }
                ]
            },
            "messages",
        ),
    ],
)
def test_chat_bad_requests_are_400(server, body, param):
    client, engine = server
    error = assert_error_shape(chat(client, body), 400)
    assert error["param"] == param, error
    assert error["code"] is not None and not error["message"].startswith("None"), error
    assert not engine.generated


def test_chat_image_input_says_text_to_image(server):
    client, _ = server
    content = [{"type": "text", "text": "edit"}, {"type": "image_url", "image_url": {"url": "data:,"}}]
    error = assert_error_shape(chat(client, {"messages": [{"role": "user", "content": content}]}), 400)
    assert "text-to-image" in error["message"]


def test_chat_with_openai_client(server):
    """The OpenAI SDK's chat call with `extra_body`, as vLLM-Omni's e2e tests send it."""
    import openai

    client, engine = server
    sdk = openai.OpenAI(api_key="sk-test", base_url="http://testserver/v1", http_client=client)
    completion = sdk.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "a red fox"}],
        extra_body={"height": 32, "width": 48, "num_inference_steps": 2, "seed": 5, "true_cfg_scale": 4.0},
    )
    content = completion.choices[0].message.content
    url = content[0]["image_url"]["url"]
    assert decode_png(url.split(",", 1)[1]).size == (48, 32)
    assert engine.generated[0].sampling_params.seed == 5


# ---- command lines ---------------------------------------------------------------------------------------


@pytest.fixture()
def captured(monkeypatch):
    import vllm_omni.entrypoints.cli.startup_checks as startup_checks
    import vllm_omni.entrypoints.openai.api_server as api_server

    seen = []
    monkeypatch.setattr(
        api_server, "run_server", lambda config, server_args: seen.append((config, server_args))
    )
    monkeypatch.setattr(startup_checks, "startup_errors", lambda config: [])  # tests/reliability checks them
    return seen


def _warnings(capsys) -> list[str]:
    """The no-effect warning lines `vllm serve` logged (its logging handler writes to stderr)."""
    return [line for line in capsys.readouterr().err.splitlines() if "has no effect here" in line]


def test_vllm_omni_e2e_flags_start_the_server(captured, capsys):
    argv = ["serve", "tiny-qwen-image", "--omni", "--stage-init-timeout", "600", "--init-timeout", "900"]
    argv += ["--log-stats", "--trust-remote-code", "--step-execution", "--max-num-seqs", "8"]
    assert cli_main.main(argv, prog="vllm") == 0
    config, _ = captured[0]
    assert config.init_timeout_s == 900 and config.log_stats
    warned = _warnings(capsys)
    assert len(warned) == 2, warned
    assert any("--stage-init-timeout has no effect" in w for w in warned)
    assert any("--trust-remote-code has no effect" in w for w in warned)


def test_honoured_flags_reach_the_configs(captured):
    argv = [
        "serve", "m", "--flow-shift", "3.0", "--vae-use-tiling", "--vae-use-slicing", "--num-gpus", "1",
        "--disable-log-stats", "--diffusion-load-format", "dummy", "--model-class-name", "QwenImagePipeline",
        "--uvicorn-log-level", "warning", "--allowed-origins", '["http://a.test"]', "--disable-log-requests",
        "--allowed-methods", '["POST"]', "--allowed-headers", '["Authorization"]', "--allow-credentials",
        "--default-sampling-params", '{"0": {"generator_device": "cpu", "num_inference_steps": 20}}',
    ]  # fmt: skip
    assert cli_main.main(argv, prog="vllm-omni") == 0
    config, server_args = captured[0]
    assert config.vae_use_tiling and config.vae_use_slicing and not config.log_stats
    assert config.load_format == "dummy" and config.flow_shift == 3.0
    assert config.default_sampling_params == {
        "flow_shift": 3.0,
        "generator_device": "cpu",
        "num_inference_steps": 20,
    }
    assert server_args.log_level == "warning" and server_args.allowed_origins == ["http://a.test"]
    assert (server_args.cors.methods, server_args.cors.headers) == (["POST"], ["Authorization"])
    assert server_args.cors.allow_credentials and not server_args.log_requests


def test_defaults_batch_heterogeneous_requests_with_the_latency_policy(captured):
    assert cli_main.main(["serve", "m", "--step-execution"], prog="vllm-omni") == 0
    config, _ = captured[0]
    assert config.scheduling_policy == "latency" and config.resident_cap == 16
    assert (config.mixfusion_min_chunk_tokens, config.mixfusion_max_chunks) == (None, None)


@pytest.mark.parametrize(
    ("flag", "policy"), [("fcfs", "fifo"), ("priority", "latency"), ("skip-ahead", "skip-ahead")]
)
def test_vllm_scheduling_policy_names_map_onto_ours(captured, flag, policy):
    assert (
        cli_main.main(["serve", "m", "--step-execution", "--scheduling-policy", flag], prog="vllm-omni") == 0
    )
    config, _ = captured[0]
    assert config.scheduling_policy == policy


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--num-gpus", "2"], "--num-gpus 2 disagrees"),
        (["--diffusion-load-format", "custom_pipeline"], "custom_pipeline is not supported"),
        (["--model-class-name", "WanPipeline"], "WanPipeline is not supported"),
        (["--log-stats", "--disable-log-stats"], "not allowed with"),
        (["--no-such-flag"], "unrecognized arguments"),
        (["--allowed-origins", '{"a": 1}'], "JSON list"),
        (["--allowed-headers", '"Authorization"'], "--allowed-headers must be a JSON list"),
        # MODEL swallowed by a flag of one or more values: it served the tiny model under that name
        (["--served-model-name", "foo", "Qwen/Qwen-Image"], "MODEL is missing"),
        (["--lora-path", "/a.safetensors", "Qwen/Qwen-Image"], "MODEL is missing"),
        (["--default-sampling-params", '{"generator_device": "cuda"}'], "generator_device"),
    ],
)
def test_bad_command_lines_fail_before_loading(captured, capsys, flags, needle):
    try:
        code = cli_main.main(["serve", *flags], prog="vllm-omni")
    except SystemExit as exc:  # argparse errors
        code = exc.code
    assert code == 2
    assert needle in capsys.readouterr().err
    assert not captured


def test_every_no_effect_flag_is_accepted_with_one_warning(captured, capsys):
    argv = ["serve"]
    for spec in NO_EFFECT_FLAGS:
        argv += [spec.flag] if not spec.takes_value else [spec.flag, "1"]
    assert cli_main.main(argv, prog="vllm-omni") == 0
    assert len(_warnings(capsys)) == len(NO_EFFECT_FLAGS)


def test_vllm_version_and_serve_help_without_omni(monkeypatch, capsys):
    monkeypatch.setattr(cli_main.importlib.util, "find_spec", lambda name: None)
    assert cli_main.main(["--version"], prog="vllm") == 0
    assert "vllm-omni" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        cli_main.main(["serve", "--help=all"], prog="vllm")
    assert exc.value.code == 0
    help_text = capsys.readouterr().out
    for flag in ("--step-execution", "--flow-shift", "--stage-init-timeout", "--num-gpus"):
        assert flag in help_text


def test_allowed_origins_answer_cors_preflight():
    from utils import StubEngine

    from vllm_omni.config import OmniDiffusionConfig
    from vllm_omni.entrypoints.openai.api_server import ServerArgs, build_app

    engine = StubEngine(OmniDiffusionConfig(max_num_seqs=2))
    app = build_app(engine, ServerArgs(model="m", allowed_origins=["http://a.test"]))
    headers = {"Origin": "http://a.test", "Access-Control-Request-Method": "POST"}
    with TestClient(app) as client:
        resp = client.options("/v1/images/generations", headers=headers)
        assert resp.headers["access-control-allow-origin"] == "http://a.test"
        other = client.options("/v1/images/generations", headers={**headers, "Origin": "http://b.test"})
        assert "access-control-allow-origin" not in other.headers
        # a browser calling an --api-key server with JSON asks for both headers (refused before: 400)
        asks = {**headers, "Access-Control-Request-Headers": "authorization,content-type"}
        resp = client.options("/v1/images/generations", headers=asks)
        assert resp.status_code == 200, resp.text
        assert set(resp.headers["access-control-allow-headers"].lower().replace(" ", "").split(",")) >= {
            "authorization",
            "content-type",
        }


@pytest.mark.parametrize(
    ("kwargs", "error", "needle"),
    [  # found by fuzzing the offline API: the first two were silently wrong, the rest tracebacks later
        ({"batch_invariant": "false"}, TypeError, "batch_invariant must be bool"),
        ({"enable_mixfusion": "no"}, TypeError, "enable_mixfusion must be bool"),
        ({"max_num_seqs": "8"}, TypeError, "max_num_seqs must be int"),
        ({"max_num_seqs": 2.5}, TypeError, "max_num_seqs must be int"),
        ({"flow_shift": "3"}, TypeError, "flow_shift must be a number"),
        ({"seed": 2**70}, ValueError, r"seed must be in \[0, 2\*\*63\)"),
        ({"init_timeout_s": float("nan")}, ValueError, "init_timeout_s must be a finite number"),
        ({"flow_shift": 5.0, "default_sampling_params": {"flow_shift": 3.0}}, ValueError, "given twice"),
        ({"default_sampling_params": {"height": 4096, "width": 4096}}, ValueError, "max_generated_image"),
    ],
)
def test_config_refuses_values_of_the_wrong_kind(kwargs, error, needle):
    from vllm_omni.config import OmniDiffusionConfig

    with pytest.raises(error, match=needle):
        OmniDiffusionConfig(**kwargs)
    assert OmniDiffusionConfig(flow_shift=3.0, default_sampling_params={"flow_shift": 3.0}).flow_shift == 3.0


@pytest.mark.parametrize(
    ("flags", "warned"),
    [
        (["--max-num-batched-tokens", "4096", "--mixfusion-max-chunks", "4"], ["--max-num-batched-tokens"]),
        (
            ["--step-execution", "--no-enable-mixfusion", "--mixfusion-min-chunk-tokens", "64"],
            ["--mixfusion-min"],
        ),
        (
            ["--allowed-headers", '["Authorization"]', "--allow-credentials"],
            ["--allowed-headers", "--allow-cred"],
        ),
        (["--step-execution", "--max-num-batched-tokens", "4096"], []),
    ],
)
def test_flags_whose_feature_is_off_warn_once_each(captured, capsys, flags, warned):
    """Request mode (no --step-execution) ignores the batching flags, --no-enable-mixfusion its chunk
    limits, and CORS without --allowed-origins its other flags: one warning line each, not silence."""
    assert cli_main.main(["serve", "m", *flags], prog="vllm-omni") == 0
    lines = _warnings(capsys)
    for flag in warned:
        assert any(flag in line for line in lines), lines
    assert (not warned) == (not lines), lines


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (
            ["--diffusion-batching-policy", "compute_budget"],
            "--scheduling-policy fifo --max-num-batched-tokens",
        ),
        (["--diffusion-batching-config", '{"compute_unit_budget": 10240}'], "--max-num-batched-tokens N"),
    ],
)
def test_vllm_omni_batching_policy_flags_name_what_to_use(captured, capsys, flags, needle):
    assert cli_main.main(["serve", "m", "--step-execution", *flags], prog="vllm-omni") == 2
    assert needle in capsys.readouterr().err and not captured


def test_vllm_omni_default_batching_policy_is_ours(captured):
    flags = ["serve", "m", "--step-execution", "--diffusion-batching-policy", "profile"]
    assert cli_main.main(flags, prog="vllm-omni") == 0
    assert captured[0][0].scheduling_policy == "latency"

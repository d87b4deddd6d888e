"""The HTTP layer and CLI against a stub engine (no model, fast).

The stub follows the `DiffusionEngine` contract; it records what reaches it so
each test can check that bad input never does, and that a disconnect aborts.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import types

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from utils import API_KEY, AUTH, MODEL, assert_error_shape, capture_server_start, decode_png, make_app, post

from vllm_omni.diffusion.sched.interface import ForwardPath, StepStats
from vllm_omni.entrypoints.cli import main as cli_main
from vllm_omni.entrypoints.cli import serve as cli_serve
from vllm_omni.entrypoints.cli.serve_args import add_serve_arguments
from vllm_omni.entrypoints.openai.metrics import PrometheusStatLogger


@pytest.fixture()
def captured_config(monkeypatch):
    return capture_server_start(monkeypatch)


@pytest.fixture()
def server():
    app, engine = make_app()
    with TestClient(app) as client:
        yield client, engine


def assert_serves_valid_request(client) -> None:
    resp = post(client, {"prompt": "a cat", "size": "32x48", "seed": 3, "num_inference_steps": 2})
    assert resp.status_code == 200, resp.text
    assert decode_png(resp.json()["data"][0]["b64_json"]).size == (32, 48)


# ---- valid requests ---------------------------------------------------------------------------------


def test_valid_request_openai_shape(server):
    client, engine = server
    resp = post(client, {"prompt": "a cat", "model": MODEL, "n": 3, "size": "64x32", "seed": 11})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert isinstance(body["created"], int) and body["size"] == "64x32" and body["output_format"] == "png"
    assert len(body["data"]) == 3
    for i, item in enumerate(body["data"]):
        assert item["revised_prompt"] is None and item["seed"] == 11 and item["index"] == i
        image = decode_png(item["b64_json"])
        assert image.format == "PNG" and image.size == (64, 32)
        assert image.getpixel((0, 0)) == (11, i, 7)
    assert body["timings"]["queue_s"] == 0.25 and body["timings"]["engine_s"] == 0.5
    assert body["timings"]["total_s"] >= body["timings"]["encode_s"] >= 0
    assert resp.headers["x-request-id"] == body["id"] and body["id"].startswith("img-")
    # n images = one engine request with num_outputs_per_prompt = n, admitted off the event loop
    assert len(engine.generated) == 1 and engine.generated[0].request_id == body["id"]
    assert engine.admission_threads != [threading.main_thread().name]
    sp = engine.generated[0].sampling_params
    assert (sp.num_outputs_per_prompt, sp.width, sp.height, sp.output_type) == (3, 64, 32, "pil")


def test_defaults_and_auto_size(server):
    client, engine = server
    assert post(client, {"prompt": "p", "size": "auto"}).status_code == 200
    assert post(client, {"prompt": "p"}).status_code == 200
    for req in engine.generated:
        assert (req.sampling_params.width, req.sampling_params.height) == (1024, 1024)
    app, engine = make_app(default_sampling_params={"num_inference_steps": 7, "height": 32, "width": 48})
    with TestClient(app) as client:
        assert post(client, {"prompt": "p"}).status_code == 200
        assert post(client, {"prompt": "p", "size": "16x16", "num_inference_steps": 2}).status_code == 200
    first, second = (r.sampling_params for r in engine.generated)
    assert (first.width, first.height, first.num_inference_steps) == (48, 32, 7)
    assert (second.width, second.height, second.num_inference_steps) == (16, 16, 2)


def test_extension_fields_from_extra_body_and_extra_args(server):
    client, engine = server
    body = {
        "prompt": "p",
        "size": "32x32",
        "negative_prompt": "blurry",
        "extra_body": {"seed": 5, "num_inference_steps": 3, "extra_args": {"true_cfg_scale": 2.5}},
        "extra_args": {"enable_mixfusion": False, "max_sequence_length": 64},
    }
    assert post(client, body).status_code == 200
    req = engine.generated[0]
    sp = req.sampling_params
    assert (sp.seed, sp.num_inference_steps, sp.true_cfg_scale, sp.max_sequence_length) == (5, 3, 2.5, 64)
    assert sp.extra_args == {"enable_mixfusion": False}
    assert req.negative_prompt == "blurry" and req.do_classifier_free_guidance


def test_jpeg_output_format(server):
    client, _ = server
    resp = post(client, {"prompt": "p", "size": "32x32", "output_format": "jpeg", "output_compression": 80})
    assert resp.status_code == 200
    assert decode_png(resp.json()["data"][0]["b64_json"]).format == "JPEG"


# ---- bad requests ------------------------------------------------------------------------------------

BAD_BODIES = [
    ({"prompt": "p", "size": "big"}, "size"),
    ({"prompt": "p", "size": "64x"}, "size"),
    ({"prompt": "p", "size": "8x64"}, "size"),  # a side below 16
    ({"prompt": "p", "size": "4096x4096"}, "size"),  # too many pixels
    ({"prompt": "p", "size": 64}, "size"),
    ({"prompt": "p", "n": 0}, "n"),
    ({"prompt": "p", "n": 11}, "n"),
    ({"prompt": "p", "n": "2"}, "n"),
    ({"prompt": "p", "num_inference_steps": 0}, "num_inference_steps"),
    ({"prompt": "p", "num_inference_steps": 10**9}, "num_inference_steps"),
    ({"prompt": "p", "true_cfg_scale": -1.0}, "true_cfg_scale"),
    ({"prompt": "p", "guidance_scale": -0.5}, "guidance_scale"),
    ({"prompt": "p", "true_cfg_scale": "high"}, "true_cfg_scale"),
    ({"prompt": "p", "seed": 1.5}, "seed"),
    ({"prompt": "p", "seed": -3}, "seed"),
    ({"prompt": "p", "max_sequence_length": 2000}, "max_sequence_length"),
    ({"prompt": 123}, "prompt"),
    ({"size": "32x32"}, "prompt"),
    ({"prompt": "   "}, "prompt"),
    ({"prompt": "p", "negative_prompt": 5}, "negative_prompt"),
    ({"prompt": "p", "num_inference_step": 4}, "num_inference_step"),  # typo: unknown field
    ({"prompt": "p", "": 4}, ""),  # an empty key is named as one (it read "unknown field None")
    ({"prompt": "p", "extra_args": {"foo": 1}}, "extra_args.foo"),
    ({"prompt": "p", "extra_args": {"enable_mixfusion": "yes"}}, "extra_args.enable_mixfusion"),
    ({"prompt": "p", "extra_args": [1]}, "extra_args"),
    ({"prompt": "p", "extra_body": "seed=1"}, "extra_body"),
    ({"prompt": "p", "seed": 1, "extra_body": {"seed": 2}}, "seed"),
    ({"prompt": "p", "extra_body": {"seed": 1, "extra_args": {"seed": 2}}}, "seed"),
    (
        {"prompt": "p", "num_inference_steps": 2, "extra_args": {"num_inference_steps": 2}},
        "num_inference_steps",
    ),
    (
        {
            "prompt": "p",
            "extra_args": {"enable_mixfusion": True},
            "extra_body": {"extra_args": {"enable_mixfusion": False}},
        },
        "extra_args.enable_mixfusion",
    ),
    ({"prompt": "p", "response_format": "url"}, "response_format"),
    ({"prompt": "p", "response_format": "png"}, "response_format"),
    ({"prompt": "p", "partial_images": 1}, "partial_images"),  # previews need stream=true
    ({"prompt": "p", "stream": True, "partial_images": "2"}, "partial_images"),
    ({"prompt": "p", "output_format": "gif"}, "output_format"),
    ({"prompt": "p", "background": "transparent"}, "background"),
]


@pytest.mark.parametrize(
    ("body", "param"), BAD_BODIES, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD_BODIES)]
)
def test_bad_body_is_400_naming_the_field(server, body, param):
    client, engine = server
    error = assert_error_shape(post(client, body), 400)
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error"
    assert not engine.generated  # nothing reached the engine
    assert_serves_valid_request(client)


def test_url_response_format_message_says_b64_json(server):
    client, _ = server
    error = assert_error_shape(post(client, {"prompt": "p", "response_format": "url"}), 400)
    assert "b64_json" in error["message"]


@pytest.mark.parametrize(
    "raw", [b"{not json", b'{"prompt": "p",}', b"[1, 2]", b'"prompt"', b"\xff\xfe", b""], ids=str
)
def test_malformed_json_is_400(server, raw):
    client, engine = server
    headers = {**AUTH, "Content-Type": "application/json"}
    error = assert_error_shape(client.post("/v1/images/generations", content=raw, headers=headers), 400)
    assert error["code"] == "invalid_json"
    assert not engine.generated
    assert_serves_valid_request(client)


def test_oversized_body_is_413(server):
    client, engine = server
    big = {"prompt": "x" * (1 << 20)}
    assert_error_shape(post(client, big), 413)

    def chunks():  # no Content-Length: the actual size is counted
        yield b'{"prompt": "'
        for _ in range(80):
            yield b"y" * 16384
        yield b'"}'

    headers = {**AUTH, "Content-Type": "application/json"}
    resp = client.post("/v1/images/generations", content=chunks(), headers=headers)
    assert_error_shape(resp, 413)
    assert not engine.generated
    assert_serves_valid_request(client)


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}, {"Authorization": "Basic sk-test"}],
    ids=["missing", "wrong", "no-scheme", "basic"],
)
def test_api_key_is_401(server, headers):
    client, engine = server
    error = assert_error_shape(post(client, {"prompt": "p", "size": "32x32"}, headers=headers), 401)
    assert error["code"] == "invalid_api_key"
    assert_error_shape(client.get("/v1/models", headers=headers), 401)
    assert not engine.generated
    assert_serves_valid_request(client)


def test_bad_request_id_header_is_400(server):
    client, engine = server
    headers = {**AUTH, "X-Request-Id": "x" * 200}
    error = assert_error_shape(post(client, {"prompt": "p", "size": "32x32"}, headers=headers), 400)
    assert error["param"] == "X-Request-Id" and not engine.generated
    resp = post(client, {"prompt": "p", "size": "32x32"}, headers={**AUTH, "X-Request-Id": "mine-1"})
    # The client's id is a label (echoed); the engine id and the response id are the server's.
    assert resp.status_code == 200 and resp.headers["x-request-id"] == "mine-1"
    assert resp.json()["id"] == engine.generated[0].request_id != "mine-1"


def test_unknown_model_is_404(server):
    client, engine = server
    error = assert_error_shape(post(client, {"prompt": "p", "model": "dall-e-3"}), 404)
    assert error["param"] == "model" and error["code"] == "model_not_found"
    assert not engine.generated
    assert_error_shape(client.get("/v1/nothing-here", headers=AUTH), 404)
    assert_serves_valid_request(client)


def test_queue_full_is_503_with_retry_after(server):
    client, engine = server
    engine.queue_full = True
    resp = post(client, {"prompt": "p", "size": "32x32"})
    error = assert_error_shape(resp, 503)
    assert error["code"] == "queue_full" and int(resp.headers["retry-after"]) >= 1
    engine.queue_full = False
    assert_serves_valid_request(client)
    metrics = client.get("/metrics").text
    assert 'vllm_omni:request_errors_total{kind="queue_full"} 1.0' in metrics


def test_engine_failure_is_500_with_kind(server):
    client, engine = server
    engine.fail_kind = "denoise"
    error = assert_error_shape(post(client, {"prompt": "p", "size": "32x32"}), 500)
    assert error["code"] == "denoise" and error["type"] == "server_error"


def test_client_disconnect_aborts_and_cancels():
    """A raw ASGI call whose client disconnects while the engine is still generating."""
    app, engine = make_app(api_key=None)
    engine.block = True
    body = json.dumps({"prompt": "p", "size": "32x32"}).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/images/generations",
        "raw_path": b"/v1/images/generations",
        "root_path": "",
        "query_string": b"",
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"x-request-id", b"req-gone"),
        ],
        "client": ("127.0.0.1", 5000),
        "server": ("testserver", 80),
    }

    async def run() -> list[dict]:
        pending = [{"type": "http.request", "body": body, "more_body": False}]
        gone = asyncio.Event()
        sent: list[dict] = []

        async def receive():
            if pending:
                return pending.pop(0)
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        task = asyncio.create_task(app(scope, receive, send))
        for _ in range(500):  # admitted (in a thread) and then running (back on the loop)
            if engine.num_running:
                break
            await asyncio.sleep(0.01)
        assert engine.num_running == 1 and not task.done()
        gone.set()
        await asyncio.wait_for(task, timeout=5)
        return sent

    sent = asyncio.run(run())
    request_id = engine.generated[0].request_id
    assert request_id.startswith("img-")
    assert engine.cancelled == [request_id], "cancelling engine.generate is what aborts the request"
    assert engine.num_running == 0
    assert sent[0]["status"] == 499


# ---- other endpoints -----------------------------------------------------------------------------------


def test_models_health_version_debug(server):
    client, _ = server
    models = client.get("/v1/models", headers=AUTH).json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["object"] == "model"
    assert client.get("/health").json() == {"status": "healthy"}
    assert client.get("/version").json()["version"]
    steps = client.get("/v1/debug/steps", headers=AUTH).json()["steps"]
    assert steps[0]["shapes"] == [[64, 64], [32, 64]] and steps[0]["path"] == "packed"


def test_metrics_parse_and_count(server):
    client, engine = server
    assert post(client, {"prompt": "p", "size": "32x32", "n": 2}).status_code == 200
    metrics: PrometheusStatLogger = client.app.state.metrics
    metrics.on_step(StepStats(3, 4, 300, [(32, 32), (64, 32), (32, 32)], ForwardPath.PACKED, 0.02), 3, 1)
    metrics.on_step(StepStats(1, 1, 80, [(32, 32)], ForwardPath.DENSE, 0.01), 1, 0)
    resp = client.get("/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    assert all(name.startswith("vllm_omni:") for name, _ in samples)
    assert samples[("vllm_omni:mixed_resolution_steps_total", ())] == 1
    assert samples[("vllm_omni:steps_total", (("path", "packed"),))] == 1
    assert samples[("vllm_omni:step_num_resolutions_bucket", (("le", "1.0"),))] == 1
    assert samples[("vllm_omni:step_num_resolutions_bucket", (("le", "2.0"),))] == 2
    assert samples[("vllm_omni:step_num_requests_sum", ())] == 4
    assert samples[("vllm_omni:images_generated_total", ())] == 2
    assert samples[("vllm_omni:requests_finished_total", (("status", "completed"),))] == 1
    assert samples[("vllm_omni:batch_invariant_enabled", ())] == 0
    assert ("vllm_omni:num_requests_running", ()) in samples
    assert ("vllm_omni:request_queue_time_seconds_count", ()) in samples
    info = [k for k in samples if k[0] == "vllm_omni:engine_config_info"]
    assert ("model", MODEL) in info[0][1]


def test_two_apps_have_separate_registries():
    app_a, _ = make_app()
    app_b, _ = make_app(batch_invariant=True)
    assert "vllm_omni:batch_invariant_enabled 1.0" in TestClient(app_b).get("/metrics").text
    assert "vllm_omni:batch_invariant_enabled 0.0" in TestClient(app_a).get("/metrics").text


# ---- CLI -------------------------------------------------------------------------------------------------


def test_cli_request_mode_and_step_mode(captured_config, monkeypatch):
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    assert cli_main.main(["serve", "--max-num-seqs", "4"], prog="vllm-omni") == 0
    assert (
        cli_main.main(
            ["serve", "tiny-qwen-image", "--omni", "--step-execution", "--max-num-seqs", "4"], "vllm"
        )
        == 0
    )
    (_, request_mode), (args, step_mode) = captured_config
    assert request_mode.model == "tiny-qwen-image" and not request_mode.step_execution
    assert request_mode.max_num_seqs == 1
    assert step_mode.step_execution and step_mode.max_num_seqs == 4 and not step_mode.batch_invariant
    assert step_mode.enable_mixfusion is None and args.port == 8000


def test_cli_flags_reach_the_config(captured_config, monkeypatch):
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    argv = [
        "serve", "/some/dir", "--step-execution", "--no-enable-mixfusion", "--dtype", "float32",
        "--device", "cpu", "--load-format", "dummy", "--max-generated-image-size", "65536",
        "--default-sampling-params", '{"0": {"num_inference_steps": 9}}', "--max-queue-size", "3",
        "--seed", "7", "--max-num-batched-tokens", "4096", "--scheduling-policy", "skip-ahead",
        "--mixfusion-min-chunk-tokens", "16", "--mixfusion-max-chunks", "64", "--enforce-eager",
        "--diffusion-attention-backend", "SDPA", "--served-model-name", "a", "b", "--api-key", "k",
    ]  # fmt: skip
    assert cli_main.main(argv, prog="vllm-omni") == 0
    args, config = captured_config[0]
    assert config.batch_invariant and config.enable_mixfusion is False
    assert (config.dtype, config.device, config.load_format, config.seed) == ("float32", "cpu", "dummy", 7)
    assert config.default_sampling_params == {"num_inference_steps": 9}
    assert (config.max_queue_size, config.max_num_batched_tokens, config.max_generated_image_size) == (
        3,
        4096,
        65536,
    )
    assert (config.mixfusion_min_chunk_tokens, config.mixfusion_max_chunks) == (16, 64)
    assert (config.scheduling_policy, config.attention_backend) == ("skip-ahead", "SDPA")
    assert args.served_model_names == ["a", "b"] and args.api_key == "k"


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--usp", "0"], "--ulysses-degree (--usp) must be an int >= 1"),
        (["--ring-degree", "0"], "--ring-degree (--ring) must be an int >= 1"),
        (["--cfg-parallel-size", "3"], "--cfg-parallel-size must be 1 or 2"),
        (["--tensor-parallel-size", "0"], "--tensor-parallel-size must be an int >= 1"),
        (["--usp", "2", "--batch-invariant"], "batch-invariant mode runs on one device"),
        (["--cache-backend", "mag_cache"], "supported: ['none', 'cache_dit', 'tea_cache']"),
        (
            ["--cache-backend", "cache_dit", "--cache-config", '{"Fn": 1}'],
            "unknown cache_dit cache config key",
        ),
        (["--diffusion-quantization-config", "no-such-fp8.json"], "'no-such-fp8.json' is not a file"),
        (["--default-sampling-params", '{"steps": 3}'], "num_inference_steps"),
        (["--default-sampling-params", "{bad"], "JSON"),
        (["--default-sampling-params", '{"height": 8}'], "height must be in"),
        (["--max-num-seqs", "0"], "error: --max-num-seqs must be >= 1"),
        (["--seed", str(2**70)], "error: --seed must be in [0, 2**63)"),
        (["--init-timeout", "nan"], "error: --init-timeout must be a finite number"),
    ],
)
def test_cli_refuses_before_model_load(captured_config, capsys, flags, needle):
    assert cli_main.main(["serve", *flags], prog="vllm-omni") == 2
    assert needle in capsys.readouterr().err
    assert not captured_config


def test_vllm_without_omni_needs_real_vllm(monkeypatch, capsys):
    monkeypatch.setattr(cli_main.importlib.util, "find_spec", lambda name: None)
    assert cli_main.main(["serve", "some/model"], prog="vllm") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--omni" in err


def test_vllm_without_omni_is_handed_to_real_vllm(monkeypatch):
    seen = []
    fake = types.ModuleType("vllm.entrypoints.cli.main")
    fake.main = lambda: seen.append(list(sys.argv)) or 0
    monkeypatch.setitem(sys.modules, "vllm.entrypoints.cli.main", fake)
    monkeypatch.setattr(
        cli_main.importlib.util, "find_spec", lambda name: object() if name == "vllm" else None
    )
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    assert cli_main.main(["serve", "meta/llama", "--port", "9"], prog="vllm") == 0
    assert seen == [["vllm", "serve", "meta/llama", "--port", "9"]]


def test_serve_parser_help_lists_every_flag():
    help_text = cli_main.build_parser().format_help() + _serve_help()
    for flag in (
        "--host", "--port", "--api-key", "--served-model-name", "--dtype", "--device", "--step-execution",
        "--max-num-seqs", "--enable-mixfusion", "--no-enable-mixfusion", "--mixfusion-min-chunk-tokens",
        "--mixfusion-max-chunks", "--diffusion-attention-backend", "--load-format",
        "--max-generated-image-size", "--default-sampling-params", "--max-queue-size", "--enforce-eager",
        "--seed", "--max-num-batched-tokens", "--scheduling-policy", "--batch-invariant", "--log-level",
        "--usp", "--ulysses-degree", "--ring", "--ring-degree", "--cfg-parallel-size",
        "--tensor-parallel-size", "--cache-backend", "--diffusion-quantization-config",
    ):  # fmt: skip
        assert flag in help_text, flag


def _serve_help() -> str:
    import argparse

    parser = argparse.ArgumentParser(prog="serve")
    add_serve_arguments(parser)
    return parser.format_help()


def test_default_connection_cap_counts_the_requests_the_engine_runs():
    """Every queued and running request holds a connection: request mode runs one at a time."""
    import argparse

    parser = argparse.ArgumentParser(prog="serve")
    add_serve_arguments(parser)
    caps = {}
    for extra in (
        [],
        ["--step-execution"],
        ["--step-execution", "--max-num-seqs", "4"],
        ["--max-num-seqs", "4"],
    ):
        args = parser.parse_args(["m", "--max-queue-size", "100", *extra])
        caps[" ".join(extra)] = cli_serve.http_limits_from_args(args).limit_concurrency
        assert cli_serve.engine_config_from_args(args).max_num_seqs == caps[" ".join(extra)] - 164
    assert caps == {
        "": 165,
        "--step-execution": 172,
        "--step-execution --max-num-seqs 4": 168,
        "--max-num-seqs 4": 165,
    }


def test_priority_reaches_the_engine_from_images_and_chat(server):
    """vLLM's `priority` extension: top level, in extra_body, and on the chat route."""
    client, engine = server
    assert post(client, {"prompt": "p", "size": "32x32", "priority": -3}).status_code == 200
    assert post(client, {"prompt": "p", "size": "32x32", "extra_body": {"priority": 7}}).status_code == 200
    chat = {"messages": [{"role": "user", "content": "p"}], "size": "32x32", "priority": 2}
    assert client.post("/v1/chat/completions", json=chat, headers=AUTH).status_code == 200
    assert [r.sampling_params.priority for r in engine.generated] == [-3, 7, 2]
    assert_error_shape(post(client, {"prompt": "p", "priority": "high"}), 400)

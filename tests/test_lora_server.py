"""LoRA over HTTP with the real engine on the tiny model: the `lora` field and its spellings,
`/v1/models` cards, OpenAI-shaped 4xx errors, runtime load / unload confined to --lora-runtime-dir,
and the serve flags."""

from __future__ import annotations

import base64
import io
import re
import shlex
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image
from utils import assert_error_shape

from vllm_omni.config import OmniDiffusionConfig
from vllm_omni.diffusion.engine import DiffusionEngine
from vllm_omni.entrypoints.cli.main import build_parser
from vllm_omni.entrypoints.cli.serve import engine_config_from_args
from vllm_omni.entrypoints.openai.api_server import ServerArgs, build_app
from vllm_omni.lora import LoRAConfig, LoRAModulePath, LoRARequest
from vllm_omni.lora.random_adapter import block_targets, random_lora_state_dict, save_lora_dir

MODEL = "tiny"


@pytest.fixture(scope="module")
def dirs(tiny_model_dir, tmp_path_factory):
    from vllm_omni.diffusion.models.qwen_image.loader import load_qwen_image

    transformer = load_qwen_image(str(tiny_model_dir), device="cpu", dtype=None).transformer
    root = tmp_path_factory.mktemp("lora_server")
    targets = block_targets(transformer.plans, transformer.config.num_layers)
    for name, seed in (("ink", 1), ("runtime/neon", 2), ("outside", 3)):
        save_lora_dir(root / name, random_lora_state_dict(transformer, targets, 2, seed, std=0.3))
    return root


@pytest.fixture(scope="module")
def client(tiny_model_dir, dirs):
    ink, ink_b = (
        LoRAModulePath("ink", str(dirs / "ink")),
        LoRAModulePath("ink-b", str(dirs / "ink"), "other-base"),
    )
    lora = LoRAConfig(lora_modules=(ink, ink_b), runtime_dir=str(dirs / "runtime"))
    config = OmniDiffusionConfig(model=str(tiny_model_dir), dtype="float32", device="cpu", lora=lora)
    engine = DiffusionEngine(config)
    app = build_app(engine, ServerArgs(model=str(tiny_model_dir), served_model_names=[MODEL]))
    with TestClient(app) as c:
        yield c
    engine.shutdown()


def _image(client, **fields) -> np.ndarray:
    body = {"prompt": "a red fox", "size": "32x32", "seed": 5, "num_inference_steps": 2, **fields}
    resp = client.post("/v1/images/generations", json=body)
    assert resp.status_code == 200, resp.text
    return np.asarray(
        Image.open(io.BytesIO(base64.b64decode(resp.json()["data"][0]["b64_json"]))), dtype=np.int16
    )


def test_lora_field_spellings_and_places_give_one_image(client):
    base = _image(client)
    ink = _image(client, lora={"name": "ink", "scale": 1.0})
    assert np.abs(ink - base).max() > 2, "the adapter changes the image"
    assert np.array_equal(_image(client, extra_body={"lora": {"lora_name": "ink"}}), ink)
    assert np.array_equal(_image(client, extra_args={"lora": {"adapter": "ink", "lora_scale": 1}}), ink)
    assert not np.array_equal(_image(client, lora={"name": "ink", "scale": 0.3}), ink)


def test_models_lists_adapters_as_vllm_does(client, dirs):
    cards = {c["id"]: c for c in client.get("/v1/models").json()["data"]}
    assert cards["ink"]["parent"] == MODEL and cards["ink"]["root"] == str(dirs / "ink")
    assert cards[MODEL]["parent"] is None
    assert cards["ink-b"]["parent"] == "other-base"  # --lora-modules JSON base_model_name


@pytest.mark.parametrize(
    "lora, status, param",
    [
        ({"name": "nope"}, 404, "lora"),
        ({"scale": 1.0}, 400, "lora"),
        ({"name": "ink", "weight": 1}, 400, "lora.weight"),
        ({"name": "ink", "scale": "big"}, 400, "lora.scale"),
        ({"name": "ink", "scale": 1e9}, 400, "lora_scale"),
        ({"name": "x", "path": "../ink"}, 400, "lora"),
        ({"name": "x", "path": "/etc"}, 400, "lora"),
        ("ink", 400, "lora"),
        # found by fuzzing: the first two were accepted and ignored, the others accepted as names
        ({}, 400, "lora"),
        ({"name": "ink", "path": ""}, 400, "lora"),
        ({"name": "ink\nINFO forged log line"}, 400, "lora"),
        ({"name": "ink\u202e"}, 400, "lora"),
        ({"name": "n" * 300}, 400, "lora"),
    ],
)
def test_bad_lora_fields_are_openai_errors(client, lora, status, param):
    body = {"prompt": "a fox", "size": "32x32", "num_inference_steps": 1, "lora": lora}
    error = assert_error_shape(client.post("/v1/images/generations", json=body), status)
    assert error["param"] == param, error


def test_runtime_load_and_unload_stay_inside_the_directory(client, dirs):
    load = lambda body: client.post("/v1/load_lora_adapter", json=body)  # noqa: E731
    unload = lambda body: client.post("/v1/unload_lora_adapter", json=body)  # noqa: E731
    assert (
        assert_error_shape(load({"lora_name": "o", "lora_path": str(dirs / "outside")}), 400)["param"]
        == "lora_path"
    )
    assert (
        assert_error_shape(load({"lora_name": "o", "lora_path": "../outside"}), 400)["param"] == "lora_path"
    )
    assert assert_error_shape(load({"lora_name": "o"}), 400)["param"] == "lora_path"
    resp = load({"lora_name": "neon", "lora_path": "neon"})
    assert resp.status_code == 200, resp.text
    assert assert_error_shape(load({"lora_name": "neon", "lora_path": "neon"}), 400)["param"] == "lora_name"
    assert "neon" in {c["id"] for c in client.get("/v1/models").json()["data"]}
    _image(client, lora={"name": "neon"})
    engine = client.app.state.engine
    lora_id = engine.lora.acquire(LoRARequest("neon"))  # as an admitted request holds it
    assert assert_error_shape(unload({"lora_name": "neon"}), 409)["code"] == "lora_in_use"
    engine.lora.release(lora_id)
    assert unload({"lora_name": "neon"}).status_code == 200
    assert assert_error_shape(unload({"lora_name": "neon"}), 404)["code"] == "lora_not_found"
    # a request may name a path inside the directory: loaded on first use
    _image(client, lora={"name": "neon2", "path": "neon"})
    assert "neon2" in {c["id"] for c in client.get("/v1/models").json()["data"]}


def test_runtime_endpoints_are_off_without_the_flag(tiny_model_dir, dirs):
    lora = LoRAConfig(lora_modules=(LoRAModulePath("ink", str(dirs / "ink")),))
    config = OmniDiffusionConfig(model=str(tiny_model_dir), dtype="float32", device="cpu", lora=lora)
    app = build_app(DiffusionEngine(config, autostart=False), ServerArgs(model="m"))
    with TestClient(app) as c:
        resp = c.post("/v1/load_lora_adapter", json={"lora_name": "n", "lora_path": str(dirs / "ink")})
        assert assert_error_shape(resp, 400)["code"] == "runtime_lora_disabled"
        body = {"prompt": "a fox", "lora": {"name": "n", "path": str(dirs / "ink")}}
        assert "disabled" in assert_error_shape(c.post("/v1/images/generations", json=body), 400)["message"]


def test_serve_flags(dirs):
    parser = build_parser()
    as_json = f'{{"name": "b", "path": "{dirs / "ink"}"}}'
    args = parser.parse_args(
        ["serve", "tiny-qwen-image", "--lora-modules", f"a={dirs / 'ink'}", as_json,
         "--max-loras", "3", "--max-lora-rank", "16", "--lora-runtime-dir", str(dirs / "runtime")]
    )  # fmt: skip
    lora = engine_config_from_args(args).lora
    assert (
        [m.name for m in lora.lora_modules] == ["a", "b"] and lora.max_loras == 3 and lora.max_lora_rank == 16
    )
    assert lora.runtime_dir == str(dirs / "runtime")
    bad = parser.parse_args(["serve", "tiny-qwen-image", "--lora-modules", "a", "--max-loras", "1"])
    with pytest.raises(ValueError, match="NAME=PATH"):
        engine_config_from_args(bad)


def test_chat_completions_take_the_lora_field(client):
    ink = _image(client, lora={"name": "ink"})
    body = {
        "messages": [{"role": "user", "content": "a red fox"}],
        "extra_body": {"lora": {"name": "ink"}, "size": "32x32", "seed": 5, "num_inference_steps": 2},
    }
    resp = client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    url = resp.json()["choices"][0]["message"]["content"][0]["image_url"]["url"]
    chat = np.asarray(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))), dtype=np.int16)
    assert np.array_equal(chat, ink)
    resp = client.post("/v1/chat/completions", json={**body, "extra_body": {"lora": {"name": "nope"}}})
    assert assert_error_shape(resp, 404)["code"] == "lora_not_found"


def _sdk_image(client, **kwargs) -> np.ndarray:
    import openai

    sdk = openai.OpenAI(api_key="none", base_url="http://testserver/v1", http_client=client)
    extra = {"seed": 5, "num_inference_steps": 2, **kwargs.pop("extra_body", {})}
    result = sdk.images.generate(prompt="a red fox", size="32x32", extra_body=extra, **kwargs)
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json))), dtype=np.int16)


def test_an_adapter_listed_by_models_is_a_model(client):
    """As vLLM: `model` may name a loaded adapter; that runs the base model with it at its default scale."""
    assert "ink" in {m["id"] for m in client.get("/v1/models").json()["data"]}
    by_model = _sdk_image(client, model="ink")
    assert np.array_equal(by_model, _sdk_image(client, model=MODEL, extra_body={"lora": {"name": "ink"}}))
    assert not np.array_equal(by_model, _sdk_image(client, model=MODEL))
    scaled = _sdk_image(client, model="ink", extra_body={"lora": {"scale": 0.3}})
    assert np.array_equal(scaled, _image(client, lora={"name": "ink", "scale": 0.3}))
    assert np.array_equal(_sdk_image(client, model="ink", extra_body={"lora_name": "ink"}), by_model)


def test_an_adapter_as_model_in_chat(client):
    ink = _image(client, lora={"name": "ink"})
    body = {
        "model": "ink",
        "messages": [{"role": "user", "content": "a red fox"}],
        "extra_body": {"size": "32x32", "seed": 5, "num_inference_steps": 2},
    }
    resp = client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    url = resp.json()["choices"][0]["message"]["content"][0]["image_url"]["url"]
    chat = np.asarray(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))), dtype=np.int16)
    assert np.array_equal(chat, ink)


@pytest.mark.parametrize(
    ("fields", "status", "needles"),
    [
        ({"model": "ink", "lora": {"name": "ink-b"}}, 400, ("'ink'", "'ink-b'")),
        ({"model": "ink", "lora_name": "ink-b"}, 400, ("'ink'", "'ink-b'")),
        ({"model": "nope"}, 404, ("'nope'", "ink-b")),
        ({"lora": {"name": "ink", "adapter": "ink-b"}}, 400, ("lora.name", "lora.adapter")),
        ({"lora": {"name": "ink", "lora_name": "ink"}}, 400, ("lora.name", "lora.lora_name")),
        ({"lora": {"name": "ink", "scale": 1.0, "lora_scale": 0.5}}, 400, ("lora.scale", "lora.lora_scale")),
        ({"lora": {"name": "ink", "int_id": 1, "lora_int_id": 2}}, 400, ("lora.int_id", "lora.lora_int_id")),
        ({"lora": {"name": "x", "path": "a", "local_path": "b"}}, 400, ("lora.path", "lora.local_path")),
        ({"lora_name": "x", "lora_path": "a", "local_path": "b"}, 400, ("lora_path", "local_path")),
    ],
)
def test_an_adapter_named_twice_is_refused_naming_both(client, fields, status, needles):
    body = {"prompt": "a fox", "size": "32x32", "num_inference_steps": 1, **fields}
    error = assert_error_shape(client.post("/v1/images/generations", json=body), status)
    for needle in needles:
        assert needle in error["message"], error


def _doc_curl_commands(doc: Path) -> list[list[str]]:
    """The `curl` commands of the doc's bash blocks, continuation lines joined, as argv lists."""
    blocks = re.findall(r"```bash\n(.*?)```", doc.read_text(), re.S)
    lines = "\n".join(blocks).replace("\\\n", " ").splitlines()
    return [shlex.split(line) for line in lines if line.startswith("curl ")]


def _curl_as_request(client, argv: list[str]):
    """Send what `curl URL [-H 'K: V'] [-d BODY]` sends (POST with -d, form content type unless -H)."""
    url, headers, data = None, {}, None
    args = iter(argv[1:])
    for arg in args:
        if arg == "-H":
            key, value = next(args).split(":", 1)
            headers[key.strip()] = value.strip()
        elif arg == "-d":
            data = next(args)
        elif arg == "-X":
            next(args)
        else:
            url = arg
    path = "/" + url.split("/", 1)[1]
    if data is None:
        return client.get(path, headers=headers)
    headers.setdefault("Content-Type", "application/x-www-form-urlencoded")  # curl's -d default
    return client.post(path, content=data, headers=headers)


def test_lora_docs_curl_commands_work_as_written(client):
    commands = _doc_curl_commands(Path(__file__).resolve().parents[1] / "docs" / "lora.md")
    assert len(commands) >= 3 and any("load_lora_adapter" in " ".join(c) for c in commands)
    for argv in commands:
        resp = _curl_as_request(client, argv)
        assert resp.status_code == 200, (argv, resp.text)
    without_type = [a for a in commands[0] if a not in ("-H", "Content-Type: application/json")]
    assert _curl_as_request(client, without_type).status_code == 415  # why the doc sends the header


def test_random_lora_command_writes_an_adapter_the_server_loads(client, dirs, capsys):
    from vllm_omni.entrypoints.cli.main import main

    out = dirs / "runtime" / "rand"
    assert main(["random-lora", "--out", str(out), "--rank", "2"], prog="vllm-omni") == 0
    assert f"--lora-modules rand={out}" in capsys.readouterr().out
    resp = client.post("/v1/load_lora_adapter", json={"lora_name": "rand", "lora_path": "rand"})
    assert resp.status_code == 200, resp.text
    assert not np.array_equal(_image(client, model="rand"), _image(client))
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "rand"}).status_code == 200


def test_an_adapter_as_model_in_edits_reaches_the_engine_as_the_lora_field_does():
    """The edits route shares the images path: `model=<adapter>` becomes the same engine request as
    `lora_name=<adapter>` (stub engine with one loaded adapter; the real LoRA math is tested above)."""
    from utils import AUTH, make_client, png_bytes

    class OneAdapter:
        def list_adapters(self):
            return [type("Entry", (), {"name": "ink"})()]

    client, engine = make_client()
    engine.lora = OneAdapter()
    files = {"image": ("in.png", png_bytes(), "image/png")}
    with client:
        for data in ({"model": "ink"}, {"lora_name": "ink"}, {"model": "ink", "lora_name": "ink"}):
            resp = client.post("/v1/images/edits", files=files, data={"prompt": "p", **data}, headers=AUTH)
            assert resp.status_code == 200, resp.text
        resp = client.post(
            "/v1/images/edits",
            files=files,
            data={"prompt": "p", "model": "ink", "lora_name": "x"},
            headers=AUTH,
        )
        assert assert_error_shape(resp, 400)["param"] == "model"
    adapters = [r.sampling_params.lora_request for r in engine.generated]
    assert len(adapters) == 3 and adapters[0] == adapters[1] == adapters[2] and adapters[0].lora_name == "ink"

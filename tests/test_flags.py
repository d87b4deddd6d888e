"""vLLM-Omni's and vLLM's `serve` flags (issue 26, item 2): each does what `upstream_flags.py` says
(honoured, one warning, or refused naming what works), unknown flags still fail, and docs/serving.md
names every one (its no-effect table is the one `compat_flags.markdown_table()` writes)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from utils import capture_server_start, serve_cli

from vllm_omni.entrypoints.cli.compat_flags import NO_EFFECT_FLAGS, markdown_table
from vllm_omni.entrypoints.cli.upstream_flags import UPSTREAM_FLAGS

DOCS = Path(__file__).resolve().parents[1] / "docs" / "serving.md"


@pytest.fixture()
def captured(monkeypatch):
    return capture_server_start(monkeypatch, config_first=True)


@pytest.mark.parametrize("spec", UPSTREAM_FLAGS, ids=lambda s: " ".join(s.argv)[:60])
def test_upstream_flag_does_what_its_entry_says(spec, captured, capsys, tmp_path):
    for name in ("key.pem", "cert.pem", "ca.pem"):
        (tmp_path / name).write_text("x")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in spec.argv]
    code = serve_cli(["--omni", *argv] if spec.flag != "--omni" else argv)
    err = capsys.readouterr().err
    warned = [line for line in err.splitlines() if "has no effect here" in line]
    if spec.kind == "refused":
        assert code == 2 and not captured, err
        assert "error:" in err and spec.flag.lstrip("-").split("-")[0] in err, err
        return
    assert code == 0 and len(captured) == 1, err
    if spec.kind == "no_effect":
        assert len(warned) == 1 and "no effect here" in warned[0], err
    else:
        assert not warned, err


def test_every_upstream_flag_is_named_in_the_docs():
    docs = DOCS.read_text()
    missing = sorted({s.flag for s in UPSTREAM_FLAGS if f"`{s.flag}" not in docs})
    assert not missing, f"docs/serving.md does not name {missing}"


def test_docs_no_effect_table_is_the_generated_one():
    assert markdown_table() in DOCS.read_text(), (
        "regenerate it: python -m vllm_omni.entrypoints.cli.compat_flags"
    )


def test_every_no_effect_flag_is_an_upstream_flag():
    upstream = {s.flag for s in UPSTREAM_FLAGS}
    assert not [spec.flag for spec in NO_EFFECT_FLAGS if spec.flag not in upstream]


def test_unknown_flags_still_fail(captured, capsys):
    assert serve_cli(["--omni", "--no-such-flag"]) == 2
    assert serve_cli(["--omni", "--no-stage-overrides"]) == 2  # no --no- form where upstream has none
    assert not captured


def test_honoured_flags_reach_the_configs(captured, tmp_path):
    (tmp_path / "k").write_text("x")
    (tmp_path / "c").write_text("x")
    argv = ["--omni", "--dtype", "half", "--scheduling-policy", "fcfs", "--root-path", "/omni"]
    argv += ["--ssl-keyfile", str(tmp_path / "k"), "--ssl-certfile", str(tmp_path / "c"), "-dac"]
    argv += ['{"default": {"backend": "sdpa"}}', "--diffusion-attention-backend", "SDPA"]  # same backend
    assert serve_cli(argv) == 0
    config, server_args = captured[0]
    assert (config.dtype, config.scheduling_policy, config.attention_backend) == ("float16", "fifo", "SDPA")
    assert server_args.root_path == "/omni"
    assert (server_args.tls.keyfile, server_args.tls.certfile) == (str(tmp_path / "k"), str(tmp_path / "c"))
    assert serve_cli(["--omni", "--dtype", "float"]) == 0 and captured[1][0].dtype == "float32"


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--ssl-keyfile", "/nonexistent.pem", "--ssl-certfile", "/nonexistent.pem"], "--ssl-keyfile"),
        (["--ssl-certfile", "/nonexistent.pem"], "--ssl-keyfile is required"),
        (["-dac", "{not json"], "--diffusion-attention-config must be JSON"),
        (
            ["-dac", '{"default": {"backend": "FLASH_ATTN"}}', "--diffusion-attention-backend", "SDPA"],
            "disagree",
        ),
        (["--cp", "4"], "--ring N"),
        (["--api-server-count", "2"], "one API server process"),
    ],
)
def test_refusals_name_the_flag_and_what_works(captured, capsys, argv, needle):
    assert serve_cli(["--omni", *argv]) == 2
    assert needle in capsys.readouterr().err and not captured


def test_log_file_gets_the_log(captured, tmp_path):
    path = tmp_path / "server.log"
    try:
        assert serve_cli(["--omni", "--log-file", str(path), "--stage-init-timeout", "5"]) == 0
        logging.getLogger("vllm_omni.test").warning("into the file")
    finally:
        for handler in logging.getLogger().handlers[:]:
            if isinstance(handler, logging.FileHandler):
                handler.close()
                logging.getLogger().removeHandler(handler)
    text = path.read_text()
    assert "--stage-init-timeout has no effect here" in text and "into the file" in text


def test_root_path_is_served_and_named_in_the_openapi_docs():
    from fastapi.testclient import TestClient
    from utils import StubEngine

    from vllm_omni.config import OmniDiffusionConfig
    from vllm_omni.entrypoints.openai.api_server import ServerArgs, build_app
    from vllm_omni.entrypoints.openai.http_limits import HTTPLimits, uvicorn_config

    server_args = ServerArgs(model="m", api_key=None, root_path="/omni")
    app = build_app(StubEngine(OmniDiffusionConfig()), server_args)
    assert uvicorn_config(app, HTTPLimits(), "info", None, server_args.root_path).root_path == "/omni"
    with TestClient(app, root_path="/omni") as client:  # the scope uvicorn gives the app
        assert client.get("/health").json() == {"status": "healthy"}  # a proxy that strips the prefix
        assert client.get("/omni/health").json() == {"status": "healthy"}  # one that does not
        assert client.get("/openapi.json").json()["servers"] == [{"url": "/omni"}]


@pytest.mark.slow
def test_tls_serves_https(tmp_path, tiny_model_dir):
    """`--ssl-keyfile` / `--ssl-certfile` make uvicorn serve HTTPS (a self-signed certificate)."""
    from server_process import ServerProcess

    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert)]
        + ["-days", "1", "-subj", "/CN=127.0.0.1"],
        check=True,
        capture_output=True,
    )

    def command(port: int) -> list[str]:
        cmd = [sys.executable, "-m", "vllm_omni.entrypoints.cli.main", "serve", "tiny-qwen-image", "--omni"]
        return cmd + ["--host", "127.0.0.1", "--port", str(port), "--device", "cpu"] + tls

    tls = ["--ssl-keyfile", str(key), "--ssl-certfile", str(cert)]
    server = ServerProcess(command, tmp_path / "server.log", env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        https = f"https://127.0.0.1:{server.port}"
        deadline = time.monotonic() + server.ready_timeout_s
        while True:
            assert server.proc.poll() is None, server.log()[-4000:]
            try:
                resp = httpx.get(f"{https}/health", verify=False, timeout=2)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, server.log()[-4000:]
                time.sleep(0.3)
        assert resp.status_code == 200 and resp.json() == {"status": "healthy"}
        with pytest.raises(httpx.HTTPError):  # plain HTTP is not served on the TLS port
            httpx.get(f"http://127.0.0.1:{server.port}/health", timeout=5).raise_for_status()
        assert "https://127.0.0.1" in server.log()
    finally:
        assert server.stop() == 0

"""One request followed through the log (issue 48, item 5): the server's id (the response's `id`) and
the engine's own id (`req-<session>-<n>`, which the engine's lines name) meet on the server's finish
line, as docs/serving.md says."""

from __future__ import annotations

import logging
import re

from fastapi.testclient import TestClient

from vllm_omni.config import OmniDiffusionConfig
from vllm_omni.diffusion.engine import DiffusionEngine
from vllm_omni.entrypoints.openai.api_server import ServerArgs, build_app


def test_the_finish_line_names_the_server_id_and_the_engine_id(tiny_model_dir, caplog):
    engine = DiffusionEngine(OmniDiffusionConfig(model=str(tiny_model_dir), dtype="float32", device="cpu"))
    app = build_app(engine, ServerArgs(model=str(tiny_model_dir)))
    body = {"prompt": "a fox", "size": "40x40", "num_inference_steps": 2}  # 40: the engine rounds to 32
    try:
        with caplog.at_level(logging.INFO), TestClient(app) as client:
            resp = client.post("/v1/images/generations", json=body, headers={"X-Request-Id": "mine-1"})
    finally:
        engine.shutdown()
    assert resp.status_code == 200, resp.text
    server_id = resp.json()["id"]
    lines = [r.getMessage() for r in caplog.records]
    rounded = [m for m in lines if re.match(r"request req-\S+: size \S+ rounded down", m)]
    assert len(rounded) == 1, lines  # a line of the engine's, under its own id
    engine_id = rounded[0].split()[1].rstrip(":")
    assert engine_id != server_id
    assert any(server_id in m and "mine-1" in m for m in lines)  # the server's request line
    finish = [
        m for m in lines if m.startswith(f"request {server_id} finished as engine request {engine_id}:")
    ]
    assert len(finish) == 1, lines


def test_the_finish_line_of_a_request_without_engine_times_never_fails_it(caplog, monkeypatch):
    """An engine that reports no queue / engine time: the finish line says `n/a`; with INFO on, the
    line must not turn a served image into a 500 (pytest's capture handler re-raises a formatting
    error, as a strict log handler would)."""
    from utils import MODEL, make_app, post

    from vllm_omni.entrypoints.openai import serving_images

    monkeypatch.setattr(
        serving_images, "read_engine_timings", lambda output: serving_images.EngineTimings(None, None)
    )
    app, _ = make_app()
    with caplog.at_level(logging.INFO, logger="vllm_omni"), TestClient(app) as client:
        resp = post(client, {"model": MODEL, "prompt": "a fox", "size": "64x64"})
    assert resp.status_code == 200, resp.text
    finish = [m for m in caplog.messages if "finished as engine request" in m]
    assert len(finish) == 1 and "engine n/a" in finish[0], caplog.messages

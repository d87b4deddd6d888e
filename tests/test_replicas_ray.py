"""`vllm serve --data-parallel-size 2 --data-parallel-backend ray` on the tiny model (CPU): one server
process, which starts its own local Ray, for the whole module.

Each image is compared with diffusers' `QwenImagePipeline` for the same seed, alone and concurrent;
both replicas serve (the router's per-replica counters on /metrics); a replica's process killed
mid-request answers that request with a JSON 503 while the other serves, /health says degraded until
Ray has restarted it; SIGTERM answers the request in flight and leaves no process of the server's
Ray behind.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import sys
import time

import httpx
import pytest

pytest.importorskip("ray.serve")
psutil = pytest.importorskip("psutil")

from tests.server_process import ServerProcess  # noqa: E402
from tests.test_server_engine import decode, diffusers_image, max_diff  # noqa: E402

pytestmark = pytest.mark.slow

GEN = "/v1/images/generations"


def body(seed: int, size: str = "64x64", steps: int = 3, **extra) -> dict:
    return {
        "prompt": f"a red cat number {seed}",
        "size": size,
        "num_inference_steps": steps,
        "seed": seed,
    } | extra


@pytest.fixture(scope="module")
def diffusers_pipe(tiny_model_dir):
    import torch
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    def command(port: int) -> list[str]:
        cmd = [sys.executable, "-m", "vllm_omni.entrypoints.cli.main", "serve", str(tiny_model_dir), "--omni"]
        cmd += ["--host", "127.0.0.1", "--port", str(port), "--device", "cpu", "--dtype", "float32"]
        return cmd + ["--step-execution", "--data-parallel-size", "2", "--data-parallel-backend", "ray"]

    log = tmp_path_factory.mktemp("replicas") / "server.log"
    # RAY_ADDRESS unset: the server starts (and must stop) a Ray of its own
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"PYTHONUNBUFFERED": "1"}
    proc = ServerProcess(command, log, env=env)
    proc.wait_ready(timeout_s=240)
    yield proc
    proc.stop(signal.SIGTERM, timeout_s=90)


def post(server, payload: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(server.base_url + GEN, json=payload, timeout=timeout)


def metric(text: str, name: str) -> dict[str, float]:
    """{engine label: value} of one `vllm_omni:` series."""
    pattern = rf'^vllm_omni:{name}\{{engine="(\d+)"[^}}]*\}} ([0-9.e+-]+)$'
    return {m[1]: float(m[2]) for m in re.finditer(pattern, text, re.MULTILINE)}


def replica_pids(server) -> dict[str, int]:
    text = httpx.get(server.base_url + "/metrics").text
    return {m[1]: int(m[2]) for m in re.finditer(r'replica_info\{engine="(\d+)",pid="(\d+)"\}', text)}


def test_images_equal_diffusers_alone_and_concurrent_on_both_replicas(server, diffusers_pipe):
    alone = post(server, body(1))
    assert alone.status_code == 200, alone.text
    assert (
        max_diff(decode(alone.json()["data"][0]["b64_json"]), diffusers_image(diffusers_pipe, body(1))) <= 1
    )

    mixed = [
        body(1),
        body(2, "96x64"),
        body(3, steps=5),
        body(4, "64x96", true_cfg_scale=4.0, negative_prompt="x"),
    ]
    with concurrent.futures.ThreadPoolExecutor(len(mixed)) as pool:
        answers = list(pool.map(lambda b: post(server, b), mixed))
    for payload, resp in zip(mixed, answers, strict=True):
        assert resp.status_code == 200, resp.text
        got = decode(resp.json()["data"][0]["b64_json"])
        assert max_diff(got, diffusers_image(diffusers_pipe, payload)) <= 1, payload
    assert answers[0].json()["data"][0]["b64_json"] == alone.json()["data"][0]["b64_json"]

    text = httpx.get(server.base_url + "/metrics").text
    decisions = metric(text, "router_decisions_total")
    assert set(decisions) == {"0", "1"} and min(decisions.values()) >= 1, decisions
    assert sum(decisions.values()) == 1 + len(mixed)
    assert set(metric(text, "replica_remaining_work_seconds")) == {"0", "1"}
    assert set(metric(text, "replica_num_requests_waiting")) == {"0", "1"}


def test_killed_replica_answers_its_request_503_others_serve_and_it_comes_back(server):
    pids = replica_pids(server)
    assert len(pids) == 2, pids
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        long = pool.submit(post, server, body(7, steps=400))
        deadline = time.monotonic() + 60
        busy = {}
        while not busy and time.monotonic() < deadline:  # which replica runs it (its report, 0.5 s period)
            running = metric(httpx.get(server.base_url + "/metrics").text, "replica_num_requests_running")
            busy = {engine for engine, n in running.items() if n >= 1}
            time.sleep(0.1)
        assert busy, "the long request never showed as running"
        (engine,) = busy
        os.kill(pids[engine], signal.SIGKILL)
        answer = long.result(timeout=60)
    assert answer.status_code == 503, answer.text
    assert answer.json()["error"]["code"] == "request_aborted"

    health = httpx.get(server.base_url + "/health", timeout=10)
    deadline = time.monotonic() + 30
    while health.json().get("status") != "degraded" and time.monotonic() < deadline:
        time.sleep(0.1)
        health = httpx.get(server.base_url + "/health", timeout=10)
    assert health.status_code == 200 and health.json() == {"status": "degraded"}
    assert post(server, body(8)).status_code == 200  # the other replica serves meanwhile

    deadline = time.monotonic() + 180  # Ray restarts it (a fresh process loads the model)
    while httpx.get(server.base_url + "/health", timeout=10).json().get("status") != "healthy":
        assert time.monotonic() < deadline, "the killed replica did not come back"
        time.sleep(0.5)
    deadline = time.monotonic() + 30
    while len(new := replica_pids(server)) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(new) == 2 and pids[engine] not in new.values(), (pids, new)


def test_sigterm_answers_the_request_in_flight_and_leaves_no_ray_process(server):
    ray_procs = [
        p
        for p in psutil.Process(server.proc.pid).children(recursive=True)
        if p.status() != psutil.STATUS_ZOMBIE
    ]
    names = " ".join(p.name() for p in ray_procs)
    assert "raylet" in names and "gcs_server" in names, names
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        in_flight = pool.submit(post, server, body(9, steps=40))
        time.sleep(1.0)
        server.proc.send_signal(signal.SIGTERM)
        answer = in_flight.result(timeout=60)
    assert answer.status_code == 200, answer.text
    assert server.proc.wait(timeout=90) == 0, server.log()[-3000:]
    _, alive = psutil.wait_procs(ray_procs, timeout=30)
    alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, [(p.pid, p.name()) for p in alive]

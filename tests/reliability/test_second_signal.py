"""A second SIGINT / SIGTERM during the shutdown drain (issue 26): the drain ends at once, every
waiting client still gets a JSON answer (OpenAI's error shape), and the log has no traceback.

uvicorn's own second Ctrl-C force-quits: it cancelled the handlers, so clients got its text/plain
"Internal Server Error" and the log a traceback per request.
"""

from __future__ import annotations

import concurrent.futures
import signal
import time

import httpx
import pytest
from reliability_server import TINY_BATCHING_FLAGS, start_server

pytestmark = pytest.mark.slow

DRAIN_S = 120
"""Far longer than the test waits: only the second signal can end the drain in time."""
LONG = {"prompt": "long", "size": "256x256", "n": 4, "num_inference_steps": 1000}


def _generate(base_url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{base_url}/v1/images/generations", json=body, timeout=300)


def _wait_for(base_url: str, num_reqs: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = httpx.get(f"{base_url}/v1/debug/steps", timeout=10).json()
        if state["num_running"] + state["num_waiting"] >= num_reqs:
            return
        time.sleep(0.05)
    pytest.fail(f"the engine never held {num_reqs} requests")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_second_signal_aborts_the_drain_and_answers_everyone_in_json(tmp_path, tiny_model_dir, sig):
    flags = ["--step-execution", "--max-num-seqs", "2", *TINY_BATCHING_FLAGS]
    server = start_server([*flags, "--shutdown-drain-timeout", str(DRAIN_S)], tmp_path / "server.log")
    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(_generate, server.base_url, {**LONG, "seed": i}) for i in range(4)]
            _wait_for(server.base_url, 4)  # two running, two waiting
            server.proc.send_signal(sig)
            time.sleep(1.0)  # inside the drain
            second = time.monotonic()
            server.proc.send_signal(sig)
            responses = [f.result() for f in futures]
        returncode = server.proc.wait(timeout=60)
        exit_s = time.monotonic() - second
    finally:
        server.stop()
    log = server.log()
    assert exit_s < 30, f"the second signal did not end the {DRAIN_S} s drain ({exit_s:.0f} s)"
    for response in responses:
        assert response.headers["content-type"].startswith("application/json"), response.text[:300]
        assert response.status_code == 503, response.text[:300]
        error = response.json()["error"]
        assert (error["type"], error["code"]) == ("server_error", "request_aborted"), error
        assert "second stop signal" in error["message"], error
    assert returncode == 0, log[-3000:]
    assert "Traceback" not in log and "Internal Server Error" not in log, log[-6000:]
    assert "a second stop signal ended the drain; aborting 4 in-flight request(s)" in log, log[-3000:]

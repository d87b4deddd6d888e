"""End to end: `vllm serve <tiny checkpoint> --omni` as a real subprocess, on the real engine.

Images that come back over HTTP (OpenAI client and raw httpx, concurrent, mixed
sizes and CFG) must equal what the offline API (`Omni.generate`) gives for the
same inputs, within 1/255 after PNG decoding. /metrics must show steps that
mixed resolutions; a client that disconnects must free its slot at once; 100
concurrent small requests must all come back, each with its own image.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import hashlib
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
import server_process
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow

SERVED_NAME = "tiny-e2e"
# vLLM-Omni's own e2e start-up flags: accepted (the timeouts and --log-stats are honoured or logged as
# having no effect). The batching flags are the defaults: mixed sizes and CFG on/off share steps.
VLLM_OMNI_E2E_FLAGS = ["--stage-init-timeout", "600", "--init-timeout", "900", "--log-stats"]


@dataclass
class Case:
    prompt: str
    width: int
    height: int
    seed: int
    steps: int
    negative_prompt: str | None = None
    true_cfg_scale: float | None = None
    n: int = 1


def _server_command() -> list[str]:
    """`vllm serve` from this interpreter's environment when installed, else the module."""
    script = Path(sys.executable).parent / "vllm"
    if script.exists():
        return [str(script), "serve"]
    found = shutil.which("vllm")
    if found and Path(found).resolve().parent == Path(sys.executable).resolve().parent:
        return [found, "serve"]
    return [sys.executable, "-m", "vllm_omni.entrypoints.cli.main", "serve"]


class ServerProcess(server_process.ServerProcess):
    """A `vllm serve ... --omni` subprocess on a free port, logging to a file."""

    def __init__(self, model: str, flags: list[str], log_path: Path):
        def command(port: int) -> list[str]:
            cmd = [*_server_command(), model, "--omni", "--host", "127.0.0.1", "--port", str(port)]
            return [*cmd, "--dtype", "float32", "--device", "cpu", "--served-model-name", SERVED_NAME, *flags]

        super().__init__(command, log_path)

    def metrics(self) -> dict[tuple[str, tuple], float]:
        text = httpx.get(f"{self.base_url}/metrics", timeout=10).text
        samples = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return samples

    def debug_steps(self) -> dict:
        return httpx.get(f"{self.base_url}/v1/debug/steps", timeout=10).json()


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir) -> str:
    return str(tiny_model_dir)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    flags = ["--step-execution", "--max-num-seqs", "8", *VLLM_OMNI_E2E_FLAGS]
    proc = ServerProcess(model_dir, flags, tmp_path_factory.mktemp("logs") / "server.log")
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def offline(model_dir):
    from vllm_omni import Omni

    omni = Omni(
        model=model_dir,
        step_execution=True,
        max_num_seqs=8,
        dtype="float32",
        device="cpu",
    )
    yield omni
    omni.close()


def offline_images(omni, cases: list[Case]) -> list[list[np.ndarray]]:
    """What `Omni.generate` gives for the same inputs: per case, n uint8 arrays [H, W, 3]."""
    from vllm_omni import OmniDiffusionSamplingParams

    prompts = [{"prompt": c.prompt, "negative_prompt": c.negative_prompt} for c in cases]
    params = []
    for c in cases:
        sp = OmniDiffusionSamplingParams(
            height=c.height, width=c.width, num_inference_steps=c.steps, seed=c.seed
        )
        sp.num_outputs_per_prompt = c.n
        if c.true_cfg_scale is not None:
            sp.true_cfg_scale = c.true_cfg_scale
        params.append(sp)
    outputs = omni.generate(prompts, params, use_tqdm=False)
    return [[np.asarray(img.convert("RGB")) for img in out.images] for out in outputs]


def decode(b64: str) -> np.ndarray:
    image = Image.open(io.BytesIO(base64.b64decode(b64)))
    assert image.format == "PNG"
    return np.asarray(image.convert("RGB"))


def extension_fields(c: Case) -> dict:
    fields = {"seed": c.seed, "num_inference_steps": c.steps}
    if c.negative_prompt is not None:
        fields["negative_prompt"] = c.negative_prompt
    if c.true_cfg_scale is not None:
        fields["true_cfg_scale"] = c.true_cfg_scale
    return fields


def via_openai(base_url: str, c: Case) -> tuple[list[np.ndarray], list[int]]:
    from openai import OpenAI

    client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", timeout=120, max_retries=0)
    resp = client.images.generate(
        model=SERVED_NAME,
        prompt=c.prompt,
        n=c.n,
        size=f"{c.width}x{c.height}",
        response_format="b64_json",
        extra_body=extension_fields(c),
    )
    return [decode(d.b64_json) for d in resp.data], [d.model_extra["seed"] for d in resp.data]


def via_httpx(base_url: str, c: Case) -> tuple[list[np.ndarray], list[int]]:
    # Extensions inside a literal `extra_body` object, as some clients send them.
    body = {"prompt": c.prompt, "n": c.n, "size": f"{c.width}x{c.height}", "extra_body": extension_fields(c)}
    resp = httpx.post(f"{base_url}/v1/images/generations", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    timings = resp.json()["timings"]  # the engine's own stats reached the response
    assert 0 <= timings["queue_s"] <= timings["engine_s"] <= timings["total_s"]
    data = resp.json()["data"]
    return [decode(d["b64_json"]) for d in data], [d["seed"] for d in data]


def assert_close(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.shape == want.shape, what
    diff = np.abs(got.astype(np.int16) - want.astype(np.int16)).max()
    assert diff <= 1, f"{what}: max pixel difference {diff} > 1/255"


MIXED_CASES = [
    Case("a red fox in the snow", 64, 64, seed=1, steps=3),
    Case("a lighthouse at dusk, oil painting", 96, 64, seed=2, steps=4),
    Case("a bowl of fruit", 64, 128, seed=3, steps=2),
    Case("mountains", 48, 80, seed=4, steps=3, n=2),
    Case("a cat on a sofa", 32, 32, seed=5, steps=5, negative_prompt="blurry", true_cfg_scale=4.0),
    Case(
        "a city street at night, rain, neon", 64, 48, seed=6, steps=3, negative_prompt=" ", true_cfg_scale=2.5
    ),
    Case("a small boat", 128, 64, seed=7, steps=2, negative_prompt="ugly", true_cfg_scale=6.0),
    Case("a forest", 32, 48, seed=8, steps=4, negative_prompt="dark", true_cfg_scale=1.0),  # CFG off
]


def test_concurrent_mixed_requests_match_offline(server, offline):
    callers = [via_openai if i % 2 == 0 else via_httpx for i in range(len(MIXED_CASES))]
    with concurrent.futures.ThreadPoolExecutor(len(MIXED_CASES)) as pool:
        futures = [
            pool.submit(call, server.base_url, c) for call, c in zip(callers, MIXED_CASES, strict=True)
        ]
        results = [f.result() for f in futures]
    expected = offline_images(offline, MIXED_CASES)
    for c, (images, seeds), want in zip(MIXED_CASES, results, expected, strict=True):
        assert seeds == [c.seed] * c.n and len(images) == c.n == len(want)
        for i, (got, ref) in enumerate(zip(images, want, strict=True)):
            assert_close(got, ref, f"{c.width}x{c.height} seed={c.seed} image {i}")
    if MIXED_CASES[3].n == 2:
        assert not np.array_equal(results[3][0][0], results[3][0][1])  # n images, each its own noise

    samples = server.metrics()
    assert samples[("vllm_omni:mixed_resolution_steps_total", ())] >= 1
    one_shape = samples[("vllm_omni:step_num_resolutions_bucket", (("le", "1.0"),))]
    assert one_shape < samples[("vllm_omni:step_num_resolutions_count", ())]
    assert samples[("vllm_omni:images_generated_total", ())] >= sum(c.n for c in MIXED_CASES)
    steps = server.debug_steps()["steps"]
    assert any(len({tuple(s) for s in step["shapes"]}) >= 2 for step in steps)


def via_openai_chat(base_url: str, c: Case) -> np.ndarray:
    """vLLM-Omni's chat form: a user message, the diffusion fields in `extra_body`."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", timeout=120, max_retries=0)
    completion = client.chat.completions.create(
        model=SERVED_NAME,
        messages=[{"role": "user", "content": c.prompt}],
        extra_body={"height": c.height, "width": c.width, **extension_fields(c)},
    )
    assert completion.choices[0].finish_reason == "stop"
    url = completion.choices[0].message.content[0]["image_url"]["url"]
    return decode(url.removeprefix("data:image/png;base64,"))


def test_chat_completions_match_offline(server, offline):
    cases = [MIXED_CASES[1], MIXED_CASES[5]]  # one without CFG, one with
    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        images = list(pool.map(lambda c: via_openai_chat(server.base_url, c), cases))
    for c, got, want in zip(cases, images, offline_images(offline, cases), strict=True):
        assert_close(got, want[0], f"chat {c.width}x{c.height} seed={c.seed}")


def test_hundred_concurrent_small_requests(server, offline):
    cases = [Case(f"tile {i}", 32, 32 if i % 2 else 48, seed=1000 + i, steps=2) for i in range(100)]

    async def send_all() -> list[dict]:
        limits = httpx.Limits(max_connections=128)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120, limits=limits) as client:

            async def one(c: Case) -> dict:
                body = {"prompt": c.prompt, "size": f"{c.width}x{c.height}", **extension_fields(c)}
                resp = await client.post("/v1/images/generations", json=body)
                assert resp.status_code == 200, resp.text
                return resp.json()

            return await asyncio.gather(*(one(c) for c in cases))

    responses = asyncio.run(send_all())
    assert [r["data"][0]["seed"] for r in responses] == [c.seed for c in cases]
    assert len({r["id"] for r in responses}) == 100
    images = [decode(r["data"][0]["b64_json"]) for r in responses]
    for c, image in zip(cases, images, strict=True):
        assert image.shape == (c.height, c.width, 3)
    assert len({hashlib.sha256(im.tobytes()).hexdigest() for im in images}) == 100
    spot = [0, 1, 57, 99]
    for i, want in zip(spot, offline_images(offline, [cases[i] for i in spot]), strict=True):
        assert_close(images[i], want[0], f"request {i}")


def test_disconnect_frees_the_slot(model_dir, tmp_path):
    # FIFO: the short request waits for the slot (the latency policy would preempt the long one)
    flags = ["--step-execution", "--max-num-seqs", "1", "--scheduling-policy", "fifo"]
    proc = ServerProcess(model_dir, flags, tmp_path / "server.log")
    try:
        proc.wait_ready()
        _check_disconnect(proc)
    finally:
        proc.stop()


def _check_disconnect(proc: ServerProcess) -> None:
    long_body = json.dumps(
        {"prompt": "slow", "size": "256x256", "num_inference_steps": 1000, "seed": 1}
    ).encode()
    sock = socket.create_connection(("127.0.0.1", proc.port))
    head = (
        "POST /v1/images/generations HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(long_body)}\r\n\r\n"
    )
    sock.sendall(head.encode() + long_body)
    _wait_for(lambda: len(proc.debug_steps()["steps"]) >= 3, "the long request to run a few steps")

    short = {"prompt": "quick", "size": "32x32", "num_inference_steps": 2, "seed": 2}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(httpx.post, f"{proc.base_url}/v1/images/generations", json=short, timeout=120)
        _wait_for(lambda: proc.debug_steps()["num_waiting"] == 1, "the short request to wait for the slot")
        debug = proc.debug_steps()
        assert debug["num_running"] == 1 and debug["num_waiting"] == 1
        num_done = len(debug["steps"])
        assert num_done < 900, "the long request nearly finished before the disconnect; make it longer"

        disconnected_at = time.monotonic()
        sock.close()  # the client goes away mid-denoise
        resp = pending.result(timeout=120)
        waited_s = time.monotonic() - disconnected_at
    assert resp.status_code == 200, resp.text
    steps = proc.debug_steps()["steps"]
    long_steps = sum(1 for s in steps if s["shapes"] == [[256, 256]])
    print(
        f"short request done {waited_s:.2f} s after the disconnect; long request stopped after {long_steps}"
    )
    # The slot was freed at once: the aborted request ran only a few steps past the disconnect, not the
    # ~900 it had left. "A few": the disconnect reaches the step loop through the event loop, which
    # shares the CPU with it (11 tiny-model steps on a 2-core machine busy with another test run)
    assert long_steps <= num_done + 25, (long_steps, num_done)
    assert [s["shapes"] for s in steps[long_steps:]] == [[[32, 32]]] * 2
    samples = proc.metrics()
    assert samples[("vllm_omni:requests_finished_total", (("status", "aborted"),))] == 1
    assert samples[("vllm_omni:num_requests_running", ())] == 0
    assert max(s["num_reqs"] for s in steps) == 1


def _wait_for(condition, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.02)
    pytest.fail(f"timed out waiting for {what}")


def test_cli_refuses_unsupported_flags_before_loading():
    env = {**os.environ, "VLLM_OMNI_CACHE_DIR": "/nonexistent/never-built"}
    flags = ["--cache-backend", "mag_cache", "--port", str(server_process.free_port())]
    cmd = [*_server_command(), "tiny-qwen-image", "--omni", *flags]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 2, done.stderr
    assert "--cache-backend 'mag_cache' is not supported" in done.stderr

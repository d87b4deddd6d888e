"""Quick-start demo: serve the embedded tiny Qwen-Image and watch step-wise batching.

Starts `vllm serve tiny-qwen-image --omni --step-execution --max-num-seqs 8` on a
free port, sends a burst of concurrent requests of mixed sizes and CFG settings
with the OpenAI client (extensions through `extra_body`), saves the PNGs to
outputs/quickstart/, prints how the engine batched them (from GET
/v1/debug/steps), and stops the server.

    python examples/quickstart_demo.py [--num-requests 16] [--steps 6]

The first run builds the tiny checkpoint (a few seconds to a minute); later runs reuse it.
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from openai import OpenAI

SIZES = [(64, 64), (96, 64), (64, 128), (128, 128), (48, 80), (80, 48), (32, 32), (128, 64)]
"""(width, height) cycled over the requests."""
PROMPTS = [
    "a red fox in the snow",
    "a lighthouse at dusk, oil painting",
    "a bowl of fruit on a wooden table",
    "mountains under a starry sky",
    "a cat asleep on a sofa",
    "a city street at night, rain, neon",
]
# No batching flags beyond the README's command: mixed sizes and CFG / non-CFG requests can share a
# packed forward (no MixFusion chunk limits), and the default latency policy runs the shortest
# remaining work first, packing more requests into a step while its measured cost says it is free.


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_command(port: int) -> list[str]:
    """`vllm serve ...` from this interpreter's environment (falls back to `python -m`)."""
    script = Path(sys.executable).parent / "vllm"
    base = [str(script)] if script.exists() else [sys.executable, "-m", "vllm_omni.entrypoints.cli.main"]
    flags = ["--omni", "--step-execution", "--max-num-seqs", "8", "--port", str(port), "--host", "127.0.0.1"]
    return [*base, "serve", "tiny-qwen-image", *flags]


def wait_for_health(proc: subprocess.Popen, base_url: str, log_path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"server exited with code {proc.returncode}; log:\n{log_path.read_text()[-3000:]}")
        try:
            if httpx.get(f"{base_url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    sys.exit(f"server not healthy after {timeout_s:.0f} s; see {log_path}")


def make_requests(num_requests: int, steps: int) -> list[dict]:
    """Mixed sizes, step counts and CFG settings; every third request uses true CFG."""
    requests = []
    for i in range(num_requests):
        width, height = SIZES[i % len(SIZES)]
        extra = {"seed": i, "num_inference_steps": steps + i % 3}
        if i % 3 == 2:
            extra.update(negative_prompt="blurry, low quality", true_cfg_scale=4.0)
        requests.append(
            {"prompt": PROMPTS[i % len(PROMPTS)], "size": f"{width}x{height}", "extra_body": extra}
        )
    return requests


def send_burst(base_url: str, requests: list[dict], out_dir: Path) -> None:
    client = OpenAI(base_url=f"{base_url}/v1", api_key="EMPTY", timeout=600, max_retries=0)

    def one(i: int, req: dict) -> str:
        start = time.monotonic()
        resp = client.images.generate(
            model="tiny-qwen-image", prompt=req["prompt"], size=req["size"], n=1, extra_body=req["extra_body"]
        )
        path = out_dir / f"{i:02d}_{req['size']}_seed{req['extra_body']['seed']}.png"
        path.write_bytes(base64.b64decode(resp.data[0].b64_json))
        timings = (resp.model_extra or {}).get("timings") or {}
        cfg = "cfg" if "negative_prompt" in req["extra_body"] else "   "
        queue = timings.get("queue_s") or 0.0
        return f"  {path.name:<34} {cfg} queue {queue:6.2f} s  total {time.monotonic() - start:6.2f} s"

    with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        for line in pool.map(one, range(len(requests)), requests):
            print(line)


def print_batching(base_url: str) -> None:
    steps = httpx.get(f"{base_url}/v1/debug/steps", timeout=10).json()["steps"]
    print(f"\nhow the engine batched them ({len(steps)} steps):")
    print(f"  {'step':>4}  {'reqs':>4}  {'seqs':>4}  {'tokens':>6}  {'path':<7} {'ms':>7}  sizes (WxH)")
    for i, step in enumerate(steps):
        sizes = " ".join(f"{w}x{h}" for h, w in step["shapes"])
        print(
            f"  {i:>4}  {step['num_reqs']:>4}  {step['num_seqs']:>4}  {step['num_tokens']:>6}  "
            f"{step['path']:<7} {step['step_time_s'] * 1e3:7.1f}  {sizes}"
        )
    if steps:
        shared = sum(step["num_reqs"] >= 2 for step in steps)
        mixed = sum(len({tuple(s) for s in step["shapes"]}) >= 2 for step in steps)
        mean_reqs = sum(step["num_reqs"] for step in steps) / len(steps)
        print(
            f"\n{len(steps)} steps, {mean_reqs:.1f} requests per step on average, "
            f"max {max(step['num_reqs'] for step in steps)}; {mixed} steps mixed two or more resolutions."
        )
        print(
            f"{shared} of {len(steps)} steps ({shared / len(steps):.0%}) were shared by two or more "
            "requests (the latency policy packs while a step stays nearly free; "
            "docs/design/scheduling.md)."
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--steps", type=int, default=6, help="Base denoise steps (each request adds 0..2).")
    parser.add_argument("--output-dir", type=Path, default=Path("outputs/quickstart"))
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    args = parser.parse_args()

    args.output_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    log_path = args.output_dir / "server.log"
    cmd = server_command(port)
    print("starting:", " ".join(cmd), f"\n(server log: {log_path})")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_for_health(proc, base_url, log_path, args.startup_timeout)
            print(f"server ready at {base_url}; sending {args.num_requests} concurrent requests\n")
            send_burst(base_url, make_requests(args.num_requests, args.steps), args.output_dir)
            print_batching(base_url)
            print(f"\nimages saved to {args.output_dir}/")
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


if __name__ == "__main__":
    main()

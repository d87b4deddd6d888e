"""A request's latency on a server with a LoRA adapter loaded vs a server without, openai SDK.

    python benchmarks/diffusion/lora_serving_benchmark.py --json-output lora_serving.json     # H200
    python benchmarks/diffusion/lora_serving_benchmark.py --model tiny-qwen-image --device cpu \
        --sizes 32x32 --steps 2 --iters 1 --warmup 1 --json-output /tmp/lora_serving.json      # smoke

Two servers, one after the other (`serve MODEL --omni --load-format dummy` + --server-args, a free
port): `base` without LoRA flags, and `lora` with `--lora-modules lightning=DIR --max-lora-rank RANK`,
DIR a random rank-`--rank` adapter in diffusers' format on the 12 attention and MLP linears of every
block. Per size, --steps steps, CFG off, one `images.generate` call at a time: --warmup untimed calls
of each kind (they capture the LoRA graphs), then --iters rounds of a base and an adapter call in turn
on the lora server (interleaved: a server's speed drifts by several % a minute). A row is the median
wall time of its kind's calls: base server / lora server base request / lora server adapter request.
Every request has a timeout; the JSON is rewritten after every row (with each server's command, log
tail and whether CUDA graphs stayed on); a failing server or request is recorded and the next still
runs; SIGTERM stops the server and keeps what was measured.
"""

from __future__ import annotations

import argparse
import shlex
import signal
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make `benchmarks.diffusion` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.diffusion import server_process as sp  # noqa: E402
from benchmarks.diffusion.common import environment_info, parse_size_list, ratio, write_json  # noqa: E402

ADAPTER = "lightning"
PROMPT = "a lighthouse on a cliff at dusk, oil painting"
GRAPH_LOG_MARKERS = ("CUDA graphs", "CUDA graph of", "with LoRA")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="Qwen/Qwen-Image")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--sizes", default="256x256,512x512,1024x1024")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument(
        "--std", type=float, default=1e-3, help="the adapter's matrices' std (keeps it finite)"
    )
    parser.add_argument("--servers", default="base,lora", help="which servers to run, in order")
    parser.add_argument("--server-args", default="", help="more flags for both servers")
    parser.add_argument(
        "--adapter-dir", default=None, help="where to write the adapter (default: a temp dir)"
    )
    parser.add_argument("--server-timeout", type=float, default=400.0, help="seconds until /health answers")
    parser.add_argument("--request-timeout", type=float, default=120.0)
    parser.add_argument("--log-dir", default=None, help="server logs (default: next to the JSON)")
    parser.add_argument("--json-output", default=None)
    args = parser.parse_args(argv)
    args.size_list = parse_size_list(args.sizes)
    args.server_list = [s.strip() for s in args.servers.split(",") if s.strip()]
    if not args.server_list or set(args.server_list) - {"base", "lora"}:
        parser.error(f"--servers: base and / or lora, got {args.servers!r}")
    return args


def write_adapter(args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    """A random rank-`--rank` adapter on every attention and MLP linear, as diffusers' file in `directory`.

    The transformer is built on the meta device (only the linears' shapes are read)."""
    import torch

    from benchmarks.diffusion.transformer_setup import transformer_config_dict
    from vllm_omni.diffusion.models.qwen_image.transformer import (
        QwenImageTransformer,
        QwenImageTransformerConfig,
    )
    from vllm_omni.lora.random_adapter import block_targets, random_lora_state_dict, save_lora_dir

    start = time.perf_counter()
    config = QwenImageTransformerConfig.from_dict(transformer_config_dict(args.model))
    with torch.device("meta"):
        model = QwenImageTransformer(config)
    targets = block_targets(model.plans, config.num_layers)
    state = random_lora_state_dict(model, targets, args.rank, seed=0, std=args.std)
    state = {k: v.to(torch.bfloat16) for k, v in state.items()}
    save_lora_dir(directory, state)
    num_bytes = sum(t.numel() * t.element_size() for t in state.values())
    return {
        "dir": str(directory),
        "rank": args.rank,
        "num_modules": len(targets),
        "gib": num_bytes / 2**30,
        "write_s": time.perf_counter() - start,
    }


def server_command(args: argparse.Namespace, port: int, adapter_dir: Path | None) -> list[str]:
    cmd = [sys.executable, "-m", "vllm_omni.entrypoints.cli.main", "serve", args.model, "--omni"]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--device", args.device, "--dtype", args.dtype]
    cmd += ["--load-format", args.load_format]
    if adapter_dir is not None:
        cmd += ["--lora-modules", f"{ADAPTER}={adapter_dir}", "--max-lora-rank", str(args.rank)]
    return cmd + shlex.split(args.server_args)


def one_call(client, size: str, steps: int, lora: bool, seed: int) -> float:
    """One `images.generate` call (CFG off, the adapter when `lora`); its wall time (s)."""
    extra: dict[str, Any] = {"num_inference_steps": steps, "seed": seed}
    if lora:
        extra["lora"] = {"name": ADAPTER, "scale": 1.0}
    start = time.perf_counter()
    response = client.images.generate(
        prompt=PROMPT, size=size, n=1, response_format="b64_json", extra_body=extra
    )
    elapsed = time.perf_counter() - start
    if not response.data or not response.data[0].b64_json:
        raise RuntimeError(f"{size}: the response holds no image")
    return elapsed


def timed_rows(client, size: str, steps: int, kinds: list[str], warmup: int, iters: int) -> dict[str, Any]:
    """`warmup` calls of each kind ("base", "adapter"), then `iters` rounds of one call of each kind in
    turn (interleaved, so that a drift of the server's speed reaches both alike); per kind its wall
    times (s) and their median."""
    for i in range(warmup):
        for kind in kinds:
            one_call(client, size, steps, kind == "adapter", i)
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    for i in range(warmup, warmup + iters):
        for kind in kinds:
            times[kind].append(one_call(client, size, steps, kind == "adapter", i))
    return {kind: {"times_s": t, "median_s": statistics.median(t)} for kind, t in times.items()}


def run_server(args, name: str, adapter_dir: Path | None, payload: dict, log_dir: Path) -> None:
    """Start server `name`, time every row it serves (JSON rewritten after each), stop it."""
    from openai import OpenAI

    port = sp.free_port()
    cmd = server_command(args, port, adapter_dir)
    result: dict[str, Any] = {"server_command": cmd, "rows": {}}
    payload["servers"][name] = result
    print(f"[{name}] {shlex.join(cmd[1:])}", file=sys.stderr, flush=True)
    start = time.perf_counter()
    server = sp.ServerProcess(cmd, port, log_dir / f"server_{name}.log")
    try:
        server.wait_ready(args.server_timeout)
        result["server_start_s"] = time.perf_counter() - start
        print(f"[{name}] up after {result['server_start_s']:.0f} s", file=sys.stderr, flush=True)
        client = OpenAI(
            base_url=f"{server.base_url}/v1", api_key="EMPTY", max_retries=0, timeout=args.request_timeout
        )
        kinds = ["base"] + (["adapter"] if adapter_dir is not None else [])
        for size in args.size_list:
            try:
                rows = timed_rows(client, size.label, args.steps, kinds, args.warmup, args.iters)
            except Exception as exc:  # noqa: BLE001 - record it, measure the next size
                rows = {kind: {"error": f"{type(exc).__name__}: {exc}"} for kind in kinds}
            for kind, row in rows.items():
                key = f"{size.label}/{kind}"
                result["rows"][key] = row
                print(f"[{name}] {key}: {row.get('median_s', row.get('error'))}", file=sys.stderr, flush=True)
            write_payload(args, payload)
    except Exception as exc:  # noqa: BLE001 - a server that cannot start: record it, run the next
        result["error"] = f"{type(exc).__name__}: {exc}"
        print(f"[{name}] failed: {result['error']}", file=sys.stderr, flush=True)
    finally:
        server.stop()
        log = server.log_path.read_text(errors="replace")
        result["graph_lines"] = [
            line for line in log.splitlines() if any(m in line for m in GRAPH_LOG_MARKERS)
        ][-40:]
        result["log_tail"] = log[-4000:]
        write_payload(args, payload)


def table(payload: dict) -> list[dict[str, Any]]:
    """The issue's rows per size, with the two target ratios."""
    servers, rows = payload["servers"], []

    def median(server: str, key: str) -> float | None:
        return servers.get(server, {}).get("rows", {}).get(key, {}).get("median_s")

    for size in payload["sizes"]:
        base, lora_base, lora_adapter = (
            median("base", f"{size}/base"),
            median("lora", f"{size}/base"),
            median("lora", f"{size}/adapter"),
        )
        rows.append(
            {
                "size": size,
                "base_server_s": base,
                "lora_server_base_s": lora_base,
                "lora_server_adapter_s": lora_adapter,
                "base_on_lora_vs_base": ratio(lora_base, base),
                "adapter_vs_base_on_lora": ratio(lora_adapter, lora_base),
            }
        )
    return rows


def write_payload(args: argparse.Namespace, payload: dict) -> None:
    payload["table"] = table(payload)
    if args.json_output:
        write_json(args.json_output, payload)


def markdown(payload: dict) -> str:
    def cell(value, fmt):
        return "-" if value is None else format(value, fmt)

    lines = [
        "| size | base server | LoRA server, base request | LoRA server, adapter | base on LoRA / base "
        "(target <= 1.05) | adapter / base on LoRA (target <= 1.15) |",
        "|---|---|---|---|---|---|",
    ]
    for r in payload["table"]:
        lines.append(
            f"| {r['size']} | {cell(r['base_server_s'], '.3f')} s | "
            f"{cell(r['lora_server_base_s'], '.3f')} s | {cell(r['lora_server_adapter_s'], '.3f')} s | "
            f"{cell(r['base_on_lora_vs_base'], '.3f')} | "
            f"{cell(r['adapter_vs_base_on_lora'], '.3f')} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import tempfile

    args = parse_args(argv)
    payload: dict[str, Any] = {
        "benchmark": "lora_serving_benchmark",
        "env": environment_info(args.device if args.device.startswith("cuda") else None),
        "config": {k: v for k, v in vars(args).items() if k not in ("size_list", "server_list")},
        "sizes": [s.label for s in args.size_list],
        "servers": {},
        "complete": False,
    }
    json_stem = Path(args.json_output).with_suffix("") if args.json_output else None
    log_dir = Path(
        args.log_dir or (f"{json_stem}_logs" if json_stem else tempfile.mkdtemp(prefix="lora_logs_"))
    )
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, sp.on_sigterm) if main_thread else None
    try:
        adapter_dir = None
        if "lora" in args.server_list:
            adapter_dir = Path(args.adapter_dir or tempfile.mkdtemp(prefix="lora_adapter_"))
            payload["adapter"] = write_adapter(args, adapter_dir)
            print(f"adapter: {payload['adapter']}", file=sys.stderr, flush=True)
        for name in args.server_list:
            run_server(args, name, adapter_dir if name == "lora" else None, payload, log_dir)
        payload["complete"] = all(
            "error" not in s and all("median_s" in r for r in s["rows"].values())
            for s in payload["servers"].values()
        )
    except (sp.Interrupted, KeyboardInterrupt) as exc:
        payload["interrupted"] = repr(exc)
        print(f"interrupted ({exc!r}); keeping what was measured", file=sys.stderr)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        write_payload(args, payload)
    print(markdown(payload), flush=True)
    print(f"server logs in {log_dir}", file=sys.stderr)
    return payload


if __name__ == "__main__":
    main()

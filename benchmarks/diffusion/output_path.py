"""Decode beside the steps and streaming partial images, measured.

    # a lone request's step times: its first and last step against its middle steps (in-process engine;
    # the step times are the server log's: `StepStats.step_time_s`)
    python benchmarks/diffusion/output_path.py steps --model Qwen/Qwen-Image --load-format dummy \
        --sizes 768x768,1328x1328 --steps 20 --json-output out/output_steps.json

    # time to the first partial image and the latency with partial_images N against the same request not
    # streamed, alternating, against a running server (`vllm serve ... --omni`)
    python benchmarks/diffusion/output_path.py stream --base-url http://127.0.0.1:8000 \
        --sizes 512x512,1024x1024,1328x1328 --steps 20 --partial-images 3 --repeat 3 \
        --json-output out/output_stream.json

`steps` targets: first and last step within 10 % of the median middle step (the decode and most of the
encode leave the step). `stream` targets (1024x1024, CFG, 20 steps, 3 partials): the first partial at
<= 35 % of the streamed request's latency, the streamed latency <= 1.08x the non-streamed one, and
(`neighbour_slowdown`) a plain request sent together with a streamed one <= 1.03x its latency beside
the same request not streamed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def _size(text: str) -> tuple[int, int]:
    width, height = (int(v) for v in text.lower().split("x"))
    return width, height


def measure_steps(args) -> list[dict]:
    """Per size: one CFG request alone (after a warm-up one), its step times."""
    from vllm_omni.config import OmniDiffusionConfig
    from vllm_omni.diffusion.engine import DiffusionEngine
    from vllm_omni.diffusion.request import OmniDiffusionRequest
    from vllm_omni.inputs import OmniDiffusionSamplingParams

    config = OmniDiffusionConfig(
        model=args.model, load_format=args.load_format, dtype=args.dtype, device=args.device, log_stats=False
    )
    engine = DiffusionEngine(config, autostart=False)
    rows = []
    for size in args.sizes.split(","):
        width, height = _size(size)
        runs = []
        for label in ("warm-up", "measured"):
            params = OmniDiffusionSamplingParams(
                height=height, width=width, num_inference_steps=args.steps, seed=0, true_cfg_scale=4.0
            )
            request = OmniDiffusionRequest(
                label, prompt="a lighthouse at dusk", negative_prompt=" ", sampling_params=params
            )
            start = time.perf_counter()
            handle = engine.add_request(request)
            times = []
            while not handle.done():
                stats = engine.step()
                if stats is not None:
                    times.append(stats.step_time_s)
            handle.result()
            runs.append((times, time.perf_counter() - start))
        times, latency_s = runs[-1]
        middle = statistics.median(times[1:-1]) if len(times) > 2 else float("nan")
        rows.append(
            {
                "size": size,
                "steps": args.steps,
                "first_ms": times[0] * 1e3,
                "middle_median_ms": middle * 1e3,
                "last_ms": times[-1] * 1e3,
                "first_over_middle": times[0] / middle,
                "last_over_middle": times[-1] / middle,
                "latency_s": latency_s,
                "step_ms": [t * 1e3 for t in times],
            }
        )
        print(
            f"{size}: first {times[0] * 1e3:.1f} ms, middle {middle * 1e3:.1f} ms, "
            f"last {times[-1] * 1e3:.1f} ms "
            f"(first/middle {times[0] / middle:.2f}, last/middle {times[-1] / middle:.2f}); "
            f"request {latency_s:.2f} s"
        )
    engine.shutdown()
    return rows


def _stream_once(client, url: str, body: dict) -> tuple[float, float | None, int]:
    """(latency, time to the first partial or None, partial events) of one streamed request."""
    start, first, num_partials = time.perf_counter(), None, 0
    with client.stream("POST", url, json={**body, "stream": True}) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith("event: ") and line.endswith(".partial_image"):
                num_partials += 1
                first = first if first is not None else time.perf_counter() - start
            elif line == "event: error":
                raise RuntimeError(f"stream failed: {next(resp.iter_lines())}")
    return time.perf_counter() - start, first, num_partials


def _neighbour(client, url: str, body: dict, args) -> dict:
    """A plain request's latency sent together with a second one (another seed), the second plain
    or streamed: the streamed neighbour's previews must not slow it."""
    import threading

    def plain_latency(out: list) -> None:
        start = time.perf_counter()
        client.post(url, json=body).raise_for_status()
        out.append(time.perf_counter() - start)

    beside = {"plain": [], "streamed": []}
    other = {**body, "seed": 1}
    for _ in range(args.repeat):
        for kind in ("plain", "streamed"):
            thread = threading.Thread(target=plain_latency, args=(beside[kind],))
            thread.start()
            if kind == "plain":
                client.post(url, json=other).raise_for_status()
            else:
                _stream_once(client, url, {**other, "partial_images": args.partial_images})
            thread.join()
    plain, streamed = statistics.median(beside["plain"]), statistics.median(beside["streamed"])
    return {
        "neighbour_beside_plain_s": plain,
        "neighbour_beside_streamed_s": streamed,
        "neighbour_slowdown": streamed / plain,
    }


def measure_stream(args) -> list[dict]:
    import httpx

    url = f"{args.base_url}/v1/images/generations"
    rows = []
    with httpx.Client(timeout=3600) as client:
        for size in args.sizes.split(","):
            body = {
                "prompt": "a lighthouse at dusk, waves",
                "size": size,
                "num_inference_steps": args.steps,
                "negative_prompt": " ",
                "true_cfg_scale": 4.0,
                "seed": 0,
            }
            client.post(url, json={**body, "num_inference_steps": 2}).raise_for_status()  # warm-up
            plain, streamed, firsts = [], [], []
            for _ in range(args.repeat):
                start = time.perf_counter()
                client.post(url, json=body).raise_for_status()
                plain.append(time.perf_counter() - start)
                latency, first, num_partials = _stream_once(
                    client, url, {**body, "partial_images": args.partial_images}
                )
                streamed.append(latency)
                firsts.append(first)
            row = {
                "size": size,
                "steps": args.steps,
                "partial_images": args.partial_images,
                "num_partials_received": num_partials,
                "plain_s": statistics.median(plain),
                "streamed_s": statistics.median(streamed),
                "first_partial_s": statistics.median(f for f in firsts if f is not None)
                if any(firsts)
                else None,
            }
            row["streamed_over_plain"] = row["streamed_s"] / row["plain_s"]
            row.update(_neighbour(client, url, body, args))
            if row["first_partial_s"] is not None:
                row["first_partial_fraction"] = row["first_partial_s"] / row["streamed_s"]
            rows.append(row)
            print(json.dumps(row))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    steps = sub.add_parser("steps", help="a lone request's first / last step against its middle steps")
    steps.add_argument("--model", default="tiny-qwen-image")
    steps.add_argument("--load-format", choices=("auto", "dummy"), default="auto")
    steps.add_argument("--dtype", default="auto")
    steps.add_argument("--device", default="auto")
    stream = sub.add_parser("stream", help="time to the first partial, latency streamed vs not")
    stream.add_argument("--base-url", default="http://127.0.0.1:8000")
    stream.add_argument("--partial-images", type=int, default=3)
    stream.add_argument("--repeat", type=int, default=3)
    for p in (steps, stream):
        p.add_argument("--sizes", default="768x768,1024x1024")
        p.add_argument("--steps", type=int, default=20)
        p.add_argument("--json-output", default=None)
    args = parser.parse_args()
    rows = measure_steps(args) if args.mode == "steps" else measure_stream(args)
    if args.json_output:
        Path(args.json_output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_output).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()

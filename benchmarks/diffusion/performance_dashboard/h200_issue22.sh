#!/usr/bin/env bash
# Issue 22's load benchmark (load_benchmark.py) on the H200, as sent through the device tool.
# Usage (repository root = this tree; the wheels of the server and the client in $WHEELS, default .whl,
# carried with the call): bash benchmarks/diffusion/performance_dashboard/h200_issue22.sh STAGE OUT_DIR
#   check   the carried wheels import (server and client), versions, nvidia-smi, whether the server
#           takes --scheduling-policy latency yet (~20 s)
#   smoke   check, the unit tests with CUDA paths, graph replay == eager (16 blocks, the seam's check),
#           and a 4-request latency-policy load on a real-size server (~5 min): a first call that
#           finds what breaks on the GPU before the long stages spend their 9 minutes
#   load_a  configurations request, latency: alone times and capacity on `request`, 4 loads, burst
#   load_c  a longer trace (20 requests per load, loads 0.8 and 1.0, no burst) for request, latency
#           and skip-ahead, on load_a's alone times (h200_results/issue22/alone_times.json, hence the
#           same capacity): the 10-request traces of load_a barely queue (~530 s)
#   load_d  load_c's trace for request and latency after the cost model's change (~380 s)
#   long C  configuration C alone on an 80-request trace at 80 and 100 % (~460 s per call); every call
#           draws the same trace (the alone times are fixed), so the calls are independent: merge their
#           long.json files here afterwards (load_benchmark.py --merge A/long.json B/long.json
#           --json-output long.json --markdown-output long.md --plot-dir plots)
#   steady C  configuration C on a 100-request trace at full steps and 100 % load (~480 s per call):
#           `request` first, then the others with PREV_JSON=that call's steady.json (same alone times,
#           same trace); run for request and latency on 2026-12-02 (h200_results/issue22/steady/).
#           STEADY_LOAD=0.8 STEADY_REQUESTS=80 for an 80 % trace (arrivals 1.25x sparser: 80 requests fit)
#   burst   the 8-request burst alone (20 steps), request then latency (~300 s)
#   fifo_vs_latency  budget-fifo then latency on long's 100 % trace in one call (~470 s)
#   load_b  configurations skip-ahead, budget-fifo, into load_a's JSON: copy load_a's load.json to
#           $PREV_JSON (default h200_results/issue22/load.json below) first, so that load_b reuses
#           its alone times (hence the same capacity and traces) and its table has the ratios to
#           `request`; without it load_b measures alone times on skip-ahead (the JSON says so)
# Each load stage leaves 8 files in OUT_DIR (the device tool's limit): NAME.log, load.json, load.md,
# plots/load_{0.5,0.8,1,1.2}.png, plots/burst.png. Server logs stay in /tmp/issue22_logs; the JSON
# keeps each server's command, start time and last 4000 characters of log.
#
# Budget of one load stage (measured_2026-12.md's H200 numbers; the device call's limit is 600 s):
#   --steps-scale 0.5: steps 4/4/5/7 (512², 768², 1024², 1536²), burst 10. Alone, CFG on, with
#   +300 ms first step, the decode (220 ms at 1024², by pixels elsewhere) and ~0.05-0.3 s of PNG/HTTP:
#   512² 4 x 57 ms -> 0.63 s, 768² 4 x 133 -> 1.06, 1024² 5 x 230 -> 1.82, 1536² 7 x 610 -> 5.37;
#   E[service] = .15 x 0.63 + .25 x 1.06 + .45 x 1.82 + .15 x 5.37 = 1.98 s, capacity ~0.50 req/s.
#   --num-requests 10 (quota: 1 x 512², 3 x 768², 5 x 1024², 1 x 1536², 18.3 s of work): seed 0's unit
#   trace ends at t = 7.90, so the last arrival is at 7.90 x 1.98 / L s: 31 + 20 + 16 + 13 = 80 s
#   for L = 0.5, 0.8, 1.0, 1.2, + ~25 s draining -> ~105 s of loads per configuration.
#   Burst at 10 steps: 2 x 2.97 + 2 x 2.34 + 2 x 0.98 + 0.56 + 5.12 = ~18 s one at a time.
#   Per configuration: start 85 s (CUDA graph capture) + warm-up (8 sizes x 2 steps) ~15 s + loads
#   105 s + burst 18 s + stop ~5 s = ~228 s; the first (`request`) also times 10 requests alone
#   (~23 s): 251 + 228 + wheel install ~15 = ~495 s. The run is cut at 555 s (SIGTERM: the harness
#   stops its server and keeps what was measured; SIGKILL 25 s later), inside the call's 600 s.
set -o pipefail
STAGE=$1 OUT=$2 WHEELS=${WHEELS:-.whl}
PREV=${PREV_JSON:-benchmarks/diffusion/performance_dashboard/h200_results/issue22/load.json}
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  "$WHEELS"/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
run() { local name=$1 limit=$2; shift 2; timeout -k 25 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"; }
LOAD=(python3 benchmarks/diffusion/load_benchmark.py --model Qwen/Qwen-Image --load-format dummy --device cuda
  --steps-scale 0.5 --num-requests 10 --loads 0.5,0.8,1.0,1.2 --log-dir /tmp/issue22_logs
  --json-output "$OUT/load.json" --markdown-output "$OUT/load.md" --plot-dir "$OUT/plots")
case $STAGE in
check)
  {
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 - <<'EOF'
import importlib
import importlib.metadata as md
MODULES = {"torch": "torch", "fastapi": "fastapi", "starlette": "starlette", "pydantic": "pydantic",
           "pydantic_core": "pydantic-core", "uvicorn": "uvicorn", "openai": "openai", "httpx": "httpx",
           "httpcore": "httpcore", "anyio": "anyio", "diffusers": "diffusers", "transformers": "transformers",
           "huggingface_hub": "huggingface-hub", "typing_extensions": "typing-extensions", "zipp": "zipp",
           "importlib_metadata": "importlib-metadata", "python_multipart": "python-multipart",
           "jiter": "jiter", "distro": "distro", "sniffio": "sniffio", "opentelemetry.trace": "opentelemetry-api",
           "fa3_fwd_interface": "fa3-fwd", "matplotlib": "matplotlib", "prometheus_client": "prometheus-client",
           "tqdm": "tqdm", "PIL": "pillow", "safetensors": "safetensors"}
failed = []
for module, dist in MODULES.items():
    try:
        path = importlib.import_module(module).__file__
        print(f"{dist:20s} {md.version(dist):14s} {path}")
    except Exception as exc:
        failed.append(module)
        print(f"{dist:20s} FAILED {type(exc).__name__}: {exc}")
for module in ("vllm_omni.entrypoints.openai.api_server", "benchmarks.diffusion.load_benchmark"):
    try:
        importlib.import_module(module)  # the server's whole import chain; the benchmark's
    except Exception as exc:
        failed.append(module)
        print(f"{module} FAILED {type(exc).__name__}: {exc}")
print("imports ok" if not failed else f"imports FAILED: {failed}")
EOF
    python3 -m vllm_omni.entrypoints.cli.main serve --help | grep -A2 -- "--scheduling-policy"
  } 2>&1 | tee "$OUT/check.log"
  ;;
smoke)
  bash "$0" check "$OUT"
  run gpu_tests 150 python3 -m pytest -q -p no:cacheprovider tests/test_attention_backends.py \
    tests/test_batch_invariance.py tests/test_cuda_graphs.py tests/test_fused_ops.py
  run cuda_graph_check 120 python3 benchmarks/diffusion/cuda_graph_check.py --num-layers 16 --iters 3 \
    --json-output "$OUT/cuda_graph_check.json"
  run smoke 200 "${LOAD[@]}" --configs latency --num-requests 4 \
    --loads 1.0 --no-burst --steps-scale 0.25 --json-output "$OUT/smoke.json" \
    --markdown-output "$OUT/smoke.md" --plot-dir /tmp/smoke_plots
  ;;
load_a)
  run load_a 555 "${LOAD[@]}" --configs request,latency
  ;;
load_c)
  run load_c 560 "${LOAD[@]}" --configs request,latency,skip-ahead --num-requests 20 --loads 0.8,1.0 \
    --no-burst --alone-times benchmarks/diffusion/performance_dashboard/h200_results/issue22/alone_times.json \
    --json-output "$OUT/load_c.json" --markdown-output "$OUT/load_c.md"
  ;;
load_d)
  # load_c's trace again after the cost model's change (per-bin medians, pooled violators), request
  # and latency only (skip-ahead's load_c rows stand: its code did not change)
  run load_d 450 "${LOAD[@]}" --configs request,latency --num-requests 20 --loads 0.8,1.0 --no-burst \
    --alone-times benchmarks/diffusion/performance_dashboard/h200_results/issue22/alone_times.json \
    --json-output "$OUT/load_d.json" --markdown-output "$OUT/load_d.md"
  ;;
long)
  # one configuration ($3) per call on an 80-request trace at 80 and 100 % (~460 s): the 20-request
  # traces queue too little; PREV_JSON (optional) extends an earlier call's JSON in place of --merge
  CONFIG=${3:?"long needs a configuration: request, latency, skip-ahead or budget-fifo"}
  if [ -n "${PREV_JSON:-}" ]; then cp "$PREV_JSON" "$OUT/long.json"; fi
  run "long_$CONFIG" 560 "${LOAD[@]}" --configs "$CONFIG" --num-requests 80 --loads 0.8,1.0 --no-burst \
    --alone-times benchmarks/diffusion/performance_dashboard/h200_results/issue22/alone_times.json \
    --json-output "$OUT/long.json" --markdown-output "$OUT/long.md"
  ;;
fifo_vs_latency)
  # budget-fifo and the latency default in ONE call on long's 100 % trace (80 requests, same alone times,
  # hence the same arrivals; ~470 s): the long rows of these two came from calls whose machines ran the
  # 1024x1024 step 2 % apart
  run fifo_vs_latency 585 "${LOAD[@]}" --configs budget-fifo,latency --num-requests 80 --loads 1.0 --no-burst \
    --alone-times benchmarks/diffusion/performance_dashboard/h200_results/issue22/alone_times.json \
    --json-output "$OUT/long.json" --markdown-output "$OUT/long.md"
  ;;
steady)
  # configuration $3 on a full-step trace (steps 8/8/10/14) of 100 requests at 100 % load (~480 s): closer
  # to the steady state the simulation's 400-request tables describe. Run `request` first (it measures
  # the alone times, hence the capacity and trace), then each other configuration with PREV_JSON set to
  # that call's steady.json, which fixes the same alone times and trace and keeps request's rows
  CONFIG=${3:?"steady needs a configuration: request, latency, skip-ahead or budget-fifo"}
  if [ -n "${PREV_JSON:-}" ]; then cp "$PREV_JSON" "$OUT/steady.json"; fi
  run "steady_$CONFIG" 570 "${LOAD[@]}" --configs "$CONFIG" --steps-scale 1.0 --num-requests "${STEADY_REQUESTS:-100}" \
    --loads "${STEADY_LOAD:-1.0}" \
    --no-burst --json-output "$OUT/steady.json" --markdown-output "$OUT/steady.md"
  ;;
burst)
  # the issue's 8-request burst alone (20 steps each, CFG on, all at t = 0), request mode then the
  # latency default, one call (~300 s): the burst target with today's default
  run burst 560 "${LOAD[@]}" --configs request,latency --steps-scale 1.0 --loads none
  ;;
load_b)
  if [ -f "$PREV" ]; then cp "$PREV" "$OUT/load.json"; else
    echo "warning: no $PREV (load_a's load.json): alone times are measured on skip-ahead" >&2
  fi
  run load_b 555 "${LOAD[@]}" --configs skip-ahead,budget-fifo
  ;;
*)
  echo "unknown stage $STAGE (check, smoke, load_a, load_b, load_c, load_d, long, steady, burst, fifo_vs_latency)" >&2; exit 2
  ;;
esac

#!/usr/bin/env bash
# Issue 27 (LoRA inside CUDA graphs) on the H200, as sent through the device tool.
# Usage (repository root = this tree; wheels of the server and the client in $WHEELS, default .whl,
# carried with the call): bash benchmarks/diffusion/performance_dashboard/h200_issue27.sh STAGE OUT_DIR
#   gpu_tests  the CUDA paths of the LoRA slots: the LoRA graph's replay == eager of the same padded
#              batch (max_abs 0, q/k/v as one slot group) and a slot rewritten after capture seen by
#              the replay (tests/test_cuda_graphs.py), the group kernels in bf16 against the members'
#              own and fp32 (tests/test_lora_layers.py), the two streams' deltas as one launch pair
#              == unpaired in bf16 and replayed from a graph (tests/test_lora_pair.py), the slot /
#              kernel (interpreter) / manager / merged-linear tests (~2 min)
#   kernels    benchmarks/diffusion/lora_kernels.py (then --sweep): the delta kernels alone, replayed from CUDA
#              graphs, at rows 256 / 1024 / 4096 / 8192 for qkv (one group launch pair vs three),
#              out, mlp_up, mlp_down (rank 64, bf16) against the bf16 base GEMM and the bytes bound,
#              and the fastest (tile rows, split_k, n_chunks) of a grid per case: what to set the
#              constants of vllm_omni/lora/kernels.py and batch.TILE_ROWS to (the default plans first,
#              ~1 min, then the sweep, ~3-5 min, mostly compiles)
#   serve      the issue's table (lora_serving_benchmark.py): `vllm serve Qwen/Qwen-Image --omni
#              --load-format dummy` without, then with `--lora-modules lightning=DIR` (a random rank-64
#              adapter on every attention and MLP linear, written to /tmp first, ~0.85 GB bf16); per
#              server and size (256, 512, 1024), 8 steps, CFG off, the openai SDK, 2 warm-up then 5
#              timed calls; base requests on both servers, on the LoRA one interleaved with the adapter
#              requests (one base call, one adapter call, in turn) (~4.5 min:
#              two server starts with their graph capture ~85 s each, ~45 s of requests, the adapter
#              file ~20 s). SERVER_ARGS adds flags to both servers (e.g. "--max-num-seqs 1": fewer
#              buckets to capture, faster starts; the timed single requests use the same buckets)
#   profile    lora_profile.py: the device kernels of one 256x256 request (8 steps, CFG off) with and
#              without a random rank-64 adapter, request mode and graphs as `vllm serve --max-num-seqs 1`
#              runs it, under torch.profiler: which kernels the adapter adds or slows (~2 min)
#   fold       lora_kernels.py --fold 1,8 at rows 40 (a prompt's text rows), 256, 1024, 4096: what the
#              base GEMM would cost more with 1 or 8 slots' A as extra output columns (the shrink inside
#              the GEMM, no shrink launch) beside today's delta (~2 min)
#   mix        lora_benchmark.py: the 4-adapter packed CFG mix at real size (eager: its 22.5k rows
#              are past the largest graph bucket), the Triton delta kernels against issue 12's
#              cuBLAS numbers (723.5 ms, 1.153x) (~2 min)
# Files in OUT_DIR: STAGE.log, for `kernels` lora_kernels{,_sweep}.json (and kernels_sweep.log), for
# `profile` lora_profile.json, for `fold` lora_kernels_fold.json, and
# for `serve` lora_serving.json (the table, every call's time, each server's command, its graph log
# lines and log tail) and server_{base,lora}.log.
set -o pipefail
STAGE=$1 OUT=$2 WHEELS=${WHEELS:-.whl}
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  "$WHEELS"/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
run() { local name=$1 limit=$2; shift 2; timeout -k 25 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"; }
case $STAGE in
gpu_tests)
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/env.txt"
  run gpu_tests 300 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graphs.py \
    tests/test_lora_layers.py tests/test_lora_manager.py tests/test_linear.py tests/test_merged_linear.py \
    tests/test_lora_pair.py
  ;;
kernels)
  run kernels 120 python3 benchmarks/diffusion/lora_kernels.py --json-output "$OUT/lora_kernels.json"
  run kernels_sweep 420 python3 benchmarks/diffusion/lora_kernels.py --sweep \
    --json-output "$OUT/lora_kernels_sweep.json"
  ;;
serve)
  run serve 540 python3 benchmarks/diffusion/lora_serving_benchmark.py --model Qwen/Qwen-Image \
    --load-format dummy --device cuda --sizes 256x256,512x512,1024x1024 --steps 8 --warmup 2 --iters 5 \
    --rank 64 --adapter-dir /tmp/issue27_adapter --log-dir "$OUT" --server-timeout 300 \
    --request-timeout 60 --server-args="${SERVER_ARGS:-}" --json-output "$OUT/lora_serving.json"
  ;;
profile)
  run profile 240 python3 benchmarks/diffusion/lora_profile.py --top 30 --json-output "$OUT/lora_profile.json"
  ;;
fold)
  run fold 200 python3 benchmarks/diffusion/lora_kernels.py --rows 40,256,1024,4096 --fold 1,8 \
    --json-output "$OUT/lora_kernels_fold.json"
  ;;
mix)
  run mix 240 python3 benchmarks/diffusion/lora_benchmark.py --json-output "$OUT/lora_benchmark.json"
  ;;
*)
  echo "unknown stage $STAGE (gpu_tests, kernels, serve, profile, fold, mix)" >&2; exit 2
  ;;
esac

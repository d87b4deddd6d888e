#!/usr/bin/env bash
# The H200 runs of issue 12 (CUDA graphs, FA3, peer comparison), as sent through the device tool.
# Usage (repository root = this tree; wheels of diffusers 0.42.1, importlib_metadata and fa3-fwd 0.0.3
# in $WHEELS): bash benchmarks/diffusion/performance_dashboard/h200_issue12.sh STAGE OUT_DIR
#   explore  attention kernels, equivalence with graphs (8 blocks), graph replay checks (60 blocks)
#   peer     peer_comparison.py (60 blocks) and the default bucket grid's capture cost
#   engine   engine steps through the model runner (graphs + compiled + AUTO/FA3), CFG on
#   quick    the joint q/k/v kernel against inductor's, then the peer comparison
#   final    engine, then peer (one call)
#   overlap  stream_overlap.py: text-stream and modulation GEMMs on a side stream, grouped GEMMs
#   checks   equivalence with graphs and replay == eager only (the first half of verify)
#   engine_small  the engine stage for 256x256 and 512x512 alone only
#   lora     lora_benchmark.py (mixed adapters in one forward vs none)
#   verify   equivalence + graph checks (8 / 16 blocks), weight-bound linears, then peer
#   round3   forward_profile.py's round-3 stages on CFG steps (+ the LayerNorm kernels' warp sweep)
#   timeline      step_timeline.py: one engine step's GPU busy time, idle gaps and host syncs
#   large_graphs  eager vs replayed packed forwards at exact large buckets (16 blocks)
#   probe4   checks, timeline, large_graphs (one call)
#   sustained  sustained_gemm.py (an 8192^3 GEMM's burst and 30 s rates) with nvidia-smi telemetry
#   bi       batch_invariance_check.py: batched vs alone max_abs, default and batch-invariant mode
#   gpu_tests  the unit tests with CUDA paths (attention backends, batch invariance, graphs, fused ops)
#   round4   the peer comparison (+ 2*768x1024), then the large engine steps timed both ways (one call)
#   engine_timings  the engine stage with both step timings (pipelined, synced), GPU clocks and power
#            sampled by nvidia-smi every 100 ms meanwhile
#   profile  kernel time per block by category, each elementwise change on top of the previous one,
#            and diffusers compiled (16 blocks); Triton kernels vs torch; equivalence and graph checks
set -o pipefail
STAGE=$1 OUT=$2 WHEELS=${WHEELS:-../whl}
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$WHEELS"/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
run() { local name=$1 limit=$2; shift 2; timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"; }
case $STAGE in
explore)
  { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c \
    "import torch, fa3_fwd_interface; print(torch.__version__, torch.version.cuda, 'fa3-fwd ok')"; } 2>&1 | tee "$OUT/env.txt"
  run attention_kernels 90 python3 benchmarks/diffusion/attention_kernels.py --json-output "$OUT/attention_kernels.json"
  run transformer_equivalence_graphs 150 python3 benchmarks/diffusion/transformer_equivalence.py --device cuda \
    --dtype bfloat16 --num-layers 8 --compile --graphs --json-output "$OUT/transformer_equivalence_graphs.json"
  run cuda_graph_check 300 python3 benchmarks/diffusion/cuda_graph_check.py --num-layers 60 --iters 3 \
    --json-output "$OUT/cuda_graph_check.json"
  ;;
peer)
  run peer_comparison 480 python3 benchmarks/diffusion/peer_comparison.py --num-layers 60 --warmup 2 --iters 5 \
    --json-output "$OUT/peer_comparison.json" --plot "$OUT/peer_comparison.png"
  ;;
engine)
  run step_batching_graphs 540 python3 benchmarks/diffusion/step_batching_benefit.py --load-format dummy \
    --model Qwen/Qwen-Image --cfg-modes on --negative-prompt " " --steps 5 --iters 1 --warmup 1 \
    --mixes "256x256;512x512;1024x1024;8*256x256;512x512+1024x1024;1024x1024+1024x768+768x1024+512x512" \
    --json-output "$OUT/step_batching_graphs.json" --plot "$OUT/step_batching_graphs.png"
  ;;
profile)
  run forward_profile 300 python3 benchmarks/diffusion/forward_profile.py --num-layers 16 \
    --cases "1024x1024;2*1024x1024;2*512x512;8*256x256" --json-output "$OUT/forward_profile.json"
  run forward_profile_large_buckets 120 python3 benchmarks/diffusion/forward_profile.py --num-layers 16 \
    --stages +triton --no-diffusers --cases "2*1024x1024;1328x1328;512x512+1024x1024+512x512+1024x1024" \
    --graph-img-rows 256,512,1024,1536,2048,3072,4096,6144,8192,12288 \
    --json-output "$OUT/forward_profile_large_buckets.json"
  run transformer_equivalence_graphs 150 python3 benchmarks/diffusion/transformer_equivalence.py --device cuda \
    --dtype bfloat16 --num-layers 8 --compile --graphs --json-output "$OUT/transformer_equivalence_graphs.json"
  run cuda_graph_check 150 python3 benchmarks/diffusion/cuda_graph_check.py --num-layers 16 --iters 3 \
    --json-output "$OUT/cuda_graph_check.json"
  ;;
quick)  # the joint q/k/v kernel against inductor's, then the peer comparison (one call)
  run forward_profile_quick 150 python3 benchmarks/diffusion/forward_profile.py --num-layers 16 \
    --stages +gelu_epilogue,+triton --no-diffusers --cases "1024x1024;2*1024x1024" \
    --json-output "$OUT/forward_profile_quick.json"
  run peer_comparison 420 python3 benchmarks/diffusion/peer_comparison.py --num-layers 60 --warmup 2 --iters 5 \
    --json-output "$OUT/peer_comparison.json" --plot "$OUT/peer_comparison.png"
  ;;
overlap)  # can the weight-bound GEMMs hide behind the compute-bound ones (side stream, grouped GEMM)?
  run stream_overlap 200 python3 benchmarks/diffusion/stream_overlap.py --blocks 8 --iters 10 \
    --json-output "$OUT/stream_overlap.json"
  ;;
round3)  # each round-3 change on top of the previous one (CFG steps), the norm kernels' warps
  run forward_profile_r3 240 python3 benchmarks/diffusion/forward_profile.py --num-layers 16 --no-diffusers \
    --stages +triton,+joint_rows \
    --cases "2*1024x1024;2*512x512+2*1024x1024;2*1024x1024+2*1024x768+2*768x1024+2*512x512" \
    --json-output "$OUT/forward_profile_r3.json"
  ;;
verify)  # equivalence and graph checks, the weight-bound linears, then the peer comparison (one call)
  bash "$0" checks "$OUT"
  run skinny_linears 60 python3 benchmarks/diffusion/stream_overlap.py --skinny-only \
    --json-output "$OUT/skinny_linears.json"  # (this call ran an older, event-timed version of it)
  bash "$0" peer "$OUT"
  ;;
checks)  # equivalence with graphs (8 blocks) and replay == eager (16 blocks) only
  run transformer_equivalence_graphs 150 python3 benchmarks/diffusion/transformer_equivalence.py --device cuda \
    --dtype bfloat16 --num-layers 8 --compile --graphs --json-output "$OUT/transformer_equivalence_graphs.json"
  run cuda_graph_check 150 python3 benchmarks/diffusion/cuda_graph_check.py --num-layers 16 --iters 3 \
    --json-output "$OUT/cuda_graph_check.json"
  ;;
engine_small)  # the engine stage's two graph-replayed single requests only
  run step_batching_small 240 python3 benchmarks/diffusion/step_batching_benefit.py --load-format dummy \
    --model Qwen/Qwen-Image --cfg-modes on --negative-prompt " " --steps 5 --iters 1 --warmup 1 \
    --mixes "256x256;512x512" --json-output "$OUT/step_batching_small.json"
  ;;
lora)  # the LoRA benchmark (4 adapters, 4-request CFG mix)
  run lora_benchmark 240 python3 benchmarks/diffusion/lora_benchmark.py --json-output "$OUT/lora_benchmark.json"
  ;;
engine+lora)  # the engine stage, then the LoRA benchmark (one call)
  bash "$0" engine "$OUT" && bash "$0" lora "$OUT"
  ;;
round3+engine)  # round3, then the engine stage (one call)
  bash "$0" round3 "$OUT" && bash "$0" engine "$OUT"
  ;;
final)  # the engine stage, then the peer comparison (one call)
  bash "$0" engine "$OUT" && bash "$0" peer "$OUT"
  ;;
timeline)  # where an engine step's wall time goes: GPU busy, idle gaps, host syncs
  run step_timeline 420 python3 benchmarks/diffusion/step_timeline.py --model Qwen/Qwen-Image --load-format dummy \
    --negative-prompt " " --steps 7 \
    --mixes "512x512;1024x1024;512x512+1024x1024;1024x1024+1024x768+768x1024+512x512" \
    --json-output "$OUT/step_timeline.json"
  ;;
large_graphs)  # would replaying the large packed forwards pay, at buckets that fit them exactly?
  run forward_profile_large_graphs 240 python3 benchmarks/diffusion/forward_profile.py --num-layers 16 \
    --no-diffusers --stages +joint_rows --interleaved-rounds 3 \
    --cases "2*1024x1024;2*512x512+2*1024x1024;2*1024x1024+2*1024x768+2*768x1024+2*512x512" \
    --graph-img-rows 256,512,1024,1536,2048,3072,4096,8192,10240,22528 \
    --json-output "$OUT/forward_profile_large_graphs.json"
  ;;
engine_timings)  # engine steps timed both ways, with the GPU's clocks and power meanwhile
  nvidia-smi --query-gpu=name,power.limit,power.max_limit,clocks.max.sm,clocks.max.mem --format=csv \
    > "$OUT/gpu_limits.csv"
  q=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu
  { nvidia-smi --query-gpu=$q,clocks_event_reasons.active --format=csv -lms 100 \
    || nvidia-smi --query-gpu=$q --format=csv -lms 100; } > "$OUT/gpu_telemetry.csv" 2>&1 & smi=$!
  run step_batching_timings 580 python3 benchmarks/diffusion/step_batching_benefit.py --load-format dummy \
    --model Qwen/Qwen-Image --cfg-modes on --negative-prompt " " --steps 6 --iters 1 --warmup 1 \
    --timing pipelined,synced \
    --mixes "256x256;512x512;1024x1024;8*256x256;512x512+1024x1024;1024x1024+1024x768+768x1024+512x512" \
    --json-output "$OUT/step_batching_timings.json" --plot "$OUT/step_batching_timings.png"
  kill $smi; pkill -f "nvidia-smi --query-gpu" || true
  ;;
sustained)  # the GEMM rate in a burst and sustained, the clocks and power meanwhile
  q=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu,clocks_event_reasons.active
  nvidia-smi --query-gpu=$q --format=csv -lms 100 > "$OUT/gpu_telemetry_gemm.csv" 2>&1 & smi=$!
  run sustained_gemm 120 python3 benchmarks/diffusion/sustained_gemm.py --size 8192 --seconds 30 \
    --json-output "$OUT/sustained_gemm.json"
  kill $smi; pkill -f "nvidia-smi --query-gpu" || true
  ;;
bi)  # batch-invariant mode on the current kernels: batched == alone bit for bit
  run batch_invariance_check 420 python3 benchmarks/diffusion/batch_invariance_check.py --model Qwen/Qwen-Image \
    --load-format dummy --device cuda --dtype bfloat16 --steps 4 --json-output "$OUT/batch_invariance_check.json"
  ;;
gpu_tests)  # the unit tests that have CUDA paths, on the GPU
  run gpu_tests 280 python3 -m pytest -q -p no:cacheprovider tests/test_attention_backends.py \
    tests/test_batch_invariance.py tests/test_cuda_graphs.py tests/test_fused_ops.py
  ;;
round4)  # the 5120 / 6144-row buckets: peer (with a 6144-row same-shape pair), then large engine steps
  run peer_comparison 300 python3 benchmarks/diffusion/peer_comparison.py --num-layers 60 --warmup 2 --iters 5 \
    --cases "256x256;512x512;768x1024;1024x1024;1328x1328;8*256x256;2*768x1024;512x512+1024x1024;1024x1024+1024x768+768x1024+512x512" \
    --json-output "$OUT/peer_comparison.json" --plot "$OUT/peer_comparison.png"
  run step_batching_large 290 python3 benchmarks/diffusion/step_batching_benefit.py --load-format dummy \
    --model Qwen/Qwen-Image --cfg-modes on --negative-prompt " " --steps 6 --iters 2 --warmup 1 \
    --timing pipelined,synced --mixes "768x1024;1024x1024;512x512+1024x1024;1024x1024+1024x768+768x1024+512x512" \
    --json-output "$OUT/step_batching_large.json" --plot "$OUT/step_batching_large.png"
  ;;
probe4)  # round 4's first call
  bash "$0" checks "$OUT"; bash "$0" timeline "$OUT"; bash "$0" large_graphs "$OUT"
  ;;
esac

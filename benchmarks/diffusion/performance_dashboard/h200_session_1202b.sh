# The last device call of the 2026-12-02 03:21 UTC session (about 6 device minutes were left), in
# priority order, each result written as it completes. Usage (repository root, wheels in .whl and the
# fused-norm probe in .gpu/, both carried): bash benchmarks/diffusion/performance_dashboard/h200_session_1202b.sh OUT
#   1. issue 24: peer_comparison21.py with 2.1's fused block ops (ours eager / compiled / graph replay
#      against diffusers eager and compile_repeated_blocks), three sizes (~2 min)
#   2. issue 25: the FP8 engine step with every block linear in FP8 (h200_issue24_25.sh fp8_fast's
#      command, two sizes: fewer graph buckets to capture) (~2 min)
#   3. issue 25: the batch-invariant FP8 GEMM and transformer GPU tests (~40 s)
#   4. issue 25: the fused LayerNorm + e4m3 probe (which stage differs from the unfused path) (~20 s)
set -o pipefail
OUT=$1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout -k 5 120 python3 benchmarks/diffusion/peer_comparison21.py --warmup 2 --iters 5 \
  --cases "512x512;1024x1024;2048x2048" --json-output "$OUT/peer21_fused.json" 2>&1 | grep -v "it/s\]$" \
  | tee "$OUT/peer21_fused.log"
KEPT='"img_in", "txt_in", "time_text_embed", "norm_out.linear", "proj_out"'
timeout -k 5 125 python3 benchmarks/diffusion/step_batching_benefit.py --load-format dummy --steps 5 --iters 1 \
  --warmup 1 --model Qwen/Qwen-Image --cfg-modes on --negative-prompt " " --mixes "1024x1024;1328x1328" \
  --quantization "{\"method\": \"fp8\", \"ignored_layers\": [$KEPT]}" --json-output "$OUT/engine_fp8_fast.json" \
  2>&1 | grep -v "capturing CUDA graphs\|step batching:" | tee "$OUT/engine_fp8_fast.log"
timeout -k 5 40 python3 -m pytest -q -p no:cacheprovider tests/test_fp8_gpu.py -k batch_invariant \
  2>&1 | tail -30 | tee "$OUT/gpu_tests.log"
timeout -k 5 20 python3 .gpu/diag2.py 2>&1 | tee "$OUT/fused_norm_probe.log"

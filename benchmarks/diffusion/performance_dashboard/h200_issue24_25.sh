#!/usr/bin/env bash
# Qwen-Image-2.1 (issue 24) and FP8 (issue 25) on the H200, as sent through the device tool.
# Usage (repository root = this tree; wheels in $WHEELS, default .whl, carried with the call):
#   bash benchmarks/diffusion/performance_dashboard/h200_issue24_25.sh STAGE OUT_DIR
#   gpu_tests  the unit tests with CUDA paths, including the cross-length varlen cases (FA3 / FA2 with
#              cu_seqlens_q != cu_seqlens_k) that 2.1's steps use, and the FP8 linear on the GPU (~1 min)
#   peer21     peer_comparison21.py: 2.1 (32 blocks, released widths) vs diffusers eager and
#              compile_repeated_blocks, both with the prefix cached, same weights; ours eager, with the
#              fused ops compiled (enable_compile) and replayed from the packed step's CUDA graphs (the
#              server's path); the JSON is rewritten after every timing (~5 min)
#   engine21   step_batching_benefit.py on `Qwen/Qwen-Image-2.1 --load-format dummy`: steps alone and
#              packed, CFG off (the model's default), batched / serial; CUDA graphs of the packed step
#              on (the default: buckets over image and prefix rows, captured at start-up) (~6 min)
#   engine21_eager  the same with --enforce-eager (no graphs): the before / after of the graphs (~5 min)
#   gpu_tests21     2.1's CUDA tests: a captured bucket's replay == the eager padded step (max_abs 0),
#              the tiny engine's images with graphs == eager, plus the CPU graph-path tests (~2 min)
#   fp8        step_batching_benefit.py on `Qwen/Qwen-Image --load-format dummy`, BF16 then FP8, CFG
#              on, the issue's cases (1024x1024, 1328x1328, the 4-mix) and issue 23's (512x512,
#              512x512+1024x1024) (~6 min)
#   fp8_fast   the same FP8 engine steps with every block linear in FP8 (modulation and the image MLP's
#              down projection too; only the embedders and the final projection kept in BF16): the
#              configuration under 22 GiB that docs/quantization.md documents (~2.5 min)
#   bi_fp8     batch_invariance_check.py --quantization fp8 at real size: each request of three size
#              pairs batched vs alone, default FP8 vs batch-invariant FP8, max_abs at transformer, latent
#              and image, and the step time ratio (~4 min)
#   fp8_error  fp8_layer_error.py at 60 blocks, 1024x1024: the output error of each kept-layer set and of
#              each group alone, the weights' GiB (issue 25 item 3), and with --steps 8 each set's error
#              after 8 Euler steps from the same noise (item 6, end to end) (~2 min)
#   fp8_kernels  the FP8 GPU tests (Triton quantisation == torch bit for bit, an FP8 forward captured in
#              a CUDA graph, merged QKV) then fp8_gemm.py: bf16 vs FP8 GEMM alone vs + torch / + Triton
#              quantisation at Qwen-Image's shapes, rows 8192 and 22528, sustained (~3 min)
#   fp8_profile  step_profile.py: one 1024x1024 CFG request (4 steps) under torch.profiler, BF16 then every
#              block linear in FP8, as `vllm serve --max-num-seqs 1` runs it: device ms per step by
#              kernel class (bf16 / FP8 GEMM, attention, quantisation, ...) and the kernels FP8 changed
#              most (~4 min)
#   fp8_fused  the fused-producer tests (norm / GELU kernels emit e4m3 + scales: == quantize_rows of the
#              unfused output, F.gelu bit for bit; a fused FP8 forward == the unfused one and captures in
#              a CUDA graph) then fp8_fused_blocks.py: bf16 vs FP8 unfused vs FP8 fused per block
#              (norm + QKV, up + GELU + down, GELU + down), rows 8192 and 22528, sustained (~4 min)
set -o pipefail
STAGE=$1 OUT=$2 WHEELS=${WHEELS:-.whl}
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  "$WHEELS"/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
run() { local name=$1 limit=$2; shift 2; timeout -k 20 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"; }
STEPS=(python3 benchmarks/diffusion/step_batching_benefit.py --load-format dummy --steps 5 --iters "${ITERS:-1}" --warmup 1)
case $STAGE in
gpu_tests)
  run gpu_tests 200 python3 -m pytest -q -p no:cacheprovider tests/test_attention_backends.py \
    tests/test_linear.py tests/test_quantization.py tests/test_cuda_graphs.py tests/test_fused_ops.py \
    tests/test_fp8_gpu.py tests/test_merged_linear.py
  ;;
peer21)
  run peer21 330 python3 benchmarks/diffusion/peer_comparison21.py --warmup 2 --iters 5 \
    --variants diffusers,ours,ours_compiled,ours_graph,diffusers_compiled --json-output "$OUT/peer21.json"
  ;;
engine21 | engine21_eager)
  EAGER=()
  [ "$STAGE" = engine21_eager ] && EAGER=(--enforce-eager)
  run "$STAGE" 400 "${STEPS[@]}" --model Qwen/Qwen-Image-2.1 --cfg-modes off "${EAGER[@]}" \
    --mixes "256x256;512x512;1024x1024;4*256x256;8*512x512;512x512+1024x1024+1024x768+768x1024" \
    --json-output "$OUT/$STAGE.json" --plot "$OUT/$STAGE.png"
  ;;
gpu_tests21)
  run gpu_tests21 300 python3 -m pytest -q -s -p no:cacheprovider tests/test_qwen_image21_graphs.py \
    tests/test_qwen_image21_transformer.py tests/test_qwen_image21_fused_ops.py
  ;;
fp8)
  # issue 23's engine mixes too: this stage's engine_bf16 is that issue's "after" run
  MIXES="512x512;1024x1024;1328x1328;512x512+1024x1024;1024x1024+1024x768+768x1024+512x512"
  run engine_bf16 280 "${STEPS[@]}" --model Qwen/Qwen-Image --cfg-modes on --negative-prompt " " \
    --mixes "$MIXES" --json-output "$OUT/engine_bf16.json"
  run engine_fp8 280 "${STEPS[@]}" --model Qwen/Qwen-Image --cfg-modes on --negative-prompt " " \
    --mixes "$MIXES" --quantization fp8 --json-output "$OUT/engine_fp8.json"
  ;;
fp8_fast)
  KEPT='"img_in", "txt_in", "time_text_embed", "norm_out.linear", "proj_out"'
  run engine_fp8_fast 280 "${STEPS[@]}" --model Qwen/Qwen-Image --cfg-modes on --negative-prompt " " \
    --mixes "1024x1024;1328x1328;1024x1024+1024x768+768x1024+512x512" \
    --quantization "{\"method\": \"fp8\", \"ignored_layers\": [$KEPT]}" --json-output "$OUT/engine_fp8_fast.json"
  ;;
fp8_profile)
  run fp8_profile 420 python3 benchmarks/diffusion/step_profile.py --size 1024x1024 --steps 4 --top 25 \
    --json-output "$OUT/step_profile.json"
  ;;
bi_fp8)
  run bi_fp8 400 python3 benchmarks/diffusion/batch_invariance_check.py --model Qwen/Qwen-Image \
    --load-format dummy --device cuda --dtype bfloat16 --quantization fp8 --steps 4 \
    --json-output "$OUT/bi_fp8.json"
  ;;
fp8_error)
  run fp8_error 400 python3 benchmarks/diffusion/fp8_layer_error.py --num-layers 60 --size 1024 --steps 8 \
    --device cuda --json-output "$OUT/fp8_layer_error.json"
  ;;
fp8_kernels)
  run fp8_gpu_tests 150 python3 -m pytest -q -p no:cacheprovider tests/test_fp8_gpu.py \
    tests/test_merged_linear.py tests/test_quantization.py tests/test_fp8_checkpoint.py
  run fp8_gemm 240 python3 benchmarks/diffusion/fp8_gemm.py --rows 8192,22528 --seconds 1 \
    --json-output "$OUT/fp8_gemm.json"
  ;;
fp8_fused)
  run fp8_fused_tests 200 python3 -m pytest -q -p no:cacheprovider tests/test_fp8_gpu.py tests/test_fp8_fusion.py
  run fp8_fused_blocks 240 python3 benchmarks/diffusion/fp8_fused_blocks.py --rows 8192,22528 --seconds 1 \
    --json-output "$OUT/fp8_fused_blocks.json"
  ;;
*)
  echo "unknown stage $STAGE (gpu_tests, gpu_tests21, peer21, engine21, engine21_eager, fp8, fp8_kernels," \
    "fp8_fused, fp8_fast, fp8_profile, bi_fp8, fp8_error)" >&2
  exit 2
  ;;
esac

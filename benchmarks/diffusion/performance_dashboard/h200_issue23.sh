#!/usr/bin/env bash
# Issue 23's H200 check: the model seam changed no speed. The same benchmarks on the tree before the
# seam (6cbe4e0^1, the commit the seam merged into) and on this tree, in one call, interleaved
# (after, before, after) so that a drift of the GPU shows as a difference between the two "after" runs.
# Usage (repository root = this tree; wheels in $WHEELS, default .whl; both carried with the call):
#   mkdir -p .before && git archive 6cbe4e0^1 vllm_omni benchmarks | tar -x -C .before   # once, here
#   echo /.before/ >> .git/info/exclude
#   bash benchmarks/diffusion/performance_dashboard/h200_issue23.sh STAGE OUT_DIR
#   peer    peer_comparison.py (16 blocks; diffusers, our graph replay and compiled forward; 4 cases)
#           after / before / after (~5 min)
#   engine  step_batching_benefit.py (engine steps through the model runner, CFG on, 5 mixes)
#           after / before (~6 min)
#   engine_before  the before half alone, for a call that already ran the after half with the same
#           arguments (`h200_issue24_25.sh fp8`'s engine_bf16 uses these mixes) (~3 min)
# Done when (issue 23): each of our columns is within 2 % between before and after, relative to the
# same run's diffusers column (peer), and per mix (engine).
set -o pipefail
STAGE=$1 OUT=$2 WHEELS=${WHEELS:-.whl}
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  "$WHEELS"/*.whl || exit 1
[ -d .before/vllm_omni ] || { echo "no .before/ (see the usage above)" >&2; exit 2; }
ROOT=$PWD
# run NAME TREE LIMIT CMD...: the command from TREE's root, importing TREE's vllm_omni
run() {
  local name=$1 tree=$2 limit=$3; shift 3
  (cd "$tree" && PYTHONPATH=/tmp/site:$PWD timeout -k 20 "$limit" "$@") 2>&1 | tee "$OUT/$name.log"
}
PEER=(python3 benchmarks/diffusion/peer_comparison.py --num-layers 16 --warmup 2 --iters 5
  --variants diffusers,ours_graph,ours_compiled
  --cases "512x512;1024x1024;512x512+1024x1024;1024x1024+1024x768+768x1024+512x512")
ENGINE=(python3 benchmarks/diffusion/step_batching_benefit.py --load-format dummy --model Qwen/Qwen-Image
  --cfg-modes on --negative-prompt " " --steps 5 --iters 1 --warmup 1
  --mixes "512x512;1024x1024;1328x1328;512x512+1024x1024;1024x1024+1024x768+768x1024+512x512")
case $STAGE in
peer)
  run peer_after1 "$ROOT" 150 "${PEER[@]}" --json-output "$OUT/peer_after1.json"
  run peer_before "$ROOT/.before" 150 "${PEER[@]}" --json-output "$OUT/peer_before.json"
  run peer_after2 "$ROOT" 150 "${PEER[@]}" --json-output "$OUT/peer_after2.json"
  ;;
engine)
  run engine_after "$ROOT" 240 "${ENGINE[@]}" --json-output "$OUT/engine_after.json"
  run engine_before "$ROOT/.before" 240 "${ENGINE[@]}" --json-output "$OUT/engine_before.json"
  ;;
engine_before)
  run engine_before "$ROOT/.before" 240 "${ENGINE[@]}" --json-output "$OUT/engine_before.json"
  ;;
*)
  echo "unknown stage $STAGE (peer, engine, engine_before)" >&2; exit 2
  ;;
esac

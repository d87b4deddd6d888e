set -o pipefail
OUT=$1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout -k 10 150 python3 -m pytest -q -p no:cacheprovider tests/test_fp8_gpu.py tests/test_quantization.py tests/test_cuda_graphs.py 2>&1 | tail -30 | tee $OUT/gpu_tests_fp8_graphs.log
timeout -k 10 90 python3 benchmarks/diffusion/fp8_gemm.py --rows 8192,22528 --seconds 0.5 --json-output $OUT/fp8_gemm.json 2>&1 | tail -14 | tee $OUT/fp8_gemm.log
timeout -k 10 170 python3 -m pytest -q -s -p no:cacheprovider tests/test_qwen_image21_graphs.py tests/test_qwen_image21_transformer.py 2>&1 | tail -40 | tee $OUT/gpu_tests21.log

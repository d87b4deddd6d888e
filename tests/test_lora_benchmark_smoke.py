"""`benchmarks/diffusion/lora_benchmark.py` on CPU with the tiny model (one iteration; no timing asserts)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.diffusion import lora_benchmark  # noqa: E402


def test_lora_benchmark_tiny(tmp_path):
    out = tmp_path / "lora.json"
    argv = ["--model", "tiny-qwen-image", "--device", "cpu", "--iters", "1", "--warmup", "0"]
    argv += ["--mix", "32x32+32x48+48x32", "--num-adapters", "2", "--rank", "4", "--json-output", str(out)]
    result = lora_benchmark.main(argv)
    assert result["num_seqs"] == 6 and result["num_adapters"] == 2 and result["rank"] == 4
    assert result["base_ms"] > 0 and result["mixed_ms"] > 0 and result["ratio"] is not None
    assert result["split_per_adapter_ms"] > 0 and result["split_ratio"] is not None
    assert result["max_abs_diff_vs_split"] <= 1e-4  # fp32: a request's rows do not depend on the others
    assert json.loads(out.read_text())["lora_benchmark"]["mix"] == "32x32+32x48+48x32"

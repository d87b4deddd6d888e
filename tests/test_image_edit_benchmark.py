"""Smoke test of benchmarks/diffusion/image_edit_benchmark.py on the tiny edit checkpoint (CPU)."""

from __future__ import annotations

import json

from benchmarks.diffusion import image_edit_benchmark


def test_image_edit_benchmark_smoke(tiny_edit_model_dir, tmp_path):
    out = tmp_path / "edit.json"
    argv = ["--model", str(tiny_edit_model_dir), "--mixes", "48x80+64x64", "--steps", "3"]
    payload = image_edit_benchmark.main(
        argv + ["--iters", "1", "--warmup", "0", "--no-progress", "--json-output", str(out)]
    )
    (case,) = payload["results"]
    assert case["max_reqs_per_step"] == 2 and case["batched_path"] == "packed"
    assert case["diffusers_transformer_step_ms"] > 0 and case["batched_denoise_step_ms"] > 0
    assert json.loads(out.read_text())["benchmark"] == "image_edit_benchmark"

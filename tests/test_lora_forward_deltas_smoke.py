"""`benchmarks/diffusion/lora_forward_deltas.py` under triton's CPU interpreter at tiny dims: one run
per row count, its check of a block's outputs against fp32 math (no timing asserts)."""

from __future__ import annotations

from triton_interpreter import PATCH, run_interpreted

RUN = """
import json, sys
from benchmarks.diffusion import lora_forward_deltas as bench
import vllm_omni.lora.kernels as kernels
argv = ["--device", "cpu", "--rows", "40,70", "--txt-rows", "8", "--blocks", "2", "--rank", "16",
        "--max-loras", "2", "--iters", "1", "--json-output", OUT,
        "--dims", "qkv:3:32:32,out:1:32:32,mlp_up:1:32:64,mlp_down:1:64:32"]
"""


def test_forward_deltas_run_and_match_fp32_math(tmp_path):
    out = tmp_path / "forward.json"
    script = (
        PATCH
        + f"OUT = {str(out)!r}\n"
        + RUN
        + """
result = bench.main(argv)
rows = result["results"]
cases = [(40, "exact"), (40, "graph"), (70, "exact"), (70, "graph")]
assert [(r["rows"], r["tables"]) for r in rows] == cases and all(r["txt_rows"] == 8 for r in rows)
assert all(r["max_rel_err"] < 1e-4 for r in rows), rows  # fp32: the kernels' math is the reference's
assert all(r[k] > 0 for r in rows for k in ("base_us", "cold_us", "hot_us"))
assert json.load(open(OUT))["args"]["blocks"] == 2
print("ok")
"""
    )
    run_interpreted(script)


def test_forward_deltas_check_sees_a_missing_delta(tmp_path):
    """The benchmark's own check fails a forward whose deltas are not launched."""
    script = (
        PATCH
        + f"OUT = {str(tmp_path / 'forward.json')!r}\n"
        + RUN
        + """
kernels.lora_delta_pair = lambda *args, **kwargs: None
rows = bench.main(argv)["results"]
assert all(r["max_rel_err"] > 1e-3 for r in rows), rows
print("ok")
"""
    )
    run_interpreted(script)


def test_unknown_table_kinds_are_refused(capsys):
    import sys
    from pathlib import Path

    import pytest

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.diffusion import lora_forward_deltas

    with pytest.raises(SystemExit):
        lora_forward_deltas.parse_args(["--tables", "exact,grap"])
    assert "--tables: ['grap'] are not exact / graph" in capsys.readouterr().err

"""benchmarks/diffusion/lora_serving_benchmark.py on CPU: two tiny servers (without and with a random
adapter), one size, the openai SDK; the table and the JSON's structure."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.diffusion import lora_serving_benchmark as lsb  # noqa: E402


def test_two_tiny_servers_fill_the_table(tmp_path):
    pytest.importorskip("openai")
    out = tmp_path / "lora_serving.json"
    argv = ["--model", "tiny-qwen-image", "--device", "cpu", "--sizes", "32x32", "--steps", "2"]
    argv += ["--iters", "1", "--warmup", "1", "--rank", "8", "--server-timeout", "120"]
    payload = lsb.main([*argv, "--adapter-dir", str(tmp_path / "adapter"), "--json-output", str(out)])
    assert payload["complete"], json.dumps(payload["servers"], indent=1)[-3000:]
    (row,) = json.loads(out.read_text())["table"]
    assert row["size"] == "32x32" and all(row[k] > 0 for k in ("base_server_s", "lora_server_adapter_s"))
    assert row["adapter_vs_base_on_lora"] is not None and payload["adapter"]["num_modules"] == 24
    assert "--lora-modules" in payload["servers"]["lora"]["server_command"]
    assert (tmp_path / "lora_serving_logs" / "server_lora.log").is_file()


def test_bad_server_list_is_refused():
    with pytest.raises(SystemExit):
        lsb.parse_args(["--servers", "base,bogus"])


def test_lora_profile_runs_both_requests_on_cpu(tmp_path):
    """lora_profile.py end to end on the tiny model (the kernel table itself is the GPU's: on CPU the
    engine's thread is not profiled); both requests run and the JSON has their runs."""
    from benchmarks.diffusion import lora_profile

    out = tmp_path / "lora_profile.json"
    argv = ["--model", "tiny-qwen-image", "--device", "cpu", "--size", "32x32", "--steps", "2"]
    lora_profile.main([*argv, "--warmup", "1", "--rank", "8", "--top", "5", "--json-output", str(out)])
    payload = json.loads(out.read_text())
    assert set(payload["runs"]) == {"base", "adapter"}
    assert all(run["wall_s"] > 0 for run in payload["runs"].values())
    assert payload["adapter"]["num_modules"] == 24 and len(payload["changed_kernels"]) <= 5

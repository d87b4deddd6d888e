"""`load_benchmark.py --merge`: runs of one configuration each (one device call each) joined into one
report, on the H200 run of 2026-12-02 (`load_d`: request mode and the latency policy in one call)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.diffusion import load_benchmark as lb

LOAD_D = Path(__file__).parents[1] / (
    "benchmarks/diffusion/performance_dashboard/h200_results/issue22/load_d/load_d.json"
)


def split_runs(tmp_path: Path) -> tuple[dict, list[str]]:
    whole = json.loads(LOAD_D.read_text())
    paths = []
    for name in ("request", "latency"):
        run = {**whole, "configs": {name: whole["configs"][name]}}
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(run))
        paths.append(str(path))
    return whole, paths


def test_merged_runs_give_the_report_of_the_run_that_had_both(tmp_path):
    whole, paths = split_runs(tmp_path)
    out = tmp_path / "merged.json"
    merged = lb.main(
        ["--merge", *paths, "--json-output", str(out), "--markdown-output", str(tmp_path / "m.md")]
    )
    assert set(merged["configs"]) == {"request", "latency"}
    assert merged["comparison"] == json.loads(json.dumps(lb.comparison_rows(whole)))
    rows = {(r["load"], r["config"]): r for r in merged["comparison"]}
    latency = rows[("1", "latency")]
    assert latency["x:mean_s"] == pytest.approx(2.84 / 3.49, abs=0.01)  # the dashboard's 0.81x
    assert json.loads(out.read_text())["configs"].keys() == merged["configs"].keys()


def test_runs_of_another_workload_are_refused(tmp_path):
    _, paths = split_runs(tmp_path)
    other = json.loads(Path(paths[1]).read_text())
    other["workload"]["num_requests"] += 1
    Path(paths[1]).write_text(json.dumps(other))
    with pytest.raises(ValueError, match="another workload"):
        lb.merge_runs(paths)

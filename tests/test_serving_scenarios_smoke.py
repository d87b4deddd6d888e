"""benchmarks/diffusion/run_serving_scenarios.py on CPU: three tiny servers, both scenarios.

The run is checked against what the harness does not compute itself: each server's own /metrics
(every config did the same work, 8 requests x steps request-steps; (a) never batched two requests,
(b)/(c) mixed resolutions in one step) and the JSON file it wrote. The estimate arithmetic is checked
by hand-computed cases.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.diffusion import run_serving_scenarios as rss  # noqa: E402

SIZES = "64x64,64x48,48x64,32x32"
STEPS = 2
NUM_REQUESTS = 8


def test_estimate_arithmetic():
    assert rss.serial_duration([2.0, 1.0], [0.0, 0.0]) == 3.0
    assert rss.serial_duration([2.0, 1.0], [0.0, 5.0]) == 6.0  # idle until the second arrival
    cal = rss.Calibration(fixed_s={"A": 1.0, "B": 0.5}, step_s={"A": 0.1, "B": 0.05})
    est = rss.estimate(cal, ["A", "B"], 10, "2.5")  # alone: A 2.0 s, B 1.0 s
    assert est["s0"] == {"serial_s": 3.0, "floor_s": 2.0, "max_speedup": 1.5}
    assert est["s1"]["serial_s"] == pytest.approx(3.5) and est["s1"]["floor_s"] == pytest.approx(3.5)
    assert rss.resolve_interval("scaled", 20) == pytest.approx(1.0)
    # remaining = SAFETY * (s0 + s1 serial) * (1 + configs left) + overhead * configs left
    assert rss.remaining_s(est, 2, 10.0) == pytest.approx(rss.SAFETY * 6.5 * 3 + 20.0)
    fits_20 = rss.remaining_s(rss.estimate(cal, ["A", "B"], 20, "2.5"), 2, 10.0)
    assert rss.choose_steps(cal, ["A", "B"], "2.5", fits_20, 2, 10.0) == 20
    assert rss.choose_steps(cal, ["A", "B"], "2.5", 1e9, 2, 10.0) == rss.MAX_AUTO_STEPS
    assert rss.choose_steps(cal, ["A", "B"], "2.5", 0.0, 2, 10.0) == 2  # the floor: 1 step is refused


@pytest.mark.parametrize(
    "argv, field",
    [
        (["--steps", "auto"], "--time-budget"),
        (["--steps", "0"], "--steps"),
        (["--configs", "a,d"], "--configs"),
        (["--interval", "0"], "--interval"),
        (["--sizes", "64x50"], "--sizes"),
    ],
)
def test_bad_options(argv, field):
    with pytest.raises(ValueError, match=field):
        rss.parse_args(argv)


@pytest.mark.slow
def test_three_configs_on_cpu(tiny_model_dir, tmp_path, capsys):
    out, png = tmp_path / "scenarios.json", tmp_path / "scenarios.png"
    argv = ["--model", "tiny-qwen-image", "--device", "cpu", "--sizes", SIZES, "--steps", str(STEPS)]
    argv += ["--interval", "0.2", "--warmup-steps", "2", "--calibration-steps", "1", "--no-progress"]
    argv += ["--server-args", "--mixfusion-min-chunk-tokens 1 --mixfusion-max-chunks 100000"]
    argv += ["--server-timeout", "120", "--json-output", str(out), "--plot", str(png)]
    payload = rss.main(argv)

    assert json.loads(out.read_text()) == json.loads(json.dumps(payload))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert payload["complete"] and payload["steps"] == STEPS
    assert set(payload["calibration"]["step_s"]) == set(SIZES.split(","))
    assert list(payload["configs"]) == ["a", "b", "c"]
    for key, result in payload["configs"].items():
        assert "error" not in result, result.get("error")
        assert Path(result["server_log"]).is_file()
        assert ("--no-enable-mixfusion" if key == "a" else "--enable-mixfusion") in result["server_command"]
        for scenario in ("s0", "s1"):
            run = result["scenarios"][scenario]
            summary, engine = run["summary"], run["engine"]
            assert summary["num_completed"] == NUM_REQUESTS and summary["num_failed"] == 0
            assert sorted(r["index"] for r in run["requests"] if r["ok"]) == list(range(NUM_REQUESTS))
            assert set(summary["per_resolution"]) == set(SIZES.split(","))
            # The server's own count: every config did the same work.
            assert engine["num_request_steps"] == NUM_REQUESTS * STEPS
            if key == "a":  # same-shape FIFO: never two sizes in one step (two of one size may meet when
                # concurrent arrivals reach the engine out of index order)
                assert engine["num_mixed_resolution_steps"] == 0
        arrivals = [r["arrival_s"] for r in result["scenarios"]["s1"]["requests"]]
        assert arrivals == pytest.approx([0.2 * i for i in range(NUM_REQUESTS)])
    # MixFusion batched the burst's mixed sizes (in (b) or (c): one is enough against timing noise).
    assert max(payload["configs"][k]["scenarios"]["s0"]["engine"]["num_mixed_resolution_steps"] for k in "bc")

    durations = payload["comparison"]["duration_s"]
    speedups = {(s["config"], s["baseline"], s["scenario"]): s for s in payload["comparison"]["speedups"]}
    c_vs_a = speedups[("c", "a", "s1")]
    assert c_vs_a["target"] == 1.3
    assert c_vs_a["value"] == pytest.approx(durations["a"]["s1"] / durations["c"]["s1"])
    assert {("c", "b", "s0"), ("c", "b", "s1")} <= set(speedups)
    stdout = capsys.readouterr().out
    assert "| (c) vs (a) | s1 |" in stdout and "| (a) same-shape FIFO | s0 burst |" in stdout

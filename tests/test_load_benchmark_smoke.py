"""benchmarks/diffusion/load_benchmark.py on CPU: two tiny servers, one load of 4 requests.

The run is checked for its structure (JSON, markdown, plot) and for what the harness promises: the
same trace for every configuration, alone times measured once (on `request`) and the capacity taken
from them, ratios to `request`, the server's timings kept per request. The burst (16 more requests,
too slow for a smoke run on 2 shared cores) is left out there; its table and plot are checked on a
made-up payload. Two cheap runs whose servers cannot start check that a failed configuration is
recorded and the next one still runs, and that the JSON of an earlier call is extended, not replaced.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.diffusion import load_benchmark as lb  # noqa: E402
from benchmarks.diffusion.common import ImageSize  # noqa: E402

NUM_REQUESTS = 4
# No warm-up: a tiny server's first request of a shape takes seconds on CPU, so the alone times come
# out long and the capacity low; load 2 keeps the 4 arrivals within a few seconds all the same.
SMOKE = ["--model", "tiny-qwen-image", "--device", "cpu", "--size-scale", "0.0625", "--steps-scale", "0.1"]
SMOKE += ["--num-requests", str(NUM_REQUESTS), "--loads", "2", "--server-timeout", "120"]
PROFILE_SIZES = ["32x32", "48x48", "64x64", "96x96"]
BURST_SIZES = ["64x64", "64x48", "48x64", "32x32", "64x64", "32x32", "16x16", "80x80"]
PNG = b"\x89PNG\r\n\x1a\n"


def test_workload_arithmetic():
    assert lb.scale_size(ImageSize(1328, 1328), 0.0625) == ImageSize(80, 80)  # 83 px -> nearest 16
    assert lb.scale_size(ImageSize(256, 256), 0.01) == ImageSize(16, 16)  # never below 16
    assert [lb.scale_steps(n, 0.5) for n in (8, 10, 14, 20, 3)] == [4, 5, 7, 10, 2]
    profile = lb.load_profile(1.0, 1.0)
    assert [(e.size.label, e.steps) for e in profile] == [
        ("512x512", 8), ("768x768", 8), ("1024x1024", 10), ("1536x1536", 14)
    ]  # fmt: skip
    alone = {"512x512@8": 1.0, "768x768@8": 2.0, "1024x1024@10": 3.0, "1536x1536@14": 10.0}
    assert lb.mean_service_s(profile, alone) == pytest.approx(0.15 + 0.5 + 1.35 + 1.5)
    assert lb.mean_service_s(profile, {"512x512@8": 1.0}) is None
    assert lb.quota_counts([0.15, 0.25, 0.45, 0.15], 10) == [1, 3, 5, 1]
    assert lb.quota_counts([0.15, 0.25, 0.45, 0.15], 12) == [2, 3, 5, 2]
    unit = lb.unit_trace(profile, 12, seed=3)
    assert sorted(e.size.width for e, _ in unit) == [512] * 2 + [768] * 3 + [1024] * 5 + [1536] * 2
    assert len(lb.unit_trace(profile, 12, seed=3, draw="random")) == 12
    at_2 = lb.load_items(unit, 2.0)
    assert at_2[0].arrival_s == 0.0
    assert [i.arrival_s for i in at_2] == pytest.approx([t / 2.0 for _, t in unit])  # one trace, rescaled
    assert lb.unit_trace(profile, 12, seed=3) == unit


@pytest.mark.parametrize(
    "argv, field",
    [(["--configs", "request,bogus"], "--configs"), (["--loads", "0.5,-1"], "--loads"),
     (["--steps-scale", "0"], "--steps-scale"), (["--num-requests", "0"], "--num-requests"),
     (["--loads", "none", "--no-burst"], "--loads none")],
)  # fmt: skip
def test_bad_options(argv, field):
    with pytest.raises(ValueError, match=field):
        lb.parse_args(argv)


def test_loads_none_runs_the_burst_alone():
    assert lb.parse_loads("none") == [] and lb.parse_args(["--loads", "none"]).loads == []


def test_failed_config_is_recorded_and_json_extended(tmp_path, capsys):
    """A server that refuses its flags fails fast: each configuration records it and the next runs;
    the configurations of an earlier call in the same JSON are kept."""
    out = tmp_path / "load.json"
    argv = [*SMOKE, "--json-output", str(out), "--markdown-output", str(tmp_path / "load.md")]
    args = lb.parse_args(argv)
    earlier = lb.new_payload(args, lb.load_profile(args.steps_scale, args.size_scale))
    earlier["configs"]["latency"] = {"server_command": [], "loads": {}, "burst": None, "error": "earlier"}
    out.write_text(json.dumps(earlier))
    alone = ",".join(f'"{s}@2": 1.0' for s in PROFILE_SIZES)
    payload = lb.main([*argv, "--configs", "request,skip-ahead", "--server-args=--no-such-flag",
                       "--alone-times", "{" + alone + "}", "--no-burst"])  # fmt: skip
    assert json.loads(out.read_text()) == json.loads(json.dumps(payload))
    assert list(payload["configs"]) == ["latency", "request", "skip-ahead"]
    for name in ("request", "skip-ahead"):
        assert "server exited" in payload["configs"][name]["error"]
        assert "--no-such-flag" in payload["configs"][name]["server_log_tail"]
    assert payload["capacity_req_s"] == pytest.approx(1.0)  # --alone-times: every size 1 s
    assert len(payload["calls"]) == 1 and payload["calls"][0]["configs"] == ["request", "skip-ahead"]
    failed = capsys.readouterr().out.split("Failed configurations:\n")[1].splitlines()
    assert failed[0] == "- `latency`: earlier"
    assert failed[1].startswith("- `request`: RuntimeError: server exited with")
    assert "no-such-flag" in failed[1]
    with pytest.raises(ValueError, match="another workload"):
        lb.main([*argv, "--num-requests", "5", "--configs", "request"])


@pytest.mark.slow
def test_two_configs_on_cpu(tiny_model_dir, tmp_path, capsys):
    out, md, plots = tmp_path / "load.json", tmp_path / "load.md", tmp_path / "plots"
    argv = [*SMOKE, "--configs", "request,skip-ahead", "--warmup-steps", "0", "--no-burst", "--no-progress"]
    argv += ["--json-output", str(out), "--markdown-output", str(md), "--plot-dir", str(plots)]
    payload = lb.main(argv)

    assert json.loads(out.read_text()) == json.loads(json.dumps(payload))
    assert [p.name for p in plots.iterdir()] == ["load_2.png"]
    assert (plots / "load_2.png").read_bytes()[:8] == PNG
    assert [p["size"] for p in payload["profile"]] == PROFILE_SIZES

    # Alone times: every (size, steps) of the profile, measured once, on `request`.
    assert payload["alone_config"] == "request"
    assert set(payload["alone_times"]) == {f"{s}@2" for s in PROFILE_SIZES}
    service = sum(p["weight"] * payload["alone_times"][f"{p['size']}@2"] for p in payload["profile"])
    assert payload["mean_service_s"] == pytest.approx(service)
    assert payload["capacity_req_s"] == pytest.approx(1.0 / service)
    load = payload["loads"]["2"]
    assert load["rate_req_s"] == pytest.approx(2 * payload["capacity_req_s"])
    assert len(load["trace"]) == NUM_REQUESTS and load["trace"][0][2] == 0.0

    assert list(payload["configs"]) == ["request", "skip-ahead"]
    for name, result in payload["configs"].items():
        assert "error" not in result, result.get("error")
        assert ("--step-execution" in result["server_command"]) == (name != "request")
        run = result["loads"]["2"]
        s = run["summary"]
        assert s["num_completed"] == NUM_REQUESTS and s["num_failed"] == 0
        # The same trace for every configuration, as recorded in the payload.
        sent = [[r["size"], r["num_inference_steps"], r["arrival_s"]] for r in run["requests"]]
        assert sent == load["trace"]
        assert set(s["per_size"]) <= set(PROFILE_SIZES)
        assert set(s["slo_attainment"]) == {"2x", "4x"} and s["completed_req_s"] > 0
        assert s["latency"]["p50_s"] <= s["latency"]["p99_s"] <= s["latency"]["max_s"]
        for r in run["requests"]:
            assert r["alone_s"] == payload["alone_times"][f"{r['size']}@2"]
            assert r["server_timings"]["queue_s"] is not None  # the server's timings extension
        assert set(s["server_timings_mean"]) >= {"queue_s", "engine_s", "total_s"}
        if name != "request":  # the server's own count of request-steps (/metrics)
            assert run["engine"]["num_request_steps"] == sum(t[1] for t in load["trace"])
        assert result["burst"] is None

    rows = {(r["load"], r["config"]): r for r in payload["comparison"]}
    assert rows[("2", "request")]["x:mean_s"] == pytest.approx(1.0)
    skip = payload["configs"]["skip-ahead"]["loads"]["2"]["summary"]["latency"]
    base = payload["configs"]["request"]["loads"]["2"]["summary"]["latency"]
    assert rows[("2", "skip-ahead")]["x:p99_s"] == pytest.approx(skip["p99_s"] / base["p99_s"])
    assert payload["burst_comparison"] == []

    text = md.read_text()
    assert text in capsys.readouterr().out
    assert "| load | req/s in | config | done | mean s |" in text and "| skip-ahead | 4/4 |" in text
    assert "Burst" not in text


def burst_record(index: int, size: str, latency: float) -> dict:
    return {"index": index, "size": size, "num_inference_steps": 2, "arrival_s": 0.0, "send_s": 0.0,
            "end_s": latency, "ok": True, "latency_s": latency, "alone_s": 0.5}  # fmt: skip


def test_burst_table_and_plot(tmp_path):
    """The burst's rows, markdown and plot from a made-up payload: `request` one at a time (latency
    i + 1), skip-ahead all finishing at 4 s."""
    args = lb.parse_args(SMOKE)
    payload = lb.new_payload(args, lb.load_profile(args.steps_scale, args.size_scale))
    payload["alone_times"] = {f"{s}@2": 0.5 for s in BURST_SIZES}
    assert [b["size"] for b in payload["burst"]] == BURST_SIZES
    for name, latency in (("request", lambda i: i + 1.0), ("skip-ahead", lambda i: 4.0)):
        records = [burst_record(i, s, latency(i)) for i, s in enumerate(BURST_SIZES)]
        times = [latency(i) for i in range(8)]
        summary = {"num_requests": 8, "num_completed": 8, "latency": {"mean_s": sum(times) / 8},
                   "makespan_s": max(times)}  # fmt: skip
        payload["configs"][name] = {"loads": {}, "burst": {"summary": summary, "requests": records}}
    rows = {r["config"]: r for r in lb.burst_rows(payload)}
    assert rows["request"]["x:mean_s"] == 1.0 and rows["request"]["req:6"] == 7.0
    assert rows["skip-ahead"]["x:mean_s"] == pytest.approx(4.0 / 4.5)
    assert rows["skip-ahead"]["small_x_alone"] == 8.0  # the 16x16 request: 4 s against 0.5 s alone
    payload["burst_comparison"] = lb.burst_rows(payload)
    text = lb.report(payload)
    assert "| burst | done | 64x64 | 64x48 | 48x64 |" in text and "| 16x16 x alone |" in text
    assert "| skip-ahead | 8/8 | 4.00 |" in text
    paths = lb.write_plots(str(tmp_path), payload)
    assert [p.name for p in paths] == ["burst.png"] and paths[0].read_bytes()[:8] == PNG

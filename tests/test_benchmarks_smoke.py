"""The benchmark scripts on CPU: tiny model, tiny sizes, one iteration each.

Checks what the numbers are compared against:
- step batching: batched images vs the same requests run alone through the engine (fp32: tiny diff);
- transformer: the packed forward vs per-request dense forwards, and the FLOP formula vs torch's
  `FlopCounterMode`;
- serving: the OpenAI client against our real HTTP app (`build_app`) over a stub engine, and the
  statistics vs numpy.
"""

from __future__ import annotations

import asyncio
import json
import math
import shlex
import socket
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.diffusion import common, serving_benchmark, step_batching_benefit, transformer_setup  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _load(path: Path) -> dict:
    return json.loads(path.read_text())


# ---- common -------------------------------------------------------------------------------------


def test_mix_grammar():
    mix = common.parse_mix("2*512x512+256x256,1024x768")
    assert [s.label for s in mix.sizes] == ["512x512", "512x512", "256x256", "1024x768"]
    assert mix.name == "2*512x512+256x256+1024x768"
    assert mix.num_img_tokens == 2 * 1024 + 256 + 64 * 48
    mixes = common.parse_mixes(common.ISSUE5_MIXES)
    assert [len(m) for m in mixes] == [2, 2, 8, 2, 4]
    for bad in ("512x500", "512", "0*512x512", "axb", ""):
        with pytest.raises(ValueError, match="--mixes"):
            common.parse_mixes(bad)
    modes = common.resolve_cfg_modes("off,on", 4.0, None)
    assert [(m.enabled, m.negative_prompt is not None) for m in modes] == [(False, False), (True, True)]
    assert common.resolve_cfg_modes(None, 4.0, None)[0].enabled is False  # no negative prompt: CFG off
    with pytest.raises(ValueError, match="--true-cfg-scale"):
        common.resolve_cfg_modes("on", 1.0, "x")


def test_percentile_matches_numpy():
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 100):
        values = rng.exponential(size=n).tolist()
        for q in (0, 50, 90, 99, 100):
            assert common.percentile(values, q) == pytest.approx(np.percentile(values, q), rel=1e-12)
    assert math.isnan(common.percentile([], 50))


# ---- step batching ------------------------------------------------------------------------------


def test_step_batching_benefit_smoke(tiny_model_dir, tmp_path, capsys):
    out, plot = tmp_path / "sb.json", tmp_path / "sb.png"
    argv = ["--model", "tiny-qwen-image", "--mixes", "32x32+48x32", "--cfg-modes", "off,on", "--steps", "3"]
    argv += ["--iters", "1", "--warmup", "0", "--mixfusion-min-chunk-tokens", "1", "--no-progress"]
    payload = step_batching_benefit.main(argv + ["--json-output", str(out), "--plot", str(plot)])
    assert _load(out) == json.loads(json.dumps(payload))
    assert plot.read_bytes()[:8] == PNG_MAGIC
    assert "denoise x" in capsys.readouterr().out
    cases = payload["results"]
    assert [(c["mix"], c["cfg"]) for c in cases] == [("32x32+48x32", "off"), ("32x32+48x32", "on")]
    for case in cases:
        assert case["fully_batched"] and case["max_reqs_per_step"] == 2
        assert case["batched_path"] == "packed"
        assert case["e2e_speedup"] > 0 and case["denoise_speedup"] > 0
        assert case["serial_denoise_step_ms"] > 0 and case["batched_denoise_step_ms"] > 0
        assert 0 < case["batched_outside_forward_pct"] < 100  # the forward was timed inside the step
        # fp32 on CPU: a request packed with another gets (nearly) the image it gets alone
        assert 0 <= case["max_abs_diff"] < 1e-4
    assert cases[1]["tokens_per_step"] > cases[0]["tokens_per_step"]  # CFG doubles the sequences


def test_step_batching_rejects_too_few_steps():
    with pytest.raises(ValueError, match="--steps"):
        step_batching_benefit.main(["--mixes", "32x32+32x32", "--steps", "2"])


# ---- transformer FLOPs ----------------------------------------------------------------------------


def test_flop_formula_matches_torch_counter():
    """`count_flops` (the peer comparison's % of the GEMM rate) against torch's FLOP counter, on one
    packed CFG forward of two tiny requests: every linear, then attention."""
    from torch.utils.flop_counter import FlopCounterMode

    from vllm_omni.diffusion.models.qwen_image.packing import SequenceSpec, build_packed_layout

    config_dict = transformer_setup.transformer_config_dict("tiny-qwen-image")
    model = transformer_setup.build_transformer(config_dict, None, torch.device("cpu"), torch.float32, 0)
    cfg = model.config
    specs = []  # CFG on: a positive (8 text rows) and a negative (5) sequence per request
    for i, size in enumerate(common.parse_mix("32x32+48x32").sizes):
        specs += [
            SequenceSpec(8, size.latent_grid, f"req-{i}"),
            SequenceSpec(5, size.latent_grid, f"req-{i}", True),
        ]
    gen = torch.Generator().manual_seed(0)
    img = torch.cat([torch.randn(s.num_img_tokens, cfg.in_channels, generator=gen) for s in specs])
    txt = torch.cat([torch.randn(s.num_txt_tokens, cfg.joint_attention_dim, generator=gen) for s in specs])
    layout = build_packed_layout(specs, cfg.axes_dims_rope)
    flops = transformer_setup.count_flops(cfg, specs)
    with torch.inference_mode(), FlopCounterMode(display=False) as counter:
        model.forward_packed(img, txt, torch.full((len(specs),), 0.5), layout)
    # every linear (per token, per sequence modulation, embeddings) is one addmm/mm
    assert counter.get_total_flops() == flops["linear"] + flops["modulation"] + flops["embed"]
    d = model.config.inner_dim
    with FlopCounterMode(display=False) as counter:
        for spec in specs:
            q = torch.randn(
                model.config.num_attention_heads, spec.seq_len, d // model.config.num_attention_heads
            )
            (q @ q.transpose(1, 2)).softmax(-1) @ q
    assert counter.get_total_flops() * model.config.num_layers == flops["attention"]


# ---- serving ------------------------------------------------------------------------------------


class _StubEngine:
    """The `DiffusionEngine` contract `build_app` needs; sleeps per step, refuses 64-pixel widths."""

    def __init__(self):
        from vllm_omni.config import OmniDiffusionConfig

        self.config = OmniDiffusionConfig(max_num_seqs=4)
        self.stat_loggers: list = []
        self.requests: list = []
        self.num_running = self.num_waiting = 0

    def validate_request(self, request) -> None:
        if request.sampling_params.width == 64:
            raise ValueError("width must not be 64 (stub)")
        request.sampling_params.validate(self.config.sampling_limits)

    async def generate(self, request):
        from PIL import Image

        from vllm_omni.diffusion.outputs import FinishReason, RequestOutput

        await asyncio.to_thread(self.validate_request, request)  # as the engine validates on admission
        self.requests.append(request)
        sp = request.sampling_params
        await asyncio.sleep(0.005 * sp.num_inference_steps)
        image = Image.new("RGB", (sp.width, sp.height), (sp.seed % 256, 0, 0))
        return RequestOutput(
            req_id=f"stub-{len(self.requests)}",
            request_id=request.request_id,
            finish_reason=FinishReason.COMPLETED,
            images=[image],
            seed=sp.seed,
            height=sp.height,
            width=sp.width,
        )

    def abort(self, req_id: str) -> None:
        pass

    def recent_steps(self) -> list:
        return []


@pytest.fixture()
def stub_server():
    """Our real HTTP app over a stub engine, served by uvicorn on a free local port."""
    import uvicorn

    from vllm_omni.entrypoints.openai.api_server import ServerArgs, build_app

    engine = _StubEngine()
    app = build_app(engine, ServerArgs(model="stub", served_model_names=["stub"], api_key=None))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="error"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.started
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", engine
    server.should_exit = True
    thread.join(timeout=10)
    sock.close()


@pytest.mark.parametrize("client", ["httpx", "openai"])
def test_serving_benchmark_against_stub(stub_server, tmp_path, client):
    base_url, engine = stub_server
    out, plot = tmp_path / "sv.json", tmp_path / "sv.png"
    argv = shlex.split(
        f"--client {client} --base-url {base_url} --model stub --sizes 32x32,48x32 --repeat 2 --steps 2 "
        "--arrival staggered --interval 0.01 --measure-alone --max-concurrency 2 --negative-prompt blurry "
        "--true-cfg-scale 2.5 --extra-args '{\"enable_mixfusion\": true}'"
    )
    payload = serving_benchmark.main(argv + ["--no-progress", "--json-output", str(out), "--plot", str(plot)])
    assert _load(out)["summary"]["num_completed"] == 4
    assert plot.read_bytes()[:8] == PNG_MAGIC
    # warmup + 2 alone + 4 measured requests reached the engine with the extension fields applied
    assert len(engine.requests) == 7
    measured = sorted(engine.requests[3:], key=lambda r: r.sampling_params.seed)
    assert [(r.sampling_params.width, r.sampling_params.height) for r in measured] == [(32, 32), (48, 32)] * 2
    assert {r.negative_prompt for r in measured} == {"blurry"}
    assert {r.sampling_params.true_cfg_scale for r in measured} == {2.5}
    assert {r.sampling_params.num_inference_steps for r in measured} == {2}
    assert sorted(r.sampling_params.seed for r in measured) == [0, 1, 2, 3]
    assert all(r.sampling_params.extra_args == {"enable_mixfusion": True} for r in measured)
    summary = payload["summary"]
    assert set(payload["alone_times"]) == {"32x32@2", "48x32@2"}
    assert summary["throughput_req_s"] > 0 and 0 <= summary["slo_attainment"] <= 1
    lat = summary["latency"]
    assert 0 < lat["p50_s"] <= lat["p90_s"] <= lat["p99_s"] <= lat["max_s"]
    assert set(summary["per_resolution"]) == {"32x32", "48x32"}
    arrivals = [r["arrival_s"] for r in payload["requests"]]
    assert arrivals == pytest.approx([0.0, 0.01, 0.02, 0.03])


def test_serving_benchmark_counts_failures_as_slo_misses(stub_server):
    base_url, _ = stub_server
    argv = ["--base-url", base_url, "--sizes", "32x32,64x32", "--steps", "1", "--num-warmups", "0"]
    payload = serving_benchmark.main(
        argv + ["--alone-times", '{"32x32": 100, "64x32@1": 100}', "--no-progress"]
    )
    summary = payload["summary"]
    assert (summary["num_completed"], summary["num_failed"]) == (1, 1)
    assert summary["slo_attainment"] == 0.5  # the refused 64x32 request misses its SLO
    failed = [r for r in payload["requests"] if not r["ok"]][0]
    assert "400" in failed["error"] or "BadRequest" in failed["error"]


def test_workloads_and_arrivals():
    fixed = serving_benchmark.build_workload("1024x1024,512x512", 2, None, None, 50, 0)
    assert [(s.label, n) for s, n in fixed] == [("1024x1024", 50), ("512x512", 50)] * 2
    drawn = serving_benchmark.build_workload(None, 1, "datasetC", 4000, 50, seed=1)
    assert drawn == serving_benchmark.build_workload(None, 1, "datasetC", 4000, 50, seed=1)
    for size, steps, weight in serving_benchmark.PROFILES["datasetC"]:
        share = sum(s == size for s, _ in drawn) / len(drawn)
        assert abs(share - weight) < 0.03
        assert {n for s, n in drawn if s == size} == {steps}
    assert serving_benchmark.arrival_times(3, "burst") == [0.0, 0.0, 0.0]
    assert serving_benchmark.arrival_times(3, "staggered", interval=0.5) == [0.0, 0.5, 1.0]
    poisson = serving_benchmark.arrival_times(4000, "poisson", rate=2.0, seed=3)
    gaps = np.diff(poisson)
    assert poisson[0] == 0.0 and (gaps > 0).all() and abs(gaps.mean() - 0.5) < 0.03
    with pytest.raises(ValueError, match="--interval"):
        serving_benchmark.arrival_times(3, "staggered")
    with pytest.raises(ValueError, match="--rate"):
        serving_benchmark.arrival_times(3, "poisson", rate=0)
    with pytest.raises(ValueError, match="exclusive"):
        serving_benchmark.build_workload("512x512", 1, "datasetC", 10, 50, 0)
    with pytest.raises(ValueError, match="--alone-times"):
        serving_benchmark.parse_alone_times('{"big": 3}')


def test_slo_attainment_math():
    record = serving_benchmark.RequestRecord
    records = [
        record(0, "512x512", 20, arrival_s=0.0, send_s=0.0, end_s=2.9, ok=True),  # 2.9 <= 3 x 1.0
        record(1, "512x512", 20, arrival_s=1.0, send_s=1.0, end_s=4.5, ok=True),  # 3.5 > 3.0
        record(2, "1024x1024", 25, arrival_s=0.0, send_s=0.0, end_s=5.0, ok=True),  # 5 <= 3 x 2
        record(3, "1024x1024", 25, arrival_s=0.0, send_s=0.0, end_s=1.0, ok=False),  # failed: miss
        record(4, "768x768", 20, arrival_s=0.0, send_s=0.0, end_s=1.0, ok=True),  # no alone time
    ]
    alone = serving_benchmark.parse_alone_times('{"512x512@20": 1.0, "1024x1024": 2.0}')
    assert serving_benchmark.slo_attainment(records, alone, 3.0) == 0.5
    summary = serving_benchmark.summarize(records, duration_s=5.0, alone=alone, slo_scale=3.0)
    assert summary["per_resolution"]["512x512"]["slo_attainment"] == 0.5
    assert summary["per_resolution"]["768x768"]["slo_attainment"] is None
    assert summary["num_failed"] == 1 and summary["throughput_req_s"] == pytest.approx(4 / 5.0)
    assert summary["latency"]["mean_s"] == pytest.approx(np.mean([2.9, 3.5, 5.0, 1.0]))


def test_peer_comparison21_smoke(tmp_path, capsys):
    """The Qwen-Image-2.1 peer comparison on the tiny widths (CPU): our packed step over cached prefixes,
    eager and with the fused ops compiled, equals diffusers' cached-prefix forward of each image with the
    same weights; the CUDA-graph variant is skipped on a CPU, saying so."""
    from benchmarks.diffusion import peer_comparison

    out = tmp_path / "peer21.json"
    argv = [
        "--model",
        "Qwen/Qwen-Image-2.1",
        "--tiny",
        "--device",
        "cpu",
        "--cases",
        "64x64;2*64x64;64x64+128x96",
        "--variants",
        "diffusers,ours,ours_compiled,ours_graph",
    ]
    payload = peer_comparison.main(
        argv + ["--warmup", "0", "--iters", "1", "--no-progress", "--json-output", str(out)]
    )
    assert "ours_graph: skipped (CUDA graphs need a CUDA device)" in capsys.readouterr().out
    saved = _load(out)
    rows = saved["rows"]
    assert (
        [r["case"] for r in rows]
        == ["64x64", "2*64x64", "64x64+128x96"]
        == [r["case"] for r in payload["rows"]]
    )
    assert saved["num_compile_fallbacks"] == 0
    for row in rows:
        assert row["diffusers"] > 0 and row["ours"] > 0 and row["x_diffusers"] > 0
        assert row["ours_compiled"] > 0 and row["ours_compiled_x_diffusers"] > 0
        assert row["max_rel_diff"] < 1e-4 and row["ours_compiled_max_rel_diff"] < 1e-4
        assert "ours_graph" not in row and "graph_path" not in row


def test_step_profile_runs_each_config_and_classifies_kernels(tmp_path):
    """step_profile.py on the tiny model (CPU: the engine's thread is not profiled, so the classes are
    nearly empty): every configuration builds, runs and is timed, the GELU fusion flag is restored
    after its run, and the cuBLASLt kernel names land in their classes."""
    from benchmarks.diffusion import step_profile
    from vllm_omni.diffusion.models.qwen_image.layers import GELUTanhProj

    out = tmp_path / "step_profile.json"
    configs = {"bf16": None, "fp8_gelu": {"quantization": "fp8", "fuse_gelu_fp8": True}}
    argv = ["--model", "tiny-qwen-image", "--device", "cpu", "--size", "32x32", "--steps", "2"]
    step_profile.main([*argv, "--timed", "1", "--configs", json.dumps(configs), "--json-output", str(out)])
    runs = _load(out)["runs"]
    assert set(runs) == {"bf16", "fp8_gelu"} and all(r["median_s"] > 0 for r in runs.values())
    assert runs["fp8_gelu"]["spec"]["fuse_gelu_fp8"] and not GELUTanhProj.fuse_fp8
    names = {
        "nvjet_sm90_qqtst_128x128_128x6_1x1_h_bz_coopA_algo2_ovscale_bias_TNT": "fp8 gemm",
        "nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_gelubias_TNN": "bf16 gemm",
        "void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<": "attention",
        "_quantize_rows_kernel": "quantise",
        "_modulated_layer_norm_kernel": "norm/modulation",
        "void at::native::vectorized_elementwise_kernel<8, at::native::GeluCUDAKernelImpl": "elementwise",
    }
    assert {name: step_profile.kernel_class(name) for name in names} == names

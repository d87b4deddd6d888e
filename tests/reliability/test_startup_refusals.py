"""Start-up refuses, in one line before loading weights, what cannot run on the chosen device.

`startup_errors` is given a `DeviceInfo` to pretend GPUs or short memory on this CPU machine; the CLI
tests run `vllm-omni serve` in process (with the server start replaced) or, for the missing-weights
case a user meets first, as a subprocess.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from vllm_omni.config import OmniDiffusionConfig, ParallelConfig
from vllm_omni.entrypoints.cli import main as cli_main
from vllm_omni.entrypoints.cli.startup_checks import GIB, DeviceInfo, estimate_weights, startup_errors

ONE_GPU_80G = DeviceInfo(num_cuda_devices=1, cuda_free_bytes={0: 80 * GIB}, cpu_available_bytes=64 * GIB)


def test_estimate_counts_what_diffusers_builds(tiny_model_dir):
    """The meta-device count equals the parameters of diffusers' own transformer from the same config."""
    import json

    from diffusers import QwenImageTransformer2DModel

    est = estimate_weights(
        OmniDiffusionConfig(model=str(tiny_model_dir), dtype="float32"), torch.device("cpu")
    )
    config = json.loads((tiny_model_dir / "transformer" / "config.json").read_text())
    reference = QwenImageTransformer2DModel.from_config(config)
    assert est.num_transformer_params == sum(p.numel() for p in reference.parameters())
    assert est.head_dim == config["attention_head_dim"]


def test_real_size_estimate_and_memory_refusal():
    config = OmniDiffusionConfig(
        model="Qwen/Qwen-Image", device="cuda", dtype="bfloat16", load_format="dummy"
    )
    assert startup_errors(config, ONE_GPU_80G) == []
    small = DeviceInfo(num_cuda_devices=1, cuda_free_bytes={0: 24 * GIB})
    (message,) = startup_errors(config, small)
    est = estimate_weights(config, torch.device("cuda"))
    assert 20e9 < est.num_transformer_params < 21e9  # Qwen-Image's MMDiT: 20.4B parameters
    assert f"{est.bytes_per_device / GIB:.1f} GiB" in message and "24.0 GiB" in message
    assert "--tensor-parallel-size" in message and "tiny-qwen-image" in message and "\n" not in message


def test_started_requests_state_is_counted_against_memory():
    """--max-num-resident-reqs: the latency policy keeps that many requests' latents and prompt
    embeddings on the device; their largest state is counted at start-up with the weights."""
    config = OmniDiffusionConfig(
        model="Qwen/Qwen-Image",
        device="cuda",
        dtype="bfloat16",
        load_format="dummy",
        max_num_resident_reqs=64,
    )
    est = estimate_weights(config, torch.device("cuda"))
    per_request = 10 * (2048 * 2048 // 256) * 64 * 4 + 2 * 1024 * 3584 * 2  # latents fp32 + embeddings bf16
    assert est.resident_bytes == 64 * per_request
    just_the_weights = DeviceInfo(num_cuda_devices=1, cuda_free_bytes={0: est.bytes_per_device + GIB})
    (message,) = startup_errors(config, just_the_weights)
    assert "--max-num-resident-reqs 64" in message and "lower --max-num-resident-reqs" in message


@pytest.mark.parametrize(
    ("kwargs", "info", "expected"),
    [
        ({"device": "cuda"}, DeviceInfo(num_cuda_devices=0), "--device cuda: no CUDA device"),
        (
            {"device": "cuda:3"},
            DeviceInfo(num_cuda_devices=2, cuda_free_bytes={0: 80 * GIB, 1: 80 * GIB}),
            "cuda:0..cuda:1",
        ),
        (
            {"device": "cpu", "attention_backend": "FLASH_ATTN"},
            ONE_GPU_80G,
            "--diffusion-attention-backend SDPA",
        ),
        (
            {"device": "cuda", "dtype": "bfloat16"},
            DeviceInfo(num_cuda_devices=1, cuda_free_bytes={0: 80 * GIB}, cuda_supports_bf16=False),
            "--dtype float16",
        ),
        (
            {"device": "cuda", "parallel_config": ParallelConfig(tensor_parallel_size=4)},
            DeviceInfo(num_cuda_devices=2, cuda_free_bytes={0: 80 * GIB, 1: 80 * GIB}),
            "at most 2",
        ),
    ],
    ids=["no-cuda", "cuda-index", "flash-attn-on-cpu", "bf16-unsupported", "tp-over-gpus"],
)
def test_refusals_name_the_flag_and_the_fix(tiny_model_dir, kwargs, info, expected):
    config = OmniDiffusionConfig(model=str(tiny_model_dir), load_format="dummy", **kwargs)
    errors = startup_errors(config, info)
    assert len(errors) == 1 and expected in errors[0], errors
    assert "\n" not in errors[0]


def test_flash_attn_in_fp32_on_a_gpu_is_refused(tiny_model_dir, monkeypatch):
    from vllm_omni.diffusion.attention.backends.flash_attn import FlashAttnBackend

    monkeypatch.setattr(
        FlashAttnBackend, "is_available", classmethod(lambda cls, device: True)
    )  # pretend CUDA
    config = OmniDiffusionConfig(
        model=str(tiny_model_dir),
        load_format="dummy",
        device="cuda",
        dtype="float32",
        attention_backend="FLASH_ATTN",
    )
    (message,) = startup_errors(config, ONE_GPU_80G)
    assert "not float32 (--dtype)" in message and "--diffusion-attention-backend SDPA" in message


@pytest.fixture()
def no_server_start(monkeypatch):
    import vllm_omni.entrypoints.openai.api_server as api_server

    seen = []
    monkeypatch.setattr(api_server, "run_server", lambda config, server_args: seen.append(config))
    return seen


def test_flash_attn_on_cpu_exits_2_before_serving(no_server_start, capsys):
    argv = ["serve", "--device", "cpu", "--diffusion-attention-backend", "FLASH_ATTN"]
    assert cli_main.main(argv, prog="vllm-omni") == 2
    assert no_server_start == []
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: --diffusion-attention-backend FLASH_ATTN"), err
    assert "Traceback" not in err


def test_clamp_warning_only_when_max_num_seqs_was_given(no_server_start, capsys):
    # NOTE: cmd_serve's logging.basicConfig(force=True) replaces caplog's handler; its stderr is captured.
    assert cli_main.main(["serve", "--device", "cpu"], prog="vllm-omni") == 0
    assert "clamped" not in capsys.readouterr().err and no_server_start[-1].max_num_seqs == 1
    assert cli_main.main(["serve", "--device", "cpu", "--max-num-seqs", "8"], prog="vllm-omni") == 0
    assert "--max-num-seqs 8 is clamped to 1" in capsys.readouterr().err
    assert cli_main.main(["serve", "--device", "cpu", "--step-execution"], prog="vllm-omni") == 0
    assert no_server_start[-1].max_num_seqs == 8


@pytest.mark.parametrize("flag", ["--header-read-timeout", "--body-read-timeout", "--limit-concurrency"])
def test_bad_limit_flags_exit_2(no_server_start, capsys, flag):
    assert cli_main.main(["serve", "--device", "cpu", flag, "0"], prog="vllm-omni") == 2
    assert flag in capsys.readouterr().err


@pytest.mark.slow
def test_missing_weights_is_one_short_error(tmp_path):
    """`vllm serve Qwen/Qwen-Image --omni` on a machine without the weights (offline, empty hub cache)."""
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HOME": str(tmp_path / "hf")}
    import os

    cmd = [sys.executable, "-m", "vllm_omni.entrypoints.cli.main", "serve", "Qwen/Qwen-Image", "--port", "0"]
    done = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and len(done.stderr.splitlines()) <= 3, done.stderr[-3000:]
    assert (
        "--load-format dummy" in errors[0]
        and "tiny-qwen-image" in errors[0]
        and "Qwen/Qwen-Image" in errors[0]
    )


def test_the_cli_and_the_api_error_handlers_load_without_torch():
    """`vllm serve --help` and a refused flag answer without importing torch (about a second):
    the CLI, the API server's module and its error handlers stay torch-free until the engine starts."""
    code = (
        "import sys\n"
        "import vllm_omni.entrypoints.cli.main, vllm_omni.entrypoints.cli.serve\n"
        "import vllm_omni.entrypoints.openai.errors\n"
        "print('torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False"


def test_cpu_parallel_sizes_are_capped_by_the_cores(tiny_model_dir):
    """One worker process per rank: on CPU at most one per core (`--ring 1000` spawned 999 workers)."""
    import os

    too_many = (os.cpu_count() or 1) + 1
    config = OmniDiffusionConfig(
        model=str(tiny_model_dir), device="cpu", parallel_config=ParallelConfig(ring_degree=too_many)
    )
    (message,) = startup_errors(config, ONE_GPU_80G)
    assert f"{too_many} worker processes on CPU" in message

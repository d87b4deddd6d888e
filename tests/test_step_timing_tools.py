"""The step-timing tools: step_timeline's cut of a profiled step and step_batching's two timings.

The timeline analysis runs on a hand-built profile (the H200's kernels cannot run here) whose busy
time, gaps and annotations are known; the step timings run the real engine on the tiny model.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.diffusion import step_batching_benefit, step_timeline  # noqa: E402


@dataclass
class Range:
    start: float
    end: float

    def elapsed_us(self) -> float:
        return self.end - self.start


@dataclass
class Event:
    """The FunctionEvent fields step_timeline reads."""

    name: str
    start: float
    end: float
    on_gpu: bool
    is_user_annotation: bool = False
    cpu_parent: object = None

    @property
    def device_type(self):
        return torch.autograd.DeviceType.CUDA if self.on_gpu else torch.autograd.DeviceType.CPU

    @property
    def time_range(self) -> Range:
        return Range(self.start, self.end)


class Profile:
    def __init__(self, events):
        self._events = events

    def events(self):
        return self._events


def test_merge_intervals_and_gap_bins():
    assert step_timeline.merge_intervals([(5, 7), (0, 2), (1, 3), (7, 8)]) == [(0, 3), (5, 8)]
    assert [step_timeline.gap_bin(us) for us in (1, 2, 49, 500)] == [
        "0-2 us",
        "2-10 us",
        "10-50 us",
        ">= 200 us",
    ]


def test_timeline_cuts_a_step_into_before_busy_gaps_after():
    step = Event("engine.step", 0, 1000, on_gpu=False)
    launch = Event("cudaStreamSynchronize", 390, 395, on_gpu=False, cpu_parent=step)
    events = [
        step,
        Event("runner._forward", 50, 900, on_gpu=False),
        Event("engine.step", 0, 1000, on_gpu=True, is_user_annotation=True),  # not GPU work
        Event("gemm_a", 100, 300, on_gpu=True),
        Event("norm_b", 290, 350, on_gpu=True),  # overlaps gemm_a: one busy interval
        Event("attn_c", 400, 600, on_gpu=True),  # 50 us gap after norm_b, a sync meanwhile
        Event("gemm_d", 601, 900, on_gpu=True),  # 1 us gap
        launch,
    ]
    cut = step_timeline.analyse(Profile(events))
    assert cut["before_ms"] == pytest.approx(0.1) and cut["after_ms"] == pytest.approx(0.1)
    assert cut["busy_ms"] == pytest.approx(0.749) and cut["gap_ms"] == pytest.approx(0.051)
    assert sum(cut[k] for k in ("before_ms", "busy_ms", "gap_ms", "after_ms")) == pytest.approx(
        cut["step_ms"]
    )
    assert cut["forward_host_ms"] == pytest.approx(0.85) and cut["num_kernels"] == 4
    largest = cut["largest_gaps"][0]
    assert largest["gap_us"] == 50 and largest["after_kernel"] == "norm_b"
    assert largest["before_kernel"] == "attn_c" and largest["runtime_calls"] == {"cudaStreamSynchronize": 1}
    assert cut["gap_ms_by_size"]["50-200 us"]["count"] == 1 and cut["gap_ms_by_size"]["0-2 us"]["count"] == 1


def test_timeline_charges_each_gap_to_the_phase_that_ended_it():
    """A request's idle GPU goes to the runner phase whose host range holds the next kernel's start
    (the host work the GPU waited for); the innermost one when ranges nest, "(none)" outside them."""
    events = [
        Event("engine.step", 0, 1000, on_gpu=False),
        Event("runner._encode", 10, 200, on_gpu=False),
        Event("runner._denoise", 210, 500, on_gpu=False),
        Event("runner._forward", 220, 480, on_gpu=False),  # inside _denoise: not a phase of its own
        Event("runner._finish", 500, 990, on_gpu=False),
        Event("text_encoder_gemm", 20, 100, on_gpu=True),
        Event("transformer_gemm", 250, 400, on_gpu=True),  # 150 us gap ends in _denoise
        Event("vae_conv", 700, 800, on_gpu=True),  # 300 us gap ends in _finish
        Event("copy", 995, 999, on_gpu=True),  # 195 us gap ends outside every phase
    ]
    cut = step_timeline.analyse(Profile(events))
    phases = {row["phase"]: row for row in cut["phases"]}
    assert phases["runner._encode"]["idle_gpu_ms"] == 0 and phases["runner._encode"]["host_ms"] == 0.19
    assert phases["runner._denoise"]["idle_gpu_ms"] == pytest.approx(0.15)
    assert phases["runner._finish"]["idle_gpu_ms"] == pytest.approx(0.3)
    assert phases["(none)"]["idle_gpu_ms"] == pytest.approx(0.195)
    assert sum(row["idle_gpu_ms"] for row in cut["phases"]) == pytest.approx(cut["gap_ms"])


def test_timeline_profiles_a_whole_request_in_request_mode(tiny_model_dir):
    """`--request-mode`: one request at a time through the real engine; its profiled step holds the
    text encoder, every denoise step and the decode."""
    argv = ["--model", "tiny-qwen-image", "--request-mode", "--mixes", "32x32", "--cfg-modes", "off"]
    (entry,) = step_timeline.main(argv + ["--steps", "3", "--output-type", "np"])["results"]
    phases = {row["phase"]: row["count"] for row in entry["phases"]}
    assert entry["num_reqs"] == 1 and phases["runner._encode"] == 1 and phases["runner._denoise"] == 3
    with pytest.raises(SystemExit, match="one size"):
        step_timeline.main(argv[:4] + ["32x32+48x32"])


def test_step_batching_times_steps_both_ways(tiny_model_dir):
    argv = ["--model", "tiny-qwen-image", "--mixes", "32x32+48x32", "--cfg-modes", "on", "--steps", "3"]
    argv += ["--iters", "1", "--warmup", "0", "--no-progress", "--timing", "pipelined,synced"]
    cases = step_batching_benefit.main(argv)["results"]
    assert [c["timing"] for c in cases] == ["pipelined", "synced"]
    for case in cases:
        assert case["batched_denoise_step_ms"] > 0 and case["fully_batched"]
        assert 0 < case["batched_outside_forward_pct"] < 100
    with pytest.raises(ValueError, match="--timing"):
        step_batching_benefit.main(argv[:-1] + ["overlapped"])


TELEMETRY = """timestamp, clocks.current.sm [MHz], clocks.current.memory [MHz], power.draw [W], \
temperature.gpu, utilization.gpu [%], clocks_event_reasons.active
2026/12/01 14:27:29.900, 345 MHz, 3201 MHz, 79.32 W, 36, 0 %, 0x0000000000000001
2026/12/01 14:27:30.000, 1500 MHz, 3201 MHz, 699.00 W, 60, 100 %, 0x0000000000000004
2026/12/01 14:27:30.100, 1600 MHz, 3201 MHz, 701.00 W, 61, 100 %, 0x0000000000000004
2026/12/01 14:27:30.200, 1980 MHz, 3201 MHz, 500.00 W, 61, 95 %, 0x0000000000000000
2026/12/01 14:27:30.300, [N/A], 3201 MHz, 500.00 W, 61, 95 %, 0x0000000000000000
"""

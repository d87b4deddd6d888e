"""Step batching benefit: the same requests run one after another (serial) vs submitted together (batched).

    python benchmarks/diffusion/step_batching_benefit.py --model Qwen/Qwen-Image --load-format dummy \
        --steps 8 --iters 3 --warmup 1 --cfg-modes off,on --json-output out.json --plot out.png

The model loads once; every mix (common.py's grammar) runs with every CFG mode, `--warmup` unmeasured
then `--iters` measured times, each time as two phases on one engine driven on this thread with
`engine.step()`: serial (request 0 alone until done, then request 1, ...) and batched (all submitted
at once). Steps are timed `pipelined` (back to back as the engine loop runs them: CUDA events after
each step) or `synced` (sync, step, sync: the host work before a step's first kernel exposed); each
case reports e2e and steady-state denoise times and their serial / batched ratios, the share of a
batched step outside the forward, the batched steps' path, and max |batched - serial|.
docs/benchmarks.md defines every column.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make `benchmarks.diffusion` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.diffusion.common import (  # noqa: E402
    DEFAULT_PROMPTS,
    BarPanel,
    CfgMode,
    Column,
    Mix,
    add_mix_args,
    add_output_args,
    environment_info,
    format_table,
    mean,
    mixes_from_args,
    plot_bar_panels,
    positive_int,
    progress,
    ratio,
    resolve_cfg_modes,
    sync,
    write_json,
)

MIN_STEPS = 3
"""First step encodes, last step decodes: at least one step in between must be denoise-only."""


@dataclass
class StepRecord:
    """One `engine.step()` call."""

    seconds: float
    num_reqs: int
    num_tokens: int
    path: str
    num_finished: int
    """Requests of the phase that finished during this step."""
    forward_s: float | None = None
    """Time of the step's transformer forward(s) (`ForwardTimer`), when timed."""


def _mark(on_gpu: bool):
    """A point in time: a CUDA event recorded on the current stream (the GPU's timeline), else the
    host clock."""
    if not on_gpu:
        return time.perf_counter()
    import torch

    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _span_s(start, end) -> float:
    """Seconds between two `_mark`s of one kind (events: read after a device sync)."""
    return end - start if isinstance(start, float) else start.elapsed_time(end) / 1e3


class ForwardTimer:
    """Times the model runner's transformer forward inside every step: CUDA events around its
    `_forward` (no sync added; read after the step's own sync), the host clock on CPU."""

    def __init__(self, engine, device):
        runner = getattr(getattr(engine.executor, "driver_worker", None), "runner", None)
        self.enabled = runner is not None and hasattr(runner, "_forward")
        self._pending: list = []
        if self.enabled:
            inner = runner._forward

            def timed_forward(*args, **kwargs):
                start = _mark(device.type == "cuda")
                try:
                    return inner(*args, **kwargs)
                finally:
                    self._pending.append((start, _mark(device.type == "cuda")))

            runner._forward = timed_forward

    def cut(self) -> list:
        """The forwards since the last cut, unread (no sync: read them with `seconds` later)."""
        pending, self._pending = self._pending, []
        return pending

    def seconds(self, forwards: list) -> float | None:
        """Seconds of `forwards` (from `cut`; call after a device sync), None when there are none."""
        if not self.enabled or not forwards:
            return None
        return sum(_span_s(start, end) for start, end in forwards)


@dataclass
class PhaseRun:
    """One phase: some requests submitted together and stepped until all are done."""

    wall_s: float
    steps: list[StepRecord]
    outputs: list[Any] = field(default_factory=list)
    """Per request, `DiffusionOutput.images` as a numpy array."""

    def denoise_only_steps(self) -> list[StepRecord]:
        """The denoise-only steps (see the module docstring)."""
        return [
            s
            for i, s in enumerate(self.steps)
            if i > 0 and s.num_finished == 0 and self.steps[i - 1].num_finished == 0
        ]

    def denoise_step_s(self) -> float | None:
        times = [s.seconds for s in self.denoise_only_steps()]
        return statistics.median(times) if times else None

    def outside_forward_share(self) -> float | None:
        """Median over denoise-only steps of 1 - forward / step (see the module docstring)."""
        shares = [1 - s.forward_s / s.seconds for s in self.denoise_only_steps() if s.forward_s]
        return statistics.median(shares) if shares else None


def make_requests(mix: Mix, cfg: CfgMode, args: argparse.Namespace, tag: str) -> list:
    """One request per image size of the mix; request i gets prompt i (cycled) and seed `seed + i`."""
    from vllm_omni.diffusion.request import OmniDiffusionRequest
    from vllm_omni.inputs import OmniDiffusionSamplingParams

    requests = []
    for i, size in enumerate(mix.sizes):
        params = OmniDiffusionSamplingParams(
            height=size.height,
            width=size.width,
            num_inference_steps=args.steps,
            true_cfg_scale=cfg.true_cfg_scale,
            seed=args.seed + i,
            output_type=args.output_type,
        )
        prompt = DEFAULT_PROMPTS[i % len(DEFAULT_PROMPTS)]
        requests.append(OmniDiffusionRequest(f"{tag}-{i}", prompt, cfg.negative_prompt, params))
    return requests


TIMINGS = ("pipelined", "synced")


class StepClock:
    """Per-step times of a phase (see the module docstring). `synced` syncs around every step and
    reads the host clock; `pipelined` records a CUDA event after each step and reads them all after
    the phase (the host clock on CPU, where nothing runs ahead of the host)."""

    def __init__(self, timing: str, device):
        self.pipelined = timing == "pipelined" and device.type == "cuda"
        self.device = device
        self._spans: list[tuple] = []
        self._last = None

    def _mark(self):
        if not self.pipelined:
            sync(self.device)
        return _mark(self.pipelined)

    def before_step(self) -> None:
        if not self.pipelined or self._last is None:
            self._last = self._mark()

    def after_step(self) -> None:
        end = self._mark()
        self._spans.append((self._last, end))
        self._last = end

    def seconds(self) -> list[float]:
        """Every step's seconds, in order (after the phase; syncs)."""
        sync(self.device)
        return [_span_s(start, end) for start, end in self._spans]


def run_phase(
    engine,
    requests: list,
    device,
    timer: ForwardTimer | None = None,
    timing: str = "pipelined",
    max_idle_steps: int = 100,
) -> PhaseRun:
    """Submit `requests` together and call `engine.step()` until all are done; time every step
    (`timing`, see `StepClock`) and, with a `timer`, its forward."""
    sync(device)
    if timer is not None:
        timer.cut()  # drop forwards of earlier phases
    clock = StepClock(timing, device)
    start = time.perf_counter()
    futures = [engine.add_request(r) for r in requests]
    steps: list[StepRecord] = []
    forwards: list[list] = []
    num_done, num_idle = 0, 0
    while num_done < len(futures):
        clock.before_step()
        stats = engine.step()
        now_done = sum(f.done() for f in futures)
        if stats is None:
            num_idle += 1
            if num_idle > max_idle_steps and now_done == num_done:
                raise RuntimeError(
                    f"engine scheduled nothing for {max_idle_steps} steps with requests pending"
                )
        else:
            clock.after_step()
            steps.append(StepRecord(0.0, stats.num_reqs, stats.num_tokens, stats.path, now_done - num_done))
            forwards.append([] if timer is None else timer.cut())
        num_done = now_done
    for record, seconds, fwd in zip(steps, clock.seconds(), forwards, strict=True):
        record.seconds = seconds
        record.forward_s = None if timer is None else timer.seconds(fwd)
    wall = time.perf_counter() - start
    outputs = [f.result() for f in futures]  # raises if a request failed
    images = [_as_array(o.images) for o in outputs]
    return PhaseRun(wall, steps, images)


def _as_array(images: Any):
    """'np' images (float32 [n, H, W, 3]) or 'latent' tensors -> float32 numpy array."""
    import numpy as np

    if hasattr(images, "detach"):
        images = images.detach().float().cpu().numpy()
    return np.asarray(images, dtype=np.float32)


def run_once(
    engine, case: CaseKey, args: argparse.Namespace, tag: str, device, timer: ForwardTimer
) -> dict[str, Any]:
    """One serial phase per request, then one batched phase; return this iteration's numbers."""
    import numpy as np

    phase = partial(run_phase, device=device, timer=timer, timing=case.timing)
    serial = [phase(engine, [r]) for r in make_requests(case.mix, case.cfg, args, f"{tag}-serial")]
    if device.type == "cuda":
        import torch

        torch.cuda.reset_peak_memory_stats(device)
    batched = phase(engine, make_requests(case.mix, case.cfg, args, f"{tag}-batched"))
    per_req = [p.denoise_step_s() for p in serial]
    serial_denoise = None if None in per_req else sum(per_req)
    max_abs = max(float(np.abs(p.outputs[0] - b).max()) for p, b in zip(serial, batched.outputs))
    denoise_steps = batched.denoise_only_steps()
    result = {
        "serial_e2e_s": sum(p.wall_s for p in serial),
        "batched_e2e_s": batched.wall_s,
        "serial_denoise_step_s": serial_denoise,
        "serial_denoise_step_s_per_req": per_req,
        "batched_denoise_step_s": batched.denoise_step_s(),
        "batched_outside_forward_share": batched.outside_forward_share(),
        "batched_first_step_s": batched.steps[0].seconds,
        "batched_last_step_s": batched.steps[-1].seconds,
        "batched_num_steps": len(batched.steps),
        "batched_max_reqs_per_step": max(s.num_reqs for s in batched.steps),
        "batched_tokens_per_step": max(s.num_tokens for s in batched.steps),
        "batched_paths": sorted({s.path for s in (denoise_steps or batched.steps)}),
        "serial_paths": sorted({s.path for p in serial for s in p.steps}),
        "max_abs_diff": max_abs,
    }
    if device.type == "cuda":
        import torch

        result["batched_peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return result


@dataclass(frozen=True)
class CaseKey:
    """One measured case: a mix, a CFG mode and a step timing."""

    mix: Mix
    cfg: CfgMode
    timing: str


def measure_case(
    engine, key: CaseKey, args: argparse.Namespace, bar, device, timer: ForwardTimer
) -> dict[str, Any]:
    """Warm up, then measure `args.iters` iterations of one case; aggregate them."""
    iters, mix, cfg = [], key.mix, key.cfg
    for it in range(args.warmup + args.iters):
        what = "warmup" if it < args.warmup else "iter"
        bar.set_postfix_str(f"{mix.name} cfg={cfg.label} {key.timing} {what} {it}")
        run = run_once(engine, key, args, f"{mix.name}-cfg{cfg.label}-{key.timing}-{it}", device, timer)
        if it >= args.warmup:
            iters.append(run)
        bar.update(1)

    def avg(key: str) -> float | None:
        values = [r[key] for r in iters]
        return None if None in values else mean(values)

    case = {
        "mix": mix.name,
        "sizes": [s.label for s in mix.sizes],
        "num_reqs": len(mix),
        "cfg": cfg.label,
        "timing": key.timing,
        "true_cfg_scale": cfg.true_cfg_scale if cfg.enabled else None,
        "num_img_tokens": mix.num_img_tokens,
        "tokens_per_step": iters[-1]["batched_tokens_per_step"],
        "batched_path": "/".join(iters[-1]["batched_paths"]),
        "max_reqs_per_step": iters[-1]["batched_max_reqs_per_step"],
        "fully_batched": iters[-1]["batched_max_reqs_per_step"] == len(mix),
        "serial_e2e_s": avg("serial_e2e_s"),
        "batched_e2e_s": avg("batched_e2e_s"),
        "serial_denoise_step_ms": _ms(avg("serial_denoise_step_s")),
        "batched_denoise_step_ms": _ms(avg("batched_denoise_step_s")),
        "batched_outside_forward_pct": None
        if avg("batched_outside_forward_share") is None
        else 100 * avg("batched_outside_forward_share"),
        "max_abs_diff": max(r["max_abs_diff"] for r in iters),
        "iterations": iters,
    }
    case["e2e_speedup"] = ratio(case["serial_e2e_s"], case["batched_e2e_s"])
    case["denoise_speedup"] = ratio(case["serial_denoise_step_ms"], case["batched_denoise_step_ms"])
    if case["batched_denoise_step_ms"]:
        case["batched_img_steps_per_s"] = len(mix) * 1e3 / case["batched_denoise_step_ms"]
    return case


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


TABLE_COLUMNS = [
    Column("cfg", "cfg"),
    Column("timing", "timing"),
    Column("mix", "mix"),
    Column("num_reqs", "reqs"),
    Column("tokens_per_step", "tok/step"),
    Column("batched_path", "path"),
    Column("max_reqs_per_step", "reqs/step"),
    Column("serial_e2e_s", "serial e2e s", ".3f"),
    Column("batched_e2e_s", "batched e2e s", ".3f"),
    Column("e2e_speedup", "e2e x", ".2f"),
    Column("serial_denoise_step_ms", "serial step ms", ".2f"),
    Column("batched_denoise_step_ms", "batched step ms", ".2f"),
    Column("denoise_speedup", "denoise x", ".2f"),
    Column("batched_outside_forward_pct", "outside fwd %", ".1f"),
    Column("max_abs_diff", "max|diff|", ".3g"),
]


def plot_speedups(path: str, cases: list[dict[str, Any]]) -> Path:
    """Bar plot of e2e and denoise speedup per mix, one bar per CFG mode (and step timing)."""
    mixes = list(dict.fromkeys(c["mix"] for c in cases))
    modes = list(dict.fromkeys((c["cfg"], c["timing"]) for c in cases))
    one_timing = len({t for _, t in modes}) == 1
    by_key = {(c["mix"], c["cfg"], c["timing"]): c for c in cases}
    panels = []
    for key, title in (("e2e_speedup", "end-to-end"), ("denoise_speedup", "denoise step (steady state)")):
        series = {
            f"CFG {m}" + ("" if one_timing else f", {t}"): [by_key.get((x, m, t), {}).get(key) for x in mixes]
            for m, t in modes
        }
        panels.append(BarPanel(f"{title} speedup, serial / batched", mixes, series, "speedup", {"1.0": 1.0}))
    return plot_bar_panels(path, panels, "Qwen-Image step batching benefit")


def build_engine(args: argparse.Namespace, max_num_seqs: int, request_mode: bool = False):
    """The engine under test (model loaded once), driven with `engine.step()`."""
    from vllm_omni.config import OmniDiffusionConfig
    from vllm_omni.diffusion.engine import DiffusionEngine

    kwargs: dict[str, Any] = dict(
        model=args.model,
        load_format=args.load_format,
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=max_num_seqs,
        scheduling_policy="skip-ahead",  # a mix is measured as one packed step
        attention_backend=args.attention_backend,
        enable_mixfusion=args.enable_mixfusion,
        seed=args.seed,
        log_stats=False,
        enforce_eager=args.enforce_eager,
    )
    if request_mode:  # as `vllm serve` without --step-execution: one request at a time, every step
        kwargs.update(step_execution=False, scheduling_policy="fifo", max_num_seqs=1)
    if args.batch_invariant is not None:
        kwargs["batch_invariant"] = args.batch_invariant
    if args.quantization is not None:
        kwargs["quantization"] = args.quantization  # "fp8", or a quantization config's JSON
    for name in ("mixfusion_min_chunk_tokens", "mixfusion_max_chunks"):
        if getattr(args, name) is not None:
            kwargs[name] = getattr(args, name)
    return DiffusionEngine(OmniDiffusionConfig.from_env_defaults(**kwargs), autostart=False)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny-qwen-image", help="model dir / repo id, or tiny-qwen-image")
    parser.add_argument("--load-format", choices=("auto", "dummy"), default="auto")
    add_mix_args(parser)
    parser.add_argument("--steps", type=int, default=8, help=f"denoise steps per request (>= {MIN_STEPS})")
    parser.add_argument("--iters", type=int, default=3, help="measured iterations per case")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured iterations per case first")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="engine cap (default: largest mix)")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU), bfloat16, float32")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--attention-backend", default=None, help="SDPA or FLASH_ATTN (default: auto)")
    parser.add_argument("--enable-mixfusion", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--batch-invariant", action="store_const", const=True, default=None)
    parser.add_argument(
        "--quantization", default=None, help="the transformer's linears: fp8, or a quantization config's JSON"
    )
    parser.add_argument(
        "--enforce-eager", action="store_true", help="no torch.compile'd fused block kernels on CUDA"
    )
    parser.add_argument("--mixfusion-min-chunk-tokens", type=int, default=None)
    parser.add_argument("--mixfusion-max-chunks", type=int, default=None)
    parser.add_argument("--output-type", choices=("np", "latent"), default="np")
    parser.add_argument(
        "--timing",
        default="pipelined",
        help=f"step timing(s), a comma list of {TIMINGS} (module docstring; default pipelined)",
    )
    add_output_args(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; print the table, write JSON / plot when asked, return the JSON payload."""
    args = parse_args(argv)
    mixes = mixes_from_args(args)
    cfg_modes = resolve_cfg_modes(args.cfg_modes, args.true_cfg_scale, args.negative_prompt)
    positive_int("--steps", args.steps, MIN_STEPS)
    positive_int("--iters", args.iters)
    positive_int("--warmup", args.warmup, 0)
    largest = max(len(m) for m in mixes)
    max_num_seqs = args.max_num_seqs or largest
    if max_num_seqs < largest:
        raise ValueError(
            f"--max-num-seqs must be >= the largest mix ({largest} requests), got {max_num_seqs}"
        )

    load_start = time.perf_counter()
    engine = build_engine(args, max_num_seqs)
    load_s = time.perf_counter() - load_start
    device = engine.executor.driver_worker.device
    print(f"loaded {args.model} ({args.load_format}) on {device} in {load_s:.1f} s", file=sys.stderr)
    cases, timer = [], ForwardTimer(engine, device)
    timings = [t.strip() for t in args.timing.split(",") if t.strip()]
    if not timings or any(t not in TIMINGS for t in timings):
        raise ValueError(f"--timing: a comma list of {TIMINGS}, got {args.timing!r}")
    total = len(mixes) * len(cfg_modes) * len(timings) * (args.warmup + args.iters)
    with progress(total, "step batching", args.no_progress) as bar:
        for cfg in cfg_modes:
            for mix in mixes:
                for timing in timings:
                    key = CaseKey(mix, cfg, timing)
                    cases.append(measure_case(engine, key, args, bar, device, timer))

    print(format_table(cases, TABLE_COLUMNS))
    payload = {
        "benchmark": "step_batching_benefit",
        "env": environment_info(device),
        "config": {**vars(args), "max_num_seqs": max_num_seqs, "device": str(device), "load_s": load_s},
        "results": cases,
    }
    if args.json_output:
        print(f"wrote {write_json(args.json_output, payload)}", file=sys.stderr)
    if args.plot:
        print(f"wrote {plot_speedups(args.plot, cases)}", file=sys.stderr)
    return payload


if __name__ == "__main__":
    main()

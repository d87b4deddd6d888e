"""Helpers the tests share: tiny models and their inputs, the tiny engine's cases, a stub engine for the
HTTP layer, a fake runner for the scheduler, LoRA slots, batch-invariance and parallel-forward fixtures.

Test files import from here (`from utils import ...`), never from each other (vLLM's tests/*/utils.py).
Each section names the test file it was written for.
"""

from __future__ import annotations

import asyncio
import base64
import io
import threading
import time
from collections import defaultdict

import numpy as np
import torch
from diffusers import QwenImagePipeline, QwenImageTransformer2DModel
from fastapi.testclient import TestClient
from PIL import Image
from torch import nn

from vllm_omni.config import OmniDiffusionConfig
from vllm_omni.diffusion.attention import SDPABackend
from vllm_omni.diffusion.engine import DiffusionEngine
from vllm_omni.diffusion.errors import QueueFullError, RequestFailedError
from vllm_omni.diffusion.layers.linear import Linear
from vllm_omni.diffusion.layers.merged_linear import HasMergedLinears
from vllm_omni.diffusion.layers.quant_config import QuantizationConfig
from vllm_omni.diffusion.models import registry
from vllm_omni.diffusion.models.qwen_image.packing import SequenceSpec, build_packed_layout
from vllm_omni.diffusion.models.qwen_image.transformer import QwenImageTransformer, QwenImageTransformerConfig
from vllm_omni.diffusion.outputs import ErrorKind, FinishReason, RequestOutput, RequestTimings
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.diffusion.sched.interface import (
    DiffusionOutput,
    ForwardPath,
    ModelRunnerOutput,
    RunnerOutput,
    SchedulerOutput,
    StepStats,
)
from vllm_omni.diffusion.worker.cuda_graphs import (
    CudaGraphConfig,
)
from vllm_omni.entrypoints.openai.api_server import ServerArgs, build_app
from vllm_omni.entrypoints.openai.metrics import PrometheusStatLogger
from vllm_omni.inputs import OmniDiffusionSamplingParams
from vllm_omni.lora import LoRAConfig
from vllm_omni.lora.batch import TILE_ROWS, LoRABatch
from vllm_omni.lora.layers import (
    LoRAMapping,
    LoRAModuleWeights,
    LoRAStepState,
    SeqLoRA,
    make_lora_linear,
    make_lora_slots,
)
from vllm_omni.lora.manager import LoRAManager

# ---- The tiny Qwen-Image transformer against diffusers' (test_transformer.py)


TINY = dict(
    num_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=32,
    axes_dims_rope=(4, 6, 6),
    in_channels=64,
    out_channels=16,
)


AXES = TINY["axes_dims_rope"]


JOINT = TINY["joint_attention_dim"]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def make_models(seed: int):
    """(diffusers reference, ours) with identical random weights; diffusers' zero-inits replaced."""
    ref = QwenImageTransformer2DModel(**TINY).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    ours = QwenImageTransformer(QwenImageTransformerConfig.from_dict(dict(ref.config))).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ref, ours


def run_ref(ref, img, txt, mask, t, img_shape):
    with torch.no_grad():
        return ref(img, txt, mask, t, [[img_shape]] * img.shape[0], return_dict=False)[0]


# (grid, text length, timestep, negative text length or None): square and non-square grids, one CFG pair
REQUESTS = [
    ((1, 2, 2), 5, 0.9, None),
    ((1, 3, 5), 3, 0.3, 6),
    ((1, 4, 2), 8, 0.6, None),
    ((1, 6, 6), 2, 0.05, None),
]


def make_packed_batch(seed: int = 0):
    """Specs and inputs of REQUESTS: one sequence each, two for the CFG request (same latents)."""
    gen = torch.Generator().manual_seed(seed)
    specs, imgs, txts, steps = [], [], [], []
    for i, (grid, num_txt, t, num_neg) in enumerate(REQUESTS):
        img = torch.randn(grid[1] * grid[2], 64, generator=gen)
        texts = [(num_txt, False)] + ([(num_neg, True)] if num_neg else [])
        for n, is_negative in texts:
            specs.append(SequenceSpec(n, grid, f"req-{i}", is_negative))
            imgs.append(img)
            txts.append(torch.randn(n, JOINT, generator=gen))
            steps.append(t)
    return specs, imgs, txts, torch.tensor(steps)


# ---- The tiny engine against diffusers' pipeline (test_engine_vs_diffusers.py)


LONG_PROMPT = (
    "a very detailed oil painting of a lighthouse on a rocky coast at dusk, waves crashing, seagulls, "
    "warm light from the windows, dramatic clouds, a small boat in the distance, reflections on the water"
)


CASES = [
    # (prompt, negative_prompt, height, width, steps, true_cfg_scale, seed)
    # CFG on/off is not an execution barrier: CFG requests put two sequences in the packed forward,
    # the others one, and all five share steps.
    (LONG_PROMPT, "blurry, low quality", 48, 64, 4, 4.0, 12),  # CFG on, non-square
    ("a cat on a sofa", "dark", 64, 32, 2, 2.5, 13),  # CFG on, other scale, tall
    ("a bowl of fruit on a wooden table", " ", 48, 48, 3, 7.0, 15),  # CFG on, square, other steps
    ("a red fox", None, 32, 32, 3, 4.0, 11),  # CFG off: no negative prompt
    ("mountains", "ugly", 32, 48, 5, 1.0, 14),  # CFG off: scale <= 1
]


def case_params(case) -> OmniDiffusionSamplingParams:
    _, _, h, w, steps, scale, seed = case
    return OmniDiffusionSamplingParams(
        height=h, width=w, num_inference_steps=steps, true_cfg_scale=scale, seed=seed, output_type="np"
    )


def case_request(i: int, case) -> OmniDiffusionRequest:
    return OmniDiffusionRequest(
        f"req-{i}", prompt=case[0], negative_prompt=case[1], sampling_params=case_params(case)
    )


def diffusers_reference_images(model_dir) -> list[np.ndarray]:
    """The images diffusers' `QwenImagePipeline` gives each of `CASES` alone (np, fp32, CPU)."""
    pipe = QwenImagePipeline.from_pretrained(model_dir, torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    images = []
    for prompt, negative, h, w, steps, scale, seed in CASES:
        out = pipe(
            prompt=prompt,
            negative_prompt=negative,
            true_cfg_scale=scale,
            height=h,
            width=w,
            num_inference_steps=steps,
            generator=torch.Generator("cpu").manual_seed(seed),
            max_sequence_length=512,
            output_type="np",
        )
        images.append(out.images)
    return images


def tiny_engine(model, **config) -> DiffusionEngine:
    """The tiny engine the engine tests share: CPU, fp32, 8 requests a step, built without its engine
    thread (tests drive `engine.step()`); `config` adds to or overrides those settings."""
    settings = dict(model=str(model), dtype="float32", device="cpu", max_num_seqs=8)
    return DiffusionEngine(OmniDiffusionConfig(**{**settings, **config}), autostart=False)


def run_to_completion(engine: DiffusionEngine, futures, steps_log=None) -> list[np.ndarray]:
    while not all(f.done() for f in futures):
        stats = engine.step()
        if steps_log is not None and stats is not None:
            steps_log.append(stats)
    return [f.result().images for f in futures]


def assert_matches(images, reference_images):
    for i, (got, want) in enumerate(zip(images, reference_images)):
        assert got.shape == want.shape, f"case {i}: shape {got.shape} != {want.shape}"
        diff = float(np.abs(got - want).max())
        assert diff <= 1e-4, f"case {i}: max abs diff {diff} vs diffusers"


# ---- The HTTP layer against a stub engine (test_server_api.py)


MODEL = "stub-model"


API_KEY = "sk-test"


AUTH = {"Authorization": f"Bearer {API_KEY}"}


class StubEngine:
    """Follows the DiffusionEngine contract; images are solid colours derived from the seed."""

    def __init__(self, config: OmniDiffusionConfig):
        self.config = config
        self.default_sampling_params = config.default_sampling_params
        self.stat_loggers: list = []
        self.generated: list[OmniDiffusionRequest] = []
        self.cancelled: list[str] = []
        self.admission_threads: list[str] = []
        self.queue_full = False
        self.fail_kind: str | None = None
        self.block = False
        self._running = 0

    @property
    def num_running(self) -> int:
        return self._running

    @property
    def num_waiting(self) -> int:
        return 0

    def add_request(self, request: OmniDiffusionRequest) -> None:
        """Validation and admission, as the engine does them (off the event loop)."""
        self.admission_threads.append(threading.current_thread().name)
        if not request.prompt.strip():
            raise ValueError("prompt must be a non-empty string")
        request.sampling_params.validate(self.config.sampling_limits)
        if self.queue_full:
            raise QueueFullError(f"the waiting queue is full ({self.config.max_queue_size} requests)")
        self.generated.append(request)

    async def generate(self, request: OmniDiffusionRequest) -> RequestOutput:
        await asyncio.to_thread(self.add_request, request)
        self._running += 1
        try:
            while self.block:
                await asyncio.sleep(0.005)
        except asyncio.CancelledError:
            self.cancelled.append(request.request_id)
            raise
        finally:
            self._running -= 1
        if self.fail_kind:
            raise RequestFailedError("denoise step failed: boom", kind=ErrorKind(self.fail_kind))
        sp = request.sampling_params
        seed = 1234 if sp.seed is None else sp.seed
        images = [
            Image.new("RGB", (sp.width, sp.height), (seed % 256, i, 7))
            for i in range(sp.num_outputs_per_prompt)
        ]
        output = RequestOutput(
            req_id=f"engine-{len(self.generated)}",
            request_id=request.request_id,
            finish_reason=FinishReason.COMPLETED,
            images=images,
            seed=seed,
            height=sp.height,
            width=sp.width,
            timings=RequestTimings(arrival_time=0.0, first_scheduled_time=0.25, finished_time=0.5),
        )
        for stat_logger in self.stat_loggers:
            stat_logger.on_request_finished(output)
        return output

    def abort(self, req_id: str) -> None:
        raise AssertionError("the server aborts by cancelling engine.generate")

    def recent_steps(self) -> list[StepStats]:
        return [StepStats(2, 3, 120, [(64, 64), (32, 64)], ForwardPath.PACKED, 0.01)]


def make_app(api_key: str | None = API_KEY, **config_kwargs):
    kwargs = dict(step_execution=True, max_num_seqs=4, max_queue_size=4, max_generated_image_size=1024 * 1024)
    kwargs.update(config_kwargs)
    engine = StubEngine(OmniDiffusionConfig(**kwargs))
    metrics = PrometheusStatLogger(engine.config, MODEL)
    engine.stat_loggers.append(metrics)
    app = build_app(
        engine, ServerArgs(model="/models/stub", served_model_names=[MODEL], api_key=api_key), metrics
    )
    return app, engine


def post(client, body, headers=AUTH, **kwargs):
    return client.post("/v1/images/generations", json=body, headers=headers, **kwargs)


def assert_error_shape(resp, status: int) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


def decode_png(b64: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(b64)))


def capture_server_start(monkeypatch, config_first: bool = False) -> list:
    """Replace the server start with a recorder; returns the list of (server_args, config) it was given
    ((config, server_args) with `config_first`)."""
    import vllm_omni.entrypoints.cli.startup_checks as startup_checks
    import vllm_omni.entrypoints.openai.api_server as api_server

    seen = []
    monkeypatch.setattr(
        api_server,
        "run_server",
        lambda config, server_args: seen.append(
            (config, server_args) if config_first else (server_args, config)
        ),
    )
    monkeypatch.setattr(startup_checks, "startup_errors", lambda config: [])  # tests/reliability checks them
    return seen


def serve_cli(argv: list[str]) -> int:
    """`vllm serve tiny-qwen-image ARGV` through the CLI; its exit code (argparse errors included)."""
    from vllm_omni.entrypoints.cli import main as cli_main

    try:
        return cli_main.main(["serve", "tiny-qwen-image", *argv], prog="vllm")
    except SystemExit as exc:  # argparse errors
        return exc.code


# ---- Image edits over HTTP against the stub engine (test_image_edit_server.py)


def png_bytes(width: int = 40, height: int = 24, fmt: str = "PNG", mode: str = "RGB") -> bytes:
    if width * height > 1 << 20:  # large: one colour, so it stays small in bytes
        image = Image.new(mode, (width, height))
    else:
        rng = np.random.default_rng(width * height)
        image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).convert(mode)
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


def make_client(edit_model: bool = True):
    engine = StubEngine(OmniDiffusionConfig(max_generated_image_size=4096 * 4096))
    engine.supports_image_input = edit_model  # as DiffusionEngine says for an edit checkpoint
    engine.image_input = registry.family("QwenImageEditPipeline").image_input if edit_model else None
    metrics = PrometheusStatLogger(engine.config, MODEL)
    engine.stat_loggers.append(metrics)
    app = build_app(engine, ServerArgs(model="/m", served_model_names=[MODEL], api_key="sk-test"), metrics)
    return TestClient(app), engine


def edit(client, files=None, data=None, **kwargs):
    files = files if files is not None else {"image": ("in.png", png_bytes(), "image/png")}
    return client.post(
        "/v1/images/edits", files=files, data=data or {"prompt": "make it red"}, headers=AUTH, **kwargs
    )


# ---- The step scheduler against a fake runner (test_scheduler.py)


def make_req(
    req_id: str,
    height: int = 512,
    width: int = 512,
    steps: int = 3,
    negative_prompt: str | None = "blurry",
    **sp_fields,
) -> OmniDiffusionRequest:
    sp = OmniDiffusionSamplingParams(height=height, width=width, num_inference_steps=steps, **sp_fields)
    sp.validate()
    return OmniDiffusionRequest(req_id, "a red cat", negative_prompt, sp)


class FakeRunner:
    """Keeps per-request step counts like a runner would, and checks the SchedulerOutput contract."""

    def __init__(self):
        self.steps: dict[str, list[int]] = {}
        """req_id -> [steps done, total steps]."""

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in out.finished_req_ids:
            self.steps.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            assert new.req_id not in self.steps, f"{new.req_id} sent as new twice"
            self.steps[new.req_id] = [0, new.sampling_params.num_inference_steps]
        outputs = []
        for req_id in out.scheduled_req_ids:
            state = self.steps[req_id]  # KeyError: a cached id the runner never got as new
            state[0] += 1
            finished = state[0] >= state[1]
            result = (
                DiffusionOutput([req_id], seed=0, output_type="latent", height=16, width=16)
                if finished
                else None
            )
            if finished:
                del self.steps[req_id]
            outputs.append(RunnerOutput(req_id, state[0], finished=finished, result=result))
        return ModelRunnerOutput(outputs)


# ---- A tiny transformer, graph buckets and packed inputs (CUDA graphs, LoRA in graphs) (test_cuda_graphs.py)


TINY_CONFIG = QwenImageTransformerConfig(
    num_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=32,
    axes_dims_rope=(4, 6, 6),
)


GRAPHS = CudaGraphConfig(num_seqs=(2, 4), img_rows=(32, 64), txt_rows=(16, 32))


GRAPH_SPECS = [
    SequenceSpec(5, (1, 2, 3)),
    SequenceSpec(3, (1, 4, 4)),
    SequenceSpec(7, (1, 4, 4), is_negative=True),
]


def tiny_model(device="cpu", dtype=torch.float32) -> QwenImageTransformer:
    """The tiny transformer with seeded random weights (std 0.1), on `device` in `dtype`."""
    torch.manual_seed(0)
    model = QwenImageTransformer(TINY_CONFIG, attn_backend=SDPABackend("mask")).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    return model.to(device, dtype)


def tiny_lora_model(device="cpu", dtype=torch.float32):
    """`tiny_model` with a LoRA manager of 3 slots up to rank 8: (model, manager)."""

    model = tiny_model(device, dtype)
    return model, LoRAManager(model, LoRAConfig(enabled=True, max_loras=3, max_lora_rank=8))


def batch(specs, seed=0, device="cpu", dtype=torch.float32):
    """Seeded packed inputs (drawn on the CPU, then moved): (img, txt, timesteps, layout)."""
    layout = build_packed_layout(specs, TINY_CONFIG.axes_dims_rope, device=device)
    gen = torch.Generator().manual_seed(seed)
    img = torch.randn(layout.num_img_rows, TINY_CONFIG.in_channels, generator=gen).to(device, dtype)
    txt = torch.randn(layout.num_txt_rows, TINY_CONFIG.joint_attention_dim, generator=gen).to(device, dtype)
    return img, txt, torch.rand(layout.num_seqs, generator=gen).to(device, dtype), layout


# ---- LoRA slots of one linear and of a merged q/k/v, and the per-row reference (test_lora_layers.py)


class RowLayout:  # the fields LoRAMapping.for_packed reads
    def __init__(self, img_offsets):
        self.img_row_offsets, self.txt_row_offsets = img_offsets, img_offsets
        self.specs = [None] * (len(img_offsets) - 1)


# (slot, rank, alpha / rank) of the slot test's adapters: ranks below the padded slot rank (16)
SLOT_ADAPTERS = {1: (2, 0.5), 2: (5, 1.0), 3: (3, 1.5), 4: (16, 2.0)}


# per sequence (slot, scale); rows per sequence from OFFSETS (some runs longer than a tile)
SLOT_SEQS = [(2, 1.0), (2, 1.0), (0, 1.0), (1, -0.3), (3, 2.0), (2, 0.5), (4, 1.0), (0, 0.7)]


OFFSETS = [0, 3, 5, 9, 10, 14, 20, 22 + 2 * TILE_ROWS, 23 + 2 * TILE_ROWS]


def slot_linear(invariant: bool = False, max_loras: int = 4, max_rank: int = 16):
    """A linear with SLOT_ADAPTERS written in its slots, and those adapters' matrices by slot."""
    gen = torch.Generator().manual_seed(0)
    linear = Linear(24, 40)
    if invariant:
        from vllm_omni.diffusion.batch_invariant import apply_batch_invariance

        apply_batch_invariance(linear)
    state = LoRAStepState()
    slots = make_lora_linear(
        linear, "transformer_blocks.0.attn.to_q", state, max_loras, max_rank, stream="img"
    )
    adapters = {}
    for slot, (rank, scaling) in SLOT_ADAPTERS.items():
        a, b = torch.randn(rank, 24, generator=gen), torch.randn(40, rank, generator=gen)
        adapters[slot] = LoRAModuleWeights(a, b, scaling)
        slots.write(slot, adapters[slot])
    return linear, state, adapters


def per_row_reference(linear, x, adapters, seqs, offsets):
    """Each row's base output plus its own adapter's delta, one row at a time."""
    want = nn.functional.linear(x, linear.weight, linear.bias)
    for i, (slot, scale) in enumerate(seqs):
        w = adapters.get(slot)
        for row in range(offsets[i], offsets[i + 1]):
            if w is not None:
                want[row] += scale * w.scaling * (w.lora_b @ (w.lora_a @ x[row]))
    return want


class MergedQkv(HasMergedLinears):
    """Three 24 -> 40 projections merged into one GEMM (an image-stream q/k/v)."""

    merged_linears = {"qkv": ("to_q", "to_k", "to_v")}

    def __init__(self):
        super().__init__()
        self.to_q, self.to_k, self.to_v = (Linear(24, 40) for _ in range(3))
        self.merge_linears()


# slot -> (rank, {member: alpha / rank}); slot 2 skips k, slot 3 is k alone, slot 5 stays empty
GROUP_ADAPTERS = {
    1: (2, {"to_q": 0.5, "to_k": 0.5, "to_v": 0.5}),
    2: (5, {"to_q": 1.0, "to_v": 1.0}),
    3: (16, {"to_k": 2.0}),
    4: (3, {"to_q": 1.5, "to_k": -1.0, "to_v": 0.25}),
}


GROUP_SEQS = SLOT_SEQS + [(5, 1.0)]


GROUP_OFFSETS = OFFSETS + [OFFSETS[-1] + 7]


def group_qkv(max_loras: int = 5, max_rank: int = 16):
    """A merged q/k/v with GROUP_ADAPTERS in its slots, and those matrices by (member, slot)."""
    gen = torch.Generator().manual_seed(3)
    module, state, adapters = MergedQkv(), LoRAStepState(), {}
    modules = dict(module.named_modules())
    for slot, (rank, members) in GROUP_ADAPTERS.items():
        for name, scaling in members.items():
            w = LoRAModuleWeights(
                torch.randn(rank, 24, generator=gen), torch.randn(40, rank, generator=gen), scaling
            )
            make_lora_slots(modules, name, state, max_loras, max_rank, stream="img").write(slot, w)
            adapters[name, slot] = w
    batch = LoRABatch.build(
        LoRAMapping.for_packed([SeqLoRA(*s) for s in GROUP_SEQS], RowLayout(GROUP_OFFSETS)),
        {s: s for s in range(1, max_loras + 1)},
        "cpu",
    )
    return module, state, adapters, batch


def group_reference(module, x, adapters):
    """Each member's per-row reference, side by side as the merged GEMM's columns."""
    return torch.cat(
        [
            per_row_reference(
                getattr(module, name),
                x,
                {slot: w for (member, slot), w in adapters.items() if member == name},
                GROUP_SEQS,
                GROUP_OFFSETS,
            )
            for name in ("to_q", "to_k", "to_v")
        ],
        -1,
    )


# ---- FP8 (test_fp8_fusion.py)


FP8_ALL_BLOCK_LINEARS = QuantizationConfig(
    "fp8",
    ignored_layers=tuple(n for n in QwenImageTransformer.plans.quant_kept_layers if n != "img_mlp.net.2"),
)
"""Every linear of the blocks in FP8 (the default keeps img_mlp.net.2 in BF16): both MLPs fuse."""


class ActiveLoRA:
    """A LoRA slot that is active and adds nothing: its layer must get x in high precision."""

    def is_active(self, x: torch.Tensor) -> bool:
        return True

    def add_delta(self, x: torch.Tensor, out: torch.Tensor, batch_invariant: bool) -> None:
        assert isinstance(x, torch.Tensor)

    def kernel_delta(self, x, out, batch_invariant, activation=None):
        return None  # the host path: `add_delta`


# ---- FP8 engines on the tiny model (test_quantization.py)


def quantized_engine(tiny_model_dir, quantization) -> DiffusionEngine:
    config = OmniDiffusionConfig(
        model=str(tiny_model_dir), dtype="float32", device="cpu", quantization=quantization, log_stats=False
    )
    return DiffusionEngine(config, autostart=False)


def final_latent(engine: DiffusionEngine, seed: int) -> torch.Tensor:
    params = OmniDiffusionSamplingParams(
        height=32, width=48, num_inference_steps=3, true_cfg_scale=4.0, seed=seed, output_type="latent"
    )
    handle = engine.add_request(
        OmniDiffusionRequest(f"r{seed}", prompt="a red fox", negative_prompt="blurry", sampling_params=params)
    )
    while not handle.done():
        engine.step()
    return torch.as_tensor(handle.result().images)


# ---- Batch invariance: packed against alone, bit for bit (test_batch_invariance.py)


ROW_COUNTS = (1, 2, 7, 31, 32, 33, 100, 300)


def random_rows(num_rows: int, dim: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, dim, generator=torch.Generator().manual_seed(seed)).to(dtype)


BI_SPECS = [  # (text tokens, latent grid, negative?): mixed sizes, text lengths, CFG pairs
    (5, (1, 2, 2), False),
    (7, (1, 3, 4), False),
    (3, (1, 3, 4), True),
    (9, (1, 2, 3), False),
    (4, (1, 8, 8), False),
    (11, (1, 8, 8), True),
    (2, (1, 1, 1), False),
]


def packed_vs_alone(transformer, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    cfg = transformer.config
    specs = [SequenceSpec(t, grid, f"req{i}", neg) for i, (t, grid, neg) in enumerate(BI_SPECS)]
    gen = torch.Generator().manual_seed(0)
    img = [torch.randn(s.num_img_tokens, cfg.in_channels, generator=gen).to(dtype) for s in specs]
    txt = [torch.randn(s.num_txt_tokens, cfg.joint_attention_dim, generator=gen).to(dtype) for s in specs]
    timesteps = torch.rand(len(specs), generator=gen).to(dtype)
    with torch.inference_mode():
        layout = build_packed_layout(specs, cfg.axes_dims_rope)
        packed = transformer.forward_packed(torch.cat(img), torch.cat(txt), timesteps, layout)
        packed = packed.split([x.shape[0] for x in img])
        pairs = []
        for i, spec in enumerate(specs):
            alone_layout = build_packed_layout([spec], cfg.axes_dims_rope)
            pairs.append(
                (transformer.forward_packed(img[i], txt[i], timesteps[i : i + 1], alone_layout), packed[i])
            )
    return pairs


BI_CASES = [
    # (prompt, negative_prompt, height, width, steps, true_cfg_scale, seed, output_type)
    ("a red fox in the snow", "blurry", 32, 32, 3, 4.0, 11, "np"),
    ("a lighthouse on a rocky coast at dusk, waves, seagulls", "low quality", 48, 64, 4, 2.5, 12, "latent"),
    ("a cat", "dark", 64, 32, 2, 7.0, 13, "np"),
    ("mountains", "ugly", 32, 48, 3, 1.5, 14, "latent"),
    ("a bowl of fruit", None, 48, 48, 3, 4.0, 15, "np"),  # CFG off: batches with the next one
    ("a tree", None, 32, 32, 2, 1.0, 16, "latent"),
]


def bi_request(tag: str, index: int) -> OmniDiffusionRequest:
    prompt, negative, height, width, steps, scale, seed, output_type = BI_CASES[index]
    params = OmniDiffusionSamplingParams(
        height=height,
        width=width,
        num_inference_steps=steps,
        true_cfg_scale=scale,
        seed=seed,
        output_type=output_type,
    )
    return OmniDiffusionRequest(
        f"{tag}/{index}", prompt=prompt, negative_prompt=negative, sampling_params=params
    )


class ForwardRecorder:
    """Wraps `forward_packed`; keeps every sequence's output by (case index, negative?) in step order.

    `case_of` maps the engine's request ids (from the handles `add_request` returns) to case indices."""

    def __init__(self, forward_packed):
        self.inner = forward_packed
        self.case_of: dict[str, int] = {}
        self.outputs: dict[tuple[int, bool], list[torch.Tensor]] = defaultdict(list)
        self.num_seqs: list[int] = []

    def __call__(self, img_rows, txt_rows, timestep, layout):
        out = self.inner(img_rows, txt_rows, timestep, layout)
        offsets = layout.img_row_offsets
        for i, spec in enumerate(layout.specs):
            key = (self.case_of[spec.req_id], spec.is_negative)
            self.outputs[key].append(out[offsets[i] : offsets[i + 1]].clone())
        self.num_seqs.append(len(layout.specs))
        return out


def drive(
    engine: DiffusionEngine,
    requests: list[OmniDiffusionRequest],
    late: list[OmniDiffusionRequest] = (),
    after: int = 0,
    recorder: ForwardRecorder | None = None,
) -> list:
    def add(req: OmniDiffusionRequest):
        handle = engine.add_request(req)
        if recorder is not None:
            recorder.case_of[handle.req_id] = int(req.request_id.rsplit("/", 1)[1])
        return handle

    handles, num_steps = [add(r) for r in requests], 0
    while not all(h.done() for h in handles) or late:
        if late and num_steps == after:
            handles += [add(r) for r in late]
            late = []
        engine.step()
        num_steps += 1
    return [h.result().images for h in handles]


def as_array(images) -> np.ndarray:
    return images.float().numpy() if isinstance(images, torch.Tensor) else np.asarray(images)


def assert_mixed_batch_equals_alone(engine: DiffusionEngine, monkeypatch) -> None:
    """`BI_CASES` served alone, then together (four of them joining two steps late): images, final latents
    and every per-step transformer output are equal (test_batch_invariance_fp8.py reuses it)."""
    transformer = engine.executor.driver_worker.pipeline.transformer
    alone = ForwardRecorder(transformer.forward_packed)
    monkeypatch.setattr(transformer, "forward_packed", alone)
    alone_images = [
        drive(engine, [bi_request(f"alone-{time.time()}", i)], recorder=alone)[0] for i in range(6)
    ]

    together = ForwardRecorder(alone.inner)
    monkeypatch.setattr(transformer, "forward_packed", together)
    tag = f"together-{time.time()}"
    first = [bi_request(tag, i) for i in (0, 1)]
    late = [bi_request(tag, i) for i in (2, 3, 4, 5)]  # join two steps into the first two's schedules
    together_images = drive(engine, first, late, after=2, recorder=together)

    assert max(together.num_seqs) >= 6, f"requests should share steps, got {together.num_seqs}"
    for i, (a, b) in enumerate(zip(alone_images, together_images)):
        a, b = as_array(a), as_array(b)
        assert a.shape == b.shape and np.abs(a).max() > 0, f"case {i}"
        assert np.array_equal(a, b), f"case {i} ({BI_CASES[i][7]}): max abs diff {np.abs(a - b).max()}"
    assert sorted(alone.outputs) == sorted(together.outputs)
    for key, outs in alone.outputs.items():
        assert len(outs) == len(together.outputs[key]) == BI_CASES[key[0]][4]
        for step, (a, b) in enumerate(zip(outs, together.outputs[key])):
            assert torch.equal(a, b), f"case {key} step {step}: max abs diff {(a - b).abs().max()}"


# ---- A tiny transformer and inputs for the parallel forwards (test_distributed_transformer.py)


DIST_TINY = dict(
    num_layers=2,
    attention_head_dim=16,
    num_attention_heads=4,
    joint_attention_dim=32,
    axes_dims_rope=(4, 6, 6),
    in_channels=64,
    out_channels=16,
)


DIST_SPECS = [  # cfg ranks [0, 1, 0, 1]: the gathered output must be reordered
    SequenceSpec(3, (1, 4, 2), "b"),
    SequenceSpec(7, (1, 4, 2), "b", is_negative=True),
    SequenceSpec(5, (1, 2, 3), "a"),
    SequenceSpec(4, (1, 3, 3), "c"),
]


DENSE_SHAPE, DENSE_TXT_LENS = (1, 2, 4), [6, 3, 6, 1]


def make_model() -> QwenImageTransformer:
    torch.manual_seed(1234)
    model = QwenImageTransformer(QwenImageTransformerConfig(**DIST_TINY), attn_backend="SDPA").eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape) * 0.1)
    return model


def make_inputs() -> dict:
    gen = torch.Generator().manual_seed(7)
    layout = build_packed_layout(DIST_SPECS, DIST_TINY["axes_dims_rope"])
    mask = torch.zeros(len(DENSE_TXT_LENS), max(DENSE_TXT_LENS), dtype=torch.long)
    for i, n in enumerate(DENSE_TXT_LENS):
        mask[i, :n] = 1
    num_dense = len(DENSE_TXT_LENS)
    return dict(
        img=torch.randn(layout.num_img_rows, 64, generator=gen),
        txt=torch.randn(layout.num_txt_rows, 32, generator=gen),
        t=torch.tensor([0.4, 0.4, 0.9, 0.05]),
        dense_img=torch.randn(num_dense, 8, 64, generator=gen),
        dense_txt=torch.randn(num_dense, max(DENSE_TXT_LENS), 32, generator=gen),
        dense_mask=mask,
        dense_t=torch.tensor([0.8, 0.8, 0.3, 0.3]),
    )


@torch.no_grad()
def run_model(model, x: dict) -> tuple[torch.Tensor, torch.Tensor]:
    layout = build_packed_layout(DIST_SPECS, DIST_TINY["axes_dims_rope"])
    packed = model.forward_packed(x["img"], x["txt"], x["t"], layout)
    dense = model(x["dense_img"], x["dense_txt"], x["dense_mask"], x["dense_t"], [DENSE_SHAPE] * 4)
    return packed, dense

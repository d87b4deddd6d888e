"""Batch-invariant FP8 (VLLM_BATCH_INVARIANT=1 with --quantization fp8): a request gets the same bits
batched as alone, with W8A8 linears.

As in test_batch_invariance.py, the references are things we did not compute in the batch: the same
rows or request alone (exact equality), and the dequantised product in fp64 / the default FP8 linear
(within FP8-appropriate tolerance, so the invariant linear is the same function). The CUDA kernel runs
here under triton's CPU interpreter; test_fp8_gpu.py runs it on the GPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from triton_interpreter import PATCH, run_interpreted
from utils import ROW_COUNTS, assert_mixed_batch_equals_alone, packed_vs_alone, random_rows, rel_err

from vllm_omni.config import OmniDiffusionConfig
from vllm_omni.diffusion.batch_invariant import (
    BatchInvariantLinearMethod,
    is_batch_invariant,
    make_batch_invariant,
)
from vllm_omni.diffusion.engine import DiffusionEngine
from vllm_omni.diffusion.layers.fp8 import FP8_DTYPE, Fp8Activation, Fp8LinearMethod, fp8_linear
from vllm_omni.diffusion.layers.fp8_batch_invariant import (
    BatchInvariantFp8LinearMethod,
    batch_invariant_fp8_linear,
)
from vllm_omni.diffusion.layers.linear import Linear, UnquantizedLinearMethod, linears
from vllm_omni.diffusion.layers.quant_config import QuantizationConfig
from vllm_omni.diffusion.layers.quantization import quantize_transformer

TESTS = Path(__file__).resolve().parent
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
FP8 = QuantizationConfig("fp8")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _fp8_layer(k: int, n: int, dtype: torch.dtype, bias: bool = True) -> Linear:
    """A seeded `Linear(k, n)` in dtype, quantized, then switched to the invariant FP8 method."""
    torch.manual_seed(k + n)
    layer = Linear(k, n, bias=bias).to(dtype)
    layer.set_quant_method(Fp8LinearMethod())
    layer.set_quant_method(BatchInvariantFp8LinearMethod())  # a subclass: the e4m3 weights are kept
    return layer


# ---- the linear -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,n", [(64, 32), (96, 40), (3072, 48)])
def test_fp8_linear_rows_do_not_depend_on_row_count(dtype, k, n):
    dt = DTYPES[dtype]
    layer = _fp8_layer(k, n, dt)
    assert layer.weight.dtype == FP8_DTYPE and isinstance(layer.quant_method, BatchInvariantFp8LinearMethod)
    x = random_rows(300, k, dt, 3)
    full = layer(x)
    for num_rows in ROW_COUNTS:
        assert torch.equal(layer(x[:num_rows]), full[:num_rows]), num_rows
    assert torch.equal(layer(x[45:52]), full[45:52])  # any window, at any offset
    assert torch.equal(layer(x.view(3, 100, k)).view(300, n), full)
    # a fused producer's already quantised input gives the same bits as x
    assert layer.accepts_fp8_input(x) and torch.equal(layer(Fp8Activation.quantize(x[:7])), full[:7])


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_linear_is_the_dequantised_matmul(dtype):
    """Against x8 * sx @ (W8 * sw)^T + b in fp64 from the same e4m3 values (only the GEMM's and the
    output's own rounding differ), and close to the default FP8 linear (another summation order)."""
    dt = DTYPES[dtype]
    layer = _fp8_layer(96, 40, dt)
    x = random_rows(37, 96, dt, 1)
    got = layer(x)
    assert got.dtype == dt and got.shape == (37, 40)
    act = Fp8Activation.quantize(x)
    want = (act.data.double() * act.scale.double()) @ (
        layer.weight.double() * layer.weight_scale.double()[:, None]
    ).t() + layer.bias.double()
    tol = 1e-6 if dt == torch.float32 else 8e-3  # bf16: the output's own rounding
    assert rel_err(got, want) <= tol
    default = fp8_linear(x, layer.weight, layer.weight_scale, layer.bias)
    assert rel_err(got, default) <= 2 * tol
    assert batch_invariant_fp8_linear(x[:0], layer.weight, layer.weight_scale, None).shape == (0, 40)


def test_default_fp8_linear_depends_on_row_count():
    """Why FP8 needs its own invariant method: where this CPU's `fp8_linear` gives a row other bits
    for another row count, the invariant one does not (skipped where the default happens to be
    invariant here; on the GPU cuBLAS picks tiles and split-K from M)."""
    layer = _fp8_layer(32, 192, torch.float32)
    x = random_rows(64, 32, torch.float32)
    full = fp8_linear(x, layer.weight, layer.weight_scale, layer.bias)
    params = (layer.weight, layer.weight_scale, layer.bias)
    varying = [m for m in (1, 2, 3, 5, 17) if not torch.equal(fp8_linear(x[:m], *params)[0], full[0])]
    if not varying:
        pytest.skip("the default FP8 linear happens to be batch invariant on this CPU")
    invariant_full = layer(x)
    for m in varying:
        assert torch.equal(layer(x[:m])[0], invariant_full[0])


def test_fp8_and_plain_layers_switch_to_their_invariant_twins():
    """`make_batch_invariant` on an FP8 model: quantized layers get the invariant FP8 method over the
    same e4m3 parameters, kept layers the plain invariant one; merged projections stay merged (one
    invariant FP8 GEMM); quantizing again (a second engine on the pipeline) changes nothing."""
    from utils import make_models

    _, model = make_models(3)
    quantize_transformer(model, FP8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    summary = make_batch_invariant(model)
    layers = linears(model)
    assert summary.num_linears == len(layers)
    fp8 = [n for n, m in layers.items() if isinstance(m.quant_method, BatchInvariantFp8LinearMethod)]
    plain = [n for n, m in layers.items() if isinstance(m.quant_method, BatchInvariantLinearMethod)]
    assert fp8 and plain and len(fp8) + len(plain) == len(layers)
    assert all(layers[n].weight.dtype == FP8_DTYPE for n in fp8)
    after = model.state_dict()
    assert list(after) == list(before)
    for key, value in before.items():  # (the merged groups were stacked again: new storage, same bits)
        assert torch.equal(_bits(after[key]), _bits(value)), key
    merged = model.transformer_blocks[0].attn.merged("img_qkv")
    assert merged is not None and isinstance(merged.layer.quant_method, BatchInvariantFp8LinearMethod)
    quantize_transformer(model, FP8)  # already FP8 (its invariant twin): kept
    assert all(isinstance(layers[n].quant_method, BatchInvariantFp8LinearMethod) for n in fp8)
    with pytest.raises(ValueError, match="fp8_batch_invariant linear cannot switch to unquantized"):
        layers[fp8[0]].set_quant_method(UnquantizedLinearMethod())


class RecordingLoRA:
    """An active LoRA slot that adds nothing and records what its layer handed it."""

    def __init__(self):
        self.calls: list[tuple[type, bool]] = []

    def is_active(self, x: torch.Tensor) -> bool:
        return True

    def add_delta(self, x: torch.Tensor, out: torch.Tensor, batch_invariant: bool) -> None:
        self.calls.append((type(x), batch_invariant))

    def add_merged_delta(self, members, x, out, batch_invariant: bool) -> bool:
        return False


def test_lora_over_invariant_fp8_layers_gets_x_and_the_invariant_flag():
    """An active LoRA slot declines the FP8 input (its delta needs x in high precision) and adds its
    deltas with the invariant matmul, on a layer and on a merged group's members."""
    from vllm_omni.diffusion.layers.merged_linear import MergedLinear

    x = random_rows(6, 64, torch.float32)
    layer = _fp8_layer(64, 32, torch.float32)
    layer.lora = RecordingLoRA()
    assert not layer.accepts_fp8_input(x)
    layer(x)
    assert layer.lora.calls == [(torch.Tensor, True)]
    members = tuple(_fp8_layer(64, 16, torch.float32) for _ in range(3))
    merged = MergedLinear.build(members)
    assert merged is not None and merged.layer.quant_method.batch_invariant
    members[1].lora = RecordingLoRA()
    assert not merged.accepts_fp8_input(x)
    out = merged(x)
    assert members[1].lora.calls == [(torch.Tensor, True)]
    assert torch.equal(out[:, 16:32], members[1].base_forward(x))  # a member's columns, its own GEMM


# ---- the transformer and the engine (tiny Qwen-Image) ---------------------------------------------


@pytest.fixture(scope="module")
def fp8_transformer(tiny_model_dir):
    """(dtype, invariant) -> the tiny checkpoint's transformer in FP8, batch invariant or not."""
    from vllm_omni.diffusion.models.qwen_image.loader import load_qwen_image

    cache: dict = {}

    def get(dtype: torch.dtype, invariant: bool = True):
        if (dtype, invariant) not in cache:
            transformer = load_qwen_image(str(tiny_model_dir), device="cpu", dtype=dtype).transformer
            quantize_transformer(transformer, FP8)
            if invariant:
                make_batch_invariant(transformer)
            cache[dtype, invariant] = transformer
        return cache[dtype, invariant]

    return get


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_transformer_packed_forward_equals_alone(dtype, fp8_transformer):
    dt = DTYPES[dtype]
    transformer, default = fp8_transformer(dt), fp8_transformer(dt, invariant=False)
    assert is_batch_invariant(transformer)
    methods = [m.quant_method for m in linears(transformer).values()]
    assert any(isinstance(m, BatchInvariantFp8LinearMethod) for m in methods)
    pairs = packed_vs_alone(transformer, dt)
    for i, (alone, packed) in enumerate(pairs):
        assert alone.abs().max() > 0 and torch.equal(alone, packed), f"sequence {i}"
    # the same function as the default FP8 transformer: only the GEMMs' summation order differs (in
    # bf16 a last-bit difference can move a downstream activation to the next e4m3 code, 6% of that
    # element, so the bound is on the whole output)
    for (alone, _), (default_alone, _) in zip(pairs, packed_vs_alone(default, dt)):
        assert rel_err(alone, default_alone) < (1e-5 if dt == torch.float32 else 3e-2)  # here: 2e-7, 1e-2


def test_default_fp8_transformer_depends_on_the_batch(fp8_transformer):
    """Without the mode, the FP8 transformer's packed outputs differ from alone ones here: the test
    above can fail."""
    pairs = packed_vs_alone(fp8_transformer(torch.float32, invariant=False), torch.float32)
    if all(torch.equal(alone, packed) for alone, packed in pairs):
        pytest.skip("the default fp32 FP8 transformer happens to be batch invariant on this machine")
    assert max(rel_err(alone, packed) for alone, packed in pairs) < 1e-5  # different bits, same function


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_engine_mixed_batch_equals_alone(dtype, tiny_model_dir, monkeypatch):
    """The config takes --quantization fp8 with batch invariance; every image, final latent and per-step
    transformer output of a mixed, staggered batch equals the request served alone."""
    config = OmniDiffusionConfig(
        model=str(tiny_model_dir),
        dtype=dtype,
        device="cpu",
        max_num_seqs=8,
        scheduling_policy="skip-ahead",
        batch_invariant=True,
        quantization="fp8",
        mixfusion_min_chunk_tokens=1,
        log_stats=False,
    )
    engine = DiffusionEngine(config, autostart=False)
    methods = [m.quant_method for m in linears(engine.executor.driver_worker.pipeline.transformer).values()]
    assert all(m.batch_invariant for m in methods)
    assert any(isinstance(m, BatchInvariantFp8LinearMethod) for m in methods)
    assert_mixed_batch_equals_alone(engine, monkeypatch)


def test_batch_invariance_check_runs_with_fp8():
    from benchmarks.diffusion import batch_invariance_check

    payload = batch_invariance_check.main(
        ["--device", "cpu", "--pairs", "32+48", "--transformer-only", "--iters", "1", "--quantization", "fp8"]
    )
    (row,) = payload["results"]
    assert row["batch_invariant"]["transformer_max_abs"] == 0.0
    assert payload["config"]["quantization"] == "fp8" and payload["config"]["patched"]["linears"] > 0


# ---- the CUDA kernel, under triton's CPU interpreter ----------------------------------------------

KERNEL_CHECK = (
    PATCH
    + """
import torch
from utils import rel_err
from vllm_omni.diffusion.layers.fp8 import quantize_rows
from vllm_omni.diffusion.layers.fp8_batch_invariant import cpu_fp8_matmul, triton_fp8_matmul

gen = torch.Generator().manual_seed(0)
for dtype, with_bias in ((torch.bfloat16, True), (torch.float32, False)):
    # K = 200, N = 150: neither a multiple of the tile; M up to 300 rows spans three row tiles
    x = torch.randn(300, 200, generator=gen).to(dtype)
    w = torch.randn(150, 200, generator=gen) / 200**0.5
    b = torch.randn(150, generator=gen).to(dtype) if with_bias else None
    (xq, sx), (wq, sw) = quantize_rows(x), quantize_rows(w)
    sw = sw.view(-1)
    full = triton_fp8_matmul(xq, sx, wq, sw, b, dtype)
    assert full.dtype == dtype and full.shape == (300, 150)
    for m in (1, 7, 129, 300):
        assert torch.equal(triton_fp8_matmul(xq[:m], sx[:m], wq, sw, b, dtype), full[:m]), m
    assert torch.equal(triton_fp8_matmul(xq[45:52], sx[45:52], wq, sw, b, dtype), full[45:52])
    want = (xq.double() * sx.double()) @ (wq.double() * sw.double()[:, None]).t()
    if b is not None:
        want = want + b.double()
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    assert rel_err(full, want) <= tol, rel_err(full, want)
    assert rel_err(full, cpu_fp8_matmul(xq, sx, wq, sw, b, dtype)) <= 2 * tol
assert triton_fp8_matmul(xq[:0], sx[:0], wq, sw, None, dtype).shape == (0, 150)
print("ok")
"""
)


def test_triton_fp8_kernel_rows_do_not_depend_on_row_count_interpreted():
    """The CUDA path's Triton kernel (e4m3 `tl.dot`, fp32 accumulation, scales and bias in the
    epilogue) run by triton's CPU interpreter (TRITON_INTERPRET must be set before triton loads, hence
    the subprocess): rows equal for M = 1, 7, 129, 300 and any window, the dequantised product within
    the output's rounding, close to the CPU path."""
    pytest.importorskip("triton")
    run_interpreted(KERNEL_CHECK)

"""Batch-invariant mode (VLLM_BATCH_INVARIANT=1): a request gets the same bits batched as alone.

The reference is always something we did not compute in the batch: the same request served alone
(exact equality, fp32 and bf16), and torch's own `nn.Linear` / SDPA / RMSNorm for the replaced ops
(within tolerance, so the invariant ops are the same functions). Where the default kernels happen to
differ with the batch on this CPU, the tests show that too, so the exact checks can fail.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from utils import ROW_COUNTS, assert_mixed_batch_equals_alone, packed_vs_alone, random_rows

from vllm_omni.config import OmniDiffusionConfig
from vllm_omni.diffusion.attention import SDPABackend, build_varlen_metadata
from vllm_omni.diffusion.batch_invariant import (
    BatchInvariantAttentionBackend,
    BatchInvariantLinearMethod,
    CpuElementwiseMode,
    apply_batch_invariance,
    batch_invariant_linear,
    batch_invariant_rms_norm,
    is_batch_invariant,
    make_batch_invariant,
)
from vllm_omni.diffusion.engine import DiffusionEngine
from vllm_omni.diffusion.layers.linear import Linear
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.inputs import OmniDiffusionSamplingParams

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.diffusion import batch_invariance_check  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


# ---- linear ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,n", [(32, 192), (64, 32), (3072, 48)])
def test_linear_rows_do_not_depend_on_row_count(dtype, k, n):
    dt = DTYPES[dtype]
    weight, bias, x = random_rows(n, k, dt, 1), random_rows(1, n, dt, 2)[0], random_rows(300, k, dt, 3)
    full = batch_invariant_linear(x, weight, bias)
    for num_rows in ROW_COUNTS:
        assert torch.equal(batch_invariant_linear(x[:num_rows], weight, bias), full[:num_rows]), num_rows
    # any window, at any offset, as a request's rows sit anywhere in a packed buffer
    assert torch.equal(batch_invariant_linear(x[45:52], weight, bias), full[45:52])
    assert torch.equal(
        batch_invariant_linear(x[45:52], weight, None), batch_invariant_linear(x, weight, None)[45:52]
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_is_nn_linear_within_tolerance(dtype):
    dt = DTYPES[dtype]
    layer = nn.Linear(64, 96).to(dt)
    x = random_rows(2 * 5 * 9, 64, dt).view(2, 5, 9, 64).transpose(1, 2)  # non-contiguous 4-D input
    want = F.linear(x.float(), layer.weight.float(), layer.bias.float())
    got = batch_invariant_linear(x, layer.weight, layer.bias)
    assert got.shape == want.shape and got.dtype == dt
    tol = 1e-5 if dt == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    assert got.abs().max() > 0.1  # not trivially zero
    with pytest.raises(ValueError, match="one dtype"):
        batch_invariant_linear(x.double(), layer.weight, layer.bias)


def test_default_linear_depends_on_row_count():
    """Why the mode exists: torch's fp32 CPU linear (MKL) gives row 0 other bits for few rows."""
    weight, bias, x = (
        random_rows(192, 32, torch.float32, 1),
        random_rows(1, 192, torch.float32, 2)[0],
        random_rows(64, 32, torch.float32),
    )
    full = F.linear(x, weight, bias)
    varying = [m for m in (1, 2, 3, 5) if not torch.equal(F.linear(x[:m], weight, bias)[0], full[0])]
    if not varying:
        pytest.skip("torch's CPU linear happens to be batch invariant on this machine")
    invariant_full = batch_invariant_linear(x, weight, bias)
    for m in varying:  # where the default differs, the invariant linear does not
        assert torch.equal(batch_invariant_linear(x[:m], weight, bias)[0], invariant_full[0])


def test_apply_batch_invariance_is_in_place():
    model = nn.Sequential(Linear(8, 16), nn.SiLU(), nn.Sequential(Linear(16, 4, bias=False)))
    before = {k: (v.data_ptr(), v.clone()) for k, v in model.state_dict().items()}
    assert apply_batch_invariance(model) == 2
    assert apply_batch_invariance(model) == 0  # idempotent
    after = model.state_dict()
    assert list(after) == list(before)
    for key, (ptr, value) in before.items():
        assert after[key].data_ptr() == ptr and torch.equal(after[key], value)
    assert all(isinstance(m.quant_method, BatchInvariantLinearMethod) for m in (model[0], model[2][0]))

    class LoraLinear(nn.Linear):
        pass

    with pytest.raises(ValueError, match="LoraLinear"):  # a torch linear it cannot switch: refused
        apply_batch_invariance(nn.Sequential(LoraLinear(4, 4)))


# ---- norms, activations, attention ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_rows_and_module_equal(dtype, tiny_transformer):
    dt = DTYPES[dtype]
    norm = tiny_transformer(dt).transformer_blocks[0].attn.norm_q  # our model's RMSNorm (re-classed)
    x = random_rows(300 * 2, 16, dt).view(300, 2, 16) * 3  # [tokens, heads, head_dim]
    full = batch_invariant_rms_norm(x, norm.weight, norm.eps)
    for num_rows in ROW_COUNTS:
        assert torch.equal(batch_invariant_rms_norm(x[:num_rows], norm.weight, norm.eps), full[:num_rows])
    # on CPU the invariant norm is torch's own ops, bit for bit (diffusers' casting rules)
    variance = x.float().pow(2).mean(-1, keepdim=True)
    want = (x * torch.rsqrt(variance + norm.eps)).to(dt) * norm.weight
    assert torch.equal(full, want) and full.dtype == dt


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [32, 3072])
def test_layer_norm_is_row_local(dtype, dim):
    """Kept as is (one row per thread): the tiny and real hidden sizes give the same rows for any M."""
    dt = DTYPES[dtype]
    norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
    x = random_rows(300, dim, dt) * 3
    full = norm(x)
    for num_rows in ROW_COUNTS:
        assert torch.equal(norm(x[:num_rows]), full[:num_rows])
    assert torch.equal(norm(x[45:52]), full[45:52])


@pytest.mark.parametrize("dtype", DTYPES)
def test_activations_take_one_code_path_whatever_the_size(dtype):
    """CPU SIMD loops finish with a scalar tail whose GELU/SiLU bits differ; the mode avoids tails."""
    dt = DTYPES[dtype]
    x = random_rows(40, 64, dt) * 4
    functions = [lambda t: F.gelu(t, approximate="tanh"), F.silu]
    defaults = [fn(x) for fn in functions]  # torch's own kernels, outside the mode
    with CpuElementwiseMode():
        for fn, default in zip(functions, defaults):
            full = fn(x)
            for num_elems in (1, 5, 8, 63, 64, 200):
                assert torch.equal(fn(x.view(-1)[:num_elems]), full.view(-1)[:num_elems])
            assert torch.equal(full, torch.cat([fn(part) for part in x.split(3)]))
            torch.testing.assert_close(full, default)  # the same function
        y = x.clone()
        assert F.silu(y, inplace=True) is y and torch.equal(y, F.silu(x))


def test_default_gelu_depends_on_tensor_size():
    x = random_rows(64, 64, torch.float32) * 4
    full = F.gelu(x, approximate="tanh").view(-1)
    varying = [
        n for n in (1, 5, 8, 15) if not torch.equal(F.gelu(x.view(-1)[:n], approximate="tanh"), full[:n])
    ]
    if not varying:
        pytest.skip("torch's CPU GELU happens to be size invariant on this machine")
    with CpuElementwiseMode():  # where the default differs, the mode does not
        full = F.gelu(x, approximate="tanh").view(-1)
        for n in varying:
            assert torch.equal(F.gelu(x.view(-1)[:n], approximate="tanh"), full[:n])


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_per_sequence_equals_alone(dtype):
    dt = DTYPES[dtype]
    seq_lens = [5, 37, 1, 64, 12]
    total = sum(seq_lens)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(total, 2, 16, generator=gen).to(dt) for _ in range(3))
    backend = BatchInvariantAttentionBackend()
    packed = backend(q, k, v, build_varlen_metadata(seq_lens))
    start = 0
    for n in seq_lens:
        alone = backend(
            q[start : start + n], k[start : start + n], v[start : start + n], build_varlen_metadata([n])
        )
        assert torch.equal(alone, packed[start : start + n])
        start += n
    ref = SDPABackend("mask")(q.float(), k.float(), v.float(), build_varlen_metadata(seq_lens))
    torch.testing.assert_close(packed.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernels need a CUDA device")
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_kernels_rows_do_not_depend_on_row_count(dtype):
    dt = DTYPES[dtype]
    weight, bias, x = (
        t.cuda()
        for t in (random_rows(3072, 3072, dt, 1), random_rows(1, 3072, dt, 2)[0], random_rows(4096, 3072, dt))
    )
    full = batch_invariant_linear(x, weight, bias)
    for num_rows in ROW_COUNTS + (4096,):
        assert torch.equal(batch_invariant_linear(x[:num_rows], weight, bias), full[:num_rows])
    torch.testing.assert_close(
        full.float(), F.linear(x.float(), weight.float(), bias.float()), atol=0.1, rtol=2e-2
    )
    norm_weight = torch.rand(3584, device="cuda").to(dt) + 0.5
    y = random_rows(600, 3584, dt).cuda()
    full = batch_invariant_rms_norm(y, norm_weight, 1e-6)
    for num_rows in ROW_COUNTS:
        assert torch.equal(batch_invariant_rms_norm(y[:num_rows], norm_weight, 1e-6), full[:num_rows])


# ---- the transformer ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_transformer(tiny_model_dir):
    """dtype -> the tiny checkpoint's transformer, batch invariant (loaded once per dtype)."""
    from vllm_omni.diffusion.models.qwen_image.loader import load_qwen_image

    cache: dict = {}

    def get(dtype: torch.dtype, invariant: bool = True):
        if (dtype, invariant) not in cache:
            transformer = load_qwen_image(str(tiny_model_dir), device="cpu", dtype=dtype).transformer
            if invariant:
                make_batch_invariant(transformer)
            cache[dtype, invariant] = transformer
        return cache[dtype, invariant]

    return get


@pytest.mark.parametrize("dtype", DTYPES)
def test_transformer_packed_forward_equals_alone(dtype, tiny_transformer):
    dt = DTYPES[dtype]
    transformer, default = tiny_transformer(dt), tiny_transformer(dt, invariant=False)
    assert is_batch_invariant(transformer) and not is_batch_invariant(default)
    assert list(transformer.state_dict()) == list(default.state_dict())  # names unchanged
    summary = make_batch_invariant(transformer)  # idempotent: nothing left to change
    assert (summary.num_linears, summary.num_rms_norms) == (0, 0)
    assert isinstance(transformer.attn_backend, BatchInvariantAttentionBackend)
    for i, (alone, packed) in enumerate(packed_vs_alone(transformer, dt)):
        assert alone.abs().max() > 0 and torch.equal(alone, packed), f"sequence {i}"
    # the invariant model is the same function as the default one (within tolerance)
    default_pairs = packed_vs_alone(default, dt)
    for (alone, _), (default_alone, _) in zip(packed_vs_alone(transformer, dt), default_pairs):
        tol = 1e-5 if dt == torch.float32 else 5e-2
        torch.testing.assert_close(alone.float(), default_alone.float(), atol=tol, rtol=tol)


def test_default_transformer_depends_on_the_batch(tiny_transformer):
    """Without the mode, fp32 packed outputs differ from alone ones here: the test above can fail."""
    pairs = packed_vs_alone(tiny_transformer(torch.float32, invariant=False), torch.float32)
    if all(torch.equal(alone, packed) for alone, packed in pairs):
        pytest.skip("the default fp32 transformer happens to be batch invariant on this machine")
    assert max(float((a - p).abs().max()) for a, p in pairs) < 1e-4  # different bits, same function


# ---- the engine -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    """dtype name -> a batch-invariant engine on the tiny checkpoint (built once per dtype)."""
    cache: dict[str, DiffusionEngine] = {}

    def get(dtype: str) -> DiffusionEngine:
        if dtype not in cache:
            config = OmniDiffusionConfig(
                model=str(tiny_model_dir),
                dtype=dtype,
                device="cpu",
                max_num_seqs=8,
                scheduling_policy="skip-ahead",  # every request in every step: the packed-step identity
                batch_invariant=True,
                mixfusion_min_chunk_tokens=1,  # let the tiny mixed sizes share steps
                log_stats=False,
            )
            engine = DiffusionEngine(config, autostart=False)
            # idempotent if the engine did it
            make_batch_invariant(engine.executor.driver_worker.pipeline.transformer)
            cache[dtype] = engine
        return cache[dtype]

    return get


@pytest.mark.parametrize("dtype", DTYPES)
def test_engine_mixed_batch_equals_alone(dtype, engines, monkeypatch):
    """Mixed sizes, step counts, CFG scales (and CFG off), staggered arrival: every image, final
    latent and per-step transformer output equals the same request served alone."""
    assert_mixed_batch_equals_alone(engines(dtype), monkeypatch)


def test_seed_is_required(engines):
    engine = engines("float32")
    request = OmniDiffusionRequest("no-seed", prompt="a fox", sampling_params=OmniDiffusionSamplingParams())
    with pytest.raises(ValueError, match="seed"):
        engine.add_request(request)


def test_engine_applies_the_mode(tiny_model_dir):
    config = OmniDiffusionConfig(
        model=str(tiny_model_dir), dtype="float32", device="cpu", batch_invariant=True
    )
    engine = DiffusionEngine(config, autostart=False)
    assert is_batch_invariant(engine.executor.driver_worker.pipeline.transformer)
    assert isinstance(
        engine.executor.driver_worker.pipeline.transformer.attn_backend, BatchInvariantAttentionBackend
    )


# ---- the benchmark script -------------------------------------------------------------------------


def test_batch_invariance_check_smoke(tmp_path, tiny_model_dir):
    out = tmp_path / "bi.json"
    payload = batch_invariance_check.main(
        [
            "--model", str(tiny_model_dir), "--device", "cpu", "--dtype", "float32", "--steps", "2",
            "--pairs", "32+48", "--json-output", str(out),
        ]
    )  # fmt: skip
    assert json.loads(out.read_text()) == json.loads(json.dumps(payload))
    rows = payload["results"]
    assert [r["pair"] for r in rows] == ["32x32+48x48"]
    for row in rows:
        inv = row["batch_invariant"]
        assert inv["transformer_max_abs"] == inv["latent_max_abs"] == inv["image_max_abs"] == 0.0
        assert inv["num_seqs_batched"] == 4  # both requests (CFG: 2 sequences each) in one step
        assert row["default"]["step_time_s"] > 0 and inv["step_time_s"] > 0
        assert row["step_time_ratio"] == pytest.approx(inv["step_time_s"] / row["default"]["step_time_s"])


def test_batch_invariance_check_transformer_only_smoke():
    payload = batch_invariance_check.main(
        ["--device", "cpu", "--pairs", "32+48", "--transformer-only", "--iters", "1"]
    )
    (row,) = payload["results"]
    assert (
        row["batch_invariant"]["transformer_max_abs"] == 0.0
        and row["batch_invariant"]["latent_max_abs"] is None
    )
    assert payload["config"]["timing"] == "packed forward" and row["step_time_ratio"] > 0
    with pytest.raises(ValueError, match="--pairs"):
        batch_invariance_check.main(["--pairs", "512"])


def test_mode_switches_compiled_block_ops_back_to_eager(tiny_model_dir):
    """Compiled fused ops specialise on shapes; batch-invariant mode must run the eager chains."""
    from vllm_omni.diffusion.models.qwen_image.fused_ops import BlockOps
    from vllm_omni.diffusion.models.qwen_image.loader import load_qwen_image

    model = load_qwen_image(str(tiny_model_dir), device="cpu", dtype=torch.float32).transformer
    model.block_ops = BlockOps(compiled=False)
    model.block_ops.compiled = True  # as if enable_compile() had run (no real compile on CPU here)
    make_batch_invariant(model)
    assert model.block_ops.compiled is False

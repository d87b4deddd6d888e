"""FP8 (W8A8) quantization (issue 25, the CPU-verifiable parts): the FP8 linear against a dequantised
reference matmul, which layers stay high precision, the tiny model's error against the unquantized
model (transformer output and final latent, recorded and loosely bounded), packed == alone, LoRA after
the FP8 output, tensor-parallel shards of FP8 layers, the config's accepted forms and refusals, and the
start-up weight bytes."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from utils import final_latent, make_models, make_packed_batch, quantized_engine, rel_err

from vllm_omni.config import OmniDiffusionConfig
from vllm_omni.diffusion.distributed.tensor_parallel import column_shard, row_shard
from vllm_omni.diffusion.layers.fp8 import FP8_DTYPE, Fp8LinearMethod, fp8_linear, quantize_rows
from vllm_omni.diffusion.layers.linear import Linear, UnquantizedLinearMethod, linears
from vllm_omni.diffusion.layers.quant_config import QuantizationConfig
from vllm_omni.diffusion.layers.quantization import layers_to_quantize, quantize_transformer, weight_bytes
from vllm_omni.diffusion.layout import build_packed_layout
from vllm_omni.diffusion.models.qwen_image.transformer import QwenImageTransformer
from vllm_omni.diffusion.models.qwen_image21.transformer import (
    QwenImage21Transformer,
    QwenImage21TransformerConfig,
)
from vllm_omni.lora.batch import LoRABatch
from vllm_omni.lora.layers import LoRAMapping, LoRAModuleWeights, LoRAStepState, SeqLoRA, make_lora_linear

FP8 = QuantizationConfig("fp8")


def _randn(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


# ---- the FP8 linear ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_is_the_dequantised_matmul(dtype):
    """Against x8 * sx @ (W8 * sw)^T computed in fp64 from the same e4m3 values: only the GEMM's own
    rounding differs (tight), and the e4m3 rounding of x and W is what separates it from F.linear."""
    x, w, b = _randn(37, 96, seed=1).to(dtype), _randn(40, 96, seed=2, scale=0.1), _randn(40, seed=3)
    wq, sw = quantize_rows(w)
    assert wq.dtype == FP8_DTYPE and sw.shape == (40, 1)
    assert (wq.float().abs().amax(dim=1) == 448).all()  # every row's amax maps onto e4m3's max
    got = fp8_linear(x.view(37, 1, 96), wq, sw.view(-1), b.to(dtype)).view(37, 40)
    assert got.dtype == dtype
    xq, sx = quantize_rows(x)
    want = (xq.double() * sx.double()) @ (wq.double() * sw.double()).t() + b.to(dtype).double()
    tol = 1e-6 if dtype == torch.float32 else 8e-3  # bf16: the output's own rounding
    assert rel_err(got, want) <= tol
    # and it is a linear: within e4m3's precision of the unquantized product
    assert 1e-4 < rel_err(got, F.linear(x.double(), w.double(), b.double())) < 0.06
    assert fp8_linear(x[:0], wq, sw.view(-1), None).shape == (0, 40)


def test_fp8_linear_without_cpu_row_scales_is_the_same_product(monkeypatch):
    """torch 2.11's CPU `_scaled_mm` (the H200 machine's) takes only per-tensor scales: there the
    linear computes the dequantised product in fp32, equal to `_scaled_mm` where torch has it."""
    from vllm_omni.diffusion.layers import fp8

    x, w = _randn(33, 64, seed=4), _randn(48, 64, seed=5)
    wq, sw = quantize_rows(w)
    fallback = lambda: False  # noqa: E731
    if fp8._cpu_scaled_mm_takes_row_scales():
        want = fp8_linear(x, wq, sw.view(-1), None)
        monkeypatch.setattr(fp8, "_cpu_scaled_mm_takes_row_scales", fallback)
        assert torch.equal(fp8_linear(x, wq, sw.view(-1), None), want)
    else:  # this torch's CPU kernel refuses row scales: the fallback against fp64
        xq, sx = quantize_rows(x)
        want = (xq.double() * sx.double()) @ (wq.double() * sw.double()).t()
        assert rel_err(fp8_linear(x, wq, sw.view(-1), None), want) <= 1e-6


TRITON_QUANT_CHECK = """
import torch, triton, triton.language as tl
from vllm_omni.diffusion.layers import fp8_triton
from vllm_omni.diffusion.layers.fp8 import quantize_rows

def bits(t):
    return t.view(torch.uint8)

gen = torch.Generator().manual_seed(0)
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    x = (torch.randn(40, 300, generator=gen) * torch.rand(40, 1, generator=gen) * 10).to(dtype)
    x[3] = 0  # an all-zero row: the scale floor
    x[4, :7] = -0.0
    x[5] *= 1e-6  # a tiny row (its own scale)
    x[6, 1:] *= 1e-4  # one large value: the rest of the row lands in e4m3's subnormals
    for rows in (x, x[:, :250], x[:0]):  # contiguous, strided rows, empty
        (q, s), (q_ref, s_ref) = fp8_triton.quantize_rows(rows), quantize_rows(rows)
        assert q.dtype == torch.float8_e4m3fn and s.shape == s_ref.shape == (rows.shape[0], 1)
        assert torch.equal(s, s_ref) and torch.equal(bits(q), bits(q_ref)), dtype

@triton.jit
def round_kernel(v_ptr, out_ptr, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(v_ptr + offs, mask=offs < N, other=0.0)
    tl.store(out_ptr + offs, fp8_triton._round_to_e4m3(v).to(tl.float8e4nv), mask=offs < N)

# the rounding alone: every e4m3 value, every midpoint (ties to even) and its fp32 neighbours
grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
grid = grid[torch.isfinite(grid)].unique()
mid = (grid[1:] + grid[:-1]) / 2
v = torch.cat([grid, mid, mid.nextafter(grid[1:]), mid.nextafter(grid[:-1]), -mid, torch.tensor([-0.0])])
out = torch.empty(v.shape, dtype=torch.float8_e4m3fn)
round_kernel[(triton.cdiv(v.numel(), 1024),)](v, out, v.numel(), BLOCK=1024)
assert torch.equal(bits(out), bits(v.to(torch.float8_e4m3fn)))
print("ok")
"""


def test_triton_quantize_rows_equals_torch_bit_for_bit():
    """The one-pass Triton quantisation (fp8_triton.py) against `quantize_rows`, bit for bit (scales and
    e4m3 codes), under triton's CPU interpreter (TRITON_INTERPRET must be set before triton loads,
    hence the subprocess): fp32 / bf16 / fp16 rows, strided rows, zero and subnormal rows, and the
    rounding on every e4m3 midpoint. The GPU run of the same comparison: test_fp8_gpu.py."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", TRITON_QUANT_CHECK], env=env, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_fp8_method_quantizes_at_load_and_keeps_names():
    layer = Linear(64, 48)
    with torch.no_grad():
        layer.weight.copy_(_randn(48, 64, seed=4, scale=0.2))
    x = _randn(9, 64, seed=5)
    plain = layer(x)
    layer.set_quant_method(Fp8LinearMethod())
    assert layer.weight.dtype == FP8_DTYPE and layer.weight_scale.shape == (48,)
    assert layer.bias.dtype == torch.float32 and layer.compute_dtype == torch.float32
    assert list(layer.state_dict()) == ["weight", "bias", "weight_scale"]
    assert not layer.runs_plain_gemm(x)  # the fused BF16 paths must call it, never bypass it
    assert rel_err(layer(x), plain) < 0.06
    with pytest.raises(ValueError, match="fp8 linear cannot switch to unquantized"):
        layer.set_quant_method(UnquantizedLinearMethod())


def test_lora_delta_is_added_after_the_fp8_output():
    layer = Linear(32, 24)
    layer.set_quant_method(Fp8LinearMethod())
    state = LoRAStepState()
    weights = LoRAModuleWeights(_randn(4, 32, seed=6), _randn(24, 4, seed=7), 0.5)
    make_lora_linear(
        layer, "transformer_blocks.0.attn.to_q", state, max_loras=1, max_rank=4, stream="img"
    ).write(1, weights)
    x = _randn(6, 32, seed=8)
    mapping = LoRAMapping.for_packed(
        [SeqLoRA(3, 2.0), SeqLoRA(0)],
        type("L", (), dict(img_row_offsets=[0, 4, 6], txt_row_offsets=[0, 4, 6], specs=[0, 0])),
    )
    with torch.no_grad(), state.activate(LoRABatch.build(mapping, {3: 1}, "cpu")):  # adapter id 3 in slot 1
        got = layer(x)
    base = fp8_linear(x, layer.weight, layer.weight_scale, layer.bias)
    want = base.clone()
    want[:4] += (
        2.0 * 0.5 * F.linear(F.linear(x[:4], weights.lora_a), weights.lora_b)
    )  # in the activation dtype
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(got[4:], base[4:])


@pytest.mark.parametrize("side", ["column", "row"])
def test_fp8_tensor_parallel_shards_carry_their_scales(side):
    """Two shards of an FP8 layer (gathered, or summed as the all-reduce would) give the whole layer."""
    layer = Linear(32, 16)
    layer.set_quant_method(Fp8LinearMethod())
    x = _randn(5, 32, seed=9)
    whole = layer(x)
    if side == "column":
        shards = [column_shard(layer, r, 2) for r in range(2)]
        assert all(s.weight_scale.shape == (8,) and s.fp8_out_dtype == torch.float32 for s in shards)
        got = torch.cat([s(x) for s in shards], dim=-1)
        torch.testing.assert_close(got, whole, rtol=1e-5, atol=1e-6)  # the GEMM splits N its own way
    else:
        shards = [row_shard(layer, r, 2, group=None) for r in range(2)]
        assert all(s.weight.shape == (16, 16) and s.weight_scale.shape == (16,) for s in shards)
        # each rank quantises its own half of x (per-token scales of its shard): close, not equal
        parts = [s.quant_method.apply(s, x[:, 16 * r : 16 * (r + 1)], None) for r, s in enumerate(shards)]
        assert rel_err(parts[0] + parts[1] + layer.bias, whole) < 0.05


# ---- which layers ------------------------------------------------------------------------------


def test_default_kept_layers_stay_high_precision():
    _, model = make_models(7)
    quantize_transformer(model, FP8)
    kept = {n for n, m in linears(model).items() if isinstance(m.quant_method, UnquantizedLinearMethod)}
    fp8 = {n for n, m in linears(model).items() if isinstance(m.quant_method, Fp8LinearMethod)}
    assert {"img_in", "txt_in", "proj_out", "norm_out.linear"} <= kept
    assert "transformer_blocks.0.img_mod.1" in kept and "transformer_blocks.1.txt_mod.1" in kept
    assert "time_text_embed.timestep_embedder.linear_1" in kept
    assert "transformer_blocks.0.img_mlp.net.2" in kept and "transformer_blocks.0.txt_mlp.net.2" in fp8
    assert {"transformer_blocks.0.attn.to_q", "transformer_blocks.0.img_mlp.net.0.proj"} <= fp8
    for name in kept:
        assert linears(model)[name].weight.dtype == torch.float32
    # each stream's FP8 q, k, v run as one FP8 GEMM: stacked e4m3 weights and per-channel scales
    attn = model.transformer_blocks[0].attn
    for group, first in (("img_qkv", attn.to_q), ("txt_qkv", attn.add_q_proj)):
        stacked = attn.merged(group).layer
        assert isinstance(stacked.quant_method, Fp8LinearMethod) and stacked.weight.dtype == FP8_DTYPE
        assert stacked.weight_scale.shape == (3 * first.out_features,)
        assert torch.equal(stacked.weight_scale[: first.out_features], first.weight_scale)
    assert not model.transformer_blocks[0].img_mlp.net[0].proj.runs_plain_gemm(torch.zeros(1, 1))


def test_ignored_layers_replace_the_default_and_unknown_ones_are_refused():
    _, model = make_models(7)
    selected = layers_to_quantize(model, QuantizationConfig("fp8", ("img_mlp",)))
    assert "proj_out" in selected and "img_in" in selected  # the default set no longer applies
    assert not any("img_mlp" in n for n in selected) and any("txt_mlp" in n for n in selected)
    assert len(layers_to_quantize(model, QuantizationConfig("fp8", ()))) == len(linears(model))
    with pytest.raises(ValueError, match=r"ignored_layers \['img_mpl'\] match no linear"):
        layers_to_quantize(model, QuantizationConfig("fp8", ("img_in", "img_mpl")))


def test_qwen_image21_default_kept_layers():
    model = QwenImage21Transformer(
        QwenImage21TransformerConfig(num_layers=2, attention_head_dim=16, num_attention_heads=2,
                                     context_in_dim=24, axes_dims_rope=(4, 6, 6))
    )  # fmt: skip
    selected = layers_to_quantize(model, FP8)
    assert set(selected) == {
        f"transformer_blocks.{i}.{n}"
        for i in range(2)
        for n in (
            "attn.to_q",
            "attn.to_k",
            "attn.to_v",
            "attn.to_out.0",
            "img_mlp.proj",
            "img_mlp.gate_layer",
        )
    }


def test_weight_bytes_count_fp8_weights():
    _, model = make_models(7)
    meta = copy.deepcopy(model).to("meta")
    bf16 = weight_bytes(meta, torch.bfloat16, QuantizationConfig())
    assert bf16 == 2 * sum(p.numel() for p in model.parameters())
    selected = layers_to_quantize(model, FP8)
    saved = sum(m.weight.numel() - 4 * m.out_features for m in selected.values())
    assert weight_bytes(meta, torch.bfloat16, FP8) == bf16 - saved
    quantize_transformer(model, FP8)
    assert weight_bytes(meta, torch.bfloat16, FP8) == sum(
        p.numel() * (1 if p.dtype == FP8_DTYPE else 4 if p.dtype == torch.float32 and p.dim() == 1
                     and any(p is m.weight_scale for m in selected.values()) else 2)
        for p in model.parameters()
    )  # fmt: skip


# ---- the tiny model ----------------------------------------------------------------------------


def test_tiny_transformer_fp8_error_and_packed_equals_alone():
    """Packed forward of 5 sequences (mixed sizes, CFG), FP8 vs unquantized: error recorded and loosely
    bounded; and each FP8 sequence packed equals it alone (per-token scales are row-local)."""
    _, model = make_models(1234)
    quantized = copy.deepcopy(model)
    quantize_transformer(quantized, FP8)
    specs, imgs, txts, steps = make_packed_batch()
    assert_fp8_packed_error_and_alone("tiny transformer", model, quantized, specs, imgs, txts, steps)


def assert_fp8_packed_error_and_alone(what: str, plain, fp8, specs, imgs, txts, steps) -> None:
    """One packed forward of `specs`: FP8 vs unquantized relative error printed and loosely bounded
    (1e-4 .. 0.1: it quantizes, and not wildly); each FP8 sequence packed equals it alone (1e-5)."""
    layout = build_packed_layout(specs, plain.position_tables)
    with torch.no_grad():
        want = plain.forward_packed(torch.cat(imgs), torch.cat(txts), steps, layout)
        got = fp8.forward_packed(torch.cat(imgs), torch.cat(txts), steps, layout)
        err = rel_err(got, want)
        print(f"{what}, packed forward: FP8 vs fp32 relative error {err:.4f}")
        assert 1e-4 < err < 0.1
        for spec, img, txt, t, packed in zip(specs, imgs, txts, steps, layout.split_img(got), strict=True):
            one = build_packed_layout([spec], fp8.position_tables)
            assert rel_err(packed, fp8.forward_packed(img, txt, t[None], one)) <= 1e-5, spec


def test_tiny_engine_final_latent_fp8_vs_unquantized(tiny_model_dir):
    plain, fp8 = quantized_engine(tiny_model_dir, None), quantized_engine(tiny_model_dir, "fp8")
    try:
        transformer = fp8.executor.driver_worker.pipeline.transformer
        assert isinstance(transformer.transformer_blocks[0].attn.to_q.quant_method, Fp8LinearMethod)
        want, got = final_latent(plain, 5), final_latent(fp8, 5)
        err = rel_err(got, want)
        print(f"tiny engine, final latent (3 steps, CFG 4): FP8 vs fp32 relative error {err:.4f}")
        assert got.shape == want.shape and 1e-5 < err < 0.1
    finally:
        plain.shutdown()
        fp8.shutdown()


# ---- the config ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, method, ignored",
    [
        ("fp8", "fp8", None),
        ('{"method": "fp8"}', "fp8", None),
        ({"method": "FP8", "ignored_layers": ["img_mlp"]}, "fp8", ("img_mlp",)),
        ('{"transformer": {"method": "fp8", "ignored_layers": []}}', "fp8", ()),
        (None, None, None),
    ],
)
def test_config_accepted_forms(value, method, ignored):
    config = OmniDiffusionConfig(quantization=value).quantization
    assert (config.method, config.ignored_layers) == (method, ignored)


@pytest.mark.parametrize(
    "value, message",
    [
        ("int8", "'int8' is not supported .* use 'fp8'"),
        ({"method": "awq"}, "unknown method 'awq'"),
        ({"vae": {"method": "fp8"}}, r"cannot quantize \['vae'\]"),
        (
            {"transformer": {"method": "fp8", "ignore": []}},
            r"quantization.transformer: unknown keys \['ignore'\]",
        ),
        ({"method": "fp8", "transformer": {}}, "not both"),
        ({"ignored_layers": ["a"]}, "no 'method'"),
        ({"method": "fp8", "ignored_layers": "img_in"}, "ignored_layers must be a list"),
        ("{oops", "invalid JSON"),
    ],
)
def test_config_refusals_name_the_field(value, message):
    with pytest.raises(ValueError, match=message):
        OmniDiffusionConfig(quantization=value)


def test_batch_invariant_with_fp8_is_accepted_and_methods_without_an_invariant_gemm_refused(monkeypatch):
    """FP8 has a batch-invariant linear (test_batch_invariance_fp8.py); a method without one is refused
    at start-up, by name (none exists today: the list is emptied to reach the check)."""
    config = OmniDiffusionConfig(quantization="fp8", batch_invariant=True)
    assert config.batch_invariant and config.quantization.method == "fp8"
    monkeypatch.setattr("vllm_omni.config.BATCH_INVARIANT_METHODS", ())
    with pytest.raises(ValueError, match="batch-invariant mode with quantization fp8 is not supported"):
        OmniDiffusionConfig(quantization="fp8", batch_invariant=True)


def test_qwen_image_class_declares_defaults():
    assert "img_mlp.net.2" in QwenImageTransformer.plans.quant_kept_layers


# ---- the flags and the server ----------------------------------------------------------------------


def _cli_config(*argv: str) -> QuantizationConfig:
    from vllm_omni.entrypoints.cli.main import build_parser
    from vllm_omni.entrypoints.cli.serve import engine_config_from_args

    args = build_parser().parse_args(["serve", "tiny-qwen-image", *argv])
    return engine_config_from_args(args).quantization


def test_cli_flags_reach_the_engine_config():
    assert _cli_config() == QuantizationConfig()
    assert _cli_config("--quantization", "fp8").method == "fp8"
    both = _cli_config(
        "-q", "fp8", "--diffusion-quantization-config", '{"method": "fp8", "ignored_layers": ["img_mlp"]}'
    )
    assert (both.method, both.ignored_layers) == ("fp8", ("img_mlp",))
    with pytest.raises(ValueError, match=r"--quantization: method 'int8' is not supported .* use 'fp8'"):
        _cli_config("--quantization", "int8")
    with pytest.raises(ValueError, match="--diffusion-quantization-config.transformer: unknown keys"):
        _cli_config("--diffusion-quantization-config", '{"transformer": {"method": "fp8", "layers": []}}')


@pytest.mark.slow
def test_server_with_quantization_fp8_serves_an_image(tmp_path, tiny_model_dir):
    import base64
    import io
    import os
    import sys

    import httpx
    from PIL import Image
    from server_process import ServerProcess

    def command(port: int) -> list[str]:
        cmd = [sys.executable, "-m", "vllm_omni.entrypoints.cli.main", "serve", "tiny-qwen-image"]
        return cmd + ["--host", "127.0.0.1", "--port", str(port), "--device", "cpu", "--quantization", "fp8"]

    server = ServerProcess(command, tmp_path / "server.log", env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        server.wait_ready()
        body = {"prompt": "a red fox", "size": "32x32", "seed": 5, "num_inference_steps": 2}
        resp = httpx.post(f"{server.base_url}/v1/images/generations", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        image = Image.open(io.BytesIO(base64.b64decode(resp.json()["data"][0]["b64_json"])))
        assert image.size == (32, 32)
        assert "fp8:" in server.log() and "linears quantized" in server.log()
    finally:
        assert server.stop() == 0


# ---- start-up ----------------------------------------------------------------------------------------


def test_startup_estimate_counts_fp8_weights_and_old_gpus_are_refused():
    from vllm_omni.entrypoints.cli.startup_checks import GIB, DeviceInfo, estimate_weights, startup_errors

    def config(**kw):
        return OmniDiffusionConfig(
            model="Qwen/Qwen-Image", device="cuda", dtype="bfloat16", load_format="dummy", **kw
        )

    cuda = torch.device("cuda")
    bf16, fp8 = estimate_weights(config(), cuda), estimate_weights(config(quantization="fp8"), cuda)
    saved = bf16.bytes_per_device - fp8.bytes_per_device
    # the default kept set holds img_mod / txt_mod (6.8B of the 20.4B parameters) in BF16
    assert 10 * GIB < saved < 11 * GIB
    every = estimate_weights(config(quantization={"method": "fp8", "ignored_layers": []}), cuda)
    saved_all = bf16.bytes_per_device - every.bytes_per_device
    assert 18.5 * GIB < saved_all < bf16.num_transformer_params  # about half of the 38 GiB transformer
    print(f"real-size Qwen-Image, GiB saved by fp8: default kept set {saved / GIB:.2f}, "
          f"every linear {saved_all / GIB:.2f}")  # fmt: skip
    h200 = DeviceInfo(num_cuda_devices=1, cuda_free_bytes={0: 140 * GIB}, cuda_capability=(9, 0))
    a100 = DeviceInfo(num_cuda_devices=1, cuda_free_bytes={0: 80 * GIB}, cuda_capability=(8, 0))
    assert startup_errors(config(quantization="fp8"), h200) == []
    (message,) = startup_errors(config(quantization="fp8"), a100)
    assert message.startswith("--quantization fp8: cuda:0 has compute capability 8.0") and "\n" not in message
    assert startup_errors(config(), a100) == []
    fp16 = OmniDiffusionConfig(model="Qwen/Qwen-Image", device="cuda", dtype="float16", load_format="dummy",
                               quantization="fp8")  # fmt: skip
    assert startup_errors(fp16, h200) == [
        "--quantization fp8 on CUDA computes in bfloat16; use --dtype bfloat16 (got float16)"
    ]
    bad = config(quantization={"method": "fp8", "ignored_layers": ["img_inn"]})
    (message,) = startup_errors(bad, h200)
    assert "ignored_layers ['img_inn'] match no linear" in message


# ---- tensor parallel (2 CPU processes, gloo) ---------------------------------------------------------


def _tp_rank_main(rank: int, state: dict, inputs: dict, out_dir: str) -> None:
    from pathlib import Path

    from utils import make_model, run_model

    from vllm_omni.config import ParallelConfig
    from vllm_omni.diffusion.distributed.parallel_state import init_parallel_groups
    from vllm_omni.diffusion.distributed.parallel_transformer import parallelize

    model = make_model()
    model.load_state_dict(state)
    quantize_transformer(model, FP8)
    parallel = parallelize(model, init_parallel_groups(ParallelConfig(tensor_parallel_size=2)))
    to_q = model.transformer_blocks[0].attn.to_q
    info = (to_q.weight.dtype, tuple(to_q.weight.shape), tuple(to_q.weight_scale.shape))
    torch.save((run_model(parallel, inputs), info), Path(out_dir) / f"rank{rank}.pt")


def test_fp8_tensor_parallel_two_ranks_match_one_process(tmp_path):
    from utils import make_inputs, make_model, run_model

    from vllm_omni.diffusion.distributed.launch import launch_local

    model, inputs = make_model(), make_inputs()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    want = run_model(model, inputs)
    quantize_transformer(model, FP8)
    one = run_model(model, inputs)
    launch_local(_tp_rank_main, 2, (state, inputs, str(tmp_path)))
    for rank in range(2):
        got, (dtype, shape, scale_shape) = torch.load(tmp_path / f"rank{rank}.pt")
        assert dtype == FP8_DTYPE and shape == (32, 64) and scale_shape == (32,)  # half the heads
        for g, o, w in zip(got, one, want, strict=True):
            # row shards quantise their half of the activations with their own scales: close to the
            # one-process FP8 forward, and as close to the unquantized one
            assert rel_err(g, o) < 0.01 and rel_err(g, w) < 0.05, rank


def test_qwen_image21_tiny_fp8_error_and_packed_equals_alone():
    """The second family: the tiny Qwen-Image-2.1 checkpoint, a packed step of three sequences (each
    after its prefix), FP8 vs unquantized recorded and loosely bounded; packed equals alone."""
    from safetensors.torch import load_file

    from vllm_omni.diffusion.layout import SequenceSpec
    from vllm_omni.diffusion.models import registry
    from vllm_omni.diffusion.models.qwen_image21.tiny import TINY_MODEL_NAME

    path = registry.resolve_model_path(TINY_MODEL_NAME) / "transformer"
    state = load_file(path / "diffusion_pytorch_model.safetensors")
    config = QwenImage21TransformerConfig.from_dict(json.loads((path / "config.json").read_text()))
    plain, fp8 = QwenImage21Transformer(config).eval(), QwenImage21Transformer(config).eval()
    plain.load_state_dict(state, strict=True)
    fp8.load_state_dict(state, strict=True)
    summary = quantize_transformer(fp8, FP8)
    assert summary.num_quantized == 6 * config.num_layers
    gen = torch.Generator().manual_seed(0)
    requests = [(5, (1, 4, 2), 0.9), (13, (1, 2, 2), 0.35), (9, (1, 4, 6), 0.6)]
    txts = [torch.randn(n, config.context_in_dim, generator=gen) for n, _, _ in requests]
    imgs = [torch.randn(g[1] * g[2], config.in_channels, generator=gen) for _, g, _ in requests]
    steps = torch.tensor([t for *_, t in requests])
    specs = [SequenceSpec(n, g, req_id=f"r{i}") for i, (n, g, _) in enumerate(requests)]
    assert_fp8_packed_error_and_alone("tiny Qwen-Image-2.1", plain, fp8, specs, imgs, txts, steps)


def test_the_json_flag_takes_a_file_path(tmp_path):
    path = tmp_path / "fp8.json"
    path.write_text(json.dumps({"transformer": {"method": "fp8", "ignored_layers": ["img_mlp"]}}))
    config = QuantizationConfig.from_value(str(path), "--diffusion-quantization-config")
    assert config.method == "fp8" and config.ignored_layers == ("img_mlp",)
    with pytest.raises(ValueError, match="'missing.json' is not a file"):
        QuantizationConfig.from_value("missing.json", "--diffusion-quantization-config")


def test_checkpoint_weights_quantize_as_they_load(monkeypatch):
    """With --quantization, a selected linear switches to FP8 right when its weight is set, before the
    next tensor loads, so the load never holds two of them in high precision (before: the whole
    transformer loaded first, then quantized: a load peak of the BF16 model while the start-up check
    counted the FP8 one). The result equals quantizing after the load."""
    from vllm_omni.diffusion.models.qwen_image.loader import load_qwen_image

    config = QuantizationConfig(method="fp8", ignored_layers=())
    on_load = _load_quantizing_each_weight_as_set(
        monkeypatch,
        lambda: load_qwen_image("tiny-qwen-image", "cpu", torch.float32, quantization=config).transformer,
    )
    after = load_qwen_image("tiny-qwen-image", "cpu", torch.float32).transformer
    quantize_transformer(after, config)
    assert all(torch.equal(a, b) for a, b in zip(on_load.state_dict().values(), after.state_dict().values()))


@pytest.mark.parametrize("model", ["tiny-qwen-image", "tiny-qwen-image-2.1"])
def test_dummy_weights_quantize_as_they_are_drawn(monkeypatch, model):
    """`--load-format dummy --quantization fp8` (how the H200 benchmarks start): each selected linear
    is quantized as soon as its random weight is drawn, before the next parameter is (the BF16 copy of
    the whole transformer never exists); the weights equal drawing everything, then quantizing."""
    config = QuantizationConfig(method="fp8", ignored_layers=())
    load = _dummy_loader(model)
    on_draw = _load_quantizing_each_weight_as_set(monkeypatch, lambda: load(config))
    after = load(None)
    quantize_transformer(after, config)
    assert all(torch.equal(a, b) for a, b in zip(on_draw.state_dict().values(), after.state_dict().values()))


def _load_quantizing_each_weight_as_set(monkeypatch, load):
    """The transformer `load()` returns, checking that every linear's weight was quantized right after
    it was set, before anything else loaded, and that every linear ended in FP8."""
    events = []  # ("load", layer, parameter name) and ("quantize", layer), in order
    load_weight, set_quant_method = Linear.load_weight, Linear.set_quant_method

    def recording_load_weight(self, name, value):
        events.append(("load", id(self), name))
        load_weight(self, name, value)

    def recording_set_quant_method(self, method):
        events.append(("quantize", id(self)))
        set_quant_method(self, method)

    monkeypatch.setattr(Linear, "load_weight", recording_load_weight)
    monkeypatch.setattr(Linear, "set_quant_method", recording_set_quant_method)
    transformer = load()
    monkeypatch.undo()
    weight_loads = [i for i, e in enumerate(events) if e[0] == "load" and e[2] == "weight"]
    assert len(weight_loads) == len(linears(transformer)) > 0
    for i in weight_loads:  # each weight is quantized before anything else loads
        assert events[i + 1] == ("quantize", events[i][1]), events[i : i + 2]
    layers = linears(transformer).values()
    assert all(m.quantize_on_load is None and m.weight.dtype == FP8_DTYPE for m in layers)
    return transformer


def _dummy_loader(model: str):
    """model -> (quantization -> the transformer of a dummy load of `model` on CPU in fp32, seed 0)."""
    if model == "tiny-qwen-image":
        from vllm_omni.diffusion.models.qwen_image.loader import load_qwen_image as load
    else:
        from vllm_omni.diffusion.models.qwen_image21.loader import load_qwen_image21 as load
    return lambda quantization: (
        load(model, "cpu", torch.float32, load_format="dummy", seed=0, quantization=quantization).transformer
    )

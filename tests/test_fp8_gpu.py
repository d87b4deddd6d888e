"""FP8 on the GPU (skipped without CUDA FP8, SM89+): the Triton activation quantisation equals
`quantize_rows` bit for bit, the FP8 linear is the dequantised matmul, and an FP8 transformer forward
(merged FP8 QKV, Triton quantisation) captures in a CUDA graph and replays equal to eager. The fused
producers (norm and GELU kernels emitting e4m3 + scales) equal the unfused path bit for bit (torch's
own `F.gelu` included), and a forward through them equals the unfused one and captures. Batch-invariant
FP8: the Triton invariant GEMM's rows do not depend on the row count, and an invariant FP8 transformer's
packed forward equals each sequence alone."""

from __future__ import annotations

import pytest
import torch
from utils import make_models, make_packed_batch, rel_err

from vllm_omni.diffusion.attention import SDPABackend
from vllm_omni.diffusion.layers import fp8_triton
from vllm_omni.diffusion.layers.fp8 import FP8_DTYPE, Fp8LinearMethod, fp8_linear, quantize_rows
from vllm_omni.diffusion.layers.quant_config import QuantizationConfig
from vllm_omni.diffusion.layers.quantization import quantize_transformer
from vllm_omni.diffusion.layout import build_packed_layout

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available()
    or torch.cuda.get_device_capability() < (8, 9)
    or not fp8_triton.available(),
    reason="needs a CUDA GPU with FP8 (SM89+) and triton",
)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(8192, 3072), (1000, 12288), (7, 96), (3, 5000)])
def test_triton_quantize_rows_equals_torch_on_cuda(shape, dtype):
    gen = torch.Generator(device="cuda").manual_seed(shape[0])
    x = (torch.randn(shape, device="cuda", generator=gen) * 4).to(dtype)
    x[0] = 0
    x[1, 1:] *= 1e-4  # subnormal codes
    for rows in (x, x[:, : shape[1] // 2 + 1]):  # contiguous, strided rows
        (q, s), (q_ref, s_ref) = fp8_triton.quantize_rows(rows), quantize_rows(rows)
        assert torch.equal(s, s_ref) and torch.equal(_bits(q), _bits(q_ref))


def test_fp8_linear_on_cuda_is_the_dequantised_matmul():
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(300, 512, device="cuda", generator=gen).to(torch.bfloat16)
    w = torch.randn(384, 512, device="cuda", generator=gen) / 512**0.5
    b = torch.randn(384, device="cuda", generator=gen).to(torch.bfloat16)
    wq, sw = quantize_rows(w)
    got = fp8_linear(x, wq, sw.view(-1), b)
    xq, sx = quantize_rows(x)
    want = (xq.double() * sx.double()) @ (wq.double() * sw.double()).t() + b.double()
    assert got.dtype == torch.bfloat16 and rel_err(got, want) <= 8e-3  # bf16 output rounding


def _replay_one_bucket(model, img, txt, t, layout):
    """(runner, replayed, eager): the batch through a graph runner whose one bucket just holds it (8
    padding rows per stream), the replay, and the eager forward of the same padded batch."""
    from vllm_omni.diffusion.worker.cuda_graphs import CudaGraphConfig, CUDAGraphRunner

    config = CudaGraphConfig(
        num_seqs=(layout.num_seqs,), img_rows=(layout.num_img_rows + 8,), txt_rows=(layout.num_txt_rows + 8,)
    )
    runner = CUDAGraphRunner(model, img.device, img.dtype, config)
    with torch.inference_mode():
        replayed = runner.forward_packed(img, txt, t, layout).clone()
        assert runner.last_path == "graph"
        ((_, graph),) = runner._packed.items()
        eager = graph.run_eager()[: layout.num_img_rows].clone()
    return runner, replayed, eager


def test_fp8_transformer_forward_captures_in_a_cuda_graph():
    """Through the graph runner, as the server captures: the FP8 model's bucket (merged FP8 QKV,
    Triton quantisation) replays the eager forward of the same padded batch bit for bit, and reads
    new inputs."""

    device, dtype = torch.device("cuda"), torch.bfloat16
    _, model = make_models(3)
    model = model.to(device, dtype)  # then quantize (.to(dtype) would cast e4m3 weights too)
    model.attn_backend = SDPABackend("mask")  # boundaries read on the device: capturable
    quantize_transformer(model, QuantizationConfig("fp8"))
    attn = model.transformer_blocks[0].attn
    assert isinstance(attn.merged("img_qkv").layer.quant_method, Fp8LinearMethod)
    assert attn.merged("img_qkv").layer.weight.dtype == FP8_DTYPE
    specs, imgs, txts, steps = make_packed_batch()
    layout = build_packed_layout(specs, model.position_tables, device=device)
    img, txt = (torch.cat(x).to(device, dtype) for x in (imgs, txts))
    t = steps.to(device)
    runner, replayed, eager = _replay_one_bucket(model, img, txt, t, layout)
    with torch.inference_mode():
        unpadded = model.forward_packed(img, txt, t, layout)
        again = runner.forward_packed(img * 0.5, txt, t, layout)
    assert torch.isfinite(replayed).all() and torch.equal(replayed, eager)  # max_abs 0
    assert rel_err(replayed, unpadded) < 2e-2  # GEMM tiling differs with the row count
    assert not torch.equal(again, replayed)  # the replay read the new input


# ---- the fused producers (issue 25, item 2; the CPU versions: test_fp8_fusion.py) -----------------


def _within_one_e4m3_step(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]):
    """(q, scale) pairs: dequantised, every element within one e4m3 step of the other's (3 mantissa
    bits: 2^-3 of the value, 2^-9 of the scale for subnormals) plus one bf16 rounding of the row's
    largest value (448 * scale * 2^-8: where shift and normed * scale cancel, a 1-ulp change in the
    norm's statistics moves an output near 0 by that much; the H200 had one at -0.0039 against 0.0),
    and at most 1e-5 of the codes differ."""
    deq_got, deq_want = (q.float() * s for q, s in (got, want))
    step = deq_want.abs() * 2**-3 + want[1] * (2**-9 + 448 * 2**-8)
    assert ((deq_got - deq_want).abs() <= step).all()
    assert (_bits(got[0]) != _bits(want[0])).float().mean() <= 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_producers_equal_the_unfused_path_on_cuda(dtype):
    """The norm kernels' e4m3 output == `quantize_rows` of their unfused output up to one e4m3 step in
    a few codes (the H200 compiled the fused variant's arithmetic differently in 2 of 12.6M codes; the
    interpreter test, test_fp8_fusion.py, holds them to the bits), and the GELU kernel's ==
    `quantize_rows(F.gelu(h, approximate="tanh"))`: torch's own GELU, bit for bit (libdevice's tanhf
    is CUDA's), so the fused MLP equals the unfused FP8 MLP."""
    from vllm_omni.diffusion.models.qwen_image import triton_ops

    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, dim = 4099, 3072
    ids = torch.arange(rows, device="cuda") * 3 // rows  # three sequences
    x, y = (torch.randn(rows, dim, device="cuda", generator=gen).to(dtype) for _ in range(2))
    mod = torch.randn(3, 6 * dim, device="cuda", generator=gen).to(dtype)
    shift, scale, gate = mod.chunk(6, dim=-1)[:3]
    for got, want in (
        (triton_ops.modulated_layer_norm_fp8(x, shift, scale, ids, 1e-6),
         quantize_rows(triton_ops.modulated_layer_norm(x, shift, scale, ids, 1e-6))),
        (triton_ops.gated_residual_norm_fp8(x, y, gate, shift, scale, ids, 1e-6)[1:],
         quantize_rows(triton_ops.gated_residual_norm(x, y, gate, shift, scale, ids, 1e-6)[1])),
    ):  # fmt: skip
        _within_one_e4m3_step(got, want)
    h = (torch.randn(rows, 4 * dim, device="cuda", generator=gen) * 3).to(dtype)
    h[0] = 0
    assert torch.equal(fp8_triton.gelu_tanh(h), torch.nn.functional.gelu(h, approximate="tanh"))
    q_ref, s_ref = quantize_rows(torch.nn.functional.gelu(h, approximate="tanh"))
    assert fp8_triton.resident_plan(4 * dim) is not None  # 12288 columns: held whole in registers
    for resident in (True, False):
        q, s = fp8_triton.gelu_tanh_quantize_rows(h, resident)
        assert torch.equal(s, s_ref) and torch.equal(_bits(q), _bits(q_ref))


def test_fp8_transformer_fused_forward_equals_unfused_and_captures(monkeypatch):
    """Compiled block ops on CUDA (as the server runs FP8): the fused producers serve every block
    linear in FP8, the forward equals the unfused FP8 forward bit for bit, and the fused forward
    captures in a CUDA graph (no host reads) and replays its eager run bit for bit."""
    from utils import FP8_ALL_BLOCK_LINEARS

    from vllm_omni.diffusion.models.qwen_image.fused_ops import BlockOps
    from vllm_omni.diffusion.models.qwen_image.layers import GELUTanhProj

    monkeypatch.setattr(GELUTanhProj, "fuse_fp8", True)  # off by default; its path is tested here
    device, dtype = torch.device("cuda"), torch.bfloat16
    _, model = make_models(3)
    model = model.to(device, dtype)
    model.attn_backend = SDPABackend("mask")  # boundaries read on the device: capturable
    quantize_transformer(model, FP8_ALL_BLOCK_LINEARS)
    model.enable_compile()
    specs, imgs, txts, steps = make_packed_batch()
    layout = build_packed_layout(specs, model.position_tables, device=device)
    img, txt = (torch.cat(x).to(device, dtype) for x in (imgs, txts))
    t = steps.to(device)
    num_fused = []
    serves = fp8_triton.serves
    monkeypatch.setattr(fp8_triton, "serves", lambda x: num_fused.append(1) or serves(x))
    with torch.inference_mode():
        fused = model.forward_packed(img, txt, t, layout)
        assert model.block_ops.emits_fp8(img) and num_fused
        with monkeypatch.context() as off:
            off.setattr(BlockOps, "emits_fp8", lambda self, x: False)
            off.setattr(fp8_triton, "serves", lambda x: False)
            unfused = model.forward_packed(img, txt, t, layout)
    assert torch.isfinite(fused).all() and torch.equal(fused, unfused)
    _, replayed, eager = _replay_one_bucket(model, img, txt, t, layout)
    assert torch.equal(replayed, eager)


# ---- batch-invariant FP8 (the CPU versions: test_batch_invariance_fp8.py) -------------------------


@pytest.mark.parametrize("k,n", [(3072, 9216), (12288, 3072)])  # merged QKV, MLP down (Qwen-Image)
def test_batch_invariant_fp8_gemm_rows_do_not_depend_on_row_count(k, n):
    """The invariant FP8 GEMM (layers/fp8_batch_invariant.py's Triton kernel): a row's bits are the same
    in a batch of M = 1, 7, 300 or 4099 rows and at any offset; the result is the dequantised product
    within the bf16 output's rounding and close to `fp8_linear` (cuBLAS, another summation order); it
    captures in a CUDA graph and the replay reads new inputs."""
    from vllm_omni.diffusion.layers.fp8_batch_invariant import batch_invariant_fp8_linear

    gen = torch.Generator(device="cuda").manual_seed(k)
    x = torch.randn(4099, k, device="cuda", generator=gen).to(torch.bfloat16)
    w = torch.randn(n, k, device="cuda", generator=gen) / k**0.5
    b = torch.randn(n, device="cuda", generator=gen).to(torch.bfloat16)
    wq, sw = quantize_rows(w)
    sw = sw.view(-1)
    full = batch_invariant_fp8_linear(x, wq, sw, b)
    for num_rows in (1, 7, 300, 4099):
        assert torch.equal(batch_invariant_fp8_linear(x[:num_rows], wq, sw, b), full[:num_rows]), num_rows
    assert torch.equal(batch_invariant_fp8_linear(x[1000:1007], wq, sw, b), full[1000:1007])
    xq, sx = quantize_rows(x)
    want = (xq.double() * sx.double()) @ (wq.double() * sw.double()[:, None]).t() + b.double()
    assert full.dtype == torch.bfloat16 and rel_err(full, want) <= 8e-3
    assert rel_err(full, fp8_linear(x, wq, sw, b)) <= 1.6e-2
    static_x = x[:300].clone()
    batch_invariant_fp8_linear(static_x, wq, sw, b)  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = batch_invariant_fp8_linear(static_x, wq, sw, b)
    for start in (0, 300):
        static_x.copy_(x[start : start + 300])
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, full[start : start + 300]), start


def test_batch_invariant_fp8_transformer_packed_forward_equals_alone(monkeypatch):
    """Every block linear in FP8, batch-invariant mode on CUDA, each sequence's rows of the packed
    forward equal its own forward bit for bit (max_abs 0): with the default MLP (F.gelu, then the
    down projection quantises its input) and with the GELU + quantisation kernel (off by default)
    feeding the invariant down projections an `Fp8Activation` (one program per row: still invariant)."""
    from utils import FP8_ALL_BLOCK_LINEARS

    from vllm_omni.diffusion.batch_invariant import make_batch_invariant
    from vllm_omni.diffusion.layers.fp8_batch_invariant import BatchInvariantFp8LinearMethod
    from vllm_omni.diffusion.models.qwen_image.layers import GELUTanhProj

    device, dtype = torch.device("cuda"), torch.bfloat16
    _, model = make_models(3)
    model = model.to(device, dtype)
    quantize_transformer(model, FP8_ALL_BLOCK_LINEARS)
    make_batch_invariant(model)
    attn = model.transformer_blocks[0].attn
    assert isinstance(attn.merged("img_qkv").layer.quant_method, BatchInvariantFp8LinearMethod)
    num_fused = []
    fused = fp8_triton.gelu_tanh_quantize_rows
    monkeypatch.setattr(fp8_triton, "gelu_tanh_quantize_rows", lambda h: num_fused.append(1) or fused(h))
    specs, imgs, txts, steps = make_packed_batch()
    imgs, txts = [x.to(device, dtype) for x in imgs], [x.to(device, dtype) for x in txts]
    t = steps.to(device)
    for fuse_gelu in (False, True):
        monkeypatch.setattr(GELUTanhProj, "fuse_fp8", fuse_gelu)
        with torch.inference_mode():
            layout = build_packed_layout(specs, model.position_tables, device=device)
            packed = layout.split_img(model.forward_packed(torch.cat(imgs), torch.cat(txts), t, layout))
            assert bool(num_fused) == fuse_gelu  # the fused producer served the invariant down projections
            for i, spec in enumerate(specs):
                one = build_packed_layout([spec], model.position_tables, device=device)
                alone = model.forward_packed(imgs[i], txts[i], t[i : i + 1], one)
                assert torch.isfinite(alone).all() and torch.equal(alone, packed[i]), (fuse_gelu, spec)

"""FP8 activation quantisation fused into the kernels that produce the activation (issue 25, item 2).

The modulated LayerNorm kernels (before QKV and MLP-up) and the GELU kernel (before MLP-down) emit an
`Fp8Activation` whose bits are `quantize_rows` of the unfused output, and a transformer forward through
them equals the unfused FP8 forward bit for bit. The kernels run on CPU under triton's interpreter
(TRITON_INTERPRET must be set before triton loads, hence subprocesses); test_fp8_gpu.py repeats the
comparisons on CUDA, where the GELU is compared with torch's own `F.gelu`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from triton_interpreter import PATCH, run_interpreted
from utils import FP8_ALL_BLOCK_LINEARS, ActiveLoRA, make_models

from vllm_omni.diffusion.layers.fp8 import Fp8Activation, Fp8LinearMethod, fp8_linear
from vllm_omni.diffusion.layers.linear import Linear
from vllm_omni.diffusion.layers.quantization import quantize_transformer
from vllm_omni.diffusion.models.qwen_image.fused_ops import BlockOps

TESTS = Path(__file__).resolve().parent


# ---- the boundary (no kernels) ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_fp8_linear_computes_the_same_from_its_fp8_activation(dtype):
    layer = Linear(48, 40).to(dtype)
    layer.set_quant_method(Fp8LinearMethod())
    x = torch.randn(2, 7, 48).to(dtype)
    act = Fp8Activation.quantize(x)
    assert act.data.shape == (14, 48) and act.scale.shape == (14, 1) and act.shape == x.shape
    assert torch.equal(layer(act), layer(x)) and layer(act).shape == (2, 7, 40)
    empty = torch.empty(0, 48, dtype=dtype)
    assert fp8_linear(Fp8Activation.quantize(empty), layer.weight, layer.weight_scale, layer.bias).shape == (
        0,
        40,
    )


def test_accepts_fp8_input_only_for_fp8_without_an_active_lora():
    x = torch.randn(3, 16)
    plain = Linear(16, 8)
    assert not plain.accepts_fp8_input(x)
    fp8 = Linear(16, 8)
    fp8.set_quant_method(Fp8LinearMethod())
    assert fp8.accepts_fp8_input(x)
    fp8.lora = ActiveLoRA()
    assert not fp8.accepts_fp8_input(x)


def test_merged_qkv_accepts_fp8_input_unless_a_member_has_an_active_lora():
    _, model = make_models(5)
    quantize_transformer(model, FP8_ALL_BLOCK_LINEARS)
    attn, x = model.transformer_blocks[0].attn, torch.randn(4, 32)
    assert attn.accepts_fp8_input("img_qkv", x) and attn.accepts_fp8_input("txt_qkv", x)
    merged = attn.merged("img_qkv")
    act = Fp8Activation.quantize(x)
    assert torch.equal(merged(act), merged(x))
    attn.to_k.lora = ActiveLoRA()
    assert not attn.accepts_fp8_input("img_qkv", x) and attn.accepts_fp8_input("txt_qkv", x)


def test_norms_emit_fp8_only_where_a_triton_kernel_serves():
    """On CPU (and eager, batch-invariant mode) the norms return the activation dtype, as before."""
    x, shift, scale = torch.randn(6, 32), torch.randn(2, 32), torch.randn(2, 32)
    ids = torch.tensor([0, 0, 0, 1, 1, 1])
    assert not BlockOps(compiled=True).emits_fp8(x)  # CPU tensors: no kernel (nothing compiles here)
    ops = BlockOps(compiled=False)
    assert not ops.emits_fp8(x)
    out = ops.modulated_layer_norm(x, shift, scale, ids, 1e-6, fp8_ok=True)
    assert isinstance(out, torch.Tensor) and torch.equal(
        out, ops.modulated_layer_norm(x, shift, scale, ids, 1e-6)
    )
    new_x, normed = ops.gated_residual_norm(x, 2 * x, shift, shift, scale, ids, 1e-6, fp8_ok=True)
    assert isinstance(normed, torch.Tensor) and normed.dtype == x.dtype


# ---- the kernels (triton's interpreter) ----------------------------------------------------------

KERNELS_CHECK = (
    PATCH
    + """
import torch
import torch.nn.functional as F
from vllm_omni.diffusion.layers import fp8_triton
from vllm_omni.diffusion.layers.fp8 import quantize_rows
from vllm_omni.diffusion.models.qwen_image import triton_ops

def same(got, want):
    (q, s), (q_ref, s_ref) = got, want
    assert q.dtype == torch.float8_e4m3fn and s.shape == s_ref.shape == (q.shape[0], 1)
    assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))

gen = torch.Generator().manual_seed(0)
ids = torch.tensor([0, 0, 1, 2, 2, 2, 1, 3])
for dtype in (torch.bfloat16, torch.float16, torch.float32):
    x, y = ((torch.randn(8, 40, generator=gen) * 3).to(dtype) for _ in range(2))
    mod = torch.randn(4, 6 * 40, generator=gen).to(dtype)
    mod[3] = 0  # sequence 3: shift 0, scale 0 -> its row normalises to an all-zero row (the scale floor)
    shift, scale, gate = mod.chunk(6, dim=-1)[:3]  # column slices of one output: strided rows
    same(triton_ops.modulated_layer_norm_fp8(x, shift, scale, ids, 1e-6),
         quantize_rows(triton_ops.modulated_layer_norm(x, shift, scale, ids, 1e-6)))
    new_x, normed = triton_ops.gated_residual_norm(x, y, gate, shift, scale, ids, 1e-6)
    got = triton_ops.gated_residual_norm_fp8(x, y, gate, shift, scale, ids, 1e-6)
    assert torch.equal(got[0], new_x)
    same(got[1:], quantize_rows(normed))
    joint = torch.randn(13, 40, generator=gen).to(dtype)  # y in joint rows, read by index
    y_rows = torch.tensor([3, 4, 0, 9, 10, 7, 1, 12])
    new_x, normed = triton_ops.gated_residual_norm_rows(x, joint, y_rows, gate, shift, scale, ids, 1e-6)
    got = triton_ops.gated_residual_norm_rows_fp8(x, joint, y_rows, gate, shift, scale, ids, 1e-6)
    assert torch.equal(got[0], new_x)
    same(got[1:], quantize_rows(normed))

    h = (torch.randn(9, 300, generator=gen) * 3).to(dtype)
    h[2] = 0  # GELU(0) = 0: an all-zero row
    h[3] = -20  # GELU(-20) rounds to -0 (or a tiny negative): the floor and signed zeros
    h[4, 1:] *= 1e-4  # one large value: the rest lands in e4m3's subnormals
    whole_row, default_block_k = fp8_triton.gelu_tanh(h), fp8_triton.GELU_BLOCK_K
    for block_k in (default_block_k, 64):  # the row in one chunk, and in 5 (the last masked)
        fp8_triton.GELU_BLOCK_K = block_k
        assert torch.equal(fp8_triton.gelu_tanh(h), whole_row)
        for rows in (h, h[:, :250], h[:0]):  # contiguous, strided rows, empty
            same(fp8_triton.gelu_tanh_quantize_rows(rows), quantize_rows(fp8_triton.gelu_tanh(rows)))
    fp8_triton.GELU_BLOCK_K = default_block_k
    # rows of 1 .. 4 power-of-two chunks held whole (the MLP's 12288 = 3 x 4096): the same bits as the
    # two-pass kernel and as quantize_rows of the GELU
    for cols in (1024, 3072, 4096):
        assert fp8_triton.resident_plan(cols) is not None
        wide = (torch.randn(3, cols, generator=gen) * 3).to(dtype)
        wide[1] = 0
        resident = fp8_triton.gelu_tanh_quantize_rows(wide)
        same(resident, fp8_triton.gelu_tanh_quantize_rows(wide, resident=False))
        same(resident, quantize_rows(fp8_triton.gelu_tanh(wide)))
    assert fp8_triton.resident_plan(300) is None and fp8_triton.resident_plan(5 * 1024) is None
    # the GELU itself against torch's: the interpreter has no libdevice tanh (exp instead) and
    # truncates to bf16 / fp16, so within an ulp here; on the GPU bit for bit (test_fp8_gpu.py)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(fp8_triton.gelu_tanh(h), F.gelu(h, approximate="tanh"), atol=tol, rtol=tol)
print("ok")
"""
)


def test_fused_kernels_equal_quantize_rows_of_the_unfused_output():
    """(e4m3 bits, scales) of the fused norm and GELU kernels == `quantize_rows` of the unfused
    kernels' output, bf16 / fp16 / fp32, with zero rows, strided modulation and GELU rows."""
    pytest.importorskip("triton")
    run_interpreted(KERNELS_CHECK)


# ---- a tiny transformer through the fused path (triton's interpreter) ----------------------------

TRANSFORMER_CHECK = (
    PATCH
    + """
import collections
import torch
import torch.nn.functional as F
from utils import ActiveLoRA, FP8_ALL_BLOCK_LINEARS
from utils import make_models, make_packed_batch
from vllm_omni.diffusion.layers import fp8_triton
from vllm_omni.diffusion.layers.quantization import quantize_transformer
from vllm_omni.diffusion.layout import build_packed_layout
from vllm_omni.diffusion.models.qwen_image import triton_ops
from vllm_omni.diffusion.models.qwen_image.fused_ops import OPS, BlockOps
from vllm_omni.diffusion.models.qwen_image.layers import GELUTanhProj

GELUTanhProj.fuse_fp8 = True  # off by default (slower on the H200); the kernel's path is tested here

calls = collections.Counter()

def counted(name, fn):
    def run(*args):
        calls[name] += 1
        return fn(*args)
    return run

# the kernels serve CPU tensors, as CUDA ones on the GPU (the other chains run eager)
kernels = {name: counted(name, fn) for name, fn in triton_ops.KERNELS.items()}
BlockOps._triton_kernel = lambda self, name, x: kernels.get(name)
fp8_triton.gelu_tanh_quantize_rows = counted("gelu_fp8", fp8_triton.gelu_tanh_quantize_rows)
# F.gelu as the kernel computes it (the interpreter's tanh is not torch's; on the GPU it is)
F.gelu = lambda h, approximate="none": fp8_triton.gelu_tanh(h.reshape(-1, h.shape[-1])).view_as(h)
emits_fp8 = BlockOps.emits_fp8

def forward(model, fused, *inputs):
    calls.clear()
    BlockOps.emits_fp8 = emits_fp8 if fused else (lambda self, x: False)
    fp8_triton.serves = lambda x: fused
    with torch.no_grad():
        return model.forward_packed(*inputs) if len(inputs) == 4 else model(*inputs)

_, model = make_models(7)
model = model.to(torch.bfloat16)
del model.transformer_blocks[1:]  # one block holds every producer / consumer pair (the interpreter is slow)
quantize_transformer(model, FP8_ALL_BLOCK_LINEARS)
ops = BlockOps(compiled=False, fuse_joint=True)
ops.compiled, ops._fns = True, {name: fn for name, (fn, _) in OPS.items()}
model.block_ops = ops
num_layers = len(model.transformer_blocks)

specs, imgs, txts, steps = make_packed_batch()
layout = build_packed_layout(specs, model.position_tables)
packed = (torch.cat(imgs).bfloat16(), torch.cat(txts).bfloat16(), steps, layout)
gen = torch.Generator().manual_seed(1)
dense = (torch.randn(2, 8, 64, generator=gen).bfloat16(), torch.randn(2, 5, 32, generator=gen).bfloat16(),
         torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]), torch.tensor([0.7, 0.3]), [(1, 2, 4)] * 2)
for inputs in (packed, dense):
    unfused = forward(model, False, *inputs)
    assert calls["mln_fp8"] == calls["gelu_fp8"] == 0 and calls["mln"] > 0, calls
    fused = forward(model, True, *inputs)
    assert calls["mln_fp8"] == calls["gelu_fp8"] == 2 * num_layers, calls
    assert calls["gated_norm_fp8"] + calls["gated_norm_rows_fp8"] == 2 * num_layers, calls
    assert torch.isfinite(fused).all() and torch.equal(fused, unfused), (fused - unfused).abs().max()

# the image out-projection over every joint row (the tiny texts are too long for it otherwise): FP8
# quantises each row on its own, so the image rows come out as the split rows' (the GEMM's M differs)
import vllm_omni.diffusion.models.qwen_image.transformer as transformer_module
split_rows = forward(model, True, *packed)
assert calls["gated_norm_rows_fp8"] == 0, calls
transformer_module.JOINT_ROWS_MAX_TXT_SHARE, share = 0, transformer_module.JOINT_ROWS_MAX_TXT_SHARE
joint_rows = forward(model, True, *packed)
assert calls["gated_norm_rows_fp8"] == num_layers, calls  # the image rows read back by index
torch.testing.assert_close(joint_rows, split_rows, rtol=1e-2, atol=1e-2)
transformer_module.JOINT_ROWS_MAX_TXT_SHARE = share

# an active LoRA slot on a consumer: that producer emits the activation dtype, the rest stays fused
block = model.transformer_blocks[0]
block.attn.to_v.lora, block.txt_mlp.net[2].lora, block.img_mlp.net[0].proj.lora = (ActiveLoRA(),) * 3
fused = forward(model, True, *packed)
assert calls["mln_fp8"] == calls["gelu_fp8"] == 2 * num_layers - 1, calls
assert calls["gated_norm_fp8"] + calls["gated_norm_rows_fp8"] == 2 * num_layers - 1, calls
assert torch.equal(fused, forward(model, False, *packed))
print("ok")
"""
)


def test_tiny_transformer_fused_fp8_forward_equals_the_unfused_one():
    """A bf16 tiny Qwen-Image with every block linear in FP8, packed (5 sequences, CFG) and dense:
    through the fused kernels (norms -> QKV / MLP-up, GELU -> MLP-down; call counts checked) the
    forward equals the unfused FP8 forward bit for bit; the image out-projection over all joint rows
    (FP8 layers too) gives the split rows' output; an active LoRA slot on a consumer turns its
    producer's fusion off (and only that one)."""
    pytest.importorskip("triton")
    run_interpreted(TRANSFORMER_CHECK)


def test_a_failing_gelu_kernel_falls_back_to_the_unfused_mlp(monkeypatch, caplog):
    """The fused GELU + quantisation kernel that raises (a compile failure on some GPU) leaves the MLP
    computing what it computes unfused, logs once, and is not tried again in this process."""
    from vllm_omni.diffusion.layers import fp8_triton
    from vllm_omni.diffusion.models.qwen_image.layers import FeedForward, GELUTanhProj

    torch.manual_seed(0)
    mlp = FeedForward(16)
    mlp.net[2].set_quant_method(Fp8LinearMethod())
    x = torch.randn(5, 16)
    want = mlp(x)  # on CPU the kernel never serves: the unfused path
    calls = []

    def broken(h2d):
        calls.append(h2d.shape)
        raise RuntimeError("triton: out of resources")

    monkeypatch.setattr(fp8_triton, "serves", lambda h: True)
    monkeypatch.setattr(fp8_triton, "gelu_tanh_quantize_rows", broken)
    monkeypatch.setattr(GELUTanhProj, "fused_fp8_failed", False)
    monkeypatch.setattr(GELUTanhProj, "fuse_fp8", True)
    assert torch.equal(mlp(x), want) and torch.equal(mlp(x), want)
    assert len(calls) == 1 and GELUTanhProj.fused_fp8_failed
    assert sum("running it unfused" in r.getMessage() for r in caplog.records) == 1

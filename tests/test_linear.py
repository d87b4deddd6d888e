"""`Linear` (diffusion/layers/linear.py): each quant method against a GEMM we did not write (torch's
`nn.Linear` / `F.linear`, or the batch-invariant GEMM it must be), LoRA after the method, state-dict keys
and tensor-parallel slicing through `load_weight`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from vllm_omni.diffusion.batch_invariant import BatchInvariantLinearMethod, batch_invariant_linear
from vllm_omni.diffusion.layers.linear import Linear, LinearShard, UnquantizedLinearMethod
from vllm_omni.lora.batch import LoRABatch
from vllm_omni.lora.layers import (
    LoRAMapping,
    LoRAModuleWeights,
    LoRAStepState,
    SeqLoRA,
    make_lora_linear,
    restore_linear,
)


def _x(rows: int, dim: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, dim, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("bias", [True, False])
def test_unquantized_is_nn_linear(bias):
    """Same seed -> nn.Linear's initial weights, the same state-dict keys, the same output."""
    torch.manual_seed(3)
    ref = nn.Linear(24, 40, bias=bias)
    torch.manual_seed(3)
    ours = Linear(24, 40, bias=bias)
    assert list(ours.state_dict()) == list(ref.state_dict())
    for key, value in ref.state_dict().items():
        assert torch.equal(ours.state_dict()[key], value)
    assert isinstance(ours.quant_method, UnquantizedLinearMethod)
    x = _x(7, 24).view(7, 1, 24)
    assert torch.equal(ours(x), ref(x))
    assert ours.runs_plain_gemm(x) and ours.compute_dtype == torch.float32
    ours.load_state_dict(ref.state_dict())  # a checkpoint of nn.Linear loads unchanged


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_invariant_method_is_the_invariant_gemm(dtype):
    layer = Linear(48, 32).to(dtype)
    x = _x(33, 48, dtype)
    plain = layer(x)
    weight_ptr = layer.weight.data_ptr()
    layer.set_quant_method(BatchInvariantLinearMethod())
    assert layer.weight.data_ptr() == weight_ptr  # switched in place: same parameters
    assert not layer.runs_plain_gemm(x)  # the fused fast paths must call it
    got = layer(x)
    assert torch.equal(got, batch_invariant_linear(x, layer.weight, layer.bias))
    assert torch.equal(layer(x[5:9]), got[5:9])  # rows do not depend on the row count
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, plain, atol=tol, rtol=tol)


def test_set_quant_method_refuses_a_second_format():
    layer = Linear(8, 8)
    layer.set_quant_method(BatchInvariantLinearMethod())
    layer.set_quant_method(BatchInvariantLinearMethod())  # the same: nothing to do

    class Other(UnquantizedLinearMethod):
        name = "other"

    with pytest.raises(ValueError, match="batch_invariant linear cannot switch to other"):
        layer.set_quant_method(Other())


class _Layout:
    def __init__(self, offsets):
        self.img_row_offsets, self.txt_row_offsets = offsets, offsets
        self.specs = [None] * (len(offsets) - 1)


@pytest.mark.parametrize("invariant", [False, True])
def test_lora_delta_is_added_after_the_method(invariant):
    gen = torch.Generator().manual_seed(1)
    layer = Linear(16, 12)
    if invariant:
        layer.set_quant_method(BatchInvariantLinearMethod())
    state = LoRAStepState()
    slots = make_lora_linear(
        layer, "transformer_blocks.0.attn.to_q", state, max_loras=2, max_rank=4, stream="img"
    )
    assert (
        layer.lora is slots and make_lora_linear(layer, "x", state, 2, 4, stream="img") is slots
    )  # idempotent
    w = LoRAModuleWeights(torch.randn(2, 16, generator=gen), torch.randn(12, 2, generator=gen), 0.5)
    slots.write(2, w)
    x = torch.randn(5, 16, generator=gen)
    mapping = LoRAMapping.for_packed([SeqLoRA(0), SeqLoRA(7, 2.0)], _Layout([0, 2, 5]))
    with torch.no_grad():
        assert torch.equal(layer(x), layer.base_forward(x))  # no batch active: the base only
        with state.activate(LoRABatch.build(mapping, {7: 2}, "cpu")):  # adapter id 7 in slot 2
            assert not layer.runs_plain_gemm(x)
            got = layer(x)
        want = F.linear(x, layer.weight, layer.bias)
        want[2:] += 2.0 * 0.5 * (x[2:] @ w.lora_a.t()) @ w.lora_b.t()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[:2], layer.base_forward(x)[:2])  # rows of no adapter: exactly the base
    restore_linear(layer)
    assert layer.lora is None and layer.runs_plain_gemm(x) == (not invariant)


@pytest.mark.parametrize("side", ["column", "row"])
def test_load_weight_keeps_the_shard(side):
    full = Linear(12, 8)
    if side == "column":
        shard = Linear(12, 4, shard=LinearShard("column", 4, 8), device="meta")
        want_w, want_b = full.weight[4:8], full.bias[4:8]
    else:
        shard = Linear(6, 8, shard=LinearShard("row", 6, 12), device="meta")
        want_w, want_b = full.weight[:, 6:12], full.bias
    for name, param in full.named_parameters():
        shard.load_weight(name, param)
    assert torch.equal(shard.weight, want_w) and torch.equal(shard.bias, want_b)
    assert shard.weight.data_ptr() != full.weight.data_ptr()  # a copy: the full tensor can go
    with pytest.raises(ValueError, match="no parameter 'weight_scale'"):
        shard.load_weight("weight_scale", torch.ones(8))
    with pytest.raises(ValueError, match="LinearShard.side"):
        LinearShard("diagonal", 0, 1)

"""Merged projections (layers/merged_linear.py): stacked at load for any quant method, one GEMM, the
members' names and parameters unchanged, merged again wherever parameters are replaced."""

from __future__ import annotations

import copy
import logging
from typing import ClassVar

import pytest
import torch
from utils import make_models, make_packed_batch, rel_err

from vllm_omni.diffusion.batch_invariant import BatchInvariantLinearMethod, apply_batch_invariance
from vllm_omni.diffusion.layers import fp8
from vllm_omni.diffusion.layers.fp8 import FP8_DTYPE, Fp8LinearMethod
from vllm_omni.diffusion.layers.linear import Linear
from vllm_omni.diffusion.layers.merged_linear import HasMergedLinears, merge_linears
from vllm_omni.diffusion.layers.quant_config import QuantizationConfig
from vllm_omni.diffusion.layers.quantization import quantize_transformer
from vllm_omni.diffusion.layout import build_packed_layout


class Qkv(HasMergedLinears):
    merged_linears: ClassVar[dict[str, tuple[str, ...]]] = {"qkv": ("q", "k", "v")}

    def __init__(self, bias: bool = True):
        super().__init__()
        self.q, self.k, self.v = Linear(16, 8, bias=bias), Linear(16, 8, bias=bias), Linear(16, 4, bias=bias)
        self.merge_linears()

    def forward(self, x):
        merged = self.merged("qkv")
        return merged(x) if merged is not None else torch.cat([m(x) for m in self.members("qkv")], -1)


def _x(rows=5, seed=0):
    return torch.randn(rows, 16, generator=torch.Generator().manual_seed(seed))


def _is_slices(module: Qkv) -> bool:
    stacked = module.merged("qkv").layer
    return all(
        p.data_ptr() == stacked.weight.data_ptr() + row * 16 * p.element_size()
        for p, row in ((module.q.weight, 0), (module.k.weight, 8), (module.v.weight, 16))
    )


@pytest.mark.parametrize("bias", [True, False])
def test_merged_gemm_is_the_members_and_their_names_stay(bias):
    module = Qkv(bias)
    x = _x()
    want = torch.cat(
        [torch.nn.functional.linear(x, m.weight, m.bias) for m in (module.q, module.k, module.v)], -1
    )
    assert _is_slices(module)
    torch.testing.assert_close(module(x), want)
    names = ["q.weight", "k.weight", "v.weight"] if not bias else None
    assert list(module.state_dict()) == (names or [f"{m}.{p}" for m in "qkv" for p in ("weight", "bias")])
    assert not any(isinstance(m, Linear) and m.out_features == 20 for m in module.modules())  # hidden


def test_to_load_state_dict_and_deepcopy_merge_again():
    module = Qkv()
    x = _x()
    want = module(x)
    module.to(torch.float64)
    assert _is_slices(module) and module.merged("qkv").layer.weight.dtype == torch.float64
    torch.testing.assert_close(module(x.double()).float(), want)
    state = {k: v.float().clone() * 2 for k, v in module.state_dict().items()}
    module.float().load_state_dict(state, assign=True)  # replaces every parameter
    assert _is_slices(module)
    torch.testing.assert_close(module(x), 2 * want)
    module.load_state_dict({k: v / 2 for k, v in state.items()})  # copies into the slices
    assert _is_slices(module)
    torch.testing.assert_close(module(x), want)
    twin = copy.deepcopy(module)
    assert _is_slices(twin) and twin.q.weight.data_ptr() != module.q.weight.data_ptr()


def test_replaced_parameters_run_the_members_and_say_so(caplog):
    module = Qkv()
    x = _x()
    with torch.no_grad():
        module.k.weight = torch.nn.Parameter(module.k.weight * 3)  # behind the merge's back
    want = torch.cat([module.q(x), module.k(x), module.v(x)], -1)
    with caplog.at_level(logging.WARNING):
        torch.testing.assert_close(module(x), want)
        module(x)
    assert sum("replaced without merge_linears" in r.message for r in caplog.records) == 1
    assert merge_linears(module) == 1 and _is_slices(module)
    torch.testing.assert_close(module(x), want)


def test_fp8_members_merge_into_one_fp8_gemm():
    module = Qkv()
    x = _x(7, seed=1)
    for m in (module.q, module.k, module.v):
        m.set_quant_method(Fp8LinearMethod())
    separate = torch.cat([m(x) for m in (module.q, module.k, module.v)], -1)  # stale: one by one
    assert merge_linears(module) == 1
    stacked = module.merged("qkv").layer
    assert stacked.weight.dtype == FP8_DTYPE and stacked.weight_scale.shape == (20,)
    assert module.k.weight_scale.data_ptr() == stacked.weight_scale.data_ptr() + 8 * 4
    torch.testing.assert_close(module(x), separate, rtol=1e-6, atol=1e-6)  # same x8, same W8: same GEMM


def test_mixed_methods_do_not_merge():
    module = Qkv()
    module.q.set_quant_method(Fp8LinearMethod())
    assert merge_linears(module) == 0 and module.merged("qkv") is None
    x = _x()
    torch.testing.assert_close(module(x), torch.cat([module.q(x), module.k(x), module.v(x)], -1))


def test_batch_invariant_mode_merges_with_the_invariant_method():
    module = Qkv()
    x = _x(9)
    want = module(x)
    apply_batch_invariance(module)
    assert isinstance(module.merged("qkv").layer.quant_method, BatchInvariantLinearMethod)
    torch.testing.assert_close(module(x), want)
    assert torch.equal(module(x[3:4]), module(x)[3:4])  # a row alone == in the batch


def test_fp8_transformer_quantizes_each_stream_input_once_for_qkv(monkeypatch):
    """The tiny model with FP8: per block, one activation quantisation for each stream's q, k, v
    (merged), plus to_out, to_add_out, both MLP up projections and txt_mlp.net.2: 7 (was 11)."""
    _, model = make_models(5)
    quantize_transformer(model, QuantizationConfig("fp8"))
    calls = []
    original = fp8.quantize_activation
    monkeypatch.setattr(fp8, "quantize_activation", lambda x2d: calls.append(x2d.shape) or original(x2d))
    specs, imgs, txts, steps = make_packed_batch()
    layout = build_packed_layout(specs, model.position_tables)
    with torch.no_grad():
        out = model.forward_packed(torch.cat(imgs), torch.cat(txts), steps, layout)
    assert torch.isfinite(out).all()
    assert len(calls) == 7 * model.config.num_layers


def test_merged_and_separate_qkv_give_the_same_transformer_output():
    """The whole tiny model (fp32) with its q, k, v merged vs run one by one."""
    _, model = make_models(11)
    specs, imgs, txts, steps = make_packed_batch()
    layout = build_packed_layout(specs, model.position_tables)
    args = (torch.cat(imgs), torch.cat(txts), steps, layout)
    with torch.no_grad():
        merged = model.forward_packed(*args)
        for block in model.transformer_blocks:
            block.attn._merged.clear()  # as if nothing merged
        separate = model.forward_packed(*args)
    assert rel_err(merged, separate) < 1e-5

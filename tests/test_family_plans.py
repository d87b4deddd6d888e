"""Each family's plans (`models/plans.py`, on its transformer class) name modules its transformer has,
and its declared capabilities are what the engine refuses by and what its plans back.

A plan entry that matches nothing would silently leave a linear on the wrong LoRA stream, unsharded,
variant or quantized; these checks run on tiny transformers built on the meta device (no weights).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from vllm_omni.config import OmniDiffusionConfig
from vllm_omni.diffusion.layers.linear import Linear, linears
from vllm_omni.diffusion.models import registry
from vllm_omni.diffusion.models.plans import module_matches
from vllm_omni.diffusion.models.qwen_image.transformer import QwenImageTransformer, QwenImageTransformerConfig
from vllm_omni.diffusion.models.qwen_image21.transformer import (
    QwenImage21Transformer,
    QwenImage21TransformerConfig,
)
from vllm_omni.lora import LoRAConfig

TINY = {
    "QwenImageTransformer": lambda: QwenImageTransformer(
        QwenImageTransformerConfig(
            num_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=32,
            axes_dims_rope=(4, 6, 6),
        )
    ),
    "QwenImage21Transformer": lambda: QwenImage21Transformer(
        QwenImage21TransformerConfig(
            num_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            context_in_dim=32,
            axes_dims_rope=(4, 6, 6),
        )
    ),
}


@pytest.fixture(scope="module", params=sorted(TINY))
def model(request):
    with torch.device("meta"):
        return TINY[request.param]()


def test_every_plan_entry_names_a_module(model):
    plans, names = model.plans, linears(model)
    blocks = plans.block_list(model)
    assert len(blocks) == model.config.num_layers
    patterns = list(plans.quant_kept_layers or ())
    if plans.lora is not None:
        patterns += [*plans.lora.seq_modules, *plans.lora.txt_modules]
        for suffix in plans.lora.block_targets:
            assert isinstance(blocks[0].get_submodule(suffix), Linear), suffix
    for pattern in patterns:
        assert any(module_matches(n, pattern) for n in names), f"{pattern!r} matches no linear"
    if plans.tensor_parallel is not None:
        for shard in plans.tensor_parallel.shards:
            assert isinstance(blocks[0].get_submodule(shard.path), Linear), shard.path
    for norm in plans.invariant_norms:
        assert any(isinstance(m, norm) for m in model.modules()), norm


def test_row_streams_of_each_family():
    qwen = QwenImageTransformer.plans.lora.row_stream
    assert [qwen(n) for n in ("transformer_blocks.0.img_mod.1", "transformer_blocks.0.attn.to_add_out")] == [
        "seq",
        "txt",
    ]
    q21 = QwenImage21Transformer.plans.lora.row_stream
    # 2.1's one shared modulation runs on the timestep embedding: one row per sequence
    assert q21("modulation.1") == "seq" and q21("norm_out.linear") == "seq"
    assert q21("transformer_blocks.1.img_mlp.gate_layer") == "img" and q21("txt_in.in_layer") == "txt"


@pytest.mark.parametrize("class_name", sorted(registry.PIPELINES))
def test_capabilities_refuse_what_they_do_not_declare(class_name):
    capabilities = registry.family(class_name).capabilities
    base = OmniDiffusionConfig(model="tiny-qwen-image", device="cpu")
    assert capabilities.refusals(base) == []
    wanted = {
        "lora": OmniDiffusionConfig(model="tiny-qwen-image", device="cpu", lora=LoRAConfig(enabled=True)),
        "batch_invariant": OmniDiffusionConfig(model="tiny-qwen-image", device="cpu", batch_invariant=True),
        "parallel": OmniDiffusionConfig(
            model="tiny-qwen-image", device="cpu", parallel_config={"tensor_parallel_size": 2}
        ),
    }
    for field, config in wanted.items():
        refused = capabilities.refusals(config)
        assert bool(refused) != getattr(capabilities, field), (field, refused)
        assert all(capabilities.display_name in message for message in refused)


def test_the_registry_checks_declared_capabilities_against_the_plans():
    class Pipeline:
        transformer = QwenImage21Transformer  # its class carries the plans

    family = registry.family("QwenImage21Pipeline")
    registry.check_plans(family, Pipeline())
    overclaiming = dataclasses.replace(family.capabilities, parallel=True)  # 2.1 has no TP plan

    class Family:
        pipeline_class_name = "QwenImage21Pipeline"
        capabilities = overclaiming

    with pytest.raises(TypeError, match="parallel"):
        registry.check_plans(Family(), Pipeline())

"""Parallel transformer forwards (2 and 4 CPU processes, gloo) equal the one-process forward.

One packed batch of mixed grids, text lengths and timesteps with a CFG pair, and one dense same-shape
batch with masked text, run under every parallel mode: tensor parallel, Ulysses, ring, CFG parallel,
and combinations on 4 ranks. Every rank must return the full output, equal (fp32, relative 1e-5) to
the unsharded model's, which tests/test_transformer.py checks against diffusers.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from utils import DIST_TINY as TINY
from utils import make_inputs, make_model, run_model

from vllm_omni.config import ParallelConfig
from vllm_omni.diffusion.distributed.launch import launch_local
from vllm_omni.diffusion.models.qwen_image.packing import SequenceSpec, build_packed_layout

IMG_ROWS = [8, 8, 6, 9]

MODES_2 = {
    "tp2": ParallelConfig(tensor_parallel_size=2),
    "ulysses2": ParallelConfig(ulysses_degree=2),
    "ring2": ParallelConfig(ring_degree=2),
    "cfg2": ParallelConfig(cfg_parallel_size=2),
}
MODES_4 = {
    "tp2_ulysses2": ParallelConfig(tensor_parallel_size=2, ulysses_degree=2),
    "ulysses2_ring2": ParallelConfig(ulysses_degree=2, ring_degree=2),
    "cfg2_ring2": ParallelConfig(cfg_parallel_size=2, ring_degree=2),
    "cfg2_tp2": ParallelConfig(cfg_parallel_size=2, tensor_parallel_size=2),
}


def _rank_main(rank: int, modes: dict, state: dict, inputs: dict, out_dir: str) -> None:
    from vllm_omni.diffusion.distributed.parallel_state import init_parallel_groups
    from vllm_omni.diffusion.distributed.parallel_transformer import parallelize

    results = {}
    for name, config in modes.items():
        model = make_model()
        model.load_state_dict(state)
        run_model(model, inputs)  # fills lazily built weight caches (fused QKV) before sharding
        parallel = parallelize(model, init_parallel_groups(config))
        results[name] = run_model(parallel, inputs)
        results[name] += run_model(parallel, inputs)  # cached plans give the same result again
        to_q_rows = model.transformer_blocks[0].attn.to_q.weight.shape[0]
        results[f"{name}:info"] = (parallel.num_split_forwards, to_q_rows, repr(model.attn_backend))
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def reference():
    model = make_model()
    inputs = make_inputs()
    return model.state_dict(), inputs, run_model(model, inputs)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _run_world(reference, modes: dict, world_size: int, tmp_path: Path) -> list[dict]:
    state, inputs, _ = reference
    launch_local(_rank_main, world_size, (modes, state, inputs, str(tmp_path)))
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world_size)]


@pytest.fixture(scope="module")
def results_2(reference, tmp_path_factory):
    return _run_world(reference, MODES_2, 2, tmp_path_factory.mktemp("dist2"))


@pytest.fixture(scope="module")
def results_4(reference, tmp_path_factory):
    return _run_world(reference, MODES_4, 4, tmp_path_factory.mktemp("dist4"))


def _check(per_rank: list[dict], mode: str, config: ParallelConfig, reference) -> None:
    want_packed, want_dense = reference[2]
    for rank, results in enumerate(per_rank):
        # the work really was split: 4 forwards (2 packed, 2 dense), heads sharded, wrappers in place
        num_split, to_q_rows, backend = results[f"{mode}:info"]
        is_split = config.cfg_parallel_size > 1 or config.sequence_parallel_size > 1
        assert num_split == (4 if is_split else 0)
        assert to_q_rows == TINY["num_attention_heads"] * 16 // config.tensor_parallel_size
        assert ("UlyssesAttention" in backend) == (config.ulysses_degree > 1)
        assert ("RingAttention" in backend) == (config.ring_degree > 1)
        packed, dense, packed_again, dense_again = results[mode]
        assert packed.shape == want_packed.shape and dense.shape == want_dense.shape
        assert _rel_err(packed, want_packed) <= 1e-5, f"{mode} rank {rank}: packed"
        assert _rel_err(dense, want_dense) <= 1e-5, f"{mode} rank {rank}: dense"
        assert torch.equal(packed_again, packed) and torch.equal(dense_again, dense)
        for i, (got, want) in enumerate(zip(packed.split(IMG_ROWS), want_packed.split(IMG_ROWS))):
            assert _rel_err(got, want) <= 1e-5, f"{mode} rank {rank}: sequence {i}"


@pytest.mark.parametrize("mode", list(MODES_2))
def test_two_ranks_match_one_process(results_2, reference, mode):
    _check(results_2, mode, MODES_2[mode], reference)


@pytest.mark.parametrize("mode", list(MODES_4))
def test_four_ranks_combined_modes_match_one_process(results_4, reference, mode):
    _check(results_4, mode, MODES_4[mode], reference)


def test_reference_is_sensitive_to_other_sequences_being_masked(reference):
    """Sanity: the check can fail. A packed batch where sequence b leaks into c would differ."""
    _, inputs, (want_packed, _) = reference
    model = make_model()
    specs = [SequenceSpec(5, (1, 2, 3), "a"), SequenceSpec(3 + 8 + 7 + 8 + 4, (1, 3, 3), "x")]
    layout = build_packed_layout(specs, TINY["axes_dims_rope"])
    with torch.no_grad():
        txt = torch.cat([inputs["txt"][10:15], torch.randn(layout.num_txt_rows - 5, 32)])  # a's text
        img = torch.cat([inputs["img"][16:22], inputs["img"][-9:]])  # a, then c's image rows
        out = model.forward_packed(img, txt, torch.tensor([0.9, 0.05]), layout)
    assert _rel_err(out[:6], want_packed[16:22]) <= 1e-5  # a unchanged: it never sees the others
    assert _rel_err(out[6:], want_packed[-9:]) > 1e-3  # c with foreign text tokens differs

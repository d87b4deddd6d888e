"""Paired LoRA deltas (issue 27): the two streams' linears at one point of a dual-stream block (q/k/v
groups, out projections, MLP up and down) add their deltas in ONE shrink + expand launch pair
(`kernels.lora_delta_pair`, `layers/paired_linear.py`). Kernel checks run under triton's CPU
interpreter (TRITON_INTERPRET must be set before triton loads, hence subprocesses)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from triton_interpreter import PATCH, run_interpreted

PAIR_KERNEL_CHECK = (
    PATCH
    + """
import dataclasses, sys
import torch
sys.path.insert(0, "tests")
from test_lora_layers import GROUP_OFFSETS, GROUP_SEQS, _Layout, group_qkv, slot_linear
from vllm_omni.lora import kernels
from vllm_omni.lora.batch import LoRABatch, LoRAMapping, SeqLoRA, tile_runs
from vllm_omni.lora.kernels import KernelDelta

gen = torch.Generator().manual_seed(11)


def reference(d):
    # fp32 torch: every tile's rows, every member, its slot's matrices from the stacks
    out = d.out2d.clone()
    members = d.num_members
    r, n = d.lora_b.shape[2], d.lora_b.shape[1] // members
    scaling = d.scaling.reshape(members, -1)
    for (start, end, slot), scale in zip(d.tiles.tolist(), d.scales.tolist()):
        for m in range(members):
            if slot == 0 or scaling[m, slot] == 0:
                continue
            a = d.lora_a[slot - 1, m * r : (m + 1) * r]
            b = d.lora_b[slot - 1, m * n : (m + 1) * n]
            delta = (d.x2d[start:end] @ a.t()) @ b.t()
            out[start:end, m * n : (m + 1) * n] += scale * float(scaling[m, slot]) * delta
    return out


def second_segment(first, num_rows, runs):
    # other stacks of the same shapes (another stream's linears), strided x and out, its own tiles
    a, b = torch.randn(first.lora_a.shape, generator=gen), torch.randn(first.lora_b.shape, generator=gen)
    scaling = torch.rand(first.scaling.shape, generator=gen) + 0.5
    scaling[..., 0] = 0  # slot 0: no adapter
    if scaling.dim() == 2:
        scaling[1, 3] = 0  # slot 3's adapter skips the middle member
    scaling[..., 4] = 0  # slot 4: empty on this segment
    k, n = first.x2d.shape[1], first.out2d.shape[1]
    x = torch.randn(num_rows, k + 8, generator=gen)[:, 3 : 3 + k]  # row stride k + 8
    out = torch.randn(num_rows, 2 * n, generator=gen)[:, n:]  # row stride 2 n
    tiles, scales = (torch.from_numpy(t) for t in tile_runs(runs))
    return KernelDelta(x, out, a, b, scaling, tiles, scales)


RUNS1 = ((0, 20, 3, 1.0), (25, 90, 1, -0.5), (90, 100, 4, 1.0), (100, 101, 2, 2.0))
with torch.no_grad():
    module, _, _, batch = group_qkv()
    single, _, _ = slot_linear(max_loras=5)
    group, rows = module.to_q.lora.group, batch.streams["img"]
    x0 = torch.randn(GROUP_OFFSETS[-1], 24, generator=gen)
    firsts = {
        "group": KernelDelta(x0, torch.randn(x0.shape[0], 120, generator=gen), group.lora_a, group.lora_b,
                             group.scaling, rows.tiles, rows.scales),
        "single": KernelDelta(x0, torch.randn(x0.shape[0], 40, generator=gen), single.lora.lora_a,
                              single.lora.lora_b, single.lora.scaling, rows.tiles, rows.scales),
    }
    for kind, first in firsts.items():
        second = second_segment(first, 101, RUNS1)
        assert kernels.can_pair(first, second)
        num_tiles = first.tiles.shape[0] + second.tiles.shape[0]
        default = kernels.plan_delta(num_tiles, first.num_members, 24, 40, 16, 4)
        small = dataclasses.replace(  # split-K partials, narrow blocks: segment 1's partial rows offset
            default, block_k=16, split_k=2, k_per_split=16, block_r=16, r_blocks=first.num_members,
            block_n=16, n_chunks=2, n_programs=2, expand_block_r=16,
        )
        want = [reference(first), reference(second)]
        for plan in (None, small):
            outs = [first.out2d.clone(), second.out2d.clone()]
            paired = [dataclasses.replace(d, out2d=o) for d, o in zip((first, second), outs)]
            kernels.lora_delta_pair(*paired, plan=plan)
            for got, w in zip(outs, want):
                torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-4)
            # two separate launches: under the same plan every tile's bits are its own
            sep = [first.out2d.clone(), second.out2d.clone()]
            for d, o in zip((first, second), sep):
                d = dataclasses.replace(d, out2d=o)
                kernels.lora_delta(d.x2d, d.out2d, d.lora_a, d.lora_b, d.scaling, d.tiles, d.scales,
                                   small if plan is not None else None)
            for got, s in zip(outs, sep):
                if plan is not None:
                    assert torch.equal(got, s), kind
                torch.testing.assert_close(got, s, rtol=1e-5, atol=1e-4)
        # rows without an adapter on a segment keep their base bits; the skipped member too
        got = [first.out2d.clone(), second.out2d.clone()]
        kernels.lora_delta_pair(*[dataclasses.replace(d, out2d=o) for d, o in zip((first, second), got)])
        assert torch.equal(got[1][20:25], second.out2d[20:25])  # slot 0
        assert torch.equal(got[1][90:100], second.out2d[90:100])  # slot 4: empty on this segment
        if kind == "group":
            assert torch.equal(got[1][:20, 40:80], second.out2d[:20, 40:80])
        # an empty segment, and padded static tables (a graph's): entries after the tiles are slot 0
        e = dataclasses.replace(
            second, tiles=second.tiles[:0], scales=second.scales[:0], out2d=second.out2d.clone()
        )
        o = first.out2d.clone()
        kernels.lora_delta_pair(dataclasses.replace(first, out2d=o), e)
        torch.testing.assert_close(o, want[0], rtol=1e-5, atol=1e-4)
        assert torch.equal(e.out2d, second.out2d)
        pad = lambda d, extra: dataclasses.replace(
            d, tiles=torch.cat([d.tiles, torch.zeros(extra, 3, dtype=torch.int32)]),
            scales=torch.cat([d.scales, torch.zeros(extra)]), out2d=d.out2d.clone(),
        )
        p0, p1 = pad(first, 3), pad(second, 5)
        kernels.lora_delta_pair(p0, p1)
        torch.testing.assert_close(p0.out2d, want[0], rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(p1.out2d, want[1], rtol=1e-5, atol=1e-4)
    # stacks that do not match (a group and a single linear): two launch pairs, the same deltas
    g, s = firsts["group"], second_segment(firsts["single"], 101, RUNS1)
    assert not kernels.can_pair(g, s)
    outs = [g.out2d.clone(), s.out2d.clone()]
    kernels.lora_delta_pair(dataclasses.replace(g, out2d=outs[0]), dataclasses.replace(s, out2d=outs[1]))
    torch.testing.assert_close(outs[0], reference(g), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(outs[1], reference(s), rtol=1e-5, atol=1e-4)
print("ok")
"""
)


def test_paired_kernels_equal_two_launches_and_an_fp32_reference():
    """`lora_delta_pair` (one shrink + one expand over two segments) under triton's CPU interpreter,
    fp32: a merged 3-member group and a single linear, each paired with another stream's stacks
    (different adapters, a slot without adapter, an adapter that skips a member, an empty slot),
    different row counts and row strides per segment, default and split-K plans, an empty segment,
    padded static tables; against two `lora_delta` calls (bit for bit under one plan) and fp32 torch;
    stacks that differ fall back to two launch pairs."""
    pytest.importorskip("triton")
    run_interpreted(PAIR_KERNEL_CHECK)


FUSED_KERNEL_CHECK = (
    PATCH
    + """
import dataclasses, sys
import torch
sys.path.insert(0, "tests")
from test_lora_layers import group_qkv, slot_linear
from vllm_omni.lora import kernels
from vllm_omni.lora.batch import tile_runs
from vllm_omni.lora.kernels import KernelDelta

gen = torch.Generator().manual_seed(13)
# slot 0 runs (no adapter), slot 5 empty, slot 2's adapter skips k, slot 3 is k alone (the group's)
RUNS0 = ((0, 70, 2, 1.0), (70, 75, 0, 1.0), (75, 90, 3, -0.5), (90, 100, 5, 1.0), (100, 170, 1, 2.0),
         (170, 171, 4, 0.5))
RUNS1 = ((0, 20, 3, 1.0), (20, 25, 0, 1.0), (25, 90, 1, -0.5), (90, 100, 4, 1.0), (100, 101, 2, 2.0))


def segment(lora_a, lora_b, scaling, num_rows, runs, pad=0):
    # strided x and out; `pad` slot-0 entries after the tiles (a graph's static tables)
    k, n = lora_a.shape[2], lora_b.shape[1]
    x = torch.randn(num_rows, k + 8, generator=gen)[:, 5 : 5 + k]
    out = torch.randn(num_rows, 2 * n, generator=gen)[:, :n]
    tiles, scales = (torch.from_numpy(t) for t in tile_runs(runs))
    tiles = torch.cat([tiles, torch.zeros(pad, 3, dtype=torch.int32)])
    return KernelDelta(x, out, lora_a, lora_b, scaling, tiles, torch.cat([scales, torch.zeros(pad)]))


def other_stacks(d):
    # another stream's stacks of the same shapes: slot 0 none, slot 3 skips a member, slot 4 empty
    scaling = torch.rand(d.scaling.shape, generator=gen) + 0.5
    scaling[..., 0] = scaling[..., 4] = 0
    scaling.view(-1, scaling.shape[-1])[-1, 3] = 0
    return torch.randn(d.lora_a.shape, generator=gen), torch.randn(d.lora_b.shape, generator=gen), scaling


def reference(d):  # fp32 torch, tile by tile and member by member
    out, members = d.out2d.clone(), d.num_members
    r, n = d.lora_b.shape[2], d.lora_b.shape[1] // members
    scaling = d.scaling.reshape(members, -1)
    for (start, end, slot), scale in zip(d.tiles.tolist(), d.scales.tolist()):
        for m in range(members):
            if slot != 0 and scaling[m, slot] != 0:
                a, b = d.lora_a[slot - 1, m * r : (m + 1) * r], d.lora_b[slot - 1, m * n : (m + 1) * n]
                delta = (d.x2d[start:end] @ a.t()) @ b.t()
                out[start:end, m * n : (m + 1) * n] += scale * float(scaling[m, slot]) * delta
    return out


def launch(segments, plan, fused):
    outs = [d.out2d.clone() for d in segments]
    first, *second = [dataclasses.replace(d, out2d=o) for d, o in zip(segments, outs)]
    kernels._launch(first, second[0] if second else None, plan, fused=fused)
    return outs


def plans(segments):
    d = segments[0]
    members, r = d.num_members, d.lora_b.shape[2]
    num_tiles = sum(s.tiles.shape[0] for s in segments)
    default = kernels.plan_delta(num_tiles, members, d.x2d.shape[1], d.lora_b.shape[1] // members, r, 4)
    small = dataclasses.replace(  # split-K partials, several shrink r blocks and expand programs a tile
        default, block_k=16, split_k=2, k_per_split=16, block_r=16, r_blocks=members * r // 16,
        block_n=16, n_chunks=2, n_programs=2, expand_block_r=16,
    )
    return default, small


counters = kernels._fused_counters
with torch.no_grad():
    module, _, _, _ = group_qkv()
    group = module.to_q.lora.group
    single = slot_linear(max_loras=5)[0].lora
    wide = slot_linear(max_loras=5, max_rank=32)[0].lora  # rank 32: the expand over several rank blocks
    g0 = segment(group.lora_a, group.lora_b, group.scaling, 171, RUNS0)
    s0 = segment(single.lora_a, single.lora_b, single.scaling, 171, RUNS0)
    w0 = segment(wide.lora_a, wide.lora_b, wide.scaling, 171, RUNS0, pad=2)
    cases = {
        "single": [s0],
        "single rank 32": [w0],
        "group": [g0],
        "paired group": [g0, segment(*other_stacks(g0), 101, RUNS1, pad=3)],
        "paired single": [s0, segment(*other_stacks(s0), 101, RUNS1)],
    }
    for name, segments in cases.items():
        for plan in plans(segments):
            two = launch(segments, plan, False)
            for w, d in zip(two, segments):
                torch.testing.assert_close(w, reference(d), rtol=1e-5, atol=1e-4)
            for _ in range(2):  # the launch leaves its counters zero: a second one gives the same bits
                got = launch(segments, plan, True)
                assert all(torch.equal(g, w) for g, w in zip(got, two)), (name, plan)
                assert not counters[torch.device("cpu")].any(), (name, plan)
        got = launch(segments, None, True)
        for g, d, rows in zip(got, segments, (slice(70, 75), slice(20, 25))):  # slot 0: the base bits
            assert torch.equal(g[rows], d.out2d[rows]) and not torch.equal(g, d.out2d), name
    got = launch(cases["group"], None, True)[0]  # slot 2's adapter skips k: its columns stay the base
    assert torch.equal(got[:70, 40:80], g0.out2d[:70, 40:80])
    assert not torch.equal(got[:70, :40], g0.out2d[:70, :40])
    # a table past the counters' tiles takes the pair of kernels (the fused one is not called)
    kernels.MAX_FUSED_TILES, kernels._fused_kernel = 3, None
    got = launch(cases["paired group"], None, True)
    assert all(torch.equal(g, w) for g, w in zip(got, launch(cases["paired group"], None, False)))
    # the switch is for CUDA: on the CPU a default launch is the pair
    kernels.FUSED_LAUNCH, kernels.MAX_FUSED_TILES = True, 4096
    launch(cases["group"], None, None)
    assert not kernels.fused_launch_failed
print("ok")
"""
)


def test_fused_kernel_equals_the_two_launches_bit_for_bit():
    """The one-launch delta (`_launch(fused=True)`: shrink and expand pieces in one grid, by tickets,
    the expand waiting on per-tile counters) under triton's CPU interpreter, fp32: a single linear (rank
    16 and 32), a merged q/k/v group and paired launches of both, over tables with slot-0 tiles, an empty
    slot, adapters that skip a member, padded entries, default and split-K / multi-block plans; bit for
    bit the shrink + expand pair under the same plan (and fp32 torch for the pair), twice in a row (the
    last program zeroes the counters); a table past MAX_FUSED_TILES and a CPU launch take the pair."""
    pytest.importorskip("triton")
    run_interpreted(FUSED_KERNEL_CHECK)


MODEL_PAIR_CHECK = (
    PATCH
    + """
import sys
import torch
sys.path.insert(0, "tests")
from test_cuda_graphs import SPECS, TINY, batch, tiny_lora_model
from vllm_omni.diffusion.models.qwen_image.fused_ops import BlockOps
from vllm_omni.lora import kernels, layers
from vllm_omni.lora.batch import LoRAMapping, SeqLoRA
from vllm_omni.lora.random_adapter import block_targets, random_lora_adapter

model, manager = tiny_lora_model()
targets = block_targets(TINY.num_layers)  # the 12 attention / MLP linears of every block
a = manager.add_adapter("a", random_lora_adapter(model, targets, 8, 1, std=0.2), "<random>")
b = manager.add_adapter("b", random_lora_adapter(model, targets[1::3], 3, 2, std=0.2), "<random>")  # some
img, txt, t, layout = batch(SPECS)
mapping = LoRAMapping.for_packed([SeqLoRA(a), SeqLoRA(0), SeqLoRA(b, -0.5)], layout)

# count the kernel launches: one (name, grid) per launch of the shrink or the expand
launches, real = [], kernels._kernels()


class Counted:
    def __init__(self, name, kernel):
        self.name, self.kernel = name, kernel

    def __getitem__(self, grid):
        launches.append((self.name, grid))
        return self.kernel[grid]


kernels._kernels = lambda: (Counted("shrink", real[0]), Counted("expand", real[1]))
pair = kernels.lora_delta_pair


def unpaired(first, second, plan=None):  # what each linear launched before pairing
    kernels._launch(first, None, plan)
    kernels._launch(second, None, plan)


def forward(use_kernels, paired=True):
    layers.use_kernels = lambda x: use_kernels
    kernels.lora_delta_pair = pair if paired else unpaired
    launches.clear()
    with torch.inference_mode(), manager.activate(mapping):
        streams = manager.state.batch.streams
        return model.forward_packed(img, txt, t, layout), {st: r.tiles.shape[0] for st, r in streams.items()}


with torch.inference_mode():
    base = model.forward_packed(img, txt, t, layout)
for fuse_joint in (False, True):  # the per-stream q/k/v path, and the fused join's
    model.block_ops = BlockOps(compiled=False, fuse_joint=fuse_joint)
    got, num_tiles = forward(True)
    # per block: 4 points (q/k/v groups, out projections, MLP up, MLP down), one shrink and one expand
    # each for both streams, each grid over both streams' tiles
    assert [name for name, _ in launches] == ["shrink", "expand"] * 4 * TINY.num_layers, launches
    assert {grid[0] for _, grid in launches} == {num_tiles["img"] + num_tiles["txt"]}
    want, _ = forward(True, paired=False)
    assert [name for name, _ in launches] == ["shrink", "expand"] * 8 * TINY.num_layers
    host, _ = forward(False)
    assert not launches
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, host, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, base, rtol=1e-3, atol=1e-3)
print("ok")
"""
)


def test_lora_forward_launches_one_kernel_pair_per_paired_point():
    """A LoRA forward of the tiny Qwen-Image transformer with the kernels on (triton's CPU interpreter,
    fp32), mixed adapters (one on every block linear, one on a third of them) and a sequence without:
    one shrink and one expand per block point for both streams (8 kernels a block, not 16), in both
    q/k/v paths, equal to the unpaired launches and to the host path."""
    pytest.importorskip("triton")
    run_interpreted(MODEL_PAIR_CHECK)


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


CUDA_GROUP = (512, 192, 64, 3)
"""(in, out, rank, members) of the CUDA tests' merged q/k/v group segments."""


def _cuda_group_segment(gen, num_rows, runs):
    """A merged q/k/v group's segment on CUDA in bf16 (two adapter slots; slot 2 skips the middle
    member) over `runs` (start, end, slot, scale), and its fp32 reference output on the CPU."""
    from vllm_omni.lora import kernels
    from vllm_omni.lora.batch import tile_runs

    k, n, rank, members = CUDA_GROUP
    x = torch.randn(num_rows, k, generator=gen)
    a = torch.randn(2, members * rank, k, generator=gen) * 0.05
    b = torch.randn(2, members * n, rank, generator=gen) * 0.05
    scaling = torch.rand(members, 3, generator=gen) + 0.5
    scaling[:, 0] = 0
    scaling[1, 2] = 0  # slot 2 skips the middle member
    base = torch.randn(num_rows, members * n, generator=gen).to(torch.bfloat16).float()  # exact in bf16
    want = base.clone()
    for start, end, slot, scale in runs:
        for m in range(members if slot else 0):  # slot 0: no adapter, the base
            shrunk = x[start:end] @ a[slot - 1, m * rank : (m + 1) * rank].t()
            delta = shrunk @ b[slot - 1, m * n : (m + 1) * n].t()
            want[start:end, m * n : (m + 1) * n] += scale * float(scaling[m, slot]) * delta
    tiles, scales = (torch.from_numpy(t).cuda() for t in tile_runs(runs))
    x, a, b, base = (t.to("cuda", torch.bfloat16) for t in (x, a, b, base))
    return kernels.KernelDelta(x, base, a, b, scaling.cuda(), tiles, scales), want


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernels on CUDA, in bf16")
def test_cuda_paired_kernels_match_two_launches_and_an_fp32_reference():
    """On the GPU, bf16 at rank 64 and real launch plans: a merged q/k/v group's segments of two
    streams (300 image rows, 40 text rows, different adapters) in one launch pair, against two
    launches under the same plan (bit for bit), two default launches and fp32 math."""
    pytest.importorskip("triton")
    from vllm_omni.lora import kernels

    gen = torch.Generator().manual_seed(7)
    k, n, rank, members = CUDA_GROUP
    first, want0 = _cuda_group_segment(gen, 300, ((0, 130, 1, 1.0), (200, 300, 2, 0.5)))
    second, want1 = _cuda_group_segment(gen, 40, ((0, 25, 2, -1.0), (30, 40, 1, 2.0)))
    plan = kernels.plan_delta(first.tiles.shape[0] + second.tiles.shape[0], members, k, n, rank, 2)

    def run(launch):
        outs = (first.out2d.clone(), second.out2d.clone())
        segs = [dataclasses.replace(d, out2d=o) for d, o in zip((first, second), outs)]
        launch(*segs)
        torch.cuda.synchronize()
        return outs

    paired = run(kernels.lora_delta_pair)
    same_plan = run(lambda f, s: (kernels._launch(f, None, plan), kernels._launch(s, None, plan)))
    separate = run(lambda f, s: (kernels._launch(f, None, None), kernels._launch(s, None, None)))
    for got, same, sep, want, d in zip(paired, same_plan, separate, (want0, want1), (first, second)):
        assert torch.equal(got, same)  # a tile's bits depend only on the plan and its own rows
        delta, want_delta = (got.float() - d.out2d.float()).cpu(), want - d.out2d.float().cpu()
        assert _rel_err(delta, want_delta) < 2e-2  # bf16 roundings
        assert _rel_err(delta, (sep.float() - d.out2d.float()).cpu()) < 2e-2
    assert torch.equal(paired[0][130:200], first.out2d[130:200])  # no adapter: the base bits
    assert torch.equal(paired[1][25:30], second.out2d[25:30])
    assert torch.equal(paired[1][:25, n : 2 * n], second.out2d[:25, n : 2 * n])  # slot 2 skips member 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a CUDA device")
def test_cuda_paired_lora_forward_graph_equals_eager_and_the_unpaired_forward():
    """The tiny transformer in bf16 on the GPU with adapters on every block linear: the LoRA graph
    (paired launches captured over the static tables) replays its eager forward bit for bit, and the
    paired forward matches the unpaired one (each linear its own launch pair) within bf16 rounding."""
    pytest.importorskip("triton")
    from test_cuda_graphs import GRAPHS, SPECS, TINY, batch, tiny_lora_model

    from vllm_omni.diffusion.worker.cuda_graphs import CUDAGraphRunner
    from vllm_omni.lora import kernels
    from vllm_omni.lora.batch import LoRAMapping, SeqLoRA
    from vllm_omni.lora.random_adapter import block_targets, random_lora_adapter

    device, dtype = torch.device("cuda"), torch.bfloat16
    model, manager = tiny_lora_model(device, dtype)
    targets = block_targets(TINY.num_layers)
    a = manager.add_adapter("a", random_lora_adapter(model, targets, 8, 1, std=0.2), "<random>")
    b = manager.add_adapter("b", random_lora_adapter(model, targets[1::3], 3, 2, std=0.2), "<random>")
    img, txt, t, layout = batch(SPECS, device=device, dtype=dtype)
    runner = CUDAGraphRunner(model, device, dtype, GRAPHS, lora_state=manager.state)
    mapping = LoRAMapping.for_packed([SeqLoRA(a), SeqLoRA(0), SeqLoRA(b, 0.5)], layout)
    pairs, pair = [], kernels.lora_delta_pair
    with manager.activate(mapping):
        replayed = runner.forward_packed(img, txt, t, layout)
        assert runner.last_path == "graph"
        (graph,) = [g for (_, with_lora), g in runner._packed.items() if with_lora]
        with torch.inference_mode():
            kernels.lora_delta_pair = lambda f, s, plan=None: pairs.append(1) or pair(f, s, plan)
            try:
                eager = graph.run_eager()[: layout.num_img_rows].clone()
                paired = model.forward_packed(img, txt, t, layout)
                kernels.lora_delta_pair = lambda f, s, plan=None: (
                    kernels._launch(f, None, plan),
                    kernels._launch(s, None, plan),
                )
                unpaired = model.forward_packed(img, txt, t, layout)
            finally:
                kernels.lora_delta_pair = pair
    with torch.inference_mode():
        base = model.forward_packed(img, txt, t, layout)
    assert len(pairs) == 2 * 4 * TINY.num_layers  # the eager graph forward's and the paired forward's
    assert graph.graph is not None and torch.equal(replayed, eager)
    assert _rel_err(paired, unpaired) < 2e-2 and _rel_err(replayed, paired) < 2e-2
    assert not torch.equal(paired, base)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused Triton kernel on CUDA, in bf16")
def test_cuda_fused_kernel_equals_two_launches_eager_and_in_a_graph(monkeypatch):
    """On the GPU with FUSED_LAUNCH on, bf16 at rank 64: one segment (a merged q/k/v group, one of its
    members) and a paired launch of two streams' groups (slot-0 runs, an adapter that skips a member),
    default plans and one of several shrink r blocks; the fused launch gives the shrink + expand pair's
    bits under the same plan, eagerly twice in a row and from a CUDA graph replayed twice, and leaves
    its counters zero."""
    pytest.importorskip("triton")
    from vllm_omni.lora import kernels

    device, gen = torch.device("cuda", torch.cuda.current_device()), torch.Generator().manual_seed(9)
    k, n, rank, _ = CUDA_GROUP
    first, _ = _cuda_group_segment(gen, 300, ((0, 130, 1, 1.0), (130, 200, 0, 1.0), (200, 300, 2, 0.5)))
    second, _ = _cuda_group_segment(gen, 40, ((0, 25, 2, -1.0), (25, 30, 0, 1.0), (30, 40, 1, 2.0)))
    member = dataclasses.replace(  # a single linear: the group's middle member, over its views
        first, out2d=first.out2d[:, n : 2 * n], lora_a=first.lora_a[:, rank : 2 * rank],
        lora_b=first.lora_b[:, n : 2 * n], scaling=first.scaling[1],
    )  # fmt: skip
    cases = []
    for segments in ([first], [member], [first, second]):
        m = segments[0].num_members
        default = kernels.plan_delta(sum(d.tiles.shape[0] for d in segments), m, k, n, rank, 2)
        cases += [(segments, default), (segments, dataclasses.replace(default, block_r=64, r_blocks=m))]
    counters = kernels._fused_counters

    def launch(segments, plan, outs):
        first, *second = [dataclasses.replace(d, out2d=o) for d, o in zip(segments, outs)]
        if second:
            kernels.lora_delta_pair(first, second[0], plan)
        else:
            kernels._launch(first, None, plan)

    pair = []
    for segments, plan in cases:  # the shrink + expand pair
        outs = [d.out2d.clone() for d in segments]
        launch(segments, plan, outs)
        pair.append(outs)
    monkeypatch.setattr(kernels, "FUSED_LAUNCH", True)
    monkeypatch.setattr(kernels, "fused_launch_failed", False)
    monkeypatch.setattr(kernels, "_kernels", None)  # from here on only the fused kernel may run
    for (segments, plan), want in zip(cases, pair):
        assert any(not torch.equal(w, d.out2d) for w, d in zip(want, segments))
        for _ in range(2):  # eager, twice: the first launch left its counters zero
            outs = [d.out2d.clone() for d in segments]
            launch(segments, plan, outs)
            torch.cuda.synchronize()
            assert all(torch.equal(o, w) for o, w in zip(outs, want))
            assert not counters[device].any()
        graph, outs = torch.cuda.CUDAGraph(), [d.out2d.clone() for d in segments]
        with torch.cuda.graph(graph):
            launch(segments, plan, outs)
        for _ in range(2):  # the replays reuse the counters
            for o, d in zip(outs, segments):
                o.copy_(d.out2d)
            graph.replay()
            torch.cuda.synchronize()
            assert all(torch.equal(o, w) for o, w in zip(outs, want))
            assert not counters[device].any()
    assert not kernels.fused_launch_failed


def test_a_failing_paired_launch_falls_back_to_one_launch_pair_per_stream(monkeypatch):
    """A paired launch that raises (a compile or resource error on some GPU's Triton) is logged once,
    both segments are launched unpaired instead, and later pairs skip the paired kernels."""
    from vllm_omni.lora import kernels

    launches = []

    def launch(first, second, plan):
        launches.append((first, second))
        if second is not None:
            raise RuntimeError("out of resources")

    monkeypatch.setattr(kernels, "_launch", launch)
    monkeypatch.setattr(kernels, "can_pair", lambda first, second: True)
    monkeypatch.setattr(kernels, "paired_launch_failed", False)
    kernels.lora_delta_pair("img", "txt")
    assert launches == [("img", "txt"), ("img", None), ("txt", None)]
    assert kernels.paired_launch_failed
    kernels.lora_delta_pair("img", "txt")
    assert launches[3:] == [("img", None), ("txt", None)]


class _Layer:
    """A PairableLinear that records how its delta was added (the kernel segment it returns, or its
    own path)."""

    def __init__(self, name, segment):
        self.name, self.segment, self.calls = name, segment, []

    def adds_lora_delta(self, x):
        return True

    def base_forward(self, x):
        return x.clone()

    def kernel_delta(self, x, out):
        return self.segment

    def add_lora_delta(self, x, out):
        self.calls.append("own path")


@pytest.mark.parametrize(
    ("first_segment", "second_segment", "launched", "first_calls", "second_calls"),
    [
        ("img", "txt", [("pair", "img", "txt")], [], []),
        ("img", None, [("segment", "img")], [], ["own path"]),  # first's built segment is not dropped
        (None, "txt", [], ["own path"], ["own path"]),
    ],
)
def test_paired_linear_launches_each_built_segment_once(
    monkeypatch, first_segment, second_segment, launched, first_calls, second_calls
):
    """`paired_linear` pairs two kernel segments; where only the first layer's deltas run through the
    kernels its segment launches alone and the second adds its own; neither delta is added twice."""
    from vllm_omni.diffusion.layers.paired_linear import paired_linear
    from vllm_omni.lora import kernels

    launches = []
    monkeypatch.setattr(kernels, "lora_delta_pair", lambda f, s: launches.append(("pair", f, s)))
    monkeypatch.setattr(kernels, "lora_delta_segment", lambda d: launches.append(("segment", d)))
    first, second = _Layer("first", first_segment), _Layer("second", second_segment)
    x0, x1 = torch.ones(2, 3), torch.zeros(1, 3)
    out0, out1 = paired_linear(first, x0, second, x1)
    assert launches == launched
    assert (first.calls, second.calls) == (first_calls, second_calls)
    assert torch.equal(out0, x0) and torch.equal(out1, x1)

"""Paired LoRA deltas (issue 27): the two streams' linears at one point of a dual-stream block (q/k/v
groups, out projections, MLP up and down) add their deltas in ONE shrink + expand launch pair
(`kernels.lora_delta_pair`, `layers/paired_linear.py`). Kernel checks run under triton's CPU
interpreter (TRITON_INTERPRET must be set before triton loads, hence subprocesses)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from triton_interpreter import PATCH, run_interpreted

PAIR_KERNEL_CHECK = (
    PATCH
    + """
import dataclasses, sys
import torch
sys.path.insert(0, "tests")
from utils import GROUP_OFFSETS, group_qkv, GROUP_SEQS, RowLayout, slot_linear
from vllm_omni.lora import kernels
from vllm_omni.lora.batch import LoRABatch, LoRAMapping, SeqLoRA, cover_runs, tile_runs
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
        # the expand's GELU over every row's tables: gelu(base + delta) where a delta runs, gelu(base)
        # on the rows of no adapter, a member an adapter skips and an empty slot's rows
        gelu = lambda d: torch.nn.functional.gelu(reference(d), approximate="tanh")
        tiles1, scales1 = (torch.from_numpy(t) for t in tile_runs(cover_runs(RUNS1, 101)))
        acts = [
            dataclasses.replace(first, tiles=rows.all_tiles, scales=rows.all_scales, activation="gelu_tanh"),
            dataclasses.replace(second, tiles=tiles1, scales=scales1, activation="gelu_tanh"),
        ]
        assert all(d.tiles.shape[0] > t.shape[0] for d, t in zip(acts, (first.tiles, second.tiles)))
        assert not kernels.can_pair(first, acts[1])  # one activation per launch
        for plan in (None, small):
            got = [dataclasses.replace(d, out2d=d.out2d.clone()) for d in acts]
            kernels.lora_delta_pair(*got, plan=plan)
            for d, a in zip(got, acts):
                torch.testing.assert_close(d.out2d, gelu(a), rtol=1e-5, atol=1e-5)
            alone = dataclasses.replace(acts[1], out2d=acts[1].out2d.clone())
            kernels.lora_delta_segment(alone)
            torch.testing.assert_close(alone.out2d, gelu(acts[1]), rtol=1e-5, atol=1e-5)
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


MODEL_PAIR_CHECK = (
    PATCH
    + """
import sys
import torch
sys.path.insert(0, "tests")
from utils import batch, GRAPH_SPECS as SPECS, TINY_CONFIG as TINY, tiny_lora_model
from vllm_omni.diffusion.models.qwen_image.fused_ops import BlockOps
from vllm_omni.lora import kernels, layers
from vllm_omni.lora.batch import LoRAMapping, SeqLoRA
from vllm_omni.lora.random_adapter import block_targets, random_lora_adapter

model, manager = tiny_lora_model()
targets = block_targets(model.plans, TINY.num_layers)  # the 12 attention / MLP linears of every block
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
        tables = {st: (r.tiles.shape[0], r.all_tiles.shape[0]) for st, r in streams.items()}
        return model.forward_packed(img, txt, t, layout), tables


with torch.inference_mode():
    base = model.forward_packed(img, txt, t, layout)
for fuse_joint in (False, True):  # the per-stream q/k/v path, and the fused join's
    model.block_ops = BlockOps(compiled=False, fuse_joint=fuse_joint)
    got, num_tiles = forward(True)
    # per block: 4 points (q/k/v groups, out projections, MLP up, MLP down), one shrink and one expand
    # each for both streams, each grid over both streams' tiles; the MLP ups' (their GELU in the
    # expand, for every row: the sequence without an adapter too) over the tiles of every row
    assert [name for name, _ in launches] == ["shrink", "expand"] * 4 * TINY.num_layers, launches
    runs_tiles, all_tiles = (num_tiles["img"][i] + num_tiles["txt"][i] for i in (0, 1))
    assert all_tiles > runs_tiles
    want_grids = [runs_tiles] * 4 + [all_tiles] * 2 + [runs_tiles] * 2
    assert [grid[0] for _, grid in launches] == want_grids * TINY.num_layers
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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernels on CUDA, in bf16")
def test_cuda_paired_kernels_match_two_launches_and_an_fp32_reference(monkeypatch):
    """On the GPU, bf16 at rank 64 and real launch plans: a merged q/k/v group's segments of two
    streams (300 image rows, 40 text rows, different adapters) in one launch pair, against two
    launches under the same plan (bit for bit), two default launches and fp32 math."""
    pytest.importorskip("triton")
    from vllm_omni.lora import kernels
    from vllm_omni.lora.batch import cover_runs, tile_runs

    device, dtype, gen = "cuda", torch.bfloat16, torch.Generator().manual_seed(7)
    k, n, rank, members = 512, 192, 64, 3

    def segment(num_rows, runs):
        x = torch.randn(num_rows, k, generator=gen)
        a = torch.randn(2, members * rank, k, generator=gen) * 0.05
        b = torch.randn(2, members * n, rank, generator=gen) * 0.05
        scaling = torch.rand(members, 3, generator=gen) + 0.5
        scaling[:, 0] = 0
        scaling[1, 2] = 0  # slot 2 skips the middle member
        base = torch.randn(num_rows, members * n, generator=gen).to(dtype).float()  # exact in bf16
        want = base.clone()
        for start, end, slot, scale in runs:
            for m in range(members):
                shrunk = x[start:end] @ a[slot - 1, m * rank : (m + 1) * rank].t()
                delta = shrunk @ b[slot - 1, m * n : (m + 1) * n].t()
                want[start:end, m * n : (m + 1) * n] += scale * float(scaling[m, slot]) * delta
        tiles, scales = (torch.from_numpy(t).to(device) for t in tile_runs(runs))
        x, a, b, base = (t.to(device, dtype) for t in (x, a, b, base))
        return kernels.KernelDelta(x, base, a, b, scaling.to(device), tiles, scales), want

    first, want0 = segment(300, ((0, 130, 1, 1.0), (200, 300, 2, 0.5)))
    second, want1 = segment(40, ((0, 25, 2, -1.0), (30, 40, 1, 2.0)))
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
    # the expand's GELU over the tables of every row, on rows with and without a delta, against F.gelu
    # of the un-activated launch's output: with libdevice's tanhf bit for bit (the same fp32
    # operations); with the hardware tanh (the default) within ~1e-3 on a few elements
    runs = [((0, 130, 1, 1.0), (200, 300, 2, 0.5)), ((0, 25, 2, -1.0), (30, 40, 1, 2.0))]
    tables = [
        [torch.from_numpy(t).to(device) for t in tile_runs(cover_runs(r, d.out2d.shape[0]))]
        for r, d in zip(runs, (first, second))
    ]
    for approx in (False, True):
        monkeypatch.setattr(kernels, "GELU_TANH_APPROX", approx)
        acts = [
            dataclasses.replace(d, tiles=tiles, scales=scales, activation="gelu_tanh", out2d=d.out2d.clone())
            for d, (tiles, scales) in zip((first, second), tables)
        ]
        kernels.lora_delta_pair(*acts, plan=plan)
        torch.cuda.synchronize()
        for act, got in zip(acts, paired):
            want = F.gelu(got, approximate="tanh")
            if not approx:
                assert torch.equal(act.out2d, want)
                continue
            diff = (act.out2d.float() - want.float()).abs()
            assert float(diff.max()) <= 2e-3 and float((diff > 0).float().mean()) < 0.02


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a CUDA device")
def test_cuda_paired_lora_forward_graph_equals_eager_and_the_unpaired_forward():
    """The tiny transformer in bf16 on the GPU with adapters on every block linear: the LoRA graph
    (paired launches captured over the static tables) replays its eager forward bit for bit, and the
    paired forward matches the unpaired one (each linear its own launch pair) within bf16 rounding."""
    pytest.importorskip("triton")
    from utils import GRAPH_SPECS as SPECS
    from utils import GRAPHS, batch, tiny_lora_model
    from utils import TINY_CONFIG as TINY

    from vllm_omni.diffusion.worker.cuda_graphs import CUDAGraphRunner
    from vllm_omni.lora import kernels
    from vllm_omni.lora.batch import LoRAMapping, SeqLoRA
    from vllm_omni.lora.random_adapter import block_targets, random_lora_adapter

    device, dtype = torch.device("cuda"), torch.bfloat16
    model, manager = tiny_lora_model(device, dtype)
    targets = block_targets(model.plans, TINY.num_layers)
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

    def kernel_delta(self, x, out, activation=None):
        self.activation = activation
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
@pytest.mark.parametrize("activation", [None, "gelu_tanh"])
def test_paired_linear_launches_each_built_segment_once(
    monkeypatch, first_segment, second_segment, launched, first_calls, second_calls, activation
):
    """`paired_linear` pairs two kernel segments; where only the first layer's deltas run through the
    kernels its segment launches alone and the second adds its own; neither delta is added twice. An
    activation goes to the segments it asks for (their expand applies it) and is applied after the
    deltas of a layer on its own path, once either way."""
    from vllm_omni.diffusion.layers.paired_linear import paired_linear
    from vllm_omni.lora import kernels

    launches = []
    monkeypatch.setattr(kernels, "lora_delta_pair", lambda f, s: launches.append(("pair", f, s)))
    monkeypatch.setattr(kernels, "lora_delta_segment", lambda d: launches.append(("segment", d)))
    first, second = _Layer("first", first_segment), _Layer("second", second_segment)
    x0, x1 = torch.ones(2, 3), torch.full((1, 3), -2.0)
    out0, out1 = paired_linear(first, x0, second, x1, activation=activation)
    assert launches == launched
    assert (first.calls, second.calls) == (first_calls, second_calls)
    assert first.activation == activation
    for layer, x, out in ((first, x0, out0), (second, x1, out1)):
        own = activation is not None and layer.calls == ["own path"]
        assert torch.equal(out, F.gelu(x, approximate="tanh") if own else x), layer.name


def test_spare_graph_table_entries_do_not_thin_the_expand_programs(monkeypatch):
    """A one-sequence CUDA graph's static tables hold spare entries (no rows) beside the tiles; the
    launch still gives the expand the column blocks per program of the rows' own tiles (the MLP up
    projection at 256 image + 64 text rows: 3, not the 5 that its 7 table entries would plan), and the
    shrink the same split as before (the same bits)."""
    from vllm_omni.lora import kernels
    from vllm_omni.lora.batch import max_tiles
    from vllm_omni.lora.kernels import KernelDelta

    grids = {}

    class Recorder:  # stands in for a triton kernel: records its launch grid
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **meta: grids.__setitem__(self.name, (grid, meta))

    monkeypatch.setattr(kernels, "_kernels", lambda: (Recorder("shrink"), Recorder("expand")))

    def segment(rows: int, entries: int) -> KernelDelta:
        def meta(*shape, dtype=torch.bfloat16):
            return torch.empty(*shape, dtype=dtype, device="meta")

        return KernelDelta(
            meta(rows, 3072), meta(rows, 12288), meta(8, 64, 3072), meta(8, 12288, 64),
            meta(9, dtype=torch.float32), meta(entries, 3, dtype=torch.int32),
            meta(entries, dtype=torch.float32),
            activation="gelu_tanh",
        )  # fmt: skip

    launches = {}
    for kind, (img_entries, txt_entries) in {
        "exact": (4, 1),
        "graph": (max_tiles(256, 2), max_tiles(64, 2)),
    }.items():
        kernels.lora_delta_pair(segment(256, img_entries), segment(64, txt_entries))
        launches[kind] = dict(grids)
    (exact_grid, exact_meta), (graph_grid, graph_meta) = (
        launches["exact"]["expand"],
        launches["graph"]["expand"],
    )
    assert graph_grid[0] == 7 and exact_grid[0] == 5  # every table entry gets its programs
    assert graph_meta["N_CHUNKS"] == exact_meta["N_CHUNKS"] == 3 and graph_grid[1] == exact_grid[1] == 32
    unthinned = kernels.plan_delta(7, 1, 3072, 12288, 64, 2)  # the plan sized by the 7 entries
    assert unthinned.n_chunks == 5
    assert launches["graph"]["shrink"][0] == (7, unthinned.split_k, 1)  # the shrink's split as before

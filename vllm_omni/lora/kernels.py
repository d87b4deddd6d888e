"""Triton kernels of the slot LoRA delta on CUDA (punica's shrink / expand, over our tile tables).

One launch pair serves one linear, or a merged projection of M linears that read the same x (q, k, v
of one stream: `LoRAGroupSlots` in layers.py), whose slots are stacked (a single linear is M = 1):

    lora_a   [max_loras, M * R, in]     member m's A: rows [m R, (m + 1) R) of each slot
    lora_b   [max_loras, M * N, R]      member m's B: rows [m N, (m + 1) N)
    scaling  fp32 [M, max_loras + 1]    ([max_loras + 1] for a single linear)
    out      [rows, M * N]              member m's output columns [m N, (m + 1) N)

For every tile of a row stream's table (batch.py: rows [start, end) of one run, its slot, its scale):

    shrink  grid (tiles, split_k, r blocks)   partial[split, rows, :] = x[rows, ks] @ A[slot, :, ks]^T
                                              (fp32 accumulation, stored in the activation dtype, see
                                              PARTIALS_FP32; all M R columns in one program: x is read
                                              once for the whole group; ks = the split's share of in)
    expand  grid (tiles, n programs, M)       out[rows, m N + n] += scale * scaling[m, slot] *
                                                  partial[:, rows, m R : (m + 1) R].sum(0) (fp32).to(dtype)
                                                  @ B[slot, m N + n]^T
                                              (one program: the partials summed once, then N_CHUNKS
                                              column blocks of its member); with an activation
                                              (`KernelDelta.activation`, the MLP up projection's GELU)
                                              out = act(out + delta) for every row of the table, those
                                              of slot 0 tiles (no delta) too

Two streams' linears of the same shapes at one point of a dual-stream block (image and text q/k/v
groups, out projections, MLP up / down) share ONE launch pair (`lora_delta_pair`, two `KernelDelta`
segments): programs of tile < T0 work on segment 0 (its x, stacks, scaling, tiles, scales, out), the
others on segment 1 at tile - T0, its rows of the partials after segment 0's. The text stream's one or
two tiles become a few more programs of the image launch instead of two more dependent launches: 8
kernels a block instead of 16.

A tile whose slot holds no adapter on any member (`scaling == 0`: slot 0, "no adapter", or an adapter
that targets none of them) returns at once in the shrink; an expand program returns when its own
member has none (an adapter may target only q and v: k's columns stay the base), or, with an
activation, applies only that. The expand sums the
split-K partials in a fixed order (no atomics), so a tile's bits depend only on the launch's shapes
and the tile's own rows: a replayed graph gives the eager call's bits for the same tables. Launch
shapes (`plan_delta`) depend only on the tables' sizes, the rows and the slot stacks' shapes, never on
what the tables hold, which is what lets a CUDA graph capture them.

The constants below set the launch shapes. They were chosen from bytes and FLOPs (Qwen-Image: rows
256 .. 8192, in / out 3072 or 12288, rank 64) and checked by a sweep of launch shapes: the defaults are
near the best at 256 rows; at 1024 rows fewer splits and 4 column blocks per expand program would take
a little off a block's deltas, left as they are (another plan moves the bits of every reference image
of the tests). docs/lora.md says how the deltas are launched.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math

import torch

from vllm_omni.diffusion.layers import fp8_triton

logger = logging.getLogger(__name__)

SHRINK_MAX_BLOCK_R = 256
"""Widest shrink program (columns of x @ A^T). A merged q/k/v group at rank 64 (192 columns) is one
program per tile and split, so each x tile is loaded once for the three members; its [64, 256] fp32
accumulator is 64 registers a thread at 8 warps. Wider stacks take several r blocks (x re-read)."""
SHRINK_STAGE_BYTES = 48 * 1024
"""Bytes of one K step's x and A tiles: BLOCK_K is the largest power of two (16 .. 128) that fits.
Triton's software pipeline holds num_stages (3) of them in shared memory (227 KB a block on
Hopper): a rank-64 linear gets BLOCK_K 128 (32 KB a stage), a merged group (256 columns) 64 (40 KB), so
a small table's K range is a short loop (the shrink is one program per SM, latency bound)."""
TARGET_SHRINK_PROGRAMS = 132
"""Most shrink programs a split may make (one wave: one per SM of a 132-SM GPU). A table of many tiles is
not split: each program streams its K range through a pipelined loop, and every split costs the
expand a read of the partials."""
MAX_SPLIT_K = 16
"""Most splits of in_features (the expand unrolls one partial load per split). Below it a small table
is split by bytes (`plan_delta`): at 256 rows (4 tiles, one program per SM) an SM's time is about the
bytes its shrink program reads, (BLOCK_M + M R) x K x 2 / split of x and A, plus the partials its
expand program reads, split x BLOCK_M x R x 4 (fp32 partials: the plan predates PARTIALS_FP32 = False
and stays as swept), so split = sqrt(their ratio): 8 for a merged q/k/v
(1.5 MB / 16 KB), 6 for a 3072-wide linear, 12 for the 12288-wide MLP down projection."""
MIN_K_STEPS = 2
"""A split keeps at least this many BLOCK_K steps (fewer is all prologue)."""
EXPAND_BLOCK_N = 128
"""Output columns per expand step: a [64, 128] fp32 accumulator (64 registers a thread at 4 warps),
a [R, 128] tile of B (16 KB at rank 64) and a 32 KB read-modify-write of the output (bf16)."""
EXPAND_MAX_BLOCK_R = 128
"""Rank columns per expand step. A member of rank <= this sums its partials ONCE per program and
keeps the [BLOCK_M, R] shrunk tile in registers for all its column blocks; larger ranks loop over R
(and re-read the partials per column block)."""
TARGET_EXPAND_PROGRAMS = 132
"""Expand programs aimed for (one wave: one per SM of a 132-SM GPU). Past one wave, an SM's bytes are
(its programs) x (partials + chunks x 48 KB): fewer, fatter programs (`MAX_EXPAND_CHUNKS` column
blocks each) read the partials fewer times for the same output, so a table gets as many chunks per
program as still leave every SM a program."""
MAX_EXPAND_CHUNKS = 8
"""Most column blocks per expand program (1024 columns at BLOCK_N 128)."""
PARTIALS_FP32 = False
"""The shrink's split-K partials in fp32 (True) or, for bf16 / fp16 activations, in their dtype
(False, the default): half the bytes every expand program of a tile re-reads from L2 (at 256 rows
~10-20 MB a launch), each partial rounded to the activation dtype before the fixed-order fp32 sum
(the shrunk tile is rounded to it after the sum either way): 7-9 % off a block's deltas, and the LoRA
CUDA tests pass with it. `plan_delta` still sizes splits by fp32 partials (what was swept)."""
ACTIVATIONS = {None: 0, "gelu_tanh": 1}
"""The expand's fused activations (`KernelDelta.activation`) and their kernel codes. "gelu_tanh" is
`F.gelu(approximate="tanh")` of the output rounded to its dtype: what a layer computes when it applies
the GELU to the linear's output after the delta (see GELU_TANH_APPROX for its bits). Why: a separate
GELU was 960 more launches in a 256x256 8-step adapter request."""
GELU_TANH_APPROX = True
"""The expand's "gelu_tanh" with the hardware tanh (`fp8_triton.gelu_tanh_fp32`'s APPROX_TANH, the
default: ~0.3 % of bf16 outputs one ulp from `F.gelu`) rather than libdevice's tanhf (bit-equal to
`F.gelu` on the GPU, but compute bound in the expand's few programs: nearly twice as slow for a
256-row up projection)."""
ACC_PER_THREAD = 64
"""fp32 accumulator elements a thread holds: num_warps = BLOCK_M * BLOCK_{R,N} / (32 * this), 4 .. 8."""


@functools.cache
def triton_available() -> bool:
    """Whether triton imports (CUDA builds of torch ship it): the CUDA delta path, and graphs with LoRA."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def shrink_kernel(
        x_ptr, a_ptr, partial_ptr, tiles_ptr, scaling_ptr, K, RT, k_per_split,
        stride_xm, stride_a_slot, stride_a_r, stride_p_split, stride_pm, stride_s_member,
        num_tiles0, x1_ptr, a1_ptr, tiles1_ptr, scaling1_ptr, stride_xm1, p_row1,
        NUM_MEMBERS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
        IEEE: tl.constexpr, PAIRED: tl.constexpr,
    ):  # fmt: skip
        tile, split, r_block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        if PAIRED:  # programs past segment 0's tiles work on segment 1 (see `lora_delta_pair`)
            seg = (tile >= num_tiles0).to(tl.int32)  # 0 / 1; integers select by arithmetic
            tile -= seg * num_tiles0
            stride_xm += seg * (stride_xm1 - stride_xm)
            partial_ptr += (seg * p_row1).to(tl.int64) * stride_pm  # segment 1's rows follow segment 0's
            if seg == 1:  # pointers by a scalar branch (same pointer types on both sides)
                x_ptr, a_ptr, tiles_ptr, scaling_ptr = x1_ptr, a1_ptr, tiles1_ptr, scaling1_ptr
        slot = tl.load(tiles_ptr + 3 * tile + 2)
        active = tl.abs(tl.load(scaling_ptr + slot))
        for m in tl.static_range(1, NUM_MEMBERS):
            active += tl.abs(tl.load(scaling_ptr + m * stride_s_member + slot))
        if active == 0.0:
            return
        start, end = tl.load(tiles_ptr + 3 * tile), tl.load(tiles_ptr + 3 * tile + 1)
        rows = (start + tl.arange(0, BLOCK_M)).to(tl.int64)
        rs = r_block * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok, r_ok = rows < end, rs < RT
        a_base = a_ptr + (slot - 1).to(tl.int64) * stride_a_slot
        k_start = split * k_per_split
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k in range(0, k_per_split, BLOCK_K):
            ks = k_start + k + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            x = tl.load(
                x_ptr + rows[:, None] * stride_xm + ks[None, :],
                mask=row_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            a = tl.load(
                a_base + rs[None, :] * stride_a_r + ks[:, None], mask=k_ok[:, None] & r_ok[None, :], other=0.0
            )
            if IEEE:  # fp32 activations: true fp32 products (no TF32), as torch's default
                acc = tl.dot(x, a, acc, input_precision="ieee")
            else:
                acc = tl.dot(x, a, acc)
        out = partial_ptr + split * stride_p_split + rows[:, None] * stride_pm + rs[None, :]
        tl.store(out, acc.to(partial_ptr.dtype.element_ty), mask=row_ok[:, None] & r_ok[None, :])

    @triton.jit
    def expand_kernel(
        partial_ptr, b_ptr, out_ptr, tiles_ptr, scales_ptr, scaling_ptr, N, R,
        stride_p_split, stride_pm, stride_b_slot, stride_b_n, stride_om, stride_s_member,
        num_tiles0, b1_ptr, out1_ptr, tiles1_ptr, scales1_ptr, scaling1_ptr, stride_om1, p_row1,
        SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
        N_CHUNKS: tl.constexpr, ONE_R_BLOCK: tl.constexpr, IEEE: tl.constexpr, PAIRED: tl.constexpr,
        ACTIVATION: tl.constexpr, INTERPRETED: tl.constexpr,
    ):  # fmt: skip
        tile, n_prog, member = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        if PAIRED:  # as in the shrink
            seg = (tile >= num_tiles0).to(tl.int32)
            tile -= seg * num_tiles0
            stride_om += seg * (stride_om1 - stride_om)
            partial_ptr += (seg * p_row1).to(tl.int64) * stride_pm
            if seg == 1:
                b_ptr, out_ptr, tiles_ptr = b1_ptr, out1_ptr, tiles1_ptr
                scales_ptr, scaling_ptr = scales1_ptr, scaling1_ptr
        slot = tl.load(tiles_ptr + 3 * tile + 2)
        scaling = tl.load(scaling_ptr + member * stride_s_member + slot)
        if ACTIVATION == 0:  # noqa: SIM102 (a compile-time branch around a runtime one)
            if scaling == 0.0:
                return
        out_dtype = out_ptr.dtype.element_ty
        scale = tl.load(scales_ptr + tile) * scaling
        start, end = tl.load(tiles_ptr + 3 * tile), tl.load(tiles_ptr + 3 * tile + 1)
        if ACTIVATION != 0:  # noqa: SIM102 (as above)
            if end <= start:  # a graph's spare table entry: no rows, nothing to activate
                return
        rows = (start + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_ok = rows < end
        # with an activation every tile's rows get it, those without this member's delta too: for them
        # no partial (never written: the shrink skipped the tile) and no column of B is read, so the
        # delta is zeros. Masks on rows and columns, never on the rank: the bound R along the loads'
        # contiguous axis keeps them vectorised (NOTE(perf): a runtime rank bound there made every
        # expand ~1.9x slower)
        has_delta = (scaling != 0.0).to(tl.int32)
        delta_ok = rows < start + (end - start) * has_delta
        n_delta = N * has_delta
        p_base = partial_ptr + rows[:, None] * stride_pm + member * R  # the member's shrink columns
        b_base = b_ptr + (slot - 1).to(tl.int64) * stride_b_slot + (member * N).to(tl.int64) * stride_b_n
        o_base = out_ptr + rows[:, None] * stride_om + member * N  # the member's output columns
        if ONE_R_BLOCK:  # the member's whole rank in one block: sum the partials once
            rs = tl.arange(0, BLOCK_R)
            r_ok = rs < R
            shrunk = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            for split in tl.static_range(SPLIT_K):  # a fixed order: deterministic bits
                p = p_base + split * stride_p_split + rs[None, :]
                shrunk += tl.load(p, mask=delta_ok[:, None] & r_ok[None, :], other=0.0).to(tl.float32)
            shrunk = shrunk.to(b_ptr.dtype.element_ty)  # the activation dtype, as the shrink GEMM's output
        for c in range(N_CHUNKS):
            ns = (n_prog * N_CHUNKS + c) * BLOCK_N + tl.arange(0, BLOCK_N)
            n_ok = ns < N
            if ONE_R_BLOCK:
                b_mask = r_ok[:, None] & (ns < n_delta)[None, :]
                b = tl.load(b_base + ns[None, :] * stride_b_n + rs[:, None], mask=b_mask, other=0.0)
                if IEEE:
                    acc = tl.dot(shrunk, b, input_precision="ieee")
                else:
                    acc = tl.dot(shrunk, b)
            else:  # a rank past one block: the partials are summed per column block
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for r in range(0, R, BLOCK_R):
                    rs = r + tl.arange(0, BLOCK_R)
                    r_ok = rs < R
                    shrunk = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
                    for split in tl.static_range(SPLIT_K):
                        p = p_base + split * stride_p_split + rs[None, :]
                        shrunk += tl.load(p, mask=delta_ok[:, None] & r_ok[None, :], other=0.0).to(tl.float32)
                    shrunk = shrunk.to(b_ptr.dtype.element_ty)
                    b = tl.load(
                        b_base + ns[None, :] * stride_b_n + rs[:, None],
                        mask=r_ok[:, None] & (ns < n_delta)[None, :],
                        other=0.0,
                    )
                    if IEEE:
                        acc = tl.dot(shrunk, b, acc, input_precision="ieee")
                    else:
                        acc = tl.dot(shrunk, b, acc)
            mask = row_ok[:, None] & n_ok[None, :]
            y = tl.load(o_base + ns[None, :], mask=mask, other=0.0).to(tl.float32) + scale * acc
            y = y.to(out_dtype)
            if ACTIVATION != 0:  # "gelu_tanh" of the output rounded to its dtype, as the layer's F.gelu;
                # code 2: with the hardware tanh (GELU_TANH_APPROX)
                y = fp8_triton.gelu_tanh_fp32(y.to(tl.float32), INTERPRETED, ACTIVATION == 2).to(out_dtype)
            tl.store(o_base + ns[None, :], y, mask=mask)

    return shrink_kernel, expand_kernel


def _activation_code(activation: str | None) -> int:
    """The expand kernel's ACTIVATION for `activation` (0 none, 1 exact GELU, 2 hardware-tanh GELU)."""
    code = ACTIVATIONS[activation]
    return 2 if code == 1 and GELU_TANH_APPROX else code


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _block(n: int, low: int, high: int) -> int:
    """The power of two >= n, clamped to [low, high] (tl.dot needs >= 16 on every side)."""
    return max(low, min(high, 1 << max(n - 1, 0).bit_length()))


def _num_warps(acc_elems: int) -> int:
    return max(4, min(8, _block(acc_elems // (32 * ACC_PER_THREAD), 1, 8)))


@dataclasses.dataclass(frozen=True)
class DeltaLaunch:
    """The launch shapes of one `lora_delta` call (functions of shapes only: graph-safe, and the same
    for a graph's replay and the eager call over the same tables)."""

    block_m: int
    """Rows per program: the tables' tile size (batch.TILE_ROWS)."""
    block_k: int
    block_r: int
    """Shrink columns per program (of the M R stacked ones)."""
    r_blocks: int
    split_k: int
    k_per_split: int
    shrink_warps: int
    block_n: int
    expand_block_r: int
    n_chunks: int
    """Column blocks per expand program."""
    n_programs: int
    """Expand programs per tile and member."""
    expand_warps: int


def plan_delta(
    num_tiles: int,
    num_members: int,
    k: int,
    n: int,
    r: int,
    elem_size: int,
    *,
    work_tiles: int | None = None,
    block_m: int | None = None,
    split_k: int | None = None,
    n_chunks: int | None = None,
) -> DeltaLaunch:
    """The launch shapes for a table of `num_tiles` over `num_members` linears of in_features `k`,
    out_features `n` each and padded rank `r` (see the constants above). `work_tiles`: how many of the
    tiles hold rows (default all; see `working_tiles`): the column blocks an expand program loops
    over are sized for them, since spare entries' programs return at once. `block_m`, `split_k`,
    `n_chunks` override the heuristics (tests, the kernel benchmark's sweeps)."""
    from vllm_omni.lora.batch import TILE_ROWS

    block_m = block_m or TILE_ROWS
    rt = num_members * r
    block_r = _block(rt, 16, SHRINK_MAX_BLOCK_R)
    r_blocks = _cdiv(rt, block_r)
    block_k = _block(k, 16, 128)
    while block_k > 16 and (block_m + block_r) * block_k * elem_size > SHRINK_STAGE_BYTES:
        block_k //= 2
    if split_k is None:
        # bytes of a tile's shrink (its x rows and the stacked A) against one split's partials, which
        # every expand program of the tile reads (see MAX_SPLIT_K); one wave; MIN_K_STEPS per split
        shrink_bytes, partial_bytes = (block_m + rt) * k * elem_size, block_m * r * 4
        split_k = min(MAX_SPLIT_K, math.isqrt(shrink_bytes // partial_bytes))
        split_k = min(split_k, TARGET_SHRINK_PROGRAMS // (num_tiles * r_blocks), k // (MIN_K_STEPS * block_k))
        split_k = max(1, split_k)
    k_per_split = _cdiv(_cdiv(k, split_k), block_k) * block_k
    split_k = _cdiv(k, k_per_split)  # no empty split
    block_n = _block(n, 16, EXPAND_BLOCK_N)
    expand_block_r = _block(r, 16, EXPAND_MAX_BLOCK_R)
    n_blocks = _cdiv(n, block_n)
    if n_chunks is None:
        busy = num_tiles if work_tiles is None else min(work_tiles, num_tiles)
        n_chunks = busy * num_members * n_blocks // TARGET_EXPAND_PROGRAMS
        n_chunks = max(1, min(MAX_EXPAND_CHUNKS, n_chunks))
    n_chunks = min(n_chunks, n_blocks)
    return DeltaLaunch(
        block_m, block_k, block_r, r_blocks, split_k, k_per_split, _num_warps(block_m * block_r),
        block_n, expand_block_r, n_chunks, _cdiv(n_blocks, n_chunks), _num_warps(block_m * block_n),
    )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class KernelDelta:
    """What one segment of a delta launch reads and writes: a linear's (or a merged group's) rows, its
    output and its slot stacks, as `lora_delta` takes them (see its arguments)."""

    x2d: torch.Tensor
    """[rows, in] activation rows (unit column stride)."""
    out2d: torch.Tensor
    """[rows, num_members * out] the base GEMM's output, written in place (unit column stride)."""
    lora_a: torch.Tensor
    """[max_loras, num_members * R, in]."""
    lora_b: torch.Tensor
    """[max_loras, num_members * out, R]."""
    scaling: torch.Tensor
    """fp32 [max_loras + 1] or [num_members, max_loras + 1]."""
    tiles: torch.Tensor
    """int32 [T, 3] (start, end, slot) of the stream's rows."""
    scales: torch.Tensor
    """fp32 [T]."""
    activation: str | None = None
    """An activation the expand applies to the whole output after the deltas (`ACTIVATIONS`: the
    MLP up projection's GELU, saving its own pass over the output), or None. Then every output row
    must lie in a tile (batch.py's tables cover every row of a forward; rows of no adapter are slot 0
    tiles, which get only the activation)."""

    @property
    def num_members(self) -> int:
        return self.scaling.shape[0] if self.scaling.dim() == 2 else 1

    def check(self) -> None:
        """ValueError unless the stacks are those of `num_members` linears over x2d and out2d, and the
        activation is one the expand knows."""
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"lora_delta: activation {self.activation!r} is not one of {list(ACTIVATIONS)}")
        num_members, r = self.num_members, self.lora_b.shape[2]
        n = self.lora_b.shape[1] // num_members
        if self.lora_a.shape[1] != num_members * r or self.out2d.shape[1] != num_members * n:
            raise ValueError(
                f"lora_delta: A {list(self.lora_a.shape)}, B {list(self.lora_b.shape)}, out "
                f"{list(self.out2d.shape)} are not the stacks of {num_members} linears"
            )


def can_pair(first: KernelDelta, second: KernelDelta) -> bool:
    """Whether one launch pair can serve both segments: the same stack shapes, strides and dtypes (the
    kernels read both segments' stacks with one set of strides and one plan), on one device."""
    return (
        first.num_members == second.num_members
        and first.activation == second.activation
        and first.x2d.shape[1] == second.x2d.shape[1]
        and first.out2d.shape[1] == second.out2d.shape[1]
        and all(
            getattr(first, name).shape == getattr(second, name).shape
            and getattr(first, name).stride() == getattr(second, name).stride()
            for name in ("lora_a", "lora_b", "scaling")
        )
        and len({t.dtype for t in (first.x2d, first.out2d, first.lora_a, second.x2d, second.out2d)}) == 1
        and first.x2d.device == second.x2d.device
    )


def lora_delta(
    x2d: torch.Tensor,
    out2d: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: torch.Tensor,
    tiles: torch.Tensor,
    scales: torch.Tensor,
    plan: DeltaLaunch | None = None,
    activation: str | None = None,
) -> None:
    """out2d += the slot deltas of `tiles` (see the module docstring), in place, in two launches;
    with an `activation`, out2d = activation(out2d + deltas) (`KernelDelta.activation`).

    Args:
        x2d: [M_rows, in] activation rows (unit column stride).
        out2d: [M_rows, num_members * out] (unit column stride, any row stride: a fused GEMM's columns).
        lora_a: [max_loras, num_members * R, in], lora_b: [max_loras, num_members * out, R]: slot s at
            index s - 1, x2d's dtype, unit last stride (a member's view of a group's stacks is fine);
            R a multiple of 16.
        scaling: fp32 [max_loras + 1] (one linear) or [num_members, max_loras + 1] (a merged group):
            each member's alpha / rank of the adapter in slot s, 0 for none (contiguous rows).
        tiles: int32 [T, 3] (start, end, slot), at most `plan.block_m` rows each; scales: fp32 [T].
        plan: launch shapes (default: `plan_delta`'s for these shapes).
    """
    _launch(KernelDelta(x2d, out2d, lora_a, lora_b, scaling, tiles, scales, activation), None, plan)


def lora_delta_segment(delta: KernelDelta) -> None:
    """`lora_delta` over a segment already built (`KernelDelta`); through `lora_delta` itself, looked
    up at the call, so a test that wraps it sees every single-segment launch."""
    d = delta
    lora_delta(d.x2d, d.out2d, d.lora_a, d.lora_b, d.scaling, d.tiles, d.scales, activation=d.activation)


paired_launch_failed = False
"""Set when the paired launch raised once (`lora_delta_pair`): the process launches per stream after."""


def lora_delta_pair(first: KernelDelta, second: KernelDelta, plan: DeltaLaunch | None = None) -> None:
    """Both segments' deltas (each as `lora_delta` would add it) in ONE launch pair, when `can_pair`;
    else two `lora_delta` calls. The grids run first's tiles, then second's:

        shrink / expand grid axis 0   | first.tiles: 0 .. T0 - 1 | second.tiles: T0 .. T0 + T1 - 1 |
        partials rows [split, ., MR]  | first's rows 0 .. rows0  | second's rows0 .. rows0 + rows1 |

    so the launch shapes are `plan_delta(T0 + T1, ...)`'s: functions of the tables' sizes and the
    stacks' shapes only (graph-safe). A tile's bits are those of its own `lora_delta` under the same
    plan (the programs of one segment never read the other's rows); a default plan may differ from
    the one a single segment gets (more tiles: fewer splits), hence tolerances, not bits, against two
    separate calls.
    """
    global paired_launch_failed
    if not paired_launch_failed and can_pair(first, second):
        try:
            _launch(first, second, plan)
            return
        except Exception:
            # NOTE(lora): a compile or resource error of the paired kernels (they reach the GPU's Triton
            # first in the graphs' eager warm-up, before any capture): the shrink may have written
            # partials, never an output, so two unpaired launches give the right result
            paired_launch_failed = True
            logger.exception("the paired LoRA delta kernels failed; each stream launches its own from now")
    _launch(first, None, plan)
    _launch(second, None, plan)


def working_tiles(segments: tuple[KernelDelta, ...]) -> int:
    """The tiles a launch's expand is planned for: per segment its table's entries, capped at the tiles
    its rows fill (ceil(rows / TILE_ROWS); runs' partial tiles can add a few, so this sizes the plan
    and bounds nothing: the grid still covers every entry). A CUDA graph's static tables
    (batch.max_tiles) hold a spare entry for every run a bucket may have but one, whose programs
    return at once. Planned by the entries (then one spare per run), a 256-row image + 64-row text
    graph (9 entries, 5 tiles with rows) gave the q/k/v and MLP up expands 4 and 6 column blocks a
    program instead of 2 and 3, so half the SMs idled while each program looped (a block's deltas
    ~15 % slower). Shapes only: graph-safe; and no bits
    change (each column block is computed as before, only fewer to a program)."""
    from vllm_omni.lora.batch import TILE_ROWS

    return sum(min(d.tiles.shape[0], _cdiv(d.out2d.shape[0], TILE_ROWS)) for d in segments)


def _launch(first: KernelDelta, second: KernelDelta | None, plan: DeltaLaunch | None) -> None:
    """The launch pair over `first`'s tiles, then `second`'s (None: one segment, the unpaired kernels)."""
    segments = (first,) if second is None else (first, second)
    num_tiles = sum(d.tiles.shape[0] for d in segments)
    if num_tiles == 0:
        return
    for d in segments:
        d.check()
    x2d, lora_a, lora_b, scaling = first.x2d, first.lora_a, first.lora_b, first.scaling
    num_members, (num_rows0, k), r = first.num_members, x2d.shape, lora_b.shape[2]
    n = lora_b.shape[1] // num_members
    if plan is None:
        work = working_tiles(segments)
        plan = plan_delta(num_tiles, num_members, k, n, r, x2d.element_size(), work_tiles=work)
    shrink_kernel, expand_kernel = _kernels()
    stride_s = scaling.stride(0) if scaling.dim() == 2 else 0
    num_rows = num_rows0 + (second.x2d.shape[0] if second is not None else 0)
    # [split, rows of both segments, num_members * R] fp32
    ieee = x2d.dtype == torch.float32
    partial_dtype = torch.float32 if PARTIALS_FP32 or ieee else x2d.dtype
    partial = torch.empty(plan.split_k, num_rows, num_members * r, dtype=partial_dtype, device=x2d.device)
    # segment 1's arguments (the first's again and zero counts when unpaired: the kernels then never
    # read them, and constant counts add no specialisations of the unpaired kernels)
    other = second if second is not None else first
    num_tiles0, p_row1 = (first.tiles.shape[0], num_rows0) if second is not None else (0, 0)
    shrink_kernel[(num_tiles, plan.split_k, plan.r_blocks)](
        x2d, lora_a, partial, first.tiles, scaling, k, num_members * r, plan.k_per_split,
        x2d.stride(0), lora_a.stride(0), lora_a.stride(1), partial.stride(0), partial.stride(1), stride_s,
        num_tiles0, other.x2d, other.lora_a, other.tiles, other.scaling, other.x2d.stride(0), p_row1,
        NUM_MEMBERS=num_members, BLOCK_M=plan.block_m, BLOCK_R=plan.block_r, BLOCK_K=plan.block_k,
        IEEE=ieee, PAIRED=second is not None, num_warps=plan.shrink_warps,
    )  # fmt: skip
    expand_kernel[(num_tiles, plan.n_programs, num_members)](
        partial, lora_b, first.out2d, first.tiles, first.scales, scaling, n, r,
        partial.stride(0), partial.stride(1), lora_b.stride(0), lora_b.stride(1), first.out2d.stride(0),
        stride_s,
        num_tiles0, other.lora_b, other.out2d, other.tiles, other.scales, other.scaling,
        other.out2d.stride(0), p_row1,
        SPLIT_K=plan.split_k, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_R=plan.expand_block_r,
        N_CHUNKS=plan.n_chunks, ONE_R_BLOCK=r <= plan.expand_block_r, IEEE=ieee, PAIRED=second is not None,
        ACTIVATION=_activation_code(first.activation), INTERPRETED=fp8_triton.interpreted(),
        num_warps=plan.expand_warps,
    )  # fmt: skip

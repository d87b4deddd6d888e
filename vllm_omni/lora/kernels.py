"""Triton kernels of the slot LoRA delta on CUDA (punica's shrink / expand, over our tile tables).

For every tile of a row stream's table (batch.py: rows [start, end) of one run, its slot, its scale):

    out[rows] += scale * scaling[slot] * (x[rows] @ A[slot]^T) @ B[slot]^T

in two kernels per linear:

    shrink  grid (tiles, split_k, rank blocks)   partial[split, rows, r] = x[rows, ks] @ A[slot, r, ks]^T
                                                 (fp32; ks = the split's share of in_features)
    expand  grid (tiles, out blocks)             out[rows, n] += scale * scaling[slot] *
                                                 partial[:, rows].sum(0).to(dtype) @ B[slot, n]^T

A tile whose slot holds no adapter on this linear (`scaling[slot] == 0`: slot 0, "no adapter", or an
adapter that does not target this linear) returns at once: its rows cost nothing but the launch.
The expand sums the split-K partials in a fixed order (no atomics), so a tile's bits depend only on
the launch's shapes and the tile's own rows: a replayed graph gives the eager call's bits for the same
tables. Launch shapes depend only on the table size, the linear and the slot stacks, never on what
the tables hold, which is what lets a CUDA graph capture them.
"""

from __future__ import annotations

import functools

import torch

MAX_SPLIT_K = 8
TARGET_PROGRAMS = 264
"""Shrink programs aimed for (two per SM of an H200): small tables split in_features to get there."""


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
        x_ptr, a_ptr, partial_ptr, tiles_ptr, scaling_ptr, K, R, k_per_split,
        stride_xm, stride_a_slot, stride_a_r, stride_p_split, stride_pm,
        BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
    ):  # fmt: skip
        tile, split, r_block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        slot = tl.load(tiles_ptr + 3 * tile + 2)
        if tl.load(scaling_ptr + slot) == 0.0:
            return
        start, end = tl.load(tiles_ptr + 3 * tile), tl.load(tiles_ptr + 3 * tile + 1)
        rows = (start + tl.arange(0, BLOCK_M)).to(tl.int64)
        rs = r_block * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok, r_ok = rows < end, rs < R
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
        tl.store(out, acc, mask=row_ok[:, None] & r_ok[None, :])

    @triton.jit
    def expand_kernel(
        partial_ptr, b_ptr, out_ptr, tiles_ptr, scales_ptr, scaling_ptr, N, R,
        stride_p_split, stride_pm, stride_b_slot, stride_b_n, stride_om,
        SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
        IEEE: tl.constexpr,
    ):  # fmt: skip
        tile, n_block = tl.program_id(0), tl.program_id(1)
        slot = tl.load(tiles_ptr + 3 * tile + 2)
        scaling = tl.load(scaling_ptr + slot)
        if scaling == 0.0:
            return
        scale = tl.load(scales_ptr + tile) * scaling
        start, end = tl.load(tiles_ptr + 3 * tile), tl.load(tiles_ptr + 3 * tile + 1)
        rows = (start + tl.arange(0, BLOCK_M)).to(tl.int64)
        ns = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok, n_ok = rows < end, ns < N
        b_base = b_ptr + (slot - 1).to(tl.int64) * stride_b_slot
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for r in range(0, R, BLOCK_R):
            rs = r + tl.arange(0, BLOCK_R)
            r_ok = rs < R
            mask = row_ok[:, None] & r_ok[None, :]
            shrunk = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            for split in tl.static_range(SPLIT_K):  # a fixed order: deterministic bits
                p = partial_ptr + split * stride_p_split + rows[:, None] * stride_pm + rs[None, :]
                shrunk += tl.load(p, mask=mask, other=0.0)
            shrunk = shrunk.to(b_ptr.dtype.element_ty)  # the activation dtype, as the shrink GEMM's output
            b = tl.load(
                b_base + ns[None, :] * stride_b_n + rs[:, None], mask=r_ok[:, None] & n_ok[None, :], other=0.0
            )
            if IEEE:
                acc = tl.dot(shrunk, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(shrunk, b, acc)
        out = out_ptr + rows[:, None] * stride_om + ns[None, :]
        mask = row_ok[:, None] & n_ok[None, :]
        y = tl.load(out, mask=mask, other=0.0).to(tl.float32) + scale * acc
        tl.store(out, y.to(out_ptr.dtype.element_ty), mask=mask)

    return shrink_kernel, expand_kernel


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _block(n: int, low: int, high: int) -> int:
    """The power of two >= n, clamped to [low, high] (tl.dot needs >= 16 on every side)."""
    return max(low, min(high, 1 << max(n - 1, 0).bit_length()))


def lora_delta(
    x2d: torch.Tensor,
    out2d: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: torch.Tensor,
    tiles: torch.Tensor,
    scales: torch.Tensor,
) -> None:
    """out2d += the slot deltas of `tiles` (see the module docstring), in place.

    Args:
        x2d: [M, in] activation rows (unit column stride).
        out2d: [M, out] (unit column stride, any row stride: a fused GEMM's columns).
        lora_a: [max_loras, R, in], lora_b: [max_loras, out, R]: slot s at index s - 1, contiguous,
            x2d's dtype; R a multiple of 16.
        scaling: fp32 [max_loras + 1]: each slot's alpha / rank on this linear, 0 for none.
        tiles: int32 [T, 3] (start, end, slot), at most `batch.TILE_ROWS` rows each; scales: fp32 [T].
    """
    from vllm_omni.lora.batch import TILE_ROWS

    num_tiles = tiles.shape[0]
    if num_tiles == 0:
        return
    shrink_kernel, expand_kernel = _kernels()
    (num_rows, k), n, r = x2d.shape, out2d.shape[1], lora_a.shape[1]
    block_k, block_r, block_n = _block(k, 16, 64), _block(r, 16, 64), _block(n, 16, 128)
    r_blocks = _cdiv(r, block_r)
    # split in_features while the table is small (a 256x256 image: 8 tiles), keeping >= 2 K-steps each
    split_k = max(1, min(MAX_SPLIT_K, TARGET_PROGRAMS // (num_tiles * r_blocks), _cdiv(k, 2 * block_k)))
    k_per_split = _cdiv(_cdiv(k, split_k), block_k) * block_k
    split_k = _cdiv(k, k_per_split)
    partial = torch.empty(split_k, num_rows, r, dtype=torch.float32, device=x2d.device)  # [split, M, R]
    ieee = x2d.dtype == torch.float32
    shrink_kernel[(num_tiles, split_k, r_blocks)](
        x2d, lora_a, partial, tiles, scaling, k, r, k_per_split,
        x2d.stride(0), lora_a.stride(0), lora_a.stride(1), partial.stride(0), partial.stride(1),
        BLOCK_M=TILE_ROWS, BLOCK_R=block_r, BLOCK_K=block_k, IEEE=ieee,
    )  # fmt: skip
    expand_kernel[(num_tiles, _cdiv(n, block_n))](
        partial, lora_b, out2d, tiles, scales, scaling, n, r,
        partial.stride(0), partial.stride(1), lora_b.stride(0), lora_b.stride(1), out2d.stride(0),
        SPLIT_K=split_k, BLOCK_M=TILE_ROWS, BLOCK_N=block_n, BLOCK_R=block_r, IEEE=ieee,
    )  # fmt: skip

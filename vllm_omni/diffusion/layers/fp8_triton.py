"""Per-row FP8 quantisation of activations in Triton: `fp8.quantize_rows` in one pass, alone or fused.

    quantize_rows            x [M, K] (bf16 / fp16 / fp32; strided rows)  ->  q [M, K] e4m3, scale [M, 1] fp32
    gelu_tanh_quantize_rows  h [M, K] (the MLP up projection's output)   ->  quantize_rows(gelu_tanh(h))

One program per row holds the whole row in registers: it loads the row once, takes its amax, and
stores the e4m3 row and its scale (`store_e4m3_row`, which a producer kernel elsewhere, such as the
Qwen-Image LayerNorm kernels, also ends with to emit an `fp8.Fp8Activation`). The torch version runs
about six passes over the activations (float, abs, amax, divide, clamp, cast): that costs more than
the FP8 GEMM saves for the out and down projections (docs/quantization.md). The GELU kernel
computes torch's CUDA GELU (tanh approximation) in fp32 and rounds it to h's dtype in registers
before quantising. A row of 1 to 4 power-of-two chunks (the MLP's 12288 columns: 3 x 4096) stays whole in
registers, one chunk variable each (`resident_plan`): h read once, every tanh computed once, no masked
lanes. Other rows go `GELU_BLOCK_K` columns at a time, twice (the amax, then the codes, the GELU
recomputed from h, which the first pass left in cache). Either way the down projection's input costs
one read of the up output from memory, not a GELU pass plus a quantisation pass. Whether the model
uses it is `GELUTanhProj.fuse_fp8` (the first, power-of-two whole-row version and the two-pass one were
slower than `F.gelu` + `quantize_rows`).

The arithmetic is `quantize_rows`'s, so the results are bit for bit the same:
    scale = max(amax / 448, 1e-12)                  IEEE division (`div_rn`; triton's `/` approximates)
    inv   = 1 / scale                               IEEE, once per row
    q     = e4m3(clamp(x * inv, -448, 448))         round to nearest even

The first version divided every element (`div_rn`): compute-bound, enough to cancel the FP8 GEMM's
gain on the out projection; a multiply per element leaves the loads and stores.

NOTE(fp8): on the GPU the cast rounds to nearest even (cvt.rn.satfinite). triton's CPU interpreter
(TRITON_INTERPRET=1, the CPU test) truncates instead (31.3 came out as 16), so under the interpreter
the kernel rounds to the e4m3 grid itself first (`_round_to_e4m3`, `EXPLICIT_ROUND`) and the cast
only re-encodes an exact value: both agree with torch bit for bit. The interpreter has no libdevice
either, so there the GELU kernel's tanh goes through exp (close to torch's, not bit-equal; on the GPU
it is libdevice's tanhf, bit-equal to `F.gelu`: tests/test_fp8_gpu.py).

Nothing here reads a device value on the host: it captures in a CUDA graph.
"""

from __future__ import annotations

import functools
import os

import torch

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # CPU wheels of torch come without triton
    triton = None


@functools.cache
def available() -> bool:
    """Whether the kernels can serve CUDA tensors here (triton importable, a GPU present)."""
    return triton is not None and torch.cuda.is_available()


def serves(x: torch.Tensor) -> bool:
    """Whether a fused FP8 producer kernel (here, or a model's norm kernels) runs for `x`: a CUDA tensor
    with triton. Elsewhere the unfused path runs (the tests force this on CPU under the interpreter)."""
    return x.is_cuda and available()


if triton is not None:

    @triton.jit
    def _round_to_e4m3(v):
        """fp32 `v` (|v| <= 448) rounded to nearest even on the e4m3 grid, still fp32 (exact in e4m3).

        normals (|v| >= 2^-6): keep 3 of the 23 mantissa bits, carrying into the exponent;
        subnormals: multiples of 2^-9 (adding then subtracting 1.5 * 2^14 rounds there).
        The sign is put back last, so a negative value that rounds to zero stays -0 (as torch's cast)."""
        bits = v.to(tl.uint32, bitcast=True)
        sign = bits & 0x80000000
        mag = bits & 0x7FFFFFFF
        normal = (mag + 0x7FFFF + ((mag >> 20) & 1)) & 0xFFF00000
        a = mag.to(tl.float32, bitcast=True)
        subnormal = ((a + 24576.0) - 24576.0).to(tl.uint32, bitcast=True)
        rounded = tl.where(a < 0.015625, subnormal, normal)
        return (rounded | sign).to(tl.float32, bitcast=True)

    @triton.jit
    def _row_scale(amax):
        """A row's scale and its reciprocal from its amax (`fp8.quantize_rows`' operations)."""
        scale = tl.maximum(tl.math.div_rn(amax, 448.0), 1e-12)
        return scale, tl.math.div_rn(1.0, scale)

    @triton.jit
    def _store_e4m3(x, inv_scale, q_ptrs, mask, EXPLICIT_ROUND: tl.constexpr):
        """x (fp32) times the row's reciprocal scale, clamped and stored as e4m3 codes."""
        q = tl.clamp(x * inv_scale, -448.0, 448.0)
        if EXPLICIT_ROUND:
            q = _round_to_e4m3(q)
        tl.store(q_ptrs, q.to(tl.float8e4nv), mask=mask)

    @triton.jit
    def store_e4m3_row(x, q_ptrs, mask, scale_ptr, EXPLICIT_ROUND: tl.constexpr):
        """Quantise one row held in registers (`x` fp32 [BLOCK], 0 in masked lanes): its e4m3 codes
        to `q_ptrs` and its scale to `scale_ptr`, with `fp8.quantize_rows`' operations (module docstring).
        Every kernel that holds a whole row and emits an `Fp8Activation` ends with this."""
        scale, inv_scale = _row_scale(tl.max(tl.abs(x), axis=0))
        _store_e4m3(x, inv_scale, q_ptrs, mask, EXPLICIT_ROUND)
        tl.store(scale_ptr, scale)

    @triton.jit
    def _quantize_rows_kernel(
        x_ptr, q_ptr, scale_ptr, K, stride_x, BLOCK_K: tl.constexpr, EXPLICIT_ROUND: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_K)
        mask = cols < K
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_K]
        store_e4m3_row(x, q_ptr + row * K + cols, mask, scale_ptr + row, EXPLICIT_ROUND)

    @triton.jit
    def gelu_tanh_fp32(h, INTERPRETED: tl.constexpr, APPROX_TANH: tl.constexpr):
        """torch's CUDA GELU (tanh approximation) of fp32 values `h`, in fp32 (any shape): the operations
        of `F.gelu(h, approximate="tanh")`, so rounding the result to h's storage dtype gives its bits.
        With APPROX_TANH the tanh is the GPU's tanh.approx.f32 (one MUFU instruction, relative error
        below 2^-10.9) instead of libdevice's tanhf (~20 dependent instructions): for a GELU applied by
        few threads (the LoRA expand's epilogue, vllm_omni/lora/kernels.py), where the exact tanh is
        compute latency. Not bit-equal to `F.gelu` then (rounded to bf16, ~1 ulp on some elements), as
        cuBLASLt's GELU epilogue is not."""
        # 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))) in fp32
        inner = 0.7978845608028654 * (h + 0.044715 * (h * h * h))
        if INTERPRETED:  # no libdevice, no inline assembly: tanh through exp (not bit-equal to tanhf)
            t = 1.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0)
        elif APPROX_TANH:
            t = tl.inline_asm_elementwise(
                "tanh.approx.f32 $0, $1;", "=r,r", [inner], dtype=tl.float32, is_pure=True, pack=1
            )
        else:
            t = libdevice.tanh(inner)
        return 0.5 * h * (1.0 + t)

    @triton.jit
    def _gelu_tanh_chunk(h_ptr, cols, mask, OUT_DTYPE: tl.constexpr, INTERPRETED: tl.constexpr):
        """torch's CUDA GELU (tanh) of one chunk of a row, in fp32, rounded to OUT_DTYPE (F.gelu's
        output) and back to fp32; 0 in masked lanes."""
        h = tl.load(h_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        g = gelu_tanh_fp32(h, INTERPRETED, False).to(OUT_DTYPE)
        return tl.where(mask, g.to(tl.float32), 0.0)

    @triton.jit
    def _gelu_tanh_kernel(
        h_ptr, out_ptr, scale_ptr, K, stride_h,
        BLOCK_K: tl.constexpr, QUANTIZE: tl.constexpr, INTERPRETED: tl.constexpr,
    ):  # fmt: skip
        # One program per row, BLOCK_K columns at a time. Quantising takes two passes over the row: the
        # first finds the amax of its GELU, the second recomputes the GELU (the same bits) from h, which
        # the first pass left in cache, and stores e4m3 (module docstring: why not the whole row at once).
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_K)
        h_row, out_row = h_ptr + row * stride_h, out_ptr + row * K
        act = h_ptr.dtype.element_ty
        if QUANTIZE:
            amax = tl.zeros((BLOCK_K,), dtype=tl.float32)  # per lane; a max is exact in any order
            for start in range(0, K, BLOCK_K):
                mask = start + cols < K
                g = _gelu_tanh_chunk(h_row + start, cols, mask, act, INTERPRETED)
                amax = tl.maximum(amax, tl.abs(g))
            scale, inv_scale = _row_scale(tl.max(amax, axis=0))
            for start in range(0, K, BLOCK_K):
                mask = start + cols < K
                g = _gelu_tanh_chunk(h_row + start, cols, mask, act, INTERPRETED)
                _store_e4m3(g, inv_scale, out_row + start + cols, mask, INTERPRETED)
            tl.store(scale_ptr + row, scale)
        else:
            for start in range(0, K, BLOCK_K):
                mask = start + cols < K
                g = _gelu_tanh_chunk(h_row + start, cols, mask, act, INTERPRETED)
                tl.store(out_row + start + cols, g.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _gelu_tanh_quantize_resident_kernel(
        h_ptr, q_ptr, scale_ptr, stride_h,
        CHUNK: tl.constexpr, NUM_CHUNKS: tl.constexpr, INTERPRETED: tl.constexpr,
    ):  # fmt: skip
        # One program per row of exactly NUM_CHUNKS * CHUNK columns (1 .. 4 chunks), every chunk's GELU
        # kept in registers: h read once, each tanh computed once, no masked lanes (the MLP's 12288
        # columns are 3 chunks of 4096; a power-of-two block would mask a quarter of 16384).
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, CHUNK)
        full = cols < CHUNK
        h_row, q_row = h_ptr + row * stride_h, q_ptr + row * (CHUNK * NUM_CHUNKS)
        act = h_ptr.dtype.element_ty
        g0 = _gelu_tanh_chunk(h_row, cols, full, act, INTERPRETED)
        amax = tl.max(tl.abs(g0), axis=0)
        if NUM_CHUNKS > 1:
            g1 = _gelu_tanh_chunk(h_row + CHUNK, cols, full, act, INTERPRETED)
            amax = tl.maximum(amax, tl.max(tl.abs(g1), axis=0))
        if NUM_CHUNKS > 2:
            g2 = _gelu_tanh_chunk(h_row + 2 * CHUNK, cols, full, act, INTERPRETED)
            amax = tl.maximum(amax, tl.max(tl.abs(g2), axis=0))
        if NUM_CHUNKS > 3:
            g3 = _gelu_tanh_chunk(h_row + 3 * CHUNK, cols, full, act, INTERPRETED)
            amax = tl.maximum(amax, tl.max(tl.abs(g3), axis=0))
        scale, inv_scale = _row_scale(amax)
        _store_e4m3(g0, inv_scale, q_row + cols, full, INTERPRETED)
        if NUM_CHUNKS > 1:
            _store_e4m3(g1, inv_scale, q_row + CHUNK + cols, full, INTERPRETED)
        if NUM_CHUNKS > 2:
            _store_e4m3(g2, inv_scale, q_row + 2 * CHUNK + cols, full, INTERPRETED)
        if NUM_CHUNKS > 3:
            _store_e4m3(g3, inv_scale, q_row + 3 * CHUNK + cols, full, INTERPRETED)
        tl.store(scale_ptr + row, scale)


RESIDENT_CHUNKS = (4096, 2048, 1024)
"""Chunk sizes (largest first) of the resident GELU + e4m3 kernel: a row of K = n * chunk columns,
n <= 4, is held whole in registers (`resident_plan`); other rows take the two-pass chunked kernel."""

GELU_BLOCK_K = 2048
"""Columns of a row the GELU kernel holds at once (16 fp32 values a thread at 4 warps). NOTE(perf): the
first version held the whole row (16384 lanes for the MLP's 12288 columns, 16 warps, one program an SM
for its registers) and was slower than `F.gelu` plus the quantisation pass. Chunks keep the
registers small and many rows in flight; other chunk sizes were not timed."""


@functools.cache
def interpreted() -> bool:
    """Whether triton runs kernels in its CPU interpreter (its fp8 cast truncates there)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def num_warps_for(block_k: int) -> int:
    """Warps per row: about 32 elements per thread (4 warps at 4096 columns, 16 at 16384)."""
    return max(4, min(16, block_k // 1024))


def quantize_rows(x2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`fp8.quantize_rows` as one kernel: `x2d [M, K]` (columns contiguous, rows at any stride) ->
    (q [M, K] e4m3, scale [M, 1] fp32) with x ~ q * scale. Runs on CUDA, or on CPU tensors under
    triton's interpreter (TRITON_INTERPRET=1)."""
    x2d = _check_rows(x2d)
    rows, cols = x2d.shape
    q = torch.empty((rows, cols), dtype=torch.float8_e4m3fn, device=x2d.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x2d.device)
    if rows:
        block_k = triton.next_power_of_2(cols)
        _quantize_rows_kernel[(rows,)](
            x2d, q, scale, cols, x2d.stride(0), BLOCK_K=block_k, EXPLICIT_ROUND=interpreted(),
            num_warps=num_warps_for(block_k),
        )  # fmt: skip
    return q, scale


def _check_rows(x2d: torch.Tensor) -> torch.Tensor:
    if x2d.dim() != 2:
        raise ValueError(f"the FP8 row kernels take [M, K] rows, got {list(x2d.shape)}")
    return x2d if x2d.stride(1) == 1 else x2d.contiguous()


def resident_plan(cols: int) -> tuple[int, int] | None:
    """(chunk, num_chunks) of the resident GELU + e4m3 kernel for rows of `cols` columns, or None (the
    two-pass chunked kernel serves them)."""
    for chunk in RESIDENT_CHUNKS:
        if cols % chunk == 0 and cols // chunk <= 4:
            return chunk, cols // chunk
    return None


def _gelu_tanh(h2d: torch.Tensor, quantize: bool, resident: bool = True):
    h2d = _check_rows(h2d)
    rows, cols = h2d.shape
    dtype = torch.float8_e4m3fn if quantize else h2d.dtype
    out = torch.empty((rows, cols), dtype=dtype, device=h2d.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=h2d.device)
    plan = resident_plan(cols) if quantize and resident else None
    if rows and plan is not None:
        chunk, num_chunks = plan
        _gelu_tanh_quantize_resident_kernel[(rows,)](
            h2d, out, scale, h2d.stride(0),
            CHUNK=chunk, NUM_CHUNKS=num_chunks, INTERPRETED=interpreted(),
            num_warps=num_warps_for(triton.next_power_of_2(cols)),
        )  # fmt: skip
    elif rows:
        block_k = min(GELU_BLOCK_K, triton.next_power_of_2(cols))
        _gelu_tanh_kernel[(rows,)](
            h2d, out, scale, cols, h2d.stride(0),
            BLOCK_K=block_k, QUANTIZE=quantize, INTERPRETED=interpreted(), num_warps=num_warps_for(block_k),
        )  # fmt: skip
    return out, scale


def gelu_tanh_quantize_rows(h2d: torch.Tensor, resident: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows(F.gelu(h2d, approximate="tanh"))` in one pass: `h2d [M, K]` (the MLP up
    projection's output; columns contiguous, rows at any stride) -> (q [M, K] e4m3, scale [M, 1] fp32).

    The GELU is torch's CUDA formula in fp32, rounded to h's dtype in registers (F.gelu's output)
    before the amax, so on the GPU the result is the unfused path's bit for bit where libdevice's
    tanhf is CUDA's (tests/test_fp8_gpu.py checks). Reads the up output once and writes e4m3: the
    unfused path writes and re-reads the GELU output in h's dtype. Rows whose columns `resident_plan`
    covers (the MLP's 12288) are held whole in registers; `resident=False` forces the two-pass
    chunked kernel (tests, the block benchmark)."""
    return _gelu_tanh(h2d, quantize=True, resident=resident)


def gelu_tanh(h2d: torch.Tensor) -> torch.Tensor:
    """The same kernel's GELU alone, `[M, K]` in h's dtype: the unfused reference of the tests (the
    model runs `F.gelu`)."""
    return _gelu_tanh(h2d, quantize=False)[0]

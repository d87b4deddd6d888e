"""The packed CUDA-graph grid: bucket sizes, which buckets to capture, which one a batch replays in and
when a padded replay pays (the runner: cuda_graphs.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class PackedBucket:
    """Static sizes of one packed graph: rows per stream and real-sequence slots."""

    num_img_rows: int
    num_txt_rows: int
    """Text rows (a family with its own graph step: its second-axis rows, e.g. 2.1's prefix rows)."""
    num_seqs: int
    """Real sequences it takes; one more slot holds the padding sequence."""

    @property
    def total_tokens(self) -> int:
        return self.num_img_rows + self.num_txt_rows

    def fits(self, num_img_rows: int, num_txt_rows: int, num_seqs: int) -> bool:
        return (
            num_img_rows <= self.num_img_rows
            and num_txt_rows <= self.num_txt_rows
            and num_seqs <= self.num_seqs
        )


QUANTIZED_IMG_ROWS = (7168, 8192)
"""Image-row buckets past 6144 for a transformer with quantized (FP8) linears. Its eager forward has
more host work per linear (the activation quantisation) and ~1.4x less GPU time, so where BF16 is
GPU-bound it is host-bound: eager, a 1024x1024 CFG step (8192 image rows) takes well over its kernel
time (docs/quantization.md).
Replayed, the launches cost nothing, and the bucket pads ~1 %."""


@dataclass(frozen=True)
class CudaGraphConfig:
    """Which graphs to capture (like vLLM's cudagraph capture sizes) and when a padded replay pays.

    Why (docs/design/packed_forward.md has the measurements): a replay
    saves the ~100-150 ms of host launches of an eager forward, which matters while the GPU work is not
    much longer than that; past a few thousand tokens padding costs more than the launches saved
    (512+1024 padded 5.2k -> 6.4k tokens: 204 ms replayed vs 182 ms eager), so the grid steps by 1024
    rows from 4096 to 6144, where a batch pads little and eager still shows host time (two 768x1024
    images: 170.6 ms replayed vs 176.0 eager). Larger batches run eager (compiled ops,
    FA3; GPU-bound, launch gaps hidden): even a nearly full 8192-row bucket took a 1024x1024 CFG step
    (8266 -> 8320 tokens) to 238 ms against 231 ms eager. Dense same-shape batches
    replay exact-shape graphs without padding. With FP8 linears the grid goes on to 8192 image rows
    (`QUANTIZED_IMG_ROWS`: that eager forward is host-bound).
    """

    num_seqs: tuple[int, ...] = (1, 2, 4, 8, 16)
    """Sequence-slot buckets (a CFG request takes two)."""
    img_rows: tuple[int, ...] = (256, 512, 1024, 1536, 2048, 3072, 4096, 5120, 6144)
    """Image-row buckets."""
    txt_rows: tuple[int, ...] = (64, 128, 256, 512, 1024, 2048)
    """Text-row buckets (a bucket of s slots takes at most `txt_rows_per_seq` * s text rows). 64: one CFG
    request with a short prompt (~40 text rows) would otherwise pad to 128, 4 % more rows at 512x512.
    A family with its own second axis replaces both (`interface.GraphContextAxis`)."""
    txt_rows_per_seq: int = 512
    """Second-axis rows one sequence slot may bring (prunes buckets no batch can fill)."""
    max_padding: float = 0.25
    """A bucket is used only when its tokens are at most (1 + this) x the batch's real tokens ..."""
    pad_freely_below: int = 2048
    """... or at most this many: below it a forward is launch-bound and padding costs ~nothing."""
    max_dense_graphs: int = 8
    """Dense shapes captured on first use, at most this many; later new shapes run eager."""
    warmup_runs: int = 1
    """Eager runs before each capture (compiles the fused ops, fills caches, settles cuBLAS)."""

    @classmethod
    def for_max_num_seqs(cls, max_num_seqs: int, quantized: bool = False) -> CudaGraphConfig:
        """Sequence-slot buckets up to `2 * max_num_seqs` (every request with CFG), powers of two; with
        `quantized` linears also the image-row buckets of `QUANTIZED_IMG_ROWS`."""
        slots = [1]
        while slots[-1] < 2 * max_num_seqs:
            slots.append(slots[-1] * 2)
        img_rows = cls.img_rows + (QUANTIZED_IMG_ROWS if quantized else ())
        return cls(num_seqs=tuple(slots), img_rows=img_rows)

    def packed_buckets(self) -> list[PackedBucket]:
        """Every bucket of the grid that can hold a batch, largest first (>= 16 image rows and
        <= `txt_rows_per_seq` text rows per slot)."""
        buckets = {
            PackedBucket(img, txt, seqs)
            for seqs in self.num_seqs
            for img in self.img_rows
            for txt in self.txt_rows
            if img >= 16 * seqs and txt <= self.txt_rows_per_seq * seqs
        }
        return sorted(buckets, key=lambda b: (b.total_tokens, b.num_seqs), reverse=True)

    def pays(self, bucket: PackedBucket, real_tokens: int) -> bool:
        """Whether replaying `bucket` for a batch of `real_tokens` beats running it eager."""
        return bucket.total_tokens <= max(real_tokens * (1 + self.max_padding), self.pad_freely_below)


def select_bucket(buckets: list[PackedBucket], num_img_rows: int, num_txt_rows: int, num_seqs: int):
    """The fitting bucket with the fewest tokens (then slots), or None when none fits."""
    fitting = [b for b in buckets if b.fits(num_img_rows, num_txt_rows, num_seqs)]
    return min(fitting, key=lambda b: (b.total_tokens, b.num_seqs), default=None)

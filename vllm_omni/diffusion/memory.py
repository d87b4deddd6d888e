"""What a request needs at its peak, and what the server has for it (why: one allowed request,
`n=10` at 2048x2048, took 21 GB of a 23 GB host while a small request waited behind it).

A request's memory, from admission to its answer::

    latents       its latent rows (`RequestGeometry`: n target grids    on the device, while it denoises
                  + condition rows) x the family's latent row width,
                  and as many velocity rows, in the model dtype
    prefix cache  its prefix rows x `prefix_row_bytes` (Qwen-Image-2.1) on the device, while it denoises
    step cache    per sequence 2 x img rows + txt rows of kept residuals (step caching, `cache_bytes`)
    decode        one VAE call: its own n images, at most              on the device, once, at the end
                  `max_decode_pixels` of them (the n images decode in slices: same pixels, bounded
                  peak; `decode_slices`); same-size requests finishing in one step share the call
    outputs       n decoded images, their PNG and base64               on the host, until answered

The VAE decode dominates: its activations grow with the pixels of one call (about 700 bytes per pixel
for the tiny VAE in fp32, more for the real one), which is why it is sliced. Its cost per pixel is
measured once at start-up with a small probe decode (`measure_decode_bytes_per_pixel`).

`MemoryBudget` holds what the server has and what admitted requests reserved. What it has is
`--gpu-memory-utilization` (default 0.9) of the memory free beside the loaded server, measured at
start-up and again whenever no request holds memory (so memory another process gave back counts, and
memory it took is not promised twice; on CUDA the blocks earlier requests left in PyTorch's cache count
as free, those cached at start-up, such as CUDA graphs' pools, do not). A request that could never
fit is refused (400 naming `n` / `size` and the flags that would make room); one that fits but not
next to the requests already admitted waits in the engine until they finish. Decodes run one call
at a time, so the largest call counts: same-size requests that finish together decode in one call, up
to `max_decode_pixels`.
The prefix KV caches (Qwen-Image-2.1: each request's prompt and reference-image K/V, kept from
admission to its end) count in the same budget, and together under `--kv-cache-memory-bytes` when it
is set: a request whose cache alone is over it is refused (400 naming the flag), one that fits later
waits.

When the pipeline offers a fixed pool of prefix rows (`prefix_arena`, `interface.PrefixRowReservations`:
Qwen-Image-2.1 on CUDA with graphs, sized by `--kv-cache-memory-bytes` or its default), that pool is
the source of truth for the prefixes instead: admission reserves the request's rows in it (one
contiguous block, so fragmentation counts too), a request larger than the whole pool is refused (400
naming the flag), one that does not fit now waits, and the prefix bytes leave the device budget (the
pool was allocated at start-up, before the budget measured what is free).

What start-up allocates is outside the budget, since it measures what is free after the worker is
built: the weights, the prefix arena when there is one, and the CUDA graphs' static buffers and memory
pool (Qwen-Image-2.1 adds one layer's K/V sized for the largest bucket, plus, without an arena, a
prefix store; `PackedStepGraphs.num_bytes`, logged).
"""

from __future__ import annotations

import math
import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vllm_omni.config import OmniDiffusionConfig
from vllm_omni.diffusion.cache.config import CacheConfig
from vllm_omni.diffusion.models.interface import PrefixRowReservations, RequestGeometry
from vllm_omni.inputs import InvalidRequestError, OmniDiffusionSamplingParams

DEFAULT_MAX_DECODE_PIXELS = OmniDiffusionConfig.max_decode_pixels
"""Pixels one VAE decode call may hold (`--max-decode-pixels`; n images decode in slices of whole
images; one image is never split: tiling, `vae_use_tiling`, is what bounds a single huge image)."""
OUTPUT_BYTES_PER_PIXEL = 3 * 4 + 3 + 3 + 4
"""Host bytes per output pixel until the answer is sent: float RGB from the decode (fp32), the uint8
image, its PNG (at most about the raw size) and base64 (4/3 of it)."""
DEFAULT_MEMORY_UTILIZATION = 0.9
"""Share of the free memory that requests may use (`--gpu-memory-utilization`; the rest: allocator
slack, the server itself, other processes' growth)."""
PROBE_SIZE = 64
"""Side of the probe decode that measures the VAE's bytes per pixel."""


def decode_slices(num_images: int, height: int, width: int, max_decode_pixels: int) -> list[int]:
    """Images per VAE call for `num_images` images of `height` x `width`: as many as fit in
    `max_decode_pixels` (at least one), e.g. 10 images of 2048x2048 at 2048x2048 pixels -> [1] * 10."""
    per_call = max(1, max_decode_pixels // (height * width))
    full, rest = divmod(num_images, per_call)
    return [per_call] * full + ([rest] if rest else [])


@dataclass(frozen=True)
class RequestMemory:
    """A request's peak memory, in bytes, by where it lives."""

    device_bytes: int
    """Its latents plus its largest decode slice (the device's peak while it decodes)."""
    host_bytes: int
    """Its decoded images and their encoding (on the host until the answer is sent)."""
    latent_bytes: int
    """The part of `device_bytes` held for its whole life (latents and prefix cache; the rest only
    during its decode)."""
    prefix_bytes: int = 0
    """The part of `latent_bytes` its prefix KV cache holds (`kv_cache_bytes` caps their sum)."""
    decode_size: tuple[int, int] | None = None
    """(height, width) of its images, which same-size requests finishing together decode in one VAE
    call; None: it decodes nothing (latent output)."""
    num_images: int = 0
    """Its images (`num_outputs_per_prompt`)."""
    prefill_bytes: int = 0
    """What filling its prefix holds for a moment beyond the cache (the pipeline's `prefill_peak_bytes`):
    transient like a decode call, and never at the same time as one."""


class TensorPeak(TorchDispatchMode):
    """Peak bytes of the tensors created inside (and still alive), on any device.

    Counts each op's outputs that own their storage (not views), until they are freed; kernels'
    own scratch space is not seen, so callers leave a margin."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._lock = threading.Lock()
        self._seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t._base is None and t.data_ptr() not in self._seen:
                self._count(t)
        return out

    def _count(self, t: torch.Tensor) -> None:
        size, ptr = t.untyped_storage().nbytes(), t.data_ptr()
        with self._lock:
            self._seen.add(ptr)
            self.live += size
            self.peak = max(self.peak, self.live)
        weakref.finalize(t, self._free, ptr, size)

    def _free(self, ptr: int, size: int) -> None:
        with self._lock:
            self._seen.discard(ptr)
            self.live -= size


_DECODE_COST: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""VAE module -> its measured bytes per pixel (engines sharing a pipeline probe once)."""


def latent_row_width(pipeline) -> int:
    """Values per latent row of the family (Qwen-Image: 16 channels x a 2x2 patch = 64), from the
    latents its `prepare_latents` makes for one small image."""
    params = OmniDiffusionSamplingParams(height=PROBE_SIZE, width=PROBE_SIZE, seed=0)
    return int(pipeline.prepare_latents(params, torch.Generator("cpu").manual_seed(0)).shape[-1])


def measure_decode_bytes_per_pixel(pipeline) -> float:
    """The VAE decode's peak bytes per output pixel, from one probe decode of a `PROBE_SIZE` square
    (CUDA: the allocator's peak; elsewhere: the live tensors' peak, `TensorPeak`)."""
    if pipeline.vae not in _DECODE_COST:
        _DECODE_COST[pipeline.vae] = _probe_decode(pipeline)
    return _DECODE_COST[pipeline.vae]


@torch.inference_mode()
def _probe_decode(pipeline) -> float:
    side = PROBE_SIZE
    # the family's own latent layout for one image of this size (rows and channels differ by model)
    params = OmniDiffusionSamplingParams(height=side, width=side, seed=0)
    latents = torch.zeros_like(pipeline.prepare_latents(params, torch.Generator("cpu").manual_seed(0)))
    device = torch.device(pipeline.device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        pipeline.decode(latents, side, side, "np")
        peak = torch.cuda.max_memory_allocated(device) - base
    else:
        with TensorPeak() as tracker:
            pipeline.decode(latents, side, side, "np")
        peak = tracker.peak
    return peak / (side * side)


def host_available_bytes() -> int:
    """The host memory a new allocation can get without swapping: Linux's `MemAvailable`, lowered to
    the container's cgroup v2 limit (`memory.max - memory.current`) when one is set; elsewhere the
    free pages."""
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        available = int(fields["MemAvailable"].split()[0]) * 1024
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read())
        if limit != "max":
            available = min(available, int(limit) - used)
    except (OSError, KeyError, ValueError):
        pass
    return max(0, available)


def free_memory_bytes(device: torch.device) -> tuple[int, int]:
    """(device bytes, host bytes) free now: `torch.cuda.mem_get_info` on CUDA, else the host's
    available memory for both (one pool)."""
    host = host_available_bytes()
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0]), host
    return host, host


def allocator_cached_bytes(device: torch.device) -> int:
    """Bytes PyTorch's CUDA allocator holds without a tensor in them (0 off CUDA)."""
    if device.type != "cuda":
        return 0
    return max(0, torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


class MemoryBudget:
    """What requests may use, and what the admitted ones hold (thread-safe)."""

    def __init__(
        self,
        device: torch.device,
        dtype: torch.dtype,
        decode_bytes_per_pixel: float,
        max_decode_pixels: int = DEFAULT_MAX_DECODE_PIXELS,
        free_bytes: tuple[int, int] | None = None,
        *,
        latent_row_width: int,
        prefix_row_bytes: int = 0,
        kv_cache_bytes: int | None = None,
        prefix_arena: PrefixRowReservations | None = None,
        utilization: float = DEFAULT_MEMORY_UTILIZATION,
        prefill_bytes: Callable[[int], int] | None = None,
        cache: CacheConfig | None = None,
        cache_row_bytes: int = 0,
    ):
        """`free_bytes`: (device, host) bytes free to use instead of measuring them (tools, tests: then
        never re-measured); `latent_row_width`: values per latent row (`latent_row_width`)."""
        self.device = torch.device(device)
        self.shared_pool = self.device.type != "cuda"
        """CPU: the device and the host are one memory, so both parts count against one budget."""
        self.dtype_bytes = torch.empty((), dtype=dtype).element_size()
        self.decode_bytes_per_pixel = decode_bytes_per_pixel
        self.max_decode_pixels = max_decode_pixels
        self.latent_row_width = latent_row_width
        self.prefix_row_bytes = prefix_row_bytes
        """Bytes one prefix row holds in the family's prefix KV cache (0: the family keeps none)."""
        self.kv_cache_bytes = kv_cache_bytes
        """`--kv-cache-memory-bytes`: the prefix caches' cap together; None: only the budget bounds them."""
        self.prefix_arena = prefix_arena
        """The fixed prefix rows admission reserves in (None: prefixes are charged in bytes, above)."""
        self.prefill_bytes = prefill_bytes
        """The pipeline's `prefill_peak_bytes(num_prefix_rows)` (None: 0 for every request)."""
        self.utilization = utilization
        """`--gpu-memory-utilization`: the share of the free memory requests may hold together."""
        self._fixed_free = free_bytes
        self._startup_cached: int | None = None
        """The allocator's unused cache at the first measurement (CUDA graphs' pools among it)."""
        self.free_bytes = (0, 0)
        """(device, host) bytes free beside the server at the last measurement."""
        self.device_bytes = self.host_bytes = 0
        """What requests may hold: `utilization` x the free bytes (device; host, off CPU)."""
        self.cache = cache
        """The server's step caching (a request's own setting resolved from it), or None."""
        self.cache_row_bytes = cache_row_bytes
        """Bytes of one stream row of one kept residual (hidden size x dtype bytes; 0: not charged)."""
        self._reserved: dict[str, RequestMemory] = {}
        self._lock = threading.Lock()
        self.refresh()

    def refresh(self) -> bool:
        """Measure the free memory again while no admitted request holds any (what they hold is
        missing from the free memory while they run); True when it did."""
        with self._lock:
            if self._reserved:
                return False
            free = self._fixed_free
            if free is None:
                device_free, host_free = free_memory_bytes(self.device)
                # blocks finished requests left in PyTorch's cache serve the next ones, though the
                # driver counts them used; what was cached at start-up (graph pools) does not count
                cached = allocator_cached_bytes(self.device)
                if self._startup_cached is None:
                    self._startup_cached = cached
                free = (device_free + max(0, cached - self._startup_cached), host_free)
            self.free_bytes = free
            self.device_bytes = int(free[0] * self.utilization)
            self.host_bytes = int(free[1] * self.utilization)
            return True

    @property
    def request_bytes(self) -> int:
        """What requests may hold together (the device's share; on CPU the one pool)."""
        return self.device_bytes if self.shared_pool else min(self.device_bytes, self.host_bytes)

    def prefix_bytes(self, num_prefix_rows: int) -> int:
        """Bytes a request's prefix KV cache of `num_prefix_rows` rows holds (`RequestGeometry`'s
        `num_prefix_cache_rows`)."""
        return num_prefix_rows * self.prefix_row_bytes

    def _decode_bytes(self, height: int, width: int, num_images: int) -> int:
        """Peak bytes of one VAE call holding `num_images` images of the size, at most the
        `max_decode_pixels` slice (one image at least)."""
        per_call = max(1, self.max_decode_pixels // (height * width))
        return math.ceil(self.decode_bytes_per_pixel * min(num_images, per_call) * height * width)

    def estimate(self, params: OmniDiffusionSamplingParams, geometry: RequestGeometry) -> RequestMemory:
        """The request's peak memory; `geometry` its rows (`RequestGeometry`, the family's)."""
        n, height, width = params.num_outputs_per_prompt, params.height, params.width
        prefix = self.prefix_bytes(geometry.num_prefix_cache_rows)
        rows = geometry.num_images * geometry.num_img_tokens + geometry.num_cond_rows
        latent = rows * self.latent_row_width * self.dtype_bytes * 2  # latents + velocity
        latent += self.cache_bytes(params, geometry.num_img_tokens)
        if self.prefix_arena is None:  # in an arena, the prefix lives in memory allocated at start-up
            latent += prefix
        num_rows = geometry.num_prefix_cache_rows
        prefill = self.prefill_bytes(num_rows) if num_rows and self.prefill_bytes is not None else 0
        if params.output_type == "latent":
            return RequestMemory(
                device_bytes=latent,
                host_bytes=0,
                latent_bytes=latent,
                prefix_bytes=prefix,
                prefill_bytes=prefill,
            )
        return RequestMemory(
            device_bytes=latent + self._decode_bytes(height, width, n),
            host_bytes=n * height * width * OUTPUT_BYTES_PER_PIXEL,
            latent_bytes=latent,
            prefix_bytes=prefix,
            decode_size=(height, width),
            num_images=n,
            prefill_bytes=prefill,
        )

    def cache_bytes(self, params: OmniDiffusionSamplingParams, img_rows: int) -> int:
        """Step caching's kept tensors, held from the first step to the end: per sequence (two with a
        CFG scale > 1) a reference `[img rows, hidden]` (DBCache's Fn residual or TeaCache's input) and
        the reused residuals of both streams `[img rows + txt rows, hidden]` (text at its maximum);
        `img_rows`: one image's latent rows, from the request's geometry."""
        if self.cache is None or not self.cache_row_bytes or not params.resolve_cache(self.cache).is_enabled:
            return 0
        num_seqs = params.num_outputs_per_prompt * (2 if params.true_cfg_scale > 1 else 1)
        return num_seqs * (2 * img_rows + params.max_sequence_length) * self.cache_row_bytes

    def _decode_peak(self, everyone: list[RequestMemory]) -> int:
        """The largest VAE call these requests can make: decodes run one call at a time, and
        same-size requests finishing in one step share a call (up to the slice)."""
        by_size: dict[tuple[int, int], int] = {}
        for m in everyone:
            if m.decode_size is not None:
                by_size[m.decode_size] = by_size.get(m.decode_size, 0) + m.num_images
        return max((self._decode_bytes(h, w, k) for (h, w), k in by_size.items()), default=0)

    def _fits(self, need: RequestMemory, held: list[RequestMemory]) -> bool:
        """Latents and outputs add up over the requests; the largest decode call counts once."""
        everyone = [*held, need]
        latents = sum(m.latent_bytes for m in everyone)
        hosts = sum(m.host_bytes for m in everyone)
        # a prefill and a decode call are both transient and run one at a time (the step loop's thread)
        decode = max(self._decode_peak(everyone), max(m.prefill_bytes for m in everyone))
        capped = self.kv_cache_bytes is not None and self.prefix_arena is None  # an arena is its own cap
        if capped and sum(m.prefix_bytes for m in everyone) > self.kv_cache_bytes:
            return False
        if self.shared_pool:
            return latents + decode + hosts <= self.device_bytes
        return latents + decode <= self.device_bytes and hosts <= self.host_bytes

    def could_ever_fit(self, params: OmniDiffusionSamplingParams, geometry: RequestGeometry) -> bool:
        """Whether the request fits the budget on an idle server (measured again when idle)."""
        self.refresh()
        return self._fits(self.estimate(params, geometry), [])

    def check(
        self, params: OmniDiffusionSamplingParams, geometry: RequestGeometry, prefix_param: str = "prompt"
    ) -> None:
        """InvalidRequestError (400) when the request could not fit even on an idle server, naming the
        field, the numbers and the flags that would make room; one whose prefix cache alone is over
        `--kv-cache-memory-bytes` names `prefix_param` and the flag."""
        num_prefix_rows = geometry.num_prefix_cache_rows
        self._check_arena(num_prefix_rows, prefix_param)
        if self.could_ever_fit(params, geometry):
            return
        need = self.estimate(params, geometry)
        mib, gib = 2**20, 2**30
        if self.kv_cache_bytes is not None and need.prefix_bytes > self.kv_cache_bytes:
            raise InvalidRequestError(
                f"this request's prefix KV cache needs {need.prefix_bytes} bytes "
                f"({need.prefix_bytes / mib:.1f} MiB: {num_prefix_rows} prefix rows of its prompt(s) and "
                f"reference images), more than the limit of {self.kv_cache_bytes} bytes "
                "(--kv-cache-memory-bytes, offline kv_cache_memory_bytes); "
                "send a shorter prompt or fewer / smaller reference images, or raise the limit",
                prefix_param,
            )
        # the HTTP answer names them `n` and `size` (errors.SAMPLING_FIELD_TO_PARAM)
        param = "num_outputs_per_prompt" if params.num_outputs_per_prompt > 1 else "height*width"
        decode = need.device_bytes - need.latent_bytes
        one_call = self._decode_bytes(params.height, params.width, 1)
        fixes = [
            f"start the server with a larger --gpu-memory-utilization (now {self.utilization:g}, at most 1)"
        ]
        if decode > one_call:
            fixes.append(
                f"a smaller --max-decode-pixels (now {self.max_decode_pixels}; "
                f"{params.height * params.width} decodes one image per call: {one_call / gib:.2f} GiB "
                f"instead of {decode / gib:.2f} GiB)"
            )
        raise InvalidRequestError(
            f"this request needs about {(need.device_bytes + need.host_bytes) / gib:.2f} GiB at its peak "
            f"({params.num_outputs_per_prompt} image(s) of {params.width}x{params.height}: "
            f"{need.latent_bytes / gib:.2f} GiB of latents (of which {need.prefix_bytes / gib:.2f} GiB "
            f"of prefix KV cache) and {decode / gib:.2f} GiB to decode on {self.device.type}, "
            f"{need.host_bytes / gib:.2f} GiB for the images and their encoding), more than this server "
            f"has for requests ({self.request_bytes / gib:.2f} GiB: {self.describe_share()}); ask for "
            "fewer images (n, num_outputs_per_prompt) or a smaller size, or " + ", or ".join(fixes),
            param,
        )

    def describe_share(self) -> str:
        """How the budget was set, e.g. '0.9 of the 1.67 GiB free beside the loaded server,
        --gpu-memory-utilization'."""
        free = self.free_bytes[0] if self.shared_pool else min(self.free_bytes)
        return (
            f"{self.utilization:g} of the {free / 2**30:.2f} GiB free beside the loaded server, "
            "--gpu-memory-utilization"
        )

    def describe(self) -> str:
        """One line for the start-up log: the budget and how a request is charged."""
        where = (
            f"{self.device_bytes / 2**30:.2f} GiB on {self.device.type}"
            if self.shared_pool
            else f"{self.device_bytes / 2**30:.2f} GiB on {self.device}, {self.host_bytes / 2**30:.2f} GiB "
            "on the host"
        )
        return (
            f"memory for requests: {where} ({self.describe_share()}; measured again whenever no request "
            f"holds memory); a request is charged its latents, its decode (its own images, at most "
            f"--max-decode-pixels {self.max_decode_pixels} per VAE call, "
            f"{self.decode_bytes_per_pixel:.0f} bytes per pixel) and its encoded images"
        )

    def _check_arena(self, num_prefix_rows: int, prefix_param: str) -> None:
        """InvalidRequestError when the request's prefix rows exceed the whole prefix arena."""
        arena = self.prefix_arena
        if arena is None or num_prefix_rows <= arena.capacity_rows:
            return
        size = (
            f"--kv-cache-memory-bytes {self.kv_cache_bytes}, offline kv_cache_memory_bytes"
            if self.kv_cache_bytes is not None
            else "its default size; set --kv-cache-memory-bytes, offline kv_cache_memory_bytes"
        )
        raise InvalidRequestError(
            f"this request's prefix KV cache needs {num_prefix_rows} rows "
            f"({num_prefix_rows * arena.row_bytes / 2**20:.1f} MiB: its prompt(s) and reference images), "
            f"more than the prefix KV arena holds ({arena.capacity_rows} rows, "
            f"{arena.num_bytes} bytes: {size}); "
            "send a shorter prompt or fewer / smaller reference images, or raise the limit",
            prefix_param,
        )

    def try_reserve(
        self, req_id: str, params: OmniDiffusionSamplingParams, geometry: RequestGeometry
    ) -> bool:
        """Hold the request's memory if it fits next to the admitted ones (and, with a prefix arena, one
        contiguous block of its prefix rows there); False: it must wait."""
        need = self.estimate(params, geometry)
        self.refresh()
        with self._lock:
            if not self._fits(need, list(self._reserved.values())):
                return False
            if self.prefix_arena is not None and not self.prefix_arena.reserve(
                req_id, geometry.num_prefix_cache_rows
            ):
                return False
            self._reserved[req_id] = need
            return True

    def release(self, req_id: str) -> None:
        """Drop the request's reservation (and its prefix arena rows, when the worker has not already)."""
        with self._lock:
            self._reserved.pop(req_id, None)
            if self.prefix_arena is not None:
                self.prefix_arena.release(req_id)

    @property
    def num_reserved(self) -> int:
        return len(self._reserved)

    @property
    def reserved_bytes(self) -> int:
        """Bytes the admitted requests are charged (device and host parts)."""
        with self._lock:
            return sum(m.device_bytes + m.host_bytes for m in self._reserved.values())

    @property
    def reserved_prefix_bytes(self) -> int:
        """Bytes the admitted requests' prefix KV caches are charged."""
        with self._lock:
            return sum(m.prefix_bytes for m in self._reserved.values())

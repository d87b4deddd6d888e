"""`OmniDiffusionConfig`: the one engine configuration users see.

Environment variables users of vLLM-Omni expect (`VLLM_BATCH_INVARIANT`,
`DIFFUSION_ATTENTION_BACKEND`) are read here, once, by `from_env_defaults`;
nothing deeper reads the environment.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field
from typing import Any

from vllm_omni.diffusion.cache.config import CacheConfig, CacheConfigError
from vllm_omni.diffusion.layers.quant_config import BATCH_INVARIANT_METHODS, QuantizationConfig
from vllm_omni.inputs import OmniDiffusionSamplingParams, SamplingLimits
from vllm_omni.lora.config import LoRAConfig

DEFAULT_MAX_GENERATED_IMAGE_SIZE = 2048 * 2048
"""Default pixel limit: every Qwen-Image recommended size (up to 1328x1328) and 2048x2048 pass.

Lower than vLLM-Omni's 7680x4320 on purpose: every step of a request's batch-mates waits for its
forward. A 1328x1328 forward takes a third of a second on a large GPU; 2048x2048 (16384 image tokens) has
3.3x its FLOPs, 4096x4096 (65536) 31x, 7680x4320 (129600) 109x (see docs/serving.md)."""

SCHEDULING_POLICIES = ("latency", "skip-ahead", "fifo")
"""`--scheduling-policy` values (docs/design/scheduling.md)."""

TINY_MODEL_NAME = "tiny-qwen-image"
"""Reserved model name: the embedded tiny random Qwen-Image, built on first use."""
TINY_EDIT_MODEL_NAME = "tiny-qwen-image-edit"
"""Reserved model name: the embedded tiny random Qwen-Image-Edit, built on first use."""

DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
"""Short spellings of the torch dtype names `dtype` takes."""
DTYPES = ("auto", "bfloat16", "bf16", "float16", "fp16", "float32", "fp32")
"""Every value of `dtype` (`--dtype` choices): 'auto' and each torch dtype in its two spellings."""
LOAD_FORMATS = ("auto", "dummy")
"""Every value of `load_format`: 'auto' loads the checkpoint's weights, 'dummy' draws random ones."""

_ON, _OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
BOOLEAN_WORDS = dict.fromkeys(_ON, True) | dict.fromkeys(_OFF, False)
"""The lower-case words a boolean setting takes (environment variables, form fields)."""


def env_flag(name: str) -> bool | None:
    """Parse a boolean environment variable; None when unset. Invalid strings raise."""
    raw = os.environ.get(name)
    if raw is None:
        return None
    value = raw.strip().lower()
    if value == "":  # set but empty: off
        return False
    if value in BOOLEAN_WORDS:
        return BOOLEAN_WORDS[value]
    raise ValueError(f"environment variable {name}={raw!r} is not a boolean (use 1/0, true/false)")


@dataclass(frozen=True)
class ParallelConfig:
    """Degrees of every parallel mode; their product is the number of processes (one per device).

        world_size = cfg_parallel_size * ring_degree * ulysses_degree * tensor_parallel_size

    Ranks are laid out with tensor parallel innermost (adjacent ranks share a node's fastest links) and
    CFG parallel outermost::

        rank = ((cfg_rank * ring_degree + ring_rank) * ulysses_degree + ulysses_rank) * tp_size + tp_rank

    so global rank 0 computes the positive CFG sequences and the first rows / heads of everything
    (docs/design/parallelism.md).
    """

    tensor_parallel_size: int = 1
    """Shards of every block's attention heads and MLP hidden units (all-reduce after the row-parallel
    linears)."""
    ulysses_degree: int = 1
    """Sequence-parallel shards of the packed rows; attention all-to-alls heads (DeepSpeed-Ulysses)."""
    ring_degree: int = 1
    """Sequence-parallel shards of the packed rows; attention passes K/V around a ring (exact online
    softmax)."""
    cfg_parallel_size: int = 1
    """1, or 2: positive CFG sequences on one half of the ranks, negative ones on the other."""

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "ulysses_degree", "ring_degree", "cfg_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.cfg_parallel_size not in (1, 2):
            raise ValueError(
                f"cfg_parallel_size must be 1 or 2 (positive and negative sequences), "
                f"got {self.cfg_parallel_size}"
            )

    @property
    def world_size(self) -> int:
        """Processes (devices) needed: the product of the four degrees."""
        return self.cfg_parallel_size * self.ring_degree * self.ulysses_degree * self.tensor_parallel_size

    @property
    def sequence_parallel_size(self) -> int:
        """Shards of the packed rows: ulysses_degree * ring_degree."""
        return self.ulysses_degree * self.ring_degree

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1

    def validate_model(self, num_attention_heads: int) -> None:
        """Raise ValueError unless the heads split evenly over tensor_parallel_size * ulysses_degree."""
        split = self.tensor_parallel_size * self.ulysses_degree
        if num_attention_heads % split != 0:
            raise ValueError(
                f"num_attention_heads ({num_attention_heads}) must be divisible by "
                f"tensor_parallel_size * ulysses_degree = {self.tensor_parallel_size} * "
                f"{self.ulysses_degree} = {split}; pick degrees whose product divides the heads"
            )

    def validate_world_size(self, world_size: int) -> None:
        """Raise ValueError unless `world_size` (processes / devices) equals the product of the degrees."""
        if world_size != self.world_size:
            raise ValueError(
                f"world size {world_size} must equal cfg_parallel_size * ring_degree * ulysses_degree * "
                f"tensor_parallel_size = {self.cfg_parallel_size} * {self.ring_degree} * "
                f"{self.ulysses_degree} * {self.tensor_parallel_size} = {self.world_size}"
            )

    def coords(self, rank: int) -> tuple[int, int, int, int]:
        """(cfg_rank, ring_rank, ulysses_rank, tp_rank) of global `rank`."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")
        tp_rank = rank % self.tensor_parallel_size
        rest = rank // self.tensor_parallel_size
        ulysses_rank = rest % self.ulysses_degree
        rest //= self.ulysses_degree
        return rest // self.ring_degree, rest % self.ring_degree, ulysses_rank, tp_rank

    def rank_of(self, cfg_rank: int, ring_rank: int, ulysses_rank: int, tp_rank: int) -> int:
        """Global rank of the given coordinates (inverse of `coords`)."""
        rank = cfg_rank * self.ring_degree + ring_rank
        rank = rank * self.ulysses_degree + ulysses_rank
        return rank * self.tensor_parallel_size + tp_rank


@dataclass
class OmniDiffusionConfig:
    """Engine configuration. Cross-field rules are checked in `__post_init__`."""

    model: str = TINY_MODEL_NAME
    """Local diffusers-format directory, Hugging Face repo id, or `tiny-qwen-image`."""
    dtype: str = "auto"
    """'auto' (bf16 on CUDA, fp32 on CPU), 'bfloat16', 'float16' or 'float32'."""
    device: str = "auto"
    """'auto' (cuda if available), 'cpu', 'cuda' or 'cuda:N'."""
    load_format: str = "auto"
    """'auto' loads weights; 'dummy' builds the architecture with random weights on the device."""
    step_execution: bool = True
    """Step mode (continuous batching between denoise steps); False runs whole requests one by one."""
    max_num_seqs: int = 8
    """Most requests in one denoise step (hard cap)."""
    max_num_resident_reqs: int | None = None
    """Most requests started at once (holding runner state: latents, prompt embeddings), running or
    sitting a step out; None = 2 x max_num_seqs with the latency policy, else max_num_seqs."""
    max_num_batched_tokens: int | None = None
    """Most tokens (image + text, CFG counting twice) in one step; None = no cap."""
    scheduling_policy: str | None = None
    """'latency' (shortest remaining work first with aging and priority, preemption between steps,
    packing while nearly free), 'skip-ahead' (every running request every step; a compatible later
    request may pass a blocked head, with aging) or 'fifo' (strict arrival order); None = 'latency'
    in step mode, 'fifo' in request mode. See docs/design/scheduling.md."""
    scheduling_aging_factor: float | None = None
    """Latency policy: seconds of waiting that count as one second less remaining work (larger:
    closer to shortest-remaining-work-first; smaller: closer to FIFO); None = no aging (the default:
    the deadline guard bounds the tail)."""
    scheduling_deadline_factor: float | None = 1.1
    """Latency policy: every request's deadline is this factor x the time request mode (one request
    at a time, in arrival order) would take to finish it; shortest-first gives way to deadline
    order where it would make a request later than its deadline (the tail guard); None = off."""
    packing_max_marginal_cost: float = 0.5
    """Latency policy: a request joins a step only if the step grows by at most this fraction of the
    request's own step time (the cost model's)."""
    packing_max_step_slowdown: float = 2.0
    """Latency policy: ...and the step stays within this factor of its head request's own step time."""
    max_waiting_steps: int = 50
    """skip-ahead policy: steps a passed-over head may wait before it blocks admission (aging)."""
    enable_mixfusion: bool | None = None
    """Heterogeneous (mixed shape) batching default; None = on when the pipeline supports it."""
    mixfusion_min_chunk_tokens: int | None = None
    """A mixed batch whose image token counts have a gcd below this is not formed; None = no limit
    (the packed varlen forward needs no chunks; MixFusion's chunked forward used 256)."""
    mixfusion_max_chunks: int | None = None
    """A mixed batch whose total image tokens / gcd exceeds this is not formed; None = no limit
    (MixFusion's chunked forward used 128)."""
    attention_backend: str | None = None
    """'SDPA', 'FLASH_ATTN' or None (auto: env DIFFUSION_ATTENTION_BACKEND, else per platform)."""
    max_generated_image_size: int = DEFAULT_MAX_GENERATED_IMAGE_SIZE
    """Largest height*width in pixels a request may ask for."""
    max_queue_size: int = 1024
    """Waiting requests beyond this are refused (HTTP 503)."""
    batch_invariant: bool = False
    """Bit-identical results whatever else is in the batch (VLLM_BATCH_INVARIANT=1)."""
    enforce_eager: bool = False
    """Plain eager PyTorch. When False, on CUDA the transformer blocks' elementwise chains run as
    torch.compile'd fused kernels and the forward replays CUDA graphs (worker/cuda_graphs.py);
    CPU and batch-invariant mode are always eager."""
    seed: int | None = None
    """Process-wide seed for random weights (dummy/tiny) and assigned request seeds."""
    default_sampling_params: dict[str, Any] = field(default_factory=dict)
    """Server-side defaults applied to requests before their own fields."""
    log_stats: bool = True
    """Log each step's batch composition and time (`--disable-log-stats` turns it off)."""
    flow_shift: float | None = None
    """Server-wide static sigma shift, the default of requests' `flow_shift` (None = dynamic shift)."""
    max_decode_pixels: int = 2048 * 2048
    """Most pixels one VAE decode call holds: a request's n images (and same-size requests finishing
    together) decode in slices of whole images (same pixels, bounded peak memory)."""
    gpu_memory_utilization: float = 0.9
    """Share of the memory free beside the loaded server (the GPU's, or the host's on CPU; measured at
    start-up and whenever no request holds memory) that admitted requests may hold together
    (`--gpu-memory-utilization`; vLLM sizes its KV cache from a share of the GPU's whole memory)."""
    log_step_interval: int = 0
    """Log one INFO line every this many steps (their request ids and batch composition); 0: every
    step's line at DEBUG only (`--log-step-interval`)."""
    kv_cache_memory_bytes: int | None = None
    """Bytes the prefix KV caches of admitted requests may hold together (Qwen-Image-2.1 keeps each
    request's prompt K/V for its whole run; vLLM's `--kv-cache-memory-bytes`). None: no separate cap, the
    caches count in the request memory budget (`gpu_memory_utilization` of the free memory) next to latents
    and decodes. A request that could never fit is refused (400), one that fits later waits."""
    enable_prompt_embed_cache: bool = False
    """Cache every prompt's text embedding (`prompt_embed_cache_size` entries, least recently used out);
    False caches only the empty and single-space negative prompts (diffusion/prompt_cache.py)."""
    prompt_embed_cache_size: int = 32
    """Entries of the prompt-embedding cache; 0 turns it off (every prompt encoded on admission)."""
    vae_use_slicing: bool = False
    """Decode a request's images one at a time (diffusers' `vae.enable_slicing()`)."""
    vae_use_tiling: bool = False
    """Decode in overlapping tiles (diffusers' `vae.enable_tiling()`); pixels differ near tile seams."""
    init_timeout_s: float | None = None
    """Seconds parallel workers get to load the model (None = the executor's default, 1800)."""
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    """Tensor / Ulysses / ring / CFG parallel degrees; one process per device (docs/design/parallelism.md)."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """LoRA adapters: --lora-modules, --max-loras, --max-lora-rank, --lora-runtime-dir (docs/lora.md)."""
    quantization: QuantizationConfig = field(default_factory=QuantizationConfig)
    """The transformer's linears: --quantization fp8 / --diffusion-quantization-config (a method name,
    dict or JSON text is accepted here too); docs/quantization.md."""
    cache_backend: str = "none"
    """Step caching: 'none', 'cache_dit' (cache-dit's DBCache) or 'tea_cache' (--cache-backend;
    docs/caching.md)."""
    cache_config: dict[str, Any] | str | None = None
    """The backend's knobs under its own key names (--cache-config; a dict or JSON text)."""
    enable_cache_dit_summary: bool = False
    """Log one line per finished request with its cached steps per branch."""

    def _check_types(self) -> None:
        """TypeError naming the field for a value of the wrong kind (offline users pass these as
        keywords: a string "false" must not turn a switch on, nor "8" reach a comparison)."""
        import dataclasses
        import math
        import numbers

        kinds = {"bool": bool, "int": int, "float": numbers.Real, "str": str}
        for f in dataclasses.fields(self):
            annotation = str(f.type).replace(" ", "")
            kind = kinds.get(annotation.removesuffix("|None"))
            if kind is None:
                continue
            value = getattr(self, f.name)
            if value is None and annotation.endswith("|None"):
                continue
            wrong = not isinstance(value, kind) or (kind is not bool and isinstance(value, bool))
            if kind is numbers.Real and not wrong and not math.isfinite(value):
                raise ValueError(f"{f.name} must be a finite number, got {value!r}")
            if wrong:
                expected = "a number" if kind is numbers.Real else annotation.removesuffix("|None")
                raise TypeError(f"{f.name} must be {expected}, got {value!r:.80} ({type(value).__name__})")

    def __post_init__(self) -> None:
        self._check_types()
        if isinstance(self.parallel_config, dict):
            self.parallel_config = ParallelConfig(**self.parallel_config)
        self.quantization = QuantizationConfig.from_value(self.quantization)
        method = self.quantization.method
        if self.batch_invariant and self.quantization.is_enabled and method not in BATCH_INVARIANT_METHODS:
            raise ValueError(
                f"batch-invariant mode with quantization {method} is not supported (no batch-invariant "
                f"{method} GEMM; batch-invariant: {', '.join(BATCH_INVARIANT_METHODS)}); drop "
                "VLLM_BATCH_INVARIANT or the quantization"
            )
        if self.lora.is_enabled and self.parallel_config.is_parallel:
            raise ValueError("LoRA adapters run on one device; drop the parallel flags or the LoRA flags")
        self._check_cache()
        if self.parallel_config.is_parallel and self.batch_invariant:
            raise ValueError(
                "batch-invariant mode runs on one device; drop the parallel flags or VLLM_BATCH_INVARIANT"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be auto, bfloat16, float16 or float32, got {self.dtype!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if not self.step_execution and self.max_num_seqs != 1:
            # Request mode runs one whole request at a time.
            self.max_num_seqs = 1
        if self.prompt_embed_cache_size < 0:
            raise ValueError(
                f"prompt_embed_cache_size must be >= 0 (0: off), got {self.prompt_embed_cache_size}"
            )
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        self._check_scheduling()
        for name in ("mixfusion_min_chunk_tokens", "mixfusion_max_chunks"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 (or None for no limit), got {value}")
        if self.flow_shift is not None:
            given = self.default_sampling_params.get("flow_shift")
            if given is not None and given != self.flow_shift:
                raise ValueError(
                    f"flow_shift is given twice: {self.flow_shift} (--flow-shift) and {given} "
                    "(--default-sampling-params); give it once"
                )
            self.default_sampling_params = {**self.default_sampling_params, "flow_shift": self.flow_shift}
        # (non-finite numbers were refused by _check_types)
        if self.init_timeout_s is not None and self.init_timeout_s <= 0:
            raise ValueError(f"init_timeout_s must be > 0, got {self.init_timeout_s}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.log_step_interval < 0:
            raise ValueError(f"log_step_interval must be >= 0, got {self.log_step_interval}")
        if self.max_decode_pixels < 16 * 16:
            raise ValueError(f"max_decode_pixels must be >= 256, got {self.max_decode_pixels}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError(
                f"kv_cache_memory_bytes must be >= 1 (or None), got {self.kv_cache_memory_bytes}"
            )
        if self.max_generated_image_size < 16 * 16:
            raise ValueError(f"max_generated_image_size must be >= 256, got {self.max_generated_image_size}")
        if self.max_queue_size < 1:
            raise ValueError(f"max_queue_size must be >= 1, got {self.max_queue_size}")
        self._check_default_sampling_params()

    def _check_scheduling(self) -> None:
        """Resolve the policy and the resident cap; range-check the latency policy's knobs."""
        if self.scheduling_policy is None:
            self.scheduling_policy = "latency" if self.step_execution else "fifo"
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                f"got {self.scheduling_policy!r}"
            )
        if self.max_num_resident_reqs is not None:
            if self.scheduling_policy != "latency":
                raise ValueError(
                    f"max_num_resident_reqs only applies to the latency policy (with "
                    f"{self.scheduling_policy!r} every started request runs every step); drop it"
                )
            if self.max_num_resident_reqs < self.max_num_seqs:
                raise ValueError(
                    f"max_num_resident_reqs ({self.max_num_resident_reqs}) must be >= "
                    f"max_num_seqs ({self.max_num_seqs})"
                )
        if self.scheduling_aging_factor is not None and not self.scheduling_aging_factor > 0:
            raise ValueError(f"scheduling_aging_factor must be > 0, got {self.scheduling_aging_factor}")
        if self.scheduling_deadline_factor is not None and not self.scheduling_deadline_factor >= 1:
            raise ValueError(
                f"scheduling_deadline_factor must be >= 1 (a multiple of request mode's latency), "
                f"got {self.scheduling_deadline_factor}"
            )
        if self.packing_max_marginal_cost < 0:
            raise ValueError(f"packing_max_marginal_cost must be >= 0, got {self.packing_max_marginal_cost}")
        if self.packing_max_step_slowdown < 1:
            raise ValueError(f"packing_max_step_slowdown must be >= 1, got {self.packing_max_step_slowdown}")

    @property
    def resident_cap(self) -> int:
        """Requests that may be started at once: `max_num_resident_reqs`, else 2 x `max_num_seqs` with
        the latency policy in step mode and `max_num_seqs` otherwise (derived, not stored, so a
        `dataclasses.replace` that changes the mode or the policy gets its own)."""
        if self.max_num_resident_reqs is not None:
            return self.max_num_resident_reqs
        latency = self.scheduling_policy == "latency" and self.step_execution
        return 2 * self.max_num_seqs if latency else self.max_num_seqs

    @property
    def sampling_limits(self) -> SamplingLimits:
        """The server's limits on a request (the model family may tighten `max_sequence_length`)."""
        return SamplingLimits(max_generated_image_size=self.max_generated_image_size, cache=self.cache)

    @functools.cached_property
    def cache(self) -> CacheConfig:
        """The step-caching setting built from `cache_backend` / `cache_config` (checked at init)."""
        config = self.cache_config
        if isinstance(config, str):
            try:
                config = json.loads(config)
            except json.JSONDecodeError as exc:
                raise ValueError(f"cache_config must be a JSON object, got {config!r:.80}: {exc}") from None
        try:
            return CacheConfig.from_user(self.cache_backend, config, self.enable_cache_dit_summary)
        except CacheConfigError as exc:
            if exc.key in ("cache_backend", "cache_config"):
                raise
            raise ValueError(f"cache_config {exc}") from None

    def _check_cache(self) -> None:
        """ValueError for a refused backend or key, or caching with what it cannot run with yet."""
        if not self.cache.is_enabled:
            return
        if self.parallel_config.is_parallel:
            raise ValueError(
                f"--cache-backend {self.cache_backend} runs on one device; drop the parallel flags or caching"
            )

    def _check_default_sampling_params(self) -> None:
        """The merged defaults (`--default-sampling-params` + `--flow-shift`) must pass the request
        check itself, or every request that leaves a field unset would be refused after start-up
        (found twice: a default size over `max_generated_image_size`, and `--flow-shift 0.0005`)."""
        defaults = self.default_sampling_params
        # the pixel cap binds a default size only: the built-in 1024 x 1024 is the HTTP layer's to apply
        limits = self.sampling_limits if {"height", "width"} & set(defaults) else None
        try:
            OmniDiffusionSamplingParams(**defaults).validate(limits)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"default_sampling_params (with --flow-shift): {exc}") from None

    @classmethod
    def from_env_defaults(cls, **kwargs: Any) -> OmniDiffusionConfig:
        """Build a config, filling unset fields from the environment variables users expect."""
        if "batch_invariant" not in kwargs:
            kwargs["batch_invariant"] = bool(env_flag("VLLM_BATCH_INVARIANT"))
        if kwargs.get("attention_backend") is None and os.environ.get("DIFFUSION_ATTENTION_BACKEND"):
            kwargs["attention_backend"] = os.environ["DIFFUSION_ATTENTION_BACKEND"]
        return cls(**kwargs)

    def resolve_device(self) -> str:
        """The torch device string to use."""
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolve_dtype(self):
        """The torch dtype to use for the transformer."""
        import torch

        if self.dtype != "auto":
            return getattr(torch, DTYPE_ALIASES.get(self.dtype, self.dtype))
        return torch.bfloat16 if self.resolve_device().startswith("cuda") else torch.float32

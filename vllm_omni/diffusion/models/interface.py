"""What a model family implements: the contract between the runtime and `models/<family>/`.

The engine, worker, CUDA graphs, distributed code, batch-invariant mode, model loader and HTTP layer
import this module, `plans.py` and `registry.py`, never a family. A family is one folder plus one
registry line:

    models/<family>/
      loader.py      the `ModelFamily` object (`registry.PIPELINES` names it): loading, prompt counting,
                     a request's token rows, the image-input capability, its `FamilyCapabilities`
      pipeline.py    the `StepPipeline`: prompt encoding, latent preparation, sigma schedule, decode
      transformer.py the `PackedTransformer`: dense and packed forward, its position tables
      plans.py       its transformer's `TransformerPlans` (LoRA streams, tensor-parallel shards, invariant
                     norms, FP8 kept layers, blocks): the runtime reads these, never module names
      tiny.py        the family's tiny random checkpoint (`registry.TINY_MODELS` names it)

What a family supports is declared, never probed: `FamilyCapabilities` (refusals come from it) and the
attributes below, which every family sets (None or 0 where it has nothing).

Qwen-Image (`models/qwen_image/`) and Qwen-Image-Edit (`models/qwen_image_edit/`) are the worked
examples; docs/design/architecture.md walks through them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:
    import torch

    from vllm_omni.diffusion.layout import PackedLayout, PositionTables
    from vllm_omni.diffusion.models.plans import TransformerPlans
    from vllm_omni.diffusion.request import OmniDiffusionRequest
    from vllm_omni.diffusion.solvers.flow_match import SigmaSchedule
    from vllm_omni.inputs import OmniDiffusionSamplingParams

TEXT_TO_IMAGE_REFUSAL = (
    "image: this model is text-to-image and takes no input image; serve an image-edit checkpoint "
    "(e.g. Qwen/Qwen-Image-Edit) for edits, or send the request without an image"
)
"""What a family without image input answers a request that carries an image (HTTP 400, param image)."""


def step_token_cost(
    num_img_tokens: int, num_cond_rows: int, num_txt_tokens: int, num_neg_txt_tokens: int, num_images: int
) -> int:
    """Rows one request puts in every step's forward: the one token cost (scheduler budget, step stats).

    Every image is one sequence `[text ; target image ; condition]`, two with CFG (the negative sequence
    repeats the image and condition rows; `num_neg_txt_tokens` is 0 without CFG):

        num_images * ((txt + img + cond) + (neg_txt + img + cond if CFG))
    """
    per_image = num_txt_tokens + num_img_tokens + num_cond_rows
    if num_neg_txt_tokens:
        per_image += num_neg_txt_tokens + num_img_tokens + num_cond_rows
    return num_images * per_image


@dataclass(frozen=True)
class RequestGeometry:
    """The rows one request occupies, computed once at admission by its family (`request_geometry`).

    The scheduler's batching profile and `NewRequestData` carry it; nothing downstream re-derives the
    latent grid or the token cost from the pixel size.
    """

    pixel_multiple: int
    """Image sides are multiples of this (Qwen-Image: VAE 8x times the 2x2 patch = 16)."""
    latent_grid: tuple[int, int, int]
    """(frames, h, w) latent token grid of one generated image (the RoPE grid)."""
    num_txt_tokens: int
    """Text-stream rows of the positive sequence (after truncation; an edit's vision tokens included;
    Qwen-Image-2.1: its prefix rows, each reference-image slot as the 4 latent rows it becomes)."""
    num_neg_txt_tokens: int = 0
    """Text-stream rows of the negative sequence; 0 when CFG is off (no negative sequence)."""
    num_cond_rows: int = 0
    """Image-stream rows a condition image adds after the target in every sequence (edit models)."""
    num_images: int = 1
    """Images of the request (`num_outputs_per_prompt`): one sequence each, two with CFG."""
    num_prefix_cache_rows: int = 0
    """Rows the request keeps in its family's prefix KV cache for its whole run, shared by its images
    (Qwen-Image-2.1: its prompt's and negative prompt's prefix rows); 0 for a family without one. The
    engine charges their bytes at admission (`memory.MemoryBudget`)."""

    @property
    def num_img_tokens(self) -> int:
        """Target image rows of one image: the product of the latent grid."""
        frames, h, w = self.latent_grid
        return frames * h * w

    @property
    def num_step_tokens(self) -> int:
        """Rows the request puts in every step's forward (`step_token_cost`)."""
        return step_token_cost(
            self.num_img_tokens,
            self.num_cond_rows,
            self.num_txt_tokens,
            self.num_neg_txt_tokens,
            self.num_images,
        )

    @property
    def text_rows(self) -> tuple[int, int]:
        """(positive, negative) rows of a sequence besides its target image (text + condition rows);
        negative 0 without CFG."""
        neg = self.num_neg_txt_tokens + self.num_cond_rows if self.num_neg_txt_tokens else 0
        return self.num_txt_tokens + self.num_cond_rows, neg


PARALLEL_FLAGS = "--tensor-parallel-size, --cfg-parallel-size, --ulysses-degree, --ring-degree"


@dataclass(frozen=True)
class FamilyCapabilities:
    """What a family supports, declared once on its `ModelFamily` (vLLM's `Supports*` class flags, as one
    frozen record). The engine refuses what it does not declare before anything loads (`refusals`), the
    registry checks the declaration against the loaded transformer's plans once
    (`registry.check_plans`), and the runtime reads these fields instead of probing model objects.
    """

    display_name: str
    """The family's name in messages ("Qwen-Image-2.1")."""
    lora: bool = False
    """Per-request LoRA adapters (needs the transformer's `plans.lora`)."""
    parallel: bool = False
    """Tensor, sequence and CFG parallelism (needs `plans.tensor_parallel`)."""
    batch_invariant: bool = False
    """Batch-invariant mode, VLLM_BATCH_INVARIANT=1 (needs `plans.invariant_norms`)."""
    quantization: bool = True
    """FP8 (`--quantization fp8`) of its linears (the default kept layers: `plans.quant_kept_layers`)."""
    caching: bool = False
    """Step caching (skipping blocks of a step from the previous step's residuals): its transformer's
    `forward_packed(..., cache=StepCache)` (`diffusion/cache/`)."""
    dense_forward: bool = True
    """Same-shape batches may take the dense `forward`; False: every step is `forward_packed` (2.1's
    dense forward has no request ids, so it cannot reach its prefix cache)."""
    prefix_cache: bool = False
    """A per-request prefix KV cache (`--kv-cache-memory-bytes` applies; the pipeline's
    `prefix_row_bytes` and `prefix_arena` say its size)."""
    outputs_alpha: bool = False
    """Its images are RGBA: HTTP honours `background: "transparent"`."""
    prompt_embed_cache: bool = False
    """Its pipeline's `encode_prompts(prompts, max_sequence_lengths)` gives each prompt's rows from the
    prompt and length alone (a text-only encoder): the prompt-embedding cache may wrap it
    (`diffusion/prompt_cache.py`). An edit model's prompt embedding reads its input image: False."""
    default_sampling_params: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    """The family's own request defaults (2.1: 40 steps, true_cfg_scale 1.0); the server's
    `--default-sampling-params` and the request's fields win."""

    def refusals(self, config: Any) -> list[str]:
        """One message per setting of an `OmniDiffusionConfig` the family does not declare (empty: it
        can run with `config`)."""
        name, errors = self.display_name, []
        if config.lora.is_enabled and not self.lora:
            errors.append(f"LoRA adapters (--lora-modules) are not supported for {name}; start without them")
        if config.batch_invariant and not self.batch_invariant:
            errors.append(
                f"batch-invariant mode (VLLM_BATCH_INVARIANT=1) is not supported for {name}; unset it"
            )
        if config.parallel_config.is_parallel and not self.parallel:
            errors.append(
                f"the parallel flags ({PARALLEL_FLAGS}) are not supported for {name}; serve it on one device"
            )
        if config.quantization.is_enabled and not self.quantization:
            errors.append(f"--quantization is not supported for {name}; start without it")
        if config.cache.is_enabled and not self.caching:
            errors.append(
                f"--cache-backend {config.cache.backend} is not supported for {name}; start without it"
            )
        if config.kv_cache_memory_bytes is not None and not self.prefix_cache:
            errors.append(f"--kv-cache-memory-bytes: {name} keeps no prefix KV cache; start without the flag")
        return errors


@dataclass(frozen=True)
class DenseInputs:
    """The dense forward's inputs, B same-shape sequences: the arguments of diffusers' transformer
    `forward`, in order (`args`). The graph runner, the parallel wrapper and the transformers' checks
    carry this one record."""

    hidden_states: torch.Tensor
    """[B, S_img, C_in] image rows."""
    encoder_hidden_states: torch.Tensor
    """[B, S_txt, J] text rows, padded to the longest."""
    encoder_hidden_states_mask: torch.Tensor | None
    """[B, S_txt], 1 real / 0 padding (masked as keys), or None: no padding."""
    timestep: torch.Tensor
    """[B], already / 1000."""
    img_shapes: list
    """Per item (frames, h, w), or [(frames, h, w)] as diffusers' pipeline passes."""

    @property
    def args(self) -> tuple:
        """The positional arguments of the dense `forward`."""
        return (
            self.hidden_states,
            self.encoder_hidden_states,
            self.encoder_hidden_states_mask,
            self.timestep,
            self.img_shapes,
        )


class StaticPackedStep(Protocol):
    """One packed CUDA-graph bucket of a family's own step: static input buffers and the forward over
    them (what the graph captures). Made by `PackedStepGraphs.static_step`."""

    def load(
        self, img_rows: torch.Tensor, txt_rows: torch.Tensor, timestep: torch.Tensor, layout: PackedLayout
    ) -> None:
        """Write a batch that fits the bucket into the static buffers (`forward_packed`'s arguments)."""
        ...

    def run_eager(self) -> torch.Tensor:
        """The forward over the static buffers: [bucket image rows, C_out], the batch's rows first.
        Device work only, so a graph captures it; padding never reaches a real row."""
        ...


@dataclass(frozen=True)
class GraphContextAxis:
    """A family's own second bucket axis for the packed CUDA graphs (replaces the runner's text-row
    buckets; Qwen-Image-2.1 with a prefix arena: prefix rows up to 8192)."""

    rows: tuple[int, ...]
    """Bucket sizes on the second axis."""
    max_rows_per_seq: int
    """A bucket of s sequence slots takes at most s x this many second-axis rows."""


class PrefixRowReservations(Protocol):
    """A fixed pool of prefix-cache rows that the engine reserves at admission (Qwen-Image-2.1's prefix
    arena): when a pipeline offers one (`prefix_arena`), it, not the byte count, decides whether a
    request's prefix fits, and its rows live outside the request memory budget (allocated at start-up)."""

    capacity_rows: int
    row_bytes: int
    num_bytes: int
    num_free_rows: int

    def reserve(self, owner: str, num_rows: int) -> bool:
        """Hold `num_rows` contiguous rows for `owner` (a req_id); False: not now (the request waits)."""
        ...

    def release(self, owner: str) -> int:
        """Free every row `owner` holds (idempotent); the rows freed."""
        ...


class PackedStepGraphs(Protocol):
    """A family's packed step over static buffers, for the worker's CUDA graphs: what a transformer whose
    forward reads more than the runner's static layout offers (Qwen-Image-2.1: per-request prefix K/V),
    through its optional `packed_graph_steps(max_img_rows, max_ctx_rows, device, dtype)`. The runner
    keeps the buckets, capture, memory pool and replay; the family owns the buffers and the forward."""

    num_bytes: int
    """Device bytes of the buffers shared by every bucket (logged; in use before the memory budget
    measures what is free, so requests never count on them)."""

    def bucket_rows(self, txt_rows: torch.Tensor, layout: PackedLayout) -> int:
        """Rows the batch puts on the bucket's second axis (Qwen-Image's text rows; 2.1's prefix rows)."""
        ...

    def static_step(self, num_img_rows: int, num_ctx_rows: int, num_seqs: int) -> StaticPackedStep:
        """The static step of one bucket (its image rows, second-axis rows and sequence slots)."""
        ...


class PackedTransformer(Protocol):
    """The denoiser: one forward over many requests of any shapes (packed), or a same-shape batch.

    `config` carries at least `in_channels` (latent row width), `joint_attention_dim` (text row width),
    `attention_head_dim`, `patch_size` and `out_channels`.
    """

    config: Any
    position_tables: PositionTables
    """The family's positions for a packed layout: `layout.build_packed_layout(specs, position_tables)`."""
    num_compile_fallbacks: int
    """Compiled kernels that fell back to eager so far (the runner logs a change)."""
    plans: ClassVar[TransformerPlans]
    """Its modules, for LoRA, tensor parallelism, batch-invariant mode, FP8 and the runner
    (`models/plans.py`)."""
    attn_backend: Any
    """The attention backend (instance, name or None: chosen at first use); batch-invariant mode sets it."""
    packed_graph_steps: Any
    """None, or `packed_graph_steps(max_img_rows, max_ctx_rows, device, dtype) -> PackedStepGraphs`: its
    own static-buffer step for CUDA graphs (Qwen-Image-2.1); None: the runner captures `forward_packed`
    over a static layout."""
    enable_prefix_arena: Any
    """None, or `enable_prefix_arena(kv_cache_bytes, device, dtype) -> PrefixRowReservations`: moves its
    prefix cache into fixed rows (called before graphs are built, CUDA with graphs on; `kv_cache_bytes`
    None: its default size)."""
    graph_context_axis: GraphContextAxis | None
    """Its own second bucket axis for the packed CUDA graphs (None: the runner's text rows)."""
    cuda_graphs_off_reason: str | None
    """Why its forward cannot be captured (a parallel wrapper: collectives); None: it can."""

    def get_attn_backend(self, device: torch.device) -> Any:
        """The attention backend the forwards use on `device` (resolved once)."""
        ...

    def check_packed(
        self, img_rows: torch.Tensor, txt_rows: torch.Tensor, timestep: torch.Tensor, layout: PackedLayout
    ) -> None:
        """ValueError when `forward_packed`'s inputs do not fit (CUDA graphs check before a replay)."""
        ...

    def check_dense(self, inputs: DenseInputs) -> tuple[int, int, int]:
        """ValueError when the dense `forward`'s inputs are inconsistent; else their (frames, h, w)."""
        ...

    def enable_compile(self) -> None:
        """Fuse the blocks' elementwise chains (CUDA); `disable_compile` goes back to eager."""
        ...

    def disable_compile(self) -> None: ...

    def forward_packed(
        self, img_rows: torch.Tensor, txt_rows: torch.Tensor, timestep: torch.Tensor, layout: PackedLayout
    ) -> torch.Tensor:
        """[num_img_rows, C_in] + [num_txt_rows, J] + [num_seqs] -> [num_img_rows, C_out]."""
        ...

    def forward(self, *dense_args: Any) -> torch.Tensor:
        """Dense forward of B same-shape requests, diffusers' signature (`DenseInputs.args`)
        -> [B, S_img, C_out]."""
        ...


class StepPipeline(Protocol):
    """The stages around the transformer step, for one family (diffusers' pipeline, cut into stages)."""

    supports_mixfusion: ClassVar[bool]
    """Requests of different shapes can share a step (the transformer has a packed forward)."""
    supports_image_input: ClassVar[bool]
    """Requests carry an input image (edit models); False: requests must not."""
    transformer: PackedTransformer
    vae: Any
    text_encoder: Any
    device: torch.device
    dtype: torch.dtype
    lora: Any
    """The transformer's `LoRAManager` when LoRA is on (the worker sets it once loaded), else None. A
    family whose `encode_requests` runs the transformer (Qwen-Image-2.1's prefix prefill) applies each
    request's adapter there; the others never read it."""
    prefix_row_bytes: int
    """Bytes one cached prefix row holds (a per-request prefix KV cache, Qwen-Image-2.1): the memory
    budget charges them; 0: no prefix cache."""
    prefix_arena: PrefixRowReservations | None
    """The fixed rows its prefix cache lives in, when the runner made one: the engine reserves them at
    admission; None otherwise."""
    cuda_graphs_off_reason: str | None
    """Why this family's step is not captured in CUDA graphs (logged); None: it is."""

    def release(self, req_ids: Any) -> int:
        """Free the per-request state of requests that ended (finished, failed, aborted); bytes freed."""
        ...

    def prefill_peak_bytes(self, num_prefix_rows: int) -> int:
        """Bytes filling a prefix of `num_prefix_rows` rows holds for a moment beyond the prefix cache
        itself (the memory budget charges it at admission, next to the decode slice); 0: no prefix."""
        ...

    def encode_requests(self, reqs: list, one_by_one: bool = False) -> dict[str, tuple]:
        """{req_id: (prompt rows [L, J], negative rows or None, condition or None)} of new requests."""
        ...

    def prepare_latents(
        self, params: OmniDiffusionSamplingParams, generator: torch.Generator
    ) -> torch.Tensor:
        """Initial noise of one request, drawn as the reference pipeline draws it: [n, rows, C_in]."""
        ...

    def sigma_schedule(self, params: OmniDiffusionSamplingParams) -> SigmaSchedule:
        """One request's own sigma schedule."""
        ...

    def latent_grid(self, params: OmniDiffusionSamplingParams) -> tuple[int, int, int]:
        """(frames, h, w) latent token grid of one image (a request scheduled without a geometry)."""
        ...

    def configure_vae(self, use_slicing: bool, use_tiling: bool) -> None:
        """The server's VAE memory modes."""
        ...

    def vae_modes(self, params: OmniDiffusionSamplingParams) -> Any:
        """The VAE modes `params` decodes with."""
        ...

    def decode(
        self, latents: torch.Tensor, height: int, width: int, output_type: str, modes: Any = None
    ) -> Any:
        """Packed latents of one image size -> images (PIL list, float array or latents)."""
        ...


class PromptCounter(Protocol):
    """Counts a request's prompt tokens with the tokenizer alone (the engine's side, no text encoder)."""

    def count(self, name: str, text: str) -> Any:
        """Token counts of one prompt (`num_embedded_tokens`, `num_user_tokens`); ValueError naming `name`
        when it is over the family's limit or encodes to nothing."""
        ...


class ImageInput(Protocol):
    """The image-input capability of a family (edit models): what HTTP needs before the engine."""

    max_input_images: int
    """Input images one request may carry."""

    def default_size(self, image: Any) -> tuple[int, int]:
        """(height, width) an edit of `image` gets when the request gives no size."""
        ...

    def check_image(self, image: Any) -> None:
        """`InvalidRequestError` naming `image` when the family cannot take it (before its size is used)."""
        ...


class ModelFamily(Protocol):
    """One pipeline class of `model_index.json` (`_class_name`), as the registry names it."""

    pipeline_class_name: str
    image_input: ImageInput | None
    """None: text-to-image; requests carrying an image are refused (`TEXT_TO_IMAGE_REFUSAL`)."""
    capabilities: FamilyCapabilities
    """What it supports (LoRA, parallelism, batch invariance, FP8, caching, dense forward, prefix cache,
    alpha output, its default sampling params), read before anything loads."""

    def load_pipeline(
        self,
        model: str,
        device: torch.device,
        dtype: torch.dtype,
        load_format: str = "auto",
        seed: int | None = None,
        attn_backend: Any = None,
        quantization: Any = None,
    ) -> StepPipeline:
        """The step pipeline of `model` (weights, or random ones with load_format 'dummy').
        `quantization` (a `QuantizationConfig` or None): handed to `load_transformer_weights`, which
        quantizes the selected linears as their weights load."""
        ...

    def load_components(
        self, model: str, device: str | torch.device, dtype: torch.dtype, load_format: str = "auto"
    ) -> Any:
        """The modules (`transformer`, `text_encoder`, `vae`, `transformer_config`); device 'meta' with
        load_format 'dummy' builds shapes only (the start-up memory estimate)."""
        ...

    def load_prompt_counter(self, model: str, load_format: str = "auto") -> PromptCounter:
        """The engine's prompt counter for `model` (tokenizer and processors, no weights)."""
        ...

    def request_geometry(self, prompts: PromptCounter, request: OmniDiffusionRequest) -> RequestGeometry:
        """The request's rows (latent grid, text, condition), computed once at admission; ValueError
        naming the field a request fails (a prompt over the limit, an image the family cannot take)."""
        ...

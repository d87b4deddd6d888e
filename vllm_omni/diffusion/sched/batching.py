"""Who may share a denoise step: the batching key, the MixFusion plan limit and the token cost.

Pure functions over `OmniDiffusionRequest`. The scheduler builds one `BatchingProfile` per request
when it arrives and, at admission, asks `find_join_blocker` whether a waiting request may join the
running batch. The rules and their rationale are in docs/design/scheduling.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from vllm_omni.config import OmniDiffusionConfig
from vllm_omni.diffusion.cache.cost import dynamic_cached_share, static_step_work
from vllm_omni.diffusion.models.interface import RequestGeometry, step_token_cost
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.diffusion.sched.interface import SamplingParamsKey

TextTokenCounter = Callable[[OmniDiffusionRequest], tuple[int, int]]
"""req -> (positive prompt tokens, negative prompt tokens) as the text encoder will see them."""

TEXT_TOKEN_OVERHEAD = 8
"""Estimated tokens a prompt carries besides its words when no tokenizer is at hand.

Qwen-Image wraps the prompt in a chat template and drops the first 34 template tokens; what remains
after the user text is `<|im_end|>\\n<|im_start|>assistant\\n` (about 5 tokens). 8 leaves slack for
punctuation that the tokenizer splits off words."""


def resolve_enable_mixfusion(
    req: OmniDiffusionRequest, server_default: bool, supports_mixfusion: bool
) -> bool:
    """MixFusion (mixed-shape batching) for this request.

    `extra_args["enable_mixfusion"]` when given, else the server default; always False when the
    pipeline cannot pack mixed shapes (a request asking for it then batches by shape, as without it).
    """
    if not supports_mixfusion:
        return False
    return bool(req.sampling_params.extra_args.get("enable_mixfusion", server_default))


def make_sampling_params_key(req: OmniDiffusionRequest, enable_mixfusion: bool) -> SamplingParamsKey:
    """The execution-barrier key of a request; only requests with equal keys share a step.

    Empty with MixFusion on; the image shape with it off (the request batches only with its own
    shape). CFG, LoRA, step counts, progress, text length, CFG scalars and seeds are never in the key.
    """
    if enable_mixfusion:
        return SamplingParamsKey()
    sp = req.sampling_params
    return SamplingParamsKey(height=sp.height, width=sp.width, num_frames=1)


def mixfusion_plan_ok(
    img_token_counts: Sequence[int], min_chunk_tokens: int | None, max_chunks: int | None
) -> tuple[bool, str]:
    """Check MixFusion's gcd-chunk plan for a batch of images.

    MixFusion splits every image sequence into chunks of `g = gcd(n_i)` tokens; a plan is rejected
    when the chunks are too small (`g < min_chunk_tokens`) or too many (`sum(n_i) / g > max_chunks`).
    Equal counts need no chunking (one chunk per image) and always pass.

    Example (token grids): (64, 64) + (52, 76) -> n = [4096, 3952], g = 16, 503 chunks: rejected;
    (64, 64) + (32, 32) -> n = [4096, 1024], g = 1024, 5 chunks: accepted.

    Args:
        img_token_counts: image tokens `(H/16) * (W/16)` of each image in the batch, each >= 1.
        min_chunk_tokens, max_chunks: the plan limits (>= 1); None = no limit (the default: the
            packed varlen forward needs no chunks).
    Returns:
        (ok, reason): the reason names the failing limit, or describes the accepted plan.
    """
    if any(n < 1 for n in img_token_counts):
        raise ValueError(f"img_token_counts must all be >= 1, got {list(img_token_counts)}")
    if len(set(img_token_counts)) <= 1:
        return True, "uniform image token counts: no chunking needed"
    chunk = math.gcd(*img_token_counts)
    num_chunks = sum(img_token_counts) // chunk
    if min_chunk_tokens is not None and chunk < min_chunk_tokens:
        return False, (
            f"MixFusion plan rejected: chunk size gcd{tuple(img_token_counts)} = {chunk} "
            f"< mixfusion_min_chunk_tokens = {min_chunk_tokens}"
        )
    if max_chunks is not None and num_chunks > max_chunks:
        return False, f"MixFusion plan rejected: {num_chunks} chunks > mixfusion_max_chunks = {max_chunks}"
    return True, f"MixFusion plan accepted: chunk size {chunk}, {num_chunks} chunks"


def estimate_text_tokens(req: OmniDiffusionRequest) -> tuple[int, int]:
    """Tokenizer-free estimate: `num_words + TEXT_TOKEN_OVERHEAD`, capped at `max_sequence_length`.

    Returns (positive, negative); the negative count is 0 when CFG is off (no negative sequence).
    """
    cap = req.sampling_params.max_sequence_length

    def count(text: str) -> int:
        return min(cap, len(text.split()) + TEXT_TOKEN_OVERHEAD)

    num_neg = count(req.negative_prompt or "") if req.do_classifier_free_guidance else 0
    return count(req.prompt), num_neg


def request_step_tokens(req: OmniDiffusionRequest, num_pos_text_tokens: int, num_neg_text_tokens: int) -> int:
    """Tokens one step of `req` puts in the forward.

    `num_outputs_per_prompt * ((img + pos_text) + (img + neg_text if CFG))`: every image is one
    sequence, two with CFG (the negative sequence repeats the image tokens); `step_token_cost`.
    """
    num_neg = num_neg_text_tokens if req.do_classifier_free_guidance else 0
    num_images = req.sampling_params.num_outputs_per_prompt
    return step_token_cost(req.num_img_tokens, 0, num_pos_text_tokens, num_neg, num_images)


@dataclass(frozen=True)
class BatchingProfile:
    """What admission needs to know about one request, computed once when it arrives."""

    key: SamplingParamsKey
    enable_mixfusion: bool
    """Mixed-shape batching for this request (its own toggle, else the server default)."""
    shape: tuple[int, int]
    """(height, width) in pixels."""
    img_token_counts: tuple[int, ...]
    """Image tokens of each of its images (`num_outputs_per_prompt` equal entries)."""
    num_step_tokens: int
    """Tokens it adds to every step's forward (see `request_step_tokens`)."""
    mixfusion_min_chunk_tokens: int | None
    """Plan limit used when this request joins a mixed batch (its extra_args, else the server's);
    None = no limit."""
    mixfusion_max_chunks: int | None
    geometry: RequestGeometry | None = None
    """The family's rows of the request (the engine's admission); None: estimated from the request
    (tools and tests that schedule without a model)."""
    step_work: tuple[float, ...] | None = None
    """Step caching with a static mask: per step, the share of a full step's blocks it runs
    (`cache.cost.static_step_work`); None: every step is a full one."""
    cached_step_share: float | None = None
    """Step caching decided on the device (dynamic DBCache, TeaCache): the share of a full step's
    blocks a cached step runs (`cache.cost.dynamic_cached_share`); None: not decided online."""

    def step_tokens(self, step: int) -> int:
        """`num_step_tokens` weighted by the share of the blocks step `step` runs (a cached step of a
        static mask is a cheap rider)."""
        if self.step_work is None or step >= len(self.step_work):
            return self.num_step_tokens
        return max(1, round(self.num_step_tokens * self.step_work[step]))


def build_batching_profile(
    req: OmniDiffusionRequest,
    config: OmniDiffusionConfig,
    server_enable_mixfusion: bool,
    supports_mixfusion: bool,
    text_token_counter: TextTokenCounter | None = None,
    geometry: RequestGeometry | None = None,
    cache_num_blocks: int = 0,
) -> BatchingProfile:
    """Build the request's profile: key, shape, token cost and MixFusion plan limits.

    With the family's `geometry` the token cost is its `num_step_tokens`; without, it is estimated
    from the request (`text_token_counter`, else `estimate_text_tokens`)."""
    sp = req.sampling_params
    enable_mixfusion = resolve_enable_mixfusion(req, server_enable_mixfusion, supports_mixfusion)
    if geometry is not None:
        num_img, num_step_tokens = geometry.num_img_tokens, geometry.num_step_tokens
    else:
        num_pos, num_neg = (text_token_counter or estimate_text_tokens)(req)
        num_img, num_step_tokens = req.num_img_tokens, request_step_tokens(req, num_pos, num_neg)
    extra = sp.extra_args
    cache = sp.resolve_cache(config.cache)
    return BatchingProfile(
        key=make_sampling_params_key(req, enable_mixfusion),
        enable_mixfusion=enable_mixfusion,
        shape=(sp.height, sp.width),
        img_token_counts=(num_img,) * sp.num_outputs_per_prompt,
        num_step_tokens=num_step_tokens,
        mixfusion_min_chunk_tokens=extra.get("mixfusion_min_chunk_tokens", config.mixfusion_min_chunk_tokens),
        mixfusion_max_chunks=extra.get("mixfusion_max_chunks", config.mixfusion_max_chunks),
        geometry=geometry,
        step_work=static_step_work(cache, sp.num_inference_steps, cache_num_blocks),
        cached_step_share=dynamic_cached_share(cache, cache_num_blocks),
    )


def find_join_blocker(
    candidate: BatchingProfile,
    running: Sequence[BatchingProfile],
    running_key: SamplingParamsKey | None,
    max_num_batched_tokens: int | None,
) -> str | None:
    """Why `candidate` may not join the running batch now, or None when it may.

    A request always joins an empty batch (so every request can run, alone if need be). Otherwise
    it needs the running key, room in the token budget and, when the batch would mix shapes, a
    MixFusion plan that passes the candidate's own limits over the whole batch. The `max_num_seqs`
    cap is the caller's.
    """
    if not running:
        return None
    if candidate.key != running_key:
        return f"key {candidate.key} differs from the running key {running_key}"
    if max_num_batched_tokens is not None:
        num_tokens = sum(p.num_step_tokens for p in running) + candidate.num_step_tokens
        if num_tokens > max_num_batched_tokens:
            return f"step would hold {num_tokens} tokens > max_num_batched_tokens = {max_num_batched_tokens}"
    if any(p.shape != candidate.shape for p in running):
        counts = [n for p in (*running, candidate) for n in p.img_token_counts]
        ok, reason = mixfusion_plan_ok(
            counts, candidate.mixfusion_min_chunk_tokens, candidate.mixfusion_max_chunks
        )
        if not ok:
            return reason
    return None

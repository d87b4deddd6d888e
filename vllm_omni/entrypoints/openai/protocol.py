"""Pydantic models of the OpenAI-compatible images API.

Fields OpenAI defines come first; our extensions follow the `# extensions`
marker. These models check JSON types and shapes only; what a value means (its
range) is checked once, by `OmniDiffusionSamplingParams.validate`. The server
converts a validated `ImageGenerationRequest` into the engine's
`OmniDiffusionRequest` at the edge (see `request_normalize.py`); the engine
never sees these models.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_PROMPT_CHARS = 100_000
"""Character cap on prompts; the token limit is checked later by the engine."""


class LoRAField(BaseModel):
    """vLLM-Omni's `lora` object; each field has the spellings vLLM-Omni accepts."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: str | None = None
    lora_name: str | None = None
    adapter: str | None = None
    path: str | None = None
    lora_path: str | None = None
    local_path: str | None = None
    scale: float | None = None
    lora_scale: float | None = None
    int_id: Annotated[int, Field(ge=0)] | None = None
    lora_int_id: Annotated[int, Field(ge=0)] | None = None


class ImageGenerationRequest(BaseModel):
    """Body of `POST /v1/images/generations` after `extra_body` / `extra_args` are merged.

    Strict: wrong JSON types (a string for `n`, a float for `seed`, a bool for a
    number) and unknown fields are errors, so typos do not pass silently.
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: Annotated[str, Field(min_length=1, max_length=MAX_PROMPT_CHARS)]
    model: str | None = None
    """Must be one of the served model names when given."""
    n: int | None = None
    """Images for this prompt (one engine request with `num_outputs_per_prompt=n`)."""
    size: str | None = None
    """'WIDTHxHEIGHT' or 'auto' (server default, 1024x1024 unless configured); sides are rounded down
    to multiples of 16, as diffusers does (the response's `size` is what was generated)."""
    response_format: Literal["b64_json", "url"] | None = None
    """Only 'b64_json' is supported; 'url' is answered with a 400."""
    output_format: Literal["png", "jpeg", "webp"] | None = None
    """Encoding of `b64_json`; default 'png' (lossless)."""
    output_compression: Annotated[int, Field(ge=0, le=100)] | None = None
    """Quality for 'jpeg' / 'webp' (default 95); ignored for 'png'."""
    background: Literal["auto", "opaque", "transparent"] | None = None
    """'auto' and 'opaque' are accepted; 'transparent' is answered with a 400."""
    stream: bool | None = None
    """`true`: answer with server-sent events, previews then the final image (docs/streaming.md)."""
    partial_images: int | None = None
    """Previews streamed before the final image (0-3; needs `stream: true`)."""
    quality: Literal["auto", "standard", "hd", "low", "medium", "high"] | None = None
    """Accepted and ignored (image quality follows `num_inference_steps`)."""
    style: Literal["vivid", "natural"] | None = None
    """Accepted and ignored."""
    moderation: Literal["auto", "low"] | None = None
    """Accepted and ignored (no moderation is applied)."""
    user: str | None = None
    """Logged with the request id; otherwise ignored."""
    safety_identifier: str | None = None
    """Logged with the request id; otherwise ignored."""

    # extensions
    height: int | None = None
    """Image height in pixels (vLLM-Omni's chat form); give `size` or `height`/`width`, not both."""
    width: int | None = None
    negative_prompt: Annotated[str, Field(max_length=MAX_PROMPT_CHARS)] | None = None
    """Enables true CFG together with `true_cfg_scale > 1`."""
    num_inference_steps: int | None = None
    true_cfg_scale: float | None = None
    guidance_scale: float | None = None
    """Accepted for API compatibility; Qwen-Image has no guidance embedding (as in diffusers)."""
    seed: int | None = None
    max_sequence_length: int | None = None
    flow_shift: float | None = None
    """Static sigma shift (diffusers' `shift` with `use_dynamic_shifting=False`); None = Qwen-Image's
    resolution-dependent shift."""
    sigmas: list[float] | None = None
    """Custom sigma schedule (diffusers' `QwenImagePipeline(sigmas=...)`): strictly decreasing in (0, 1],
    one per step; `num_inference_steps` defaults to its length."""
    timesteps: list[float] | None = None
    """Custom timesteps (diffusers' `set_timesteps(timesteps=...)`): strictly decreasing in (0, 1000],
    one per step; not together with `sigmas`."""
    generator_device: str | None = None
    """Only 'cpu': the seed always means `torch.Generator("cpu").manual_seed(seed)`."""
    lora: LoRAField | None = None
    lora_name: str | None = None
    lora_path: str | None = None
    local_path: str | None = None
    lora_scale: float | None = None
    lora_int_id: Annotated[int, Field(ge=0)] | None = None
    vae_use_slicing: bool | None = None
    """This request's VAE slicing (same pixels); None = the server's `--vae-use-slicing`."""
    vae_use_tiling: bool | None = None
    """This request's VAE tiling (pixels differ near tile seams); None = the server's `--vae-use-tiling`."""
    extra_args: dict[str, Any] | None = None
    """Per-request engine toggles (`vllm_omni.inputs.KNOWN_EXTRA_ARGS`)."""
    priority: int | None = None
    """vLLM's scheduling priority: lower runs first (--scheduling-policy latency); None = 0."""

    @field_validator("prompt")
    @classmethod
    def _prompt_not_blank(cls, prompt: str) -> str:
        if not prompt.strip():
            raise ValueError("must contain non-whitespace text")
        return prompt


class ImageData(BaseModel):
    """One generated image."""

    b64_json: str
    """The encoded image (PNG unless `output_format` says otherwise), base64."""
    revised_prompt: str | None = None
    url: str | None = None

    # extensions
    seed: int
    """The request's seed. Image i of n is the i-th draw from `Generator().manual_seed(seed)`,
    so the same seed and n reproduce every image."""
    index: int
    """Position of this image among the n images of the request."""


class ImageTimings(BaseModel):
    """Where the time of one request went, in seconds."""

    queue_s: float | None
    """Arrival at the engine to its first scheduled step (None if the engine did not report it)."""
    engine_s: float | None
    """Arrival at the engine to its finish (queue + denoise + decode)."""
    encode_s: float
    """Image encoding (PNG/JPEG/WebP + base64) in the server."""
    total_s: float
    """Request received by the HTTP handler to response ready."""
    num_steps_sat_out: int = 0
    """Denoise steps the request was started but sat out while shorter work ran (latency policy)."""
    num_preemptions: int = 0
    """Times it ran a step and then sat out the next."""
    num_cached_steps: list[int] | None = None
    """Step caching: steps each CFG branch reused its cached residual (per image: positive, then
    negative); None when the request ran uncached (docs/caching.md)."""


class ImageGenerationResponse(BaseModel):
    """OpenAI's `ImagesResponse` shape plus per-image seeds and timings."""

    created: int
    data: list[ImageData]
    size: str
    output_format: str
    quality: str | None = None
    background: str | None = None
    usage: dict[str, Any] | None = None
    """Always null: token usage is not reported for images."""

    # extensions
    id: str
    """The request id (also in the `X-Request-Id` response header)."""
    model: str
    timings: ImageTimings


class ModelCard(BaseModel):
    """One entry of `GET /v1/models`."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "vllm-omni"
    root: str | None = None
    parent: str | None = None


class ModelList(BaseModel):
    """`GET /v1/models` response."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    """OpenAI's error object."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every non-2xx answer: `{"error": {"message", "type", "param", "code"}}`."""

    error: ErrorInfo


# ---- chat completions (image output) ---------------------------------------------------------------


class TextPart(BaseModel):
    """`{"type": "text", "text": ...}`."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    """`{"url": "data:image/png;base64,..."}` (OpenAI's `image_url` object)."""

    url: str
    detail: str | None = None


class ImageURLPart(BaseModel):
    """`{"type": "image_url", "image_url": {"url": ...}}`."""

    type: Literal["image_url"] = "image_url"
    image_url: ImageURL


class ChatMessage(BaseModel):
    """One message of `messages`; the content is a string or a list of parts."""

    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[Annotated[TextPart | ImageURLPart, Field(discriminator="type")]] | None = None
    name: str | None = None


class ChatResponseMessage(BaseModel):
    """The assistant's answer: one `image_url` part per image."""

    role: Literal["assistant"] = "assistant"
    content: list[ImageURLPart]


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    finish_reason: Literal["stop"] = "stop"


class ChatCompletionResponse(BaseModel):
    """OpenAI's `ChatCompletion` shape with image content, plus seeds and timings."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: dict[str, int] | None = None
    """Always null: token usage is not reported for images."""

    # extensions
    seed: int
    size: str
    timings: ImageTimings

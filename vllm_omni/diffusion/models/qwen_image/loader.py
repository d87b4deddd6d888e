"""Load Qwen-Image's components from a diffusers-layout checkpoint, or build them with random weights.

    model                 path (registry.resolve_model_path)  load_format "auto"   load_format "dummy"
    "tiny-qwen-image"  -> built once into the cache            weights from files   configs of the dir
    local directory    -> itself (needs model_index)           weights from files   configs of the dir
    "Org/Name" repo id -> snapshot_download                    weights from files   REAL_* configs, no I/O

The transformer is ours (`QwenImageTransformer`, state-dict names identical to diffusers'); it is built
without allocating parameters and each safetensors tensor is moved straight to the target device and
dtype, one tensor at a time. VAE, text encoder and tokenizer are the diffusers / transformers classes.
`dummy` builds every module with parameters on the meta device and materialises each one directly on
the target device in the target dtype, filled from a seeded generator: a real-size model never exists
in fp32 on the host. `QWEN_IMAGE` is the family object `models/registry.py` names.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from vllm_omni.config import LOAD_FORMATS, TINY_MODEL_NAME
from vllm_omni.diffusion.layers.quantization import mark_for_quantization
from vllm_omni.diffusion.model_loader import (
    GIB,
    build_empty,
    finish,
    load_transformer_weights,
    local_model_dir,
    log_loaded,
    randomize_weights_,
    read_json,
    vae_dtype,
)
from vllm_omni.diffusion.models import registry
from vllm_omni.diffusion.models.interface import TEXT_TO_IMAGE_REFUSAL, FamilyCapabilities, RequestGeometry
from vllm_omni.diffusion.models.qwen_image import configs
from vllm_omni.diffusion.models.qwen_image.packing import LATENT_MULTIPLE
from vllm_omni.inputs import InvalidRequestError

if TYPE_CHECKING:
    from diffusers import AutoencoderKLQwenImage
    from transformers import PreTrainedTokenizerBase, Qwen2_5_VLForConditionalGeneration

logger = logging.getLogger(__name__)


@dataclass
class QwenImageComponents:
    """Everything the Qwen-Image pipeline needs, loaded, in eval mode, without gradients."""

    transformer: torch.nn.Module
    """Our `QwenImageTransformer` (diffusers' parameter names)."""
    vae: AutoencoderKLQwenImage
    text_encoder: Qwen2_5_VLForConditionalGeneration
    tokenizer: PreTrainedTokenizerBase
    scheduler_config: dict
    """Contents of scheduler/scheduler_config.json (sigma schedule constants)."""
    transformer_config: dict
    """Contents of transformer/config.json."""
    model_path: Path | None
    """The directory the components came from; None for a dummy model built from REAL_* configs."""
    processor: Any = None
    """Edit checkpoints: the `QwenImageEditProcessor` (qwen_image_edit/loader.py adds it); else None."""


def _make_transformer(transformer_config: dict, device, attn_backend) -> torch.nn.Module:
    from vllm_omni.diffusion.models.qwen_image.transformer import (
        QwenImageTransformer,
        QwenImageTransformerConfig,
    )

    config = QwenImageTransformerConfig.from_dict(transformer_config)
    return build_empty(lambda: QwenImageTransformer(config, attn_backend=attn_backend), device)


def load_qwen_image(
    model: str,
    device: str | torch.device,
    dtype: torch.dtype,
    load_format: str = "auto",
    seed: int | None = None,
    attn_backend: Any = None,
    quantization: Any = None,
) -> QwenImageComponents:
    """Load (or, with `load_format="dummy"`, build with random weights) every Qwen-Image component.

    `model`: `tiny-qwen-image`, a local diffusers-format directory or a Hugging Face repo id.
    `dtype` applies to the transformer and text encoder; the VAE is fp32 on CPU. `seed` fixes the
    dummy weights (default 0). `attn_backend` is passed to `QwenImageTransformer`; `quantization` to
    `load_transformer_weights` (checkpoint weights quantize as they load; dummy ones as they are
    drawn). `device="meta"` (dummy only) builds shapes without memory, e.g. to count real-size
    parameters.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    if load_format == "dummy":
        return _load_dummy(model, device, dtype, 0 if seed is None else seed, attn_backend, quantization)
    from diffusers import AutoencoderKLQwenImage
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    path = registry.resolve_model_path(model)
    logger.info("loading %s from %s onto %s in %s", model, path, device, dtype)
    start = time.perf_counter()
    transformer_config = read_json(path / "transformer" / "config.json")
    transformer = _make_transformer(transformer_config, device, attn_backend)
    load_transformer_weights(transformer, path / "transformer", device, dtype, quantization)
    log_loaded("transformer", transformer, start)
    start = time.perf_counter()
    vae = AutoencoderKLQwenImage.from_pretrained(path / "vae", torch_dtype=vae_dtype(device, dtype))
    log_loaded("VAE", vae, start)
    start = time.perf_counter()
    device_map = None if torch.device(device).type == "cpu" else str(torch.device(device))
    text_encoder = Qwen2_5_VLForConditionalGeneration.from_pretrained(
        path / "text_encoder", dtype=dtype, device_map=device_map
    )
    log_loaded("text encoder", text_encoder, start)
    return QwenImageComponents(
        transformer=finish(transformer),
        vae=finish(vae.to(device)),
        text_encoder=finish(text_encoder.to(device)),
        tokenizer=AutoTokenizer.from_pretrained(path / "tokenizer"),
        scheduler_config=read_json(path / "scheduler" / "scheduler_config.json"),
        transformer_config=transformer_config,
        model_path=path,
    )


def _dummy_source(model: str) -> Path | None:
    """Directory whose configs a dummy model copies: the tiny model's, a local dir, or None (REAL_*)."""
    if model in registry.TINY_MODELS:
        return registry.resolve_model_path(model)
    return local_model_dir(model)


def _load_dummy(
    model: str,
    device: str | torch.device,
    dtype: torch.dtype,
    seed: int,
    attn_backend: Any,
    quantization: Any = None,
) -> QwenImageComponents:
    from diffusers import AutoencoderKLQwenImage
    from transformers import AutoTokenizer, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    source = _dummy_source(model)
    if source is not None:
        transformer_config = read_json(source / "transformer" / "config.json")
        vae_config = read_json(source / "vae" / "config.json")
        text_config = Qwen2_5_VLConfig.from_pretrained(source / "text_encoder")
        scheduler_config = read_json(source / "scheduler" / "scheduler_config.json")
        tokenizer_dir = source / "tokenizer"
    else:
        transformer_config = dict(configs.REAL_TRANSFORMER_CONFIG)
        vae_config = dict(configs.REAL_VAE_CONFIG)
        kwargs = {k: v for k, v in configs.REAL_TEXT_ENCODER_CONFIG.items() if k != "architectures"}
        kwargs.pop("model_type")
        # The tiny tokenizer stands in for the real one (below): the encoder must look for ITS vision ids.
        for key in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
            kwargs[key] = configs.TINY_TEXT_ENCODER_CONFIG[key]
        text_config = Qwen2_5_VLConfig(**kwargs)
        scheduler_config = dict(configs.REAL_SCHEDULER_CONFIG)
        # Real tokenizer files cannot be fetched without network: the tiny tokenizer's ids (< 1100)
        # fit any Qwen2.5-VL vocabulary.
        tokenizer_dir = registry.ensure_tiny(TINY_MODEL_NAME) / "tokenizer"

    is_meta = torch.device(device).type == "meta"
    generator = None if is_meta else torch.Generator(device=device).manual_seed(seed)

    def materialise(what: str, module: torch.nn.Module, module_dtype: torch.dtype) -> torch.nn.Module:
        if is_meta:
            torch.nn.Module.to(module, dtype=module_dtype)  # shapes only (skips diffusers' fp32 warning)
            return finish(module)
        num_params = sum(p.numel() for p in module.parameters())
        num_bytes = num_params * torch.tensor([], dtype=module_dtype).element_size()
        logger.info(
            "building %s with random weights: %.2fM parameters, %.2f GiB in %s on %s",
            what, num_params / 1e6, num_bytes / GIB, module_dtype, device,
        )  # fmt: skip
        start = time.perf_counter()
        randomize_weights_(module, generator, device=device, dtype=module_dtype)
        log_loaded(f"{what} (dummy, random weights)", module, start)
        return finish(module)

    transformer = _make_transformer(transformer_config, device, attn_backend)
    if not is_meta:
        mark_for_quantization(transformer, quantization)  # quantized as drawn: an FP8-sized peak
    vae = build_empty(lambda: AutoencoderKLQwenImage.from_config(vae_config), device)
    text_encoder = build_empty(lambda: Qwen2_5_VLForConditionalGeneration(text_config), device)
    return QwenImageComponents(
        transformer=materialise("transformer", transformer, dtype),
        vae=materialise("VAE", vae, vae_dtype(device, dtype) if not is_meta else dtype),
        text_encoder=materialise("text encoder", text_encoder, dtype),
        tokenizer=AutoTokenizer.from_pretrained(tokenizer_dir),
        scheduler_config=scheduler_config,
        transformer_config=transformer_config,
        model_path=source,
    )


def tokenizer_dir(model: str, load_format: str = "auto") -> Path:
    """The tokenizer directory `load_qwen_image(model, load_format=...)` uses (no weights read)."""
    if load_format == "dummy":
        source = _dummy_source(model)
        if source is None:
            return registry.ensure_tiny(TINY_MODEL_NAME) / "tokenizer"
        return source / "tokenizer"
    return registry.resolve_model_path(model) / "tokenizer"


# ---------------------------------------------------------------------------------------------------------
# The family
# ---------------------------------------------------------------------------------------------------------


def count_prompts(prompts, request) -> tuple[Any, Any, int, int]:
    """(prompt tokens, negative tokens or None, positive rows, negative rows or 0 without CFG), before
    truncation; ValueError naming the prompt over the limit (`QwenImagePromptProcessor.count`)."""
    pos = prompts.count("prompt", request.prompt)
    neg = None
    if request.negative_prompt is not None:
        neg = prompts.count("negative_prompt", request.negative_prompt)
    num_neg = neg.num_embedded_tokens if neg is not None and request.do_classifier_free_guidance else 0
    return pos, neg, pos.num_embedded_tokens, num_neg


class QwenImageFamily:
    """Qwen-Image text-to-image (`QwenImagePipeline`): the `interface.ModelFamily` of this folder."""

    pipeline_class_name: ClassVar[str] = "QwenImagePipeline"
    image_input: ClassVar[Any] = None
    """Text-to-image: a request carrying an image is refused."""
    capabilities: ClassVar[FamilyCapabilities] = FamilyCapabilities(
        "Qwen-Image", lora=True, parallel=True, batch_invariant=True, prompt_embed_cache=True, caching=True
    )
    """LoRA, the parallel flags, batch-invariant mode and FP8 (its plans: plans.py); a dense forward; a
    text-only prompt encoder (the prompt-embedding cache); step caching (`forward_packed(..., cache=)`)."""

    def load_components(
        self, model: str, device: str | torch.device, dtype: torch.dtype, load_format: str = "auto"
    ) -> QwenImageComponents:
        """`load_qwen_image` (device 'meta' with 'dummy': shapes only)."""
        return load_qwen_image(model, device, dtype, load_format=load_format)

    def load_pipeline(
        self, model, device, dtype, load_format="auto", seed=None, attn_backend=None, quantization=None
    ):
        """`QwenImageStepPipeline` over `load_qwen_image`'s components."""
        from vllm_omni.diffusion.models.qwen_image.pipeline import QwenImageStepPipeline

        components = load_qwen_image(
            model,
            device,
            dtype,
            load_format=load_format,
            seed=seed,
            attn_backend=attn_backend,
            quantization=quantization,
        )
        return QwenImageStepPipeline(components, device=device, dtype=dtype)

    def load_prompt_counter(self, model: str, load_format: str = "auto"):
        """`QwenImagePromptProcessor` over the checkpoint's tokenizer (the engine's own copy)."""
        from transformers import AutoTokenizer

        from vllm_omni.diffusion.models.qwen_image.pipeline import QwenImagePromptProcessor

        return QwenImagePromptProcessor(AutoTokenizer.from_pretrained(tokenizer_dir(model, load_format)))

    def request_geometry(self, prompts, request) -> RequestGeometry:
        """Latent grid (1, H // 16, W // 16) and prompt rows after `max_sequence_length` truncation;
        an input image is refused."""
        if request.image is not None:
            raise InvalidRequestError(TEXT_TO_IMAGE_REFUSAL, "image")
        _, _, num_pos, num_neg = count_prompts(prompts, request)
        sp = request.sampling_params
        return self._geometry(sp, min(num_pos, sp.max_sequence_length), min(num_neg, sp.max_sequence_length))

    @staticmethod
    def _geometry(sp, num_txt: int, num_neg_txt: int, num_cond_rows: int = 0) -> RequestGeometry:
        multiple = LATENT_MULTIPLE
        return RequestGeometry(
            pixel_multiple=multiple,
            latent_grid=(1, sp.height // multiple, sp.width // multiple),
            num_txt_tokens=num_txt,
            num_neg_txt_tokens=num_neg_txt,
            num_cond_rows=num_cond_rows,
            num_images=sp.num_outputs_per_prompt,
        )


QWEN_IMAGE = QwenImageFamily()
"""The family object `registry.PIPELINES["QwenImagePipeline"]` names."""

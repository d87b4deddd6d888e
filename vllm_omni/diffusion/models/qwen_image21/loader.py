"""Load Qwen-Image-2.1's components from a diffusers-layout checkpoint (or build them with random weights).

    model                       path                              "auto"              "dummy"
    "tiny-qwen-image-2.1"  ->   built once into the cache          weights from files  its configs
    local directory        ->   itself (needs model_index.json)    weights from files  its configs
    "Qwen/Qwen-Image-2.1"  ->   Hub snapshot                       weights from files  REAL_* configs, no I/O
    other "Org/Name"       ->   Hub snapshot                       weights from files  (refused: no configs)

The transformer is ours (`QwenImage21Transformer`, diffusers' parameter names), loaded tensor by tensor
onto the device; the VAE and Qwen3-VL text encoder are the diffusers / transformers classes; the
processor is `TextProcessor` (text half of `Qwen3VLProcessor`). `QWEN_IMAGE21` is the family object.

`diffusers_pipeline(path)` builds diffusers' own `QwenImage21Pipeline` over the same files: the
reference our engine is compared against (tests, peer benchmarks).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar

import PIL.Image
import torch

from vllm_omni.config import LOAD_FORMATS
from vllm_omni.diffusion.layers.quantization import mark_for_quantization
from vllm_omni.diffusion.model_loader import (
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
from vllm_omni.diffusion.models.interface import FamilyCapabilities, RequestGeometry
from vllm_omni.diffusion.models.qwen_image21 import configs
from vllm_omni.diffusion.models.qwen_image21.configs import PIPELINE_CLASS_NAME
from vllm_omni.diffusion.models.qwen_image21.pipeline import (
    DEFAULT_SAMPLING_PARAMS,
    PIXEL_MULTIPLE,
    VAE_SCALE_FACTOR,
    reference_images,
)
from vllm_omni.diffusion.models.qwen_image21.processor import (
    MAX_REFERENCE_IMAGES,
    PromptCounter,
    TextProcessor,
    reference_size,
)
from vllm_omni.inputs import InvalidRequestError

logger = logging.getLogger(__name__)


def diffusers_pipeline(path: str | Path, dtype=None):
    """diffusers' `QwenImage21Pipeline` over checkpoint `path`, with our text-only processor (the real
    `Qwen3VLProcessor` needs torchvision for its video half)."""
    from diffusers import (
        AutoencoderKLQwenImage21,
        FlowMatchEulerDiscreteScheduler,
        QwenImage21Pipeline,
        QwenImage21Transformer2DModel,
    )
    from transformers import Qwen3VLForConditionalGeneration

    path, dtype = Path(path), dtype or torch.float32
    return QwenImage21Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(path / "scheduler"),
        vae=AutoencoderKLQwenImage21.from_pretrained(path / "vae", torch_dtype=dtype),
        text_encoder=Qwen3VLForConditionalGeneration.from_pretrained(path / "text_encoder", dtype=dtype),
        processor=TextProcessor.from_pretrained(path / "processor"),
        transformer=QwenImage21Transformer2DModel.from_pretrained(path / "transformer", torch_dtype=dtype),
        sample_sigmas=None,
    )


# ---------------------------------------------------------------------------------------------------------
# Components
# ---------------------------------------------------------------------------------------------------------


@dataclass
class QwenImage21Components:
    """Everything the Qwen-Image-2.1 step pipeline needs, loaded, in eval mode, without gradients."""

    transformer: torch.nn.Module
    """Our `QwenImage21Transformer` (diffusers' parameter names)."""
    vae: Any
    """diffusers' `AutoencoderKLQwenImage21` (RGBA)."""
    text_encoder: Any
    """transformers' `Qwen3VLForConditionalGeneration`."""
    processor: TextProcessor
    scheduler_config: dict
    transformer_config: dict
    model_path: Path | None
    sample_sigmas: list[float] | None = None
    """`model_index.json`'s configured sigma grid (diffusers' `sample_sigmas`), or None."""


def _make_transformer(transformer_config: dict, device, attn_backend=None) -> torch.nn.Module:
    from vllm_omni.diffusion.models.qwen_image21.transformer import (
        QwenImage21Transformer,
        QwenImage21TransformerConfig,
    )

    config = QwenImage21TransformerConfig.from_dict(transformer_config)
    return build_empty(lambda: QwenImage21Transformer(config, attn_backend=attn_backend), device)


def _checkpoint_dir(model: str, load_format: str) -> Path | None:
    """The checkpoint directory (a dummy model copies its configs); None for the released repo id
    with --load-format dummy and no local copy: its components come from `configs.REAL_*`."""
    if load_format == "dummy" and model not in registry.TINY_MODELS:
        path = local_model_dir(model)
        if path is None and registry.KNOWN_REPOS.get(model) == PIPELINE_CLASS_NAME:
            return None
        if path is None:
            raise ValueError(
                f"--load-format dummy for {model!r}: Qwen-Image-2.1 builds dummy weights from the configs "
                "of a local checkpoint directory, of Qwen/Qwen-Image-2.1 or of tiny-qwen-image-2.1; pass "
                "one of those"
            )
        return path
    return registry.resolve_model_path(model)


def _processor_dir(model: str, load_format: str) -> Path:
    """The processor (tokenizer) directory `load_qwen_image21` uses, without reading any weights."""
    path = _checkpoint_dir(model, load_format)
    return path / "processor" if path is not None else _stand_in_processor_dir()


def _stand_in_processor_dir() -> Path:
    """The tiny checkpoint's processor: the real tokenizer cannot be fetched without network."""
    return registry.ensure_tiny("tiny-qwen-image-2.1") / "processor"


@dataclass(frozen=True)
class _Configs:
    """Where each component's config comes from: a checkpoint directory's files, or `configs.REAL_*`."""

    transformer: dict
    vae: dict
    text_encoder: Any
    """a `Qwen3VLConfig`"""
    scheduler: dict
    processor_dir: Path
    sample_sigmas: list[float] | None

    @classmethod
    def from_dir(cls, path: Path) -> _Configs:
        from transformers import Qwen3VLConfig

        return cls(
            transformer=read_json(path / "transformer" / "config.json"),
            vae=read_json(path / "vae" / "config.json"),
            text_encoder=Qwen3VLConfig.from_pretrained(path / "text_encoder"),
            scheduler=read_json(path / "scheduler" / "scheduler_config.json"),
            processor_dir=path / "processor",
            sample_sigmas=read_json(path / "model_index.json").get("sample_sigmas"),
        )

    @classmethod
    def real_size(cls) -> _Configs:
        """The released model's sizes; the tiny checkpoint's processor (tokenizer) stands in."""
        from transformers import Qwen3VLConfig

        return cls(
            transformer=dict(configs.REAL_TRANSFORMER_CONFIG),
            vae=dict(configs.REAL_VAE_CONFIG),
            text_encoder=Qwen3VLConfig(**configs.REAL_TEXT_ENCODER_CONFIG),
            scheduler=dict(configs.TINY_SCHEDULER_CONFIG),
            processor_dir=_stand_in_processor_dir(),
            sample_sigmas=configs.MODEL_INDEX["sample_sigmas"],
        )


def load_qwen_image21(
    model: str,
    device: str | torch.device,
    dtype: torch.dtype,
    load_format: str = "auto",
    seed: int | None = None,
    attn_backend: Any = None,
    quantization: Any = None,
) -> QwenImage21Components:
    """Load every Qwen-Image-2.1 component (`load_format="dummy"`: random weights from the configs).

    `dtype` applies to the transformer and the text encoder; the VAE is fp32 on CPU. `attn_backend`
    (a name, an instance or None: chosen at first use) is the transformer's step attention;
    `quantization` goes to `load_transformer_weights` (checkpoint weights quantize as they load)."""
    from diffusers import AutoencoderKLQwenImage21
    from transformers import Qwen3VLForConditionalGeneration

    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    path = _checkpoint_dir(model, load_format)
    where = path if path is not None else "the released model's configs (REAL_*)"
    logger.info("loading %s (%s) from %s onto %s in %s", model, load_format, where, device, dtype)
    found = _Configs.from_dir(path) if path is not None else _Configs.real_size()
    transformer_config = found.transformer
    transformer = _make_transformer(transformer_config, device, attn_backend)
    if load_format == "dummy":
        vae = build_empty(lambda: AutoencoderKLQwenImage21.from_config(found.vae), device)
        text_encoder = build_empty(lambda: Qwen3VLForConditionalGeneration(found.text_encoder), device)
        if torch.device(device).type != "meta":
            mark_for_quantization(transformer, quantization)  # quantized as drawn: an FP8-sized peak
            generator = torch.Generator(device=device).manual_seed(0 if seed is None else seed)
            for module, module_dtype in (
                (transformer, dtype),
                (vae, vae_dtype(device, dtype)),
                (text_encoder, dtype),
            ):
                randomize_weights_(module, generator, device=device, dtype=module_dtype)
    else:
        start = time.perf_counter()
        load_transformer_weights(transformer, path / "transformer", device, dtype, quantization)
        log_loaded("transformer", transformer, start)
        vae = AutoencoderKLQwenImage21.from_pretrained(path / "vae", torch_dtype=vae_dtype(device, dtype))
        text_encoder = Qwen3VLForConditionalGeneration.from_pretrained(path / "text_encoder", dtype=dtype)
    return QwenImage21Components(
        transformer=finish(transformer),
        vae=finish(vae.to(device)),
        text_encoder=finish(text_encoder.to(device)),
        processor=TextProcessor.from_pretrained(found.processor_dir),
        scheduler_config=found.scheduler,
        transformer_config=transformer_config,
        model_path=path,
        sample_sigmas=found.sample_sigmas,
    )


# ---------------------------------------------------------------------------------------------------------
# The family
# ---------------------------------------------------------------------------------------------------------


class ReferenceImageInput:
    """Qwen-Image-2.1's image-input capability (`interface.ImageInput`): up to `MAX_REFERENCE_IMAGES`
    reference images per request."""

    max_input_images: ClassVar[int] = MAX_REFERENCE_IMAGES

    def default_size(self, image) -> tuple[int, int]:
        """(height, width): diffusers' default for an edit, the (last) reference's aspect at 1024^2 area."""
        width, height = reference_size(image)
        return height, width

    def check_image(self, image) -> None:
        """`InvalidRequestError` for an image the pipeline cannot resize to a 32-pixel grid."""
        width, height = reference_size(image)
        if min(image.size) < 1 or width < 32 or height < 32:
            raise InvalidRequestError(
                f"image: {image.size[0]}x{image.size[1]} is too small or too elongated for Qwen-Image-2.1 "
                f"(it resizes to {width}x{height}; both sides must reach 32 pixels)",
                "image",
            )

    def check_images(self, image) -> list:
        """A request's reference images (None, one PIL image or a list) as a list, each checked;
        `InvalidRequestError` naming `image` and the limit for more than `max_input_images`."""
        images = reference_images(image)
        if len(images) > self.max_input_images:
            raise InvalidRequestError(
                f"image: Qwen-Image-2.1 takes at most {self.max_input_images} reference images, "
                f"got {len(images)}",
                "image",
            )
        for item in images:
            if not isinstance(item, PIL.Image.Image):
                raise InvalidRequestError(
                    f"image must be a decoded PIL image (or a list of them), got {type(item).__name__}",
                    "image",
                )
            self.check_image(item)
        return images


class QwenImage21Family:
    """Qwen-Image-2.1 (`QwenImage21Pipeline`): the `interface.ModelFamily` of this folder."""

    pipeline_class_name: ClassVar[str] = PIPELINE_CLASS_NAME
    image_input: ClassVar[Any] = ReferenceImageInput()
    """Text-to-image, or an edit with 1 to `MAX_REFERENCE_IMAGES` reference images."""
    capabilities: ClassVar[FamilyCapabilities] = FamilyCapabilities(
        "Qwen-Image-2.1",
        lora=True,
        batch_invariant=True,
        dense_forward=False,
        prefix_cache=True,
        outputs_alpha=True,
        default_sampling_params=MappingProxyType(DEFAULT_SAMPLING_PARAMS),
    )
    """LoRA and batch-invariant mode (its plans: plans.py) and FP8; no parallel flags yet. Every step
    packed (the dense forward has no request ids to reach the prefix cache); each request keeps its
    prefix K/V for its whole run, charged at admission (`--kv-cache-memory-bytes`); RGBA images
    (`background: "transparent"`); its sampling defaults (40 steps, true_cfg_scale 1.0, CFG not
    renormalised)."""

    def load_components(self, model, device, dtype, load_format="auto") -> QwenImage21Components:
        return load_qwen_image21(model, device, dtype, load_format=load_format)

    def load_pipeline(
        self, model, device, dtype, load_format="auto", seed=None, attn_backend=None, quantization=None
    ):
        """`QwenImage21StepPipeline` over `load_qwen_image21`'s components; `attn_backend` is the packed
        step's attention (`--attention-backend`)."""
        from vllm_omni.diffusion.models.qwen_image21.pipeline import QwenImage21StepPipeline

        components = load_qwen_image21(
            model,
            device,
            dtype,
            load_format=load_format,
            seed=seed,
            attn_backend=attn_backend,
            quantization=quantization,
        )
        return QwenImage21StepPipeline(components, device=device, dtype=dtype)

    def load_prompt_counter(self, model: str, load_format: str = "auto") -> PromptCounter:
        return PromptCounter(TextProcessor.from_pretrained(_processor_dir(model, load_format)).tokenizer)

    def request_geometry(self, prompts: PromptCounter, request) -> RequestGeometry:
        """Latent grid (1, H / 16, W / 16) and prefix rows: the encoder rows (no truncation, as diffusers)
        with every reference image's slots expanded to their latent rows, for the prompt and, with CFG,
        the negative prompt. Those rows are what each step's attention reads and what the prefix KV
        cache holds for the request's whole run (`num_prefix_cache_rows`)."""
        images = self.image_input.check_images(request.image)
        sp = request.sampling_params
        num_txt = prompts.count("prompt", request.prompt, images).num_prefix_rows
        num_neg = 0
        if request.do_classifier_free_guidance:
            num_neg = prompts.count("negative_prompt", request.negative_prompt, images).num_prefix_rows
        return RequestGeometry(
            pixel_multiple=PIXEL_MULTIPLE,
            latent_grid=(1, sp.height // VAE_SCALE_FACTOR, sp.width // VAE_SCALE_FACTOR),
            num_txt_tokens=num_txt,
            num_neg_txt_tokens=num_neg,
            num_images=sp.num_outputs_per_prompt,
            num_prefix_cache_rows=num_txt + num_neg,
        )


QWEN_IMAGE21 = QwenImage21Family()
"""The family object `registry.PIPELINES["QwenImage21Pipeline"]` names."""

"""Offline API: `Omni(model=...).generate(prompts, sampling_params)`.

All prompts are submitted at once, so the engine batches them step by step
exactly as it would concurrent HTTP requests. vLLM-Omni's keyword form works too:
`omni.generate(prompt_or_list, height=..., width=..., num_inference_steps=...,
negative_prompt=..., true_cfg_scale=..., generator=torch.Generator().manual_seed(s))`.
"""

from __future__ import annotations

import concurrent.futures
import copy
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import Any

from tqdm.auto import tqdm

from vllm_omni.config import OmniDiffusionConfig
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.inputs import OmniDiffusionSamplingParams
from vllm_omni.lora.config import with_adapter_defaults

_CONFIG_FIELDS = {f.name for f in fields(OmniDiffusionConfig)}
_SAMPLING_FIELDS = {f.name for f in fields(OmniDiffusionSamplingParams)}
PROGRESS_INTERVAL_S = 0.2
"""How often the offline progress bars read the engine's step counts."""


def seed_from_generator(generator: Any) -> int:
    """The seed of a freshly seeded CPU `torch.Generator` (what diffusers' examples pass).

    The engine draws each request's noise from `torch.Generator("cpu").manual_seed(seed)`, so a
    generator is accepted only when it is exactly that: CPU, and not advanced since `manual_seed`.
    """
    import torch

    if isinstance(generator, list):
        if len(generator) != 1:
            raise ValueError(
                "pass one generator per request (a list of per-image generators is not supported)"
            )
        generator = generator[0]
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    if generator.device.type != "cpu":
        raise ValueError(
            f"generator on {generator.device} is not supported: the seed always seeds a CPU generator "
            "here (pass torch.Generator('cpu').manual_seed(s) or seed=s)"
        )
    seed = generator.initial_seed()
    fresh = torch.Generator("cpu").manual_seed(seed)
    if not torch.equal(fresh.get_state(), generator.get_state()):
        raise ValueError(
            "generator has been used since manual_seed(); pass a freshly seeded generator or seed=s"
        )
    return seed


def sampling_params_from_kwargs(
    defaults: Mapping[str, Any], kwargs: dict[str, Any], adapter_defaults: dict[str, dict] | None = None
) -> OmniDiffusionSamplingParams:
    """vLLM-Omni's keyword sampling fields (plus `generator`) -> one `OmniDiffusionSamplingParams`.
    A `lora_request` naming an adapter with `default_sampling_params` (`adapter_defaults`) gets them
    under the keywords given."""
    lora_request = kwargs.get("lora_request")
    params = with_adapter_defaults(defaults, lora_request, adapter_defaults)
    if "extra_args" in kwargs and isinstance(kwargs["extra_args"], dict):
        kwargs = {**kwargs, "extra_args": {**params.get("extra_args", {}), **kwargs["extra_args"]}}
    generator = kwargs.pop("generator", None)
    unknown = set(kwargs) - _SAMPLING_FIELDS
    if unknown:
        raise TypeError(f"unknown sampling arguments {sorted(unknown)}; accepted: {sorted(_SAMPLING_FIELDS)}")
    params.update(kwargs)
    schedule = _first_schedule(kwargs)
    if schedule is not None and "num_inference_steps" not in kwargs:
        params["num_inference_steps"] = len(schedule)  # a custom schedule sets the step count
    if generator is not None:
        seed = seed_from_generator(generator)
        if params.get("seed") is not None and params["seed"] != seed:
            raise ValueError(f"seed={params['seed']} and generator (seed {seed}) disagree; pass one")
        params["seed"] = seed
    return OmniDiffusionSamplingParams(**params)


def _first_schedule(kwargs: dict[str, Any]):
    """The custom `sigmas` or `timesteps` given (a sized value), else None."""
    for name in ("sigmas", "timesteps"):
        value = kwargs.get(name)
        if value is not None and hasattr(value, "__len__"):
            return value
    return None


@dataclass
class OmniPartialOutput:
    """A streamed prompt's preview (`generate(..., stream=True)`): its images decoded from the
    clean-image estimate after `num_steps_done` steps."""

    request_id: str
    prompt: str
    images: Any
    """As `OmniRequestOutput.images`, in the request's output type."""
    partial_image_index: int
    """0, 1, ... in order (OpenAI's `partial_image_index`)."""
    num_steps_done: int


@dataclass
class OmniRequestOutput:
    """The result of one prompt."""

    request_id: str
    prompt: str
    images: Any
    """A list of PIL images ('pil'), an array [n, H, W, 3] ('np'), or latents ('latent')."""
    seed: int
    """The seed used (assigned when the request gave none)."""
    height: int
    width: int
    error: str | None = None
    """Set (and `images` empty) when the request failed."""
    final_output_type: str = "image"
    """vLLM-Omni's output kind; always 'image' here."""

    @property
    def request_output(self) -> list[OmniRequestOutput]:
        """vLLM-Omni's per-stage outputs: one diffusion stage here, so `[self]`
        (`outputs[0].request_output[0].images` are this prompt's images)."""
        return [self]


class Omni:
    """Offline diffusion generation with step-wise continuous batching.

    Keyword arguments are `OmniDiffusionConfig` fields (`step_execution`,
    `max_num_seqs`, `dtype`, `device`, `enable_mixfusion`, ...).
    """

    default_sampling_params: Mapping[str, Any] = MappingProxyType({})
    """What a prompt's params are built on: the engine's `default_sampling_params` (the model's own
    defaults under the config's)."""
    _max_input_images: int = 1
    """Input images one prompt's `multi_modal_data` may carry (the family's; Qwen-Image-2.1: 10)."""

    def __init__(self, model: str | None = None, **kwargs: Any):
        unknown = set(kwargs) - _CONFIG_FIELDS
        if unknown:
            raise TypeError(f"unknown Omni arguments {sorted(unknown)}; accepted: {sorted(_CONFIG_FIELDS)}")
        from vllm_omni.diffusion.engine import DiffusionEngine

        if model is not None:
            kwargs["model"] = model
        self.config = OmniDiffusionConfig.from_env_defaults(**kwargs)
        from vllm_omni.entrypoints.cli.startup_checks import startup_errors

        # the server's start-up checks (device, weights, memory, parallel sizes, attention backend):
        # one message naming the setting, before anything loads
        errors = startup_errors(self.config)
        if errors:
            raise ValueError("; ".join(errors))
        self.engine = DiffusionEngine(self.config)
        self.default_sampling_params = self.engine.default_sampling_params
        image_input = self.engine.image_input
        self._max_input_images = image_input.max_input_images if image_input is not None else 1
        self._closed = False

    def generate(
        self,
        prompts: str | dict | list[str | dict],
        sampling_params: OmniDiffusionSamplingParams | list[OmniDiffusionSamplingParams] | None = None,
        use_tqdm: bool = True,
        raise_on_error: bool = True,
        *,
        negative_prompt: str | None = None,
        stream: bool = False,
        **sampling_kwargs: Any,
    ) -> list[OmniRequestOutput] | Iterator[OmniPartialOutput | OmniRequestOutput]:
        """Generate images for each prompt; returns one output per prompt, in order.

        stream: instead return an iterator over every prompt's outputs as they come: its previews
            (`OmniPartialOutput`, `partial_images` of them: a sampling field, 0-3) and then its final
            `OmniRequestOutput`, prompts interleaved (docs/streaming.md). Leaving it early aborts
            the prompts still running.

        prompts: strings or `{"prompt": ..., "negative_prompt": ..., "multi_modal_data": {"image": img}}`
            dicts; edit models need the image (a PIL image, as vLLM-Omni takes it).
        sampling_params: one object for all prompts, or one per prompt.
        negative_prompt, **sampling_kwargs: vLLM-Omni's keyword form instead of `sampling_params`:
            `OmniDiffusionSamplingParams` fields (`height`, `width`, `num_inference_steps`,
            `true_cfg_scale`, `seed`, `num_outputs_per_prompt`, ...) and `generator` (a freshly
            seeded CPU `torch.Generator`, equivalent to `seed`), applied to every prompt.
        """
        if self._closed:
            raise RuntimeError("this Omni is closed; create a new one")
        if sampling_kwargs:
            if sampling_params is not None:
                raise TypeError("pass sampling_params or keyword sampling arguments, not both")
            sampling_params = sampling_params_from_kwargs(
                self.default_sampling_params, sampling_kwargs, self.config.lora.adapter_defaults
            )
        if negative_prompt is not None:
            prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
            prompts = [_with_negative(p, negative_prompt) for p in prompts]
        requests = self._make_requests(prompts, sampling_params)
        if stream:
            return self._stream(requests, raise_on_error)
        if any(r.sampling_params.partial_images for r in requests):
            raise ValueError("partial_images needs stream=True (previews are yielded by the stream)")
        handles = []
        try:
            for req in requests:
                handles.append(self.engine.add_request(req))
        except Exception:  # a bad prompt: the ones already queued must not run on unseen
            for handle in handles:
                self.engine.abort(handle.req_id)
            raise
        if use_tqdm:
            self._show_progress(requests, handles)
        return [self._collect(req, h.future, raise_on_error) for req, h in zip(requests, handles)]

    def _show_progress(self, requests: list[OmniDiffusionRequest], handles: list) -> None:
        """Two bars until every request has finished: requests done, and denoise steps done (the
        steps of all requests together; a request's steps count as they run)."""
        num_steps = sum(r.sampling_params.num_inference_steps for r in requests)
        futures = [h.future for h in handles]
        with (
            tqdm(total=len(futures), desc="Generating", unit="req") as bar,
            tqdm(total=num_steps, desc="Denoising", unit="step") as steps_bar,
        ):
            while True:
                done, _ = concurrent.futures.wait(futures, timeout=PROGRESS_INTERVAL_S)
                steps = sum(self._steps_done(h) for h in handles)
                steps_bar.update(min(steps, num_steps) - steps_bar.n)
                bar.update(len(done) - bar.n)
                if len(done) == len(futures):
                    return

    def _steps_done(self, handle) -> int:
        """Denoise steps a request has run: its output's count once finished, else the engine's."""
        if not handle.future.done():
            return self.engine.num_steps_done(handle.req_id)
        if handle.future.exception() is not None:
            output = getattr(handle.future.exception(), "output", None)
            return output.num_steps_done if output is not None else 0
        return handle.future.result().num_steps_done

    def _stream(self, requests: list[OmniDiffusionRequest], raise_on_error: bool):
        from vllm_omni.diffusion.outputs import PartialImage
        from vllm_omni.entrypoints.stream_outputs import iter_request_outputs

        for i, item in iter_request_outputs(self.engine, requests):
            req = requests[i]
            if isinstance(item, PartialImage):
                yield OmniPartialOutput(
                    req.request_id, req.prompt, item.images, item.partial_image_index, item.step_index
                )
                continue
            future: concurrent.futures.Future = concurrent.futures.Future()
            if isinstance(item, BaseException):
                future.set_exception(item)
            else:
                future.set_result(item)
            yield self._collect(req, future, raise_on_error)

    @staticmethod
    def _collect(req: OmniDiffusionRequest, future, raise_on_error: bool) -> OmniRequestOutput:
        sp = req.sampling_params
        try:
            result = future.result()
        except Exception as exc:
            if raise_on_error:
                raise
            return OmniRequestOutput(req.request_id, req.prompt, [], sp.seed, sp.height, sp.width, str(exc))
        return OmniRequestOutput(
            req.request_id, req.prompt, result.images, result.seed, result.height, result.width
        )

    def _make_requests(self, prompts, sampling_params) -> list[OmniDiffusionRequest]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        elif isinstance(prompts, (list, tuple)):
            prompts = list(prompts)
        else:  # a set has no order to give the outputs in; None, numbers, ... are no prompts
            raise TypeError(
                f"prompts must be a string, a prompt dict or a list of them, got {type(prompts).__name__}"
            )
        if sampling_params is None:
            sampling_params = OmniDiffusionSamplingParams(**self.default_sampling_params)
        if isinstance(sampling_params, OmniDiffusionSamplingParams):
            params_list = [copy.deepcopy(sampling_params) for _ in prompts]
        elif isinstance(sampling_params, (list, tuple)) and all(
            isinstance(p, OmniDiffusionSamplingParams) for p in sampling_params
        ):
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"got {len(params_list)} sampling_params for {len(prompts)} prompts; "
                    "pass one object or one per prompt"
                )
        else:
            raise TypeError(
                "sampling_params must be an OmniDiffusionSamplingParams or a list of them (one per "
                f"prompt), got {type(sampling_params).__name__}; keyword arguments work too"
            )
        requests = []
        for prompt, params in zip(prompts, params_list):
            image = None
            if isinstance(prompt, dict):
                unknown = set(prompt) - {"prompt", "negative_prompt", "multi_modal_data"}
                if unknown:
                    raise ValueError(
                        f"unknown prompt keys {sorted(unknown)}; use 'prompt', 'negative_prompt' and "
                        "'multi_modal_data'"
                    )
                text, negative = prompt.get("prompt"), prompt.get("negative_prompt")
                image = _input_image(prompt.get("multi_modal_data"), self._max_input_images)
            else:
                text, negative = prompt, None
            requests.append(
                OmniDiffusionRequest(
                    request_id=f"offline-{uuid.uuid4().hex[:12]}",
                    prompt=text,
                    negative_prompt=negative,
                    sampling_params=copy.deepcopy(params),
                    image=image,
                )
            )
        return requests

    def close(self) -> None:
        """Stop the engine loop (and any worker processes); `generate` refuses afterwards."""
        self._closed = True
        self.engine.shutdown()

    def __enter__(self) -> Omni:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _with_negative(prompt: str | dict, negative_prompt: str) -> dict:
    """A prompt with the call-wide `negative_prompt` (a prompt dict's own one wins)."""
    if isinstance(prompt, dict):
        return {"negative_prompt": negative_prompt, **prompt}
    return {"prompt": prompt, "negative_prompt": negative_prompt}


def _input_image(multi_modal_data, max_images: int = 1):
    """The PIL image of `multi_modal_data` ({"image": img} or {"image": [img, ...]}): one image, a list of
    them for a model taking several (`max_images`, the family's limit; more are refused naming it), or
    None."""
    if multi_modal_data is None:
        return None
    from PIL import Image

    from vllm_omni.entrypoints.openai.image_input import as_rgb_or_rgba, too_many_images

    if not isinstance(multi_modal_data, dict) or set(multi_modal_data) - {"image"}:
        raise ValueError("multi_modal_data must be {'image': <PIL image or list of them>}")
    image = multi_modal_data.get("image")
    if image is None:
        return None
    param = "multi_modal_data['image']"
    images = list(image) if isinstance(image, (list, tuple)) else [image]
    if not images:
        raise ValueError(f"{param} is an empty list; pass an image, or no multi_modal_data")
    if len(images) > max_images:
        raise ValueError(too_many_images(param, max_images, len(images)))
    for item in images:
        if not isinstance(item, Image.Image):
            raise ValueError(f"{param} must be a PIL image, got {type(item).__name__}")
    decoded = [as_rgb_or_rgba(item, param) for item in images]  # as the HTTP routes decode them
    return decoded[0] if len(decoded) == 1 else decoded

"""The request as the engine sees it: identity, prompts, sampling params, status."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from PIL import Image

from vllm_omni.inputs import OmniDiffusionSamplingParams


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request. Values at or above FINISHED_COMPLETED are final."""

    WAITING = 0
    RUNNING = 1
    FINISHED_COMPLETED = 2
    FINISHED_ABORTED = 3
    FINISHED_ERROR = 4

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_COMPLETED


@dataclass
class OmniDiffusionRequest:
    """One text-to-image or image-edit request (one prompt, `num_outputs_per_prompt` images)."""

    request_id: str
    prompt: str
    negative_prompt: str | None = None
    """None means no negative prompt: CFG is then off whatever `true_cfg_scale` is."""
    sampling_params: OmniDiffusionSamplingParams = field(default_factory=OmniDiffusionSamplingParams)
    arrival_time: float = field(default_factory=time.monotonic)
    image: Image.Image | list[Image.Image] | None = None
    """Edit models: the decoded input image (never a path or URL), or a list of them for a family that
    takes several (Qwen-Image-2.1: up to 10 reference images, in order); None for text-to-image."""

    @property
    def do_classifier_free_guidance(self) -> bool:
        """True CFG runs only with scale > 1 and a negative prompt, as in diffusers."""
        return self.sampling_params.true_cfg_scale > 1.0 and self.negative_prompt is not None

    @property
    def num_img_tokens(self) -> int:
        """Packed image tokens of one image: (H/16) * (W/16)."""
        sp = self.sampling_params
        return (sp.height // 16) * (sp.width // 16)

"""Per-request state kept on the worker between steps.

Built once when a request is admitted (prompt encoding, noise, schedule); after
that only its id and step index cross from the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_omni.diffusion.cache.step import Branch
from vllm_omni.diffusion.models.interface import step_token_cost
from vllm_omni.diffusion.solvers.flow_match import SigmaSchedule
from vllm_omni.inputs import OmniDiffusionSamplingParams


@dataclass
class DiffusionRequestState:
    """Everything one request needs to take its next denoise step."""

    req_id: str
    """The engine's id."""
    params: OmniDiffusionSamplingParams
    latents: torch.Tensor
    """[n, num_img_tokens, 64] in the model dtype (n = num_outputs_per_prompt). While the request holds a
    slot of the input batch this is a view into the batch's packed latent buffer (see input_batch.py)."""
    prompt_embeds: torch.Tensor
    """[num_txt_tokens, joint_dim] at the prompt's real length."""
    negative_prompt_embeds: torch.Tensor | None
    """[num_neg_txt_tokens, joint_dim], or None when CFG is off for this request."""
    schedule: SigmaSchedule
    """Own sigmas [N + 1] and timesteps [N] (fp32, host)."""
    generator: torch.Generator
    latent_grid: tuple[int, int, int]
    """(frames, h, w) latent token grid of one image (the request's `RequestGeometry`)."""
    step_index: int = 0
    cond_latents: torch.Tensor | None = None
    """Edit models: [num_cond_tokens, 64] packed condition-image latents (every input image's, in order),
    appended to the image rows of every sequence of this request; None for text-to-image."""
    cond_shapes: tuple[tuple[int, int, int], ...] = ()
    """Condition grids after the target in each of its sequences, (1, h, w) per input image in the
    order of their rows in `cond_latents`: () for text-to-image."""
    preview_steps: tuple[int, ...] = ()
    """Steps done after which this request's x0 estimate is decoded as a preview (`inputs.preview_steps`
    of its `partial_images`); empty for every request that did not ask."""
    num_step_tokens: int | None = None
    """The family's token cost of one step (`RequestGeometry.num_step_tokens`, what the scheduler's
    budget charged; Qwen-Image-2.1 counts its prefix rows, each reference slot as 4 latent rows); None:
    counted from the embeddings' rows (`num_tokens`)."""

    cache_branches: list[Branch] | None = None
    """Step caching: one decision state per sequence of this request (per image: positive, then
    negative with CFG), with the residuals it reuses; None when the request runs every block. Kept
    while it sits steps out, freed with the slot."""

    def cache_branch(self, image_index: int, is_negative: bool) -> Branch | None:
        """The branch of one of this request's sequences (None when uncached)."""
        if self.cache_branches is None:
            return None
        return self.cache_branches[image_index * (2 if self.do_cfg else 1) + int(is_negative)]

    @property
    def do_cfg(self) -> bool:
        return self.negative_prompt_embeds is not None

    @property
    def num_images(self) -> int:
        return self.latents.shape[0]

    @property
    def num_seqs(self) -> int:
        """Sequences this request puts in a forward: one per image, two with CFG."""
        return self.num_images * (2 if self.do_cfg else 1)

    @property
    def img_shape(self) -> tuple[int, int, int]:
        """(frames, h, w) latent token grid, as RoPE takes it."""
        return self.latent_grid

    @property
    def num_img_tokens(self) -> int:
        return self.latents.shape[1]

    @property
    def is_denoised(self) -> bool:
        return self.step_index >= self.schedule.num_steps

    def timestep(self) -> float:
        """Current timestep `t` (fp32 value of the schedule; the transformer gets t / 1000)."""
        return float(self.schedule.timesteps[self.step_index])

    def sigma_delta(self) -> float:
        """`sigma_next - sigma` of the current step, computed in fp32 as the Euler update needs it."""
        sigmas = self.schedule.sigmas
        return float(sigmas[self.step_index + 1] - sigmas[self.step_index])

    def num_tokens(self) -> int:
        """Real tokens this request puts in one forward (text + image + condition, per sequence):
        its geometry's cost when it has one, else `step_token_cost` of its real rows, the function the
        scheduler's budget uses."""
        if self.num_step_tokens is not None:
            return self.num_step_tokens
        num_cond = 0 if self.cond_latents is None else self.cond_latents.shape[0]
        num_neg = self.negative_prompt_embeds.shape[0] if self.do_cfg else 0
        num_txt = self.prompt_embeds.shape[0]
        return step_token_cost(self.num_img_tokens, num_cond, num_txt, num_neg, self.num_images)

"""Types that cross the scheduler / runner boundary.

Scheduler -> runner: `SchedulerOutput` (new requests in full, once; then only ids).
Runner -> scheduler: `ModelRunnerOutput` (one `RunnerOutput` per scheduled request).
No live request objects cross: a runner could live in another process.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from PIL import Image

from vllm_omni.diffusion.models.interface import RequestGeometry
from vllm_omni.diffusion.outputs import ErrorKind
from vllm_omni.diffusion.sched.cost_model import StepCostSample
from vllm_omni.inputs import OmniDiffusionSamplingParams


@dataclass(frozen=True)
class SamplingParamsKey:
    """Execution barriers: only requests with equal keys share a denoise step.

    Only what changes the forward's code path belongs here. CFG is not a barrier (a CFG request simply
    puts two sequences in the packed forward), nor are LoRA adapters (applied per row), step counts,
    progress, text length, CFG scalars or seeds. With heterogeneous batching (MixFusion) off for a
    request, its image shape is the barrier (classic same-shape batching); with it on, the key is empty
    and every such request may share a step.
    """

    height: int | None = None
    """Set only when heterogeneous batching is off for the request."""
    width: int | None = None
    num_frames: int | None = None


@dataclass
class NewRequestData:
    """Everything the runner needs about a request, sent once when it is admitted."""

    req_id: str
    prompt: str
    negative_prompt: str | None
    sampling_params: OmniDiffusionSamplingParams
    """The engine's copy (made once, by the input processor), `seed` assigned."""
    image: Image.Image | list[Image.Image] | None = None
    """Edit models: the decoded input image; the runner turns it into condition latents once."""
    geometry: RequestGeometry | None = None
    """The family's rows of the request, computed at admission (None: scheduled without a model)."""


@dataclass
class SchedulerOutput:
    """What the runner runs in one engine step."""

    step_id: int
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    """Requests admitted this step; the runner builds their state (text encoding, noise)."""
    scheduled_cached_req_ids: list[str] = field(default_factory=list)
    """Requests continuing from an earlier step; their state lives on the runner."""
    finished_req_ids: set[str] = field(default_factory=set)
    """Requests that ended (aborted, failed) since the last step; the runner frees their state."""
    paused_req_ids: list[str] = field(default_factory=list)
    """Running requests that sit this step out (latency policy); their state stays on the runner."""
    deadline_ordered: bool = False
    """The latency policy built this step in deadline order: shortest-first would have made a request
    later than its deadline (the tail guard)."""
    num_running_reqs: int = 0
    """Started requests (holding runner state), including the paused ones."""
    num_waiting_reqs: int = 0
    predicted_step_time_s: float = 0.0
    """The scheduler's cost model's time for this step (the step clock's fallback)."""

    def all_failed(self, kind: ErrorKind, message: str) -> ModelRunnerOutput:
        """A runner output that fails every scheduled request (the step itself failed)."""
        return ModelRunnerOutput([RunnerOutput.failed(r, 0, kind, message) for r in self.scheduled_req_ids])

    @property
    def scheduled_req_ids(self) -> list[str]:
        """New ids first, then continuing ids: the order outputs come back in."""
        return [r.req_id for r in self.scheduled_new_reqs] + list(self.scheduled_cached_req_ids)

    @property
    def num_scheduled_reqs(self) -> int:
        return len(self.scheduled_new_reqs) + len(self.scheduled_cached_req_ids)

    @property
    def is_empty(self) -> bool:
        return self.num_scheduled_reqs == 0 and not self.finished_req_ids


@dataclass
class DiffusionOutput:
    """The decoded result of one finished request."""

    images: Any
    """A list of PIL images ('pil'), a float32 array [n, H, W, 3] in [0, 1] ('np'),
    or packed latents [n, num_img_tokens, 64] as a CPU tensor ('latent')."""
    seed: int
    output_type: str
    height: int
    width: int
    num_cached_steps: list[int] | None = None
    """Step caching: steps each branch (per image: positive, then negative) reused its cached
    residual; None when the request ran uncached."""


@dataclass
class RunnerOutput:
    """One scheduled request's result for one step."""

    req_id: str
    step_index: int
    """Denoise steps done after this step."""
    finished: bool = False
    """True when the request completed (denoised and decoded) or failed."""
    error: str | None = None
    """Set when this request failed; other requests of the step are unaffected."""
    error_kind: ErrorKind | None = None
    """The stage that failed (set with `error`)."""
    result: DiffusionOutput | None = None
    decoding: bool = False
    """Finished denoising and handed to the decode worker: `result` comes later, from the worker's
    listener (`decode_worker.py`), as a finished (or failed) `RunnerOutput` of its own."""
    cache_rate: float | None = None
    """Step caching: the share of this request's sequence-steps so far that reused their residual
    (the scheduler's online estimate of its remaining work); None when it runs uncached."""

    @classmethod
    def failed(cls, req_id: str, step_index: int, kind: ErrorKind, message: str) -> RunnerOutput:
        """A finished-with-error output."""
        return cls(req_id, step_index, finished=True, error=message, error_kind=kind)


class ForwardPath(str, enum.Enum):
    """How a step's transformer forward ran."""

    DENSE = "dense"
    """One same-shape `[B, S, C]` batch."""
    PACKED = "packed"
    """Packed varlen rows of any shapes."""
    SERIAL = "serial"
    """One request at a time (blocks carry hooks, e.g. a sharding wrapper)."""
    NONE = "none"
    """Nothing to denoise this step (only decodes or failures)."""


@dataclass
class StepStats:
    """What one step ran, for logs and metrics."""

    num_reqs: int = 0
    num_seqs: int = 0
    """Sequences in the forward: one per image, two with CFG."""
    num_tokens: int = 0
    """Real tokens (text + image) in the forward."""
    shapes: list[tuple[int, int]] = field(default_factory=list)
    """(height, width) of each scheduled request."""
    path: ForwardPath = ForwardPath.NONE
    step_time_s: float = 0.0
    num_compile_fallbacks: int = 0
    """Compiled block ops that raised during this step and ran eager instead."""
    num_cached_seqs: int = 0
    """Sequences that reused their cached residual this step (step caching)."""
    num_paused: int = 0
    """Running requests that sat this step out (set by the engine from the SchedulerOutput)."""
    deadline_ordered: bool = False
    """The step was built in deadline order (set by the engine from the SchedulerOutput)."""
    cost_samples: list[StepCostSample] = field(default_factory=list)
    """Denoise times measured since the last step (tokens, seconds): on CUDA, GPU event times of
    earlier steps as they complete; on CPU this step's. The scheduler's cost model learns from them."""
    req_ids: list[str] = field(default_factory=list)
    """The engine id of each request that ran, in the order of `shapes`."""


@dataclass
class ModelRunnerOutput:
    """The runner's reply to one `SchedulerOutput`."""

    outputs: list[RunnerOutput]
    stats: StepStats = field(default_factory=StepStats)

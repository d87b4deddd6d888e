"""What the engine hands back for one request: `RequestOutput`, with its finish reason and timings.

A request leaves the engine exactly once, as a `RequestOutput`: completed (images set), aborted or
failed (`error` and `error_kind` set). Front ends (the HTTP server, offline `Omni`) and stat loggers
read everything they report from it; nothing travels beside it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class FinishReason(str, enum.Enum):
    """Why a request left the engine."""

    COMPLETED = "completed"
    ABORTED = "aborted"
    ERROR = "error"


class ErrorKind(str, enum.Enum):
    """Where a failed request failed; set by the stage that failed, never parsed from messages."""

    ENCODE = "encode"
    """Prompt encoding (text encoder)."""
    SETUP = "setup"
    """Noise, sigma schedule or other per-request state."""
    DENOISE = "denoise"
    """The transformer forward, CFG combine or solver step."""
    DECODE = "decode"
    """VAE decode or image post-processing."""
    INTERNAL = "internal"
    """The engine itself (e.g. a runner that returned no output for the request)."""


@dataclass
class RequestTimings:
    """Monotonic timestamps (`time.monotonic()`) of one request's life in the engine."""

    arrival_time: float
    """`add_request` accepted it."""
    first_scheduled_time: float | None = None
    """Its first denoise step was scheduled (None: it never ran)."""
    finished_time: float | None = None
    num_steps_sat_out: int = 0
    """Steps it was started but sat out (latency policy: a shorter request ran instead)."""
    num_preemptions: int = 0
    """Times it ran a step and sat out the next."""
    num_cached_steps: list[int] | None = None
    """Step caching: cached steps per branch (per image: positive, then negative with CFG); None
    when the request ran uncached."""

    @property
    def queue_s(self) -> float | None:
        """Arrival to first scheduled step; None if it never ran."""
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def engine_s(self) -> float | None:
        """Arrival to finish (queue + denoise + decode)."""
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclass
class RequestOutput:
    """One request's result as it leaves the engine."""

    req_id: str
    """The engine's id (unique for the engine's life)."""
    request_id: str
    """The caller's label (e.g. the client's X-Request-Id); echoed, never used as a key."""
    finish_reason: FinishReason
    images: Any = None
    """Completed: a list of PIL images ('pil'), a float32 array [n, H, W, 3] in [0, 1] ('np'), or packed
    latents [n, num_img_tokens, 64] as a CPU tensor ('latent'). None otherwise."""
    seed: int | None = None
    output_type: str = "pil"
    height: int = 0
    width: int = 0
    num_steps_done: int = 0
    error: str | None = None
    error_kind: ErrorKind | None = None
    timings: RequestTimings = field(default_factory=lambda: RequestTimings(arrival_time=0.0))

    @property
    def num_images(self) -> int:
        return 0 if self.images is None else len(self.images)


@dataclass
class PartialImage:
    """A streaming request's preview: its images decoded from the clean-image estimate after a step."""

    req_id: str
    """The engine's id."""
    partial_image_index: int
    """0, 1, ... in the order the previews were taken (OpenAI's `partial_image_index`)."""
    images: Any
    """As `RequestOutput.images`, in the request's output type."""
    step_index: int
    """Denoise steps done when the estimate was taken."""
    num_steps: int
    """The request's total denoise steps."""

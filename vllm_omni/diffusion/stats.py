"""Engine events for logs and metrics, and the errors the engine reports.

The engine calls every registered `StatLogger` from its loop thread; loggers
must be cheap and must not raise (a failing logger is logged and dropped).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from vllm_omni.diffusion.sched.interface import StepStats


@dataclass
class RequestStats:
    """One finished request, as seen by the engine."""

    req_id: str
    status: str
    """'completed', 'aborted' or 'error'."""
    num_images: int
    latency_s: float
    """Arrival to finish."""
    queue_time_s: float
    """Arrival to first scheduled step."""
    error_kind: str | None = None
    """'decode', 'denoise', 'encode', 'internal' ... for errors."""


class StatLogger(Protocol):
    """Receives engine events (Prometheus metrics, logs)."""

    def on_step(self, stats: StepStats, num_running: int, num_waiting: int) -> None: ...

    def on_request_finished(self, stats: RequestStats) -> None: ...


class QueueFullError(RuntimeError):
    """The waiting queue is at `max_queue_size`; retry later (HTTP 503)."""


class RequestAbortedError(RuntimeError):
    """The request was aborted before it finished."""


class RequestFailedError(RuntimeError):
    """The request failed inside the engine; other requests are unaffected."""

    def __init__(self, message: str, kind: str = "internal"):
        super().__init__(message)
        self.kind = kind

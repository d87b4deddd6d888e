"""Engine events for logs and metrics, and the errors the engine reports.

The engine calls every registered `StatLogger` from its loop thread; loggers
must be cheap and must not raise (a failing logger is logged and dropped).
"""

from __future__ import annotations

from typing import Protocol

from vllm_omni.diffusion.outputs import ErrorKind, RequestOutput
from vllm_omni.diffusion.sched.interface import StepStats


class StatLogger(Protocol):
    """Receives engine events (Prometheus metrics, logs)."""

    def on_step(self, stats: StepStats, num_running: int, num_waiting: int) -> None: ...

    def on_request_finished(self, output: RequestOutput) -> None: ...


class QueueFullError(RuntimeError):
    """The waiting queue is at `max_queue_size`; retry later (HTTP 503)."""


class RequestAbortedError(RuntimeError):
    """The request was aborted before it finished; `output` is its (image-less) `RequestOutput`."""

    def __init__(self, message: str, output: RequestOutput | None = None):
        super().__init__(message)
        self.output = output


class RequestFailedError(RuntimeError):
    """The request failed inside the engine; other requests are unaffected."""

    def __init__(
        self, message: str, output: RequestOutput | None = None, kind: ErrorKind = ErrorKind.INTERNAL
    ):
        super().__init__(message)
        self.output = output
        self.kind = output.error_kind if output is not None and output.error_kind else kind

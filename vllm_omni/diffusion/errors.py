"""The errors the engine reports to its callers (the HTTP layer maps each to a status, `errors.py` there).

Failures of one request never stop the engine: they reach that request's caller only.
"""

from __future__ import annotations

from vllm_omni.diffusion.outputs import ErrorKind, RequestOutput


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

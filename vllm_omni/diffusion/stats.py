"""Engine events for logs and metrics (the errors the engine reports are in `errors.py`).

The engine calls every registered `StatLogger` from its loop thread; loggers
must be cheap and must not raise (a failing logger is logged and dropped).
"""

from __future__ import annotations

from typing import Protocol

from vllm_omni.diffusion.outputs import RequestOutput
from vllm_omni.diffusion.sched.interface import StepStats


class StatLogger(Protocol):
    """Receives engine events (Prometheus metrics, logs)."""

    def on_step(self, stats: StepStats, num_running: int, num_waiting: int) -> None: ...

    def on_request_finished(self, output: RequestOutput) -> None: ...

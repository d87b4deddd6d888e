"""Requests whose decode runs beside the steps: the engine's side of the decode worker.

A request that finishes denoising leaves the scheduler in that step (its slot and token budget are
free), but its images come later, on the decode worker's thread. The two events race: the decode
may end before the engine has applied the step's output. `PendingDecodes` pairs them in whichever
order they come and hands the completed `FinishedRequest` (images set, or failed by its decode) to
the engine's delivery, exactly once, outside its lock.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable

from vllm_omni.diffusion.request import RequestStatus
from vllm_omni.diffusion.sched.interface import RunnerOutput
from vllm_omni.diffusion.sched.scheduler import FinishedRequest


class PendingDecodes:
    """Pairs finished requests with their decode results; see the module docstring."""

    def __init__(self, deliver: Callable[[FinishedRequest], None]):
        self._deliver = deliver
        self._lock = threading.Lock()
        self._held: dict[str, FinishedRequest] = {}
        """Finished requests whose decode has not reported yet."""
        self._early: dict[str, RunnerOutput] = {}
        """Decode results that came before their request's step output was applied."""
        self._dropped: set[str] = set()
        """Requests that ended otherwise (aborted after their last step): their decode is discarded."""

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)

    def hold(self, item: FinishedRequest) -> None:
        """`item` finished denoising and its decode runs: deliver it when the decode reports."""
        if item.status is not RequestStatus.FINISHED_COMPLETED:
            with self._lock:  # e.g. aborted after its last step was scheduled: nobody wants its images
                if self._early.pop(item.req_id, None) is None:
                    self._dropped.add(item.req_id)
            self._deliver(item)
            return
        with self._lock:
            decoded = self._early.pop(item.req_id, None)
            if decoded is None:
                self._held[item.req_id] = item
                return
        self._deliver(_with_decode(item, decoded))

    def on_decoded(self, output: RunnerOutput) -> None:
        """The decode worker's result for one request (its thread)."""
        with self._lock:
            if output.req_id in self._dropped:
                self._dropped.discard(output.req_id)
                return
            item = self._held.pop(output.req_id, None)
            if item is None:
                self._early[output.req_id] = output
                return
        self._deliver(_with_decode(item, output))

    def clear(self) -> list[str]:
        """Forget everything (shutdown, after the engine failed every future); the held ids."""
        with self._lock:
            held = list(self._held)
            self._held.clear()
            self._early.clear()
            self._dropped.clear()
        return held


def _with_decode(item: FinishedRequest, output: RunnerOutput) -> FinishedRequest:
    """`item` completed with the decode's images, or failed with its error."""
    if output.error is not None:
        return dataclasses.replace(
            item,
            status=RequestStatus.FINISHED_ERROR,
            result=None,
            error=output.error,
            error_kind=output.error_kind,
        )
    return dataclasses.replace(item, result=output.result)

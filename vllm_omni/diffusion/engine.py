"""DiffusionEngine: the background loop that runs one denoise step per iteration.

Front ends (the HTTP server, offline `Omni`) call `add_request` / `generate` / `abort` from any
thread; the loop thread owns the scheduler and the executor. One iteration is three calls:
`schedule()` -> `executor.execute_step()` -> `update_from_output()`, then finished requests are
delivered as `RequestOutput`s (one whose VAE decode runs on the decode worker when it reports).

Identity: the engine makes every request's id (`req_id`, unique for the engine's life); the
caller's `request_id` (e.g. a client's X-Request-Id) is only a label that is echoed back.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from vllm_omni.config import OmniDiffusionConfig
from vllm_omni.diffusion.errors import QueueFullError, RequestAbortedError, RequestFailedError
from vllm_omni.diffusion.executor import create_executor
from vllm_omni.diffusion.input_processor import InputProcessor
from vllm_omni.diffusion.memory import MemoryBudget, latent_row_width, measure_decode_bytes_per_pixel
from vllm_omni.diffusion.models import registry
from vllm_omni.diffusion.models.interface import RequestGeometry
from vllm_omni.diffusion.outputs import ErrorKind, FinishReason, PartialImage, RequestOutput, RequestTimings
from vllm_omni.diffusion.pending_decodes import PendingDecodes
from vllm_omni.diffusion.request import OmniDiffusionRequest, RequestStatus
from vllm_omni.diffusion.sched.cost_model import StepCostModel
from vllm_omni.diffusion.sched.interface import ModelRunnerOutput, RunnerOutput, StepStats
from vllm_omni.diffusion.sched.scheduler import FinishedRequest, StepScheduler
from vllm_omni.diffusion.stats import StatLogger
from vllm_omni.inputs import OmniDiffusionSamplingParams

logger = logging.getLogger(__name__)

LONG_WORK_PIXELS = 1024 * 1024
"""Pixels of reference images to encode from which a step announces that work at INFO before it runs
(seconds on a CPU, a large share of the step on a GPU)."""

DECODE_DRAIN_TIMEOUT_S = 30.0
"""Seconds shutdown waits for decodes under way (their clients get images); then it fails the rest."""

_FINISH_REASONS = {
    RequestStatus.FINISHED_COMPLETED: FinishReason.COMPLETED,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORTED,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


@dataclass(frozen=True)
class RequestHandle:
    """A queued request: the engine's id (for `abort`) and the future of its `RequestOutput`."""

    req_id: str
    request_id: str
    """The caller's label."""
    future: concurrent.futures.Future

    def result(self, timeout: float | None = None) -> RequestOutput:
        """The output; raises `RequestFailedError` / `RequestAbortedError` as the engine reported."""
        return self.future.result(timeout)

    def done(self) -> bool:
        return self.future.done()


class DiffusionEngine:
    """Step-wise continuous batching engine for one diffusion pipeline."""

    def __init__(
        self,
        config: OmniDiffusionConfig,
        stat_loggers: list[StatLogger] | None = None,
        pipeline=None,
        autostart: bool = True,
    ):
        """`pipeline`: an already-built pipeline for the (single-device) worker instead of loading one."""
        self.config = config
        self.autostart = autostart
        """Start the loop thread on the first request; tests set False and call `step()`."""
        self.stat_loggers: list[StatLogger] = list(stat_loggers or [])
        family = (
            registry.family_of(pipeline)
            if pipeline is not None
            else registry.family_for(config.model, config.load_format)
        )
        registry.check_config(family, config)  # refuse, before loading, what the family does not declare
        self.executor = create_executor(config, pipeline)
        self.lora = self.executor.driver_worker.lora
        """The worker's `LoRAManager` (None when LoRA is off): names -> ids, per-request refcounts."""
        self._lora_ids: dict[str, int] = {}  # req_id -> adapter id it holds (released when it ends)
        self.family = registry.family_of(self.executor.driver_worker.pipeline)
        """The model family served (`models/interface.ModelFamily`): prompt counting, a request's rows."""
        family_defaults = self.family.capabilities.default_sampling_params
        self.default_sampling_params: Mapping = MappingProxyType(
            {**(family_defaults or {}), **config.default_sampling_params}
        )
        """What a front end builds a request's params on (read-only): the model's own defaults
        (Qwen-Image-2.1: 40 steps, scale 1.0) under the server's `--default-sampling-params`."""
        self.image_input = self.family.image_input
        """The family's image-input capability (edit models); None: text-to-image."""
        self.supports_image_input = self.image_input is not None
        """An image-edit model: requests must carry an input image (text-to-image ones must not)."""
        self.prompts = self.family.load_prompt_counter(config.model, config.load_format)
        """The engine's own tokenizer (the worker's is busy encoding on the loop thread)."""
        worker = self.executor.driver_worker
        self.scheduler = StepScheduler(
            config,
            supports_mixfusion=worker.supports_mixfusion,
            cost_model=StepCostModel(worker.runner.startup_cost_samples),
            cache_num_blocks=worker.runner.num_transformer_blocks,
        )
        prefix_row_bytes = worker.pipeline.prefix_row_bytes
        memory = MemoryBudget(
            worker.device,
            worker.pipeline.dtype,
            measure_decode_bytes_per_pixel(worker.pipeline),
            config.max_decode_pixels,
            latent_row_width=latent_row_width(worker.pipeline),
            utilization=config.gpu_memory_utilization,
            prefix_row_bytes=prefix_row_bytes,
            kv_cache_bytes=config.kv_cache_memory_bytes,
            prefix_arena=worker.pipeline.prefix_arena,
            prefill_bytes=worker.pipeline.prefill_peak_bytes,
            cache=config.cache,
            cache_row_bytes=worker.runner.cache_row_bytes,
        )
        self.inputs = InputProcessor(
            config, self.family, self.prompts, memory, self.lora, worker.pipeline.sigma_schedule
        )
        """Validates, copies and snaps a request and computes its geometry once (input_processor.py)."""
        self._memory_waiting: collections.deque[tuple[str, OmniDiffusionRequest, RequestGeometry]] = (
            collections.deque()
        )
        """Admitted requests that wait, in arrival order, for earlier ones to release memory."""
        self._lock = threading.Condition()
        self._futures: dict[str, concurrent.futures.Future] = {}
        self._ids = itertools.count()
        self._session = uuid.uuid4().hex[:8]
        self._steps: collections.deque[StepStats] = collections.deque(maxlen=1000)
        self._thread: threading.Thread | None = None
        self._stop = False
        self._decodes = PendingDecodes(self._deliver)
        """Requests that finished denoising and wait for their decode (decode_worker.py)."""
        self._partial_sinks: dict[str, Callable[[PartialImage], None]] = {}
        """Streaming requests' preview receivers, by engine id (`add_request(on_partial=...)`)."""
        self._decoder = self.executor.driver_worker.runner.decoder
        self._decoder.listener = self
        logger.info(
            "engine ready: model=%s device=%s dtype=%s step_execution=%s max_num_seqs=%d "
            "mixfusion=%s batch_invariant=%s",
            config.model,
            self.executor.driver_worker.device,
            self.executor.driver_worker.pipeline.dtype,
            config.step_execution,
            config.max_num_seqs,
            self.scheduler.enable_mixfusion,
            config.batch_invariant,
        )
        logger.info("%s", self.memory.describe())
        policy = self.scheduler.latency_policy
        logger.info(
            "scheduling: policy=%s%s max_num_seqs=%d max_num_resident_reqs=%d; %s",
            config.scheduling_policy,
            f" ({policy.describe()})" if policy is not None else "",
            config.max_num_seqs,
            config.resident_cap,
            self.scheduler.cost_model.describe(),
        )

    # ---- front end --------------------------------------------------------------------------

    @property
    def memory(self) -> MemoryBudget:
        """Each request's peak memory against what the server has free (memory.py); the input
        processor refuses by it, admission reserves in it."""
        return self.inputs.memory

    @memory.setter
    def memory(self, budget: MemoryBudget) -> None:
        self.inputs.memory = budget

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        """Requests waiting for a slot, and for memory (`memory.py`)."""
        return self.scheduler.num_waiting + len(self._memory_waiting)

    def remaining_work_s(self) -> float:
        """Seconds of denoise work left over every live request (running, waiting, waiting for memory):
        its remaining steps x the cost model's step time at its tokens, the signal a replica router
        ranks data-parallel replicas by (`entrypoints/replicas/routing.py`)."""
        step_time = self.scheduler.cost_model.step_time
        with self._lock:
            work = sum(
                r.sampling_params.num_inference_steps * step_time(g.num_step_tokens)
                for _, r, g in self._memory_waiting
            )
            for req_id in self._futures:
                state = self.scheduler.get_state(req_id)
                if state is not None:
                    work += state.num_steps_left * step_time(state.profile.num_step_tokens)
        return work

    def check_health(self) -> None:
        """Raise RuntimeError when the loop thread died, or when the memory free now could not hold
        even the smallest request (the server then answers /health with 503, degraded)."""
        thread = self._thread
        if thread is not None and not thread.is_alive() and not self._stop:
            raise RuntimeError("the engine loop thread has stopped")
        smallest = self._smallest_request()
        if not self.memory.could_ever_fit(*smallest):
            sp = smallest[0]
            need = self.memory.estimate(*smallest)
            raise RuntimeError(
                f"degraded: no request can be admitted: the smallest ({sp.width}x{sp.height}, n=1) needs "
                f"{(need.device_bytes + need.host_bytes) / 2**20:.1f} MiB, this server has "
                f"{self.memory.request_bytes / 2**20:.1f} MiB for requests ({self.memory.describe_share()}); "
                "free memory on this machine or raise --gpu-memory-utilization"
            )

    def _smallest_request(self) -> tuple[OmniDiffusionSamplingParams, RequestGeometry]:
        """(params, geometry) of a one-image request at the family's smallest size (16x16 until a
        request showed the family's pixel multiple), its latents one row (next to its decode and
        encoded image, nothing)."""
        side = self.inputs.pixel_multiple or 16
        sp = OmniDiffusionSamplingParams(height=side, width=side, num_inference_steps=1)
        rows = RequestGeometry(pixel_multiple=side, latent_grid=(1, 1, 1), num_txt_tokens=1)
        return sp, rows

    def num_steps_done(self, req_id: str) -> int:
        """Denoise steps a live request has run (0 when it is not live: waiting, finished, unknown)."""
        with self._lock:
            state = self.scheduler.get_state(req_id)
            return state.num_steps_done if state is not None else 0

    def recent_steps(self) -> list[StepStats]:
        """The last (up to 1000) steps, oldest first."""
        with self._lock:
            return list(self._steps)

    def validate_request(self, request: OmniDiffusionRequest) -> RequestGeometry:
        """Check a request; return its geometry from the model family (latent grid, text rows after
        truncation, an edit's condition rows) at its snapped size (`InputProcessor.process`).

        Raises ValueError naming the field and the limit. Tokenises each prompt once (no lock held).
        """
        return self.inputs.process(request).geometry

    def add_request(
        self, request: OmniDiffusionRequest, on_partial: Callable[[PartialImage], None] | None = None
    ) -> RequestHandle:
        """Validate and queue a request under a new engine id; the handle's future resolves to its
        `RequestOutput` (or raises `RequestFailedError` / `RequestAbortedError`). `on_partial` receives
        its previews (`sampling_params.partial_images`), on the decode worker's thread, all before the
        future resolves.

        Raises ValueError for invalid input and QueueFullError when the queue is full. Tokenises the
        prompts: call it off an event loop (`generate` does).
        """
        processed = self.inputs.process(request)  # the engine's own copy; the caller's is never changed
        request, geometry = processed.request, processed.geometry
        req_id = f"req-{self._session}-{next(self._ids)}"
        if processed.requested_size is not None:
            logger.info(
                "request %s: size %dx%d rounded down to %dx%d (multiples of %d, as diffusers)",
                req_id,
                *processed.requested_size,
                request.sampling_params.width,
                request.sampling_params.height,
                geometry.pixel_multiple,
            )
        self._acquire_lora(req_id, request.sampling_params)
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            try:
                self._admit_or_hold(request, req_id, geometry)
            except Exception:
                self._release_lora(req_id)
                raise
            self._futures[req_id] = future
            if on_partial is not None:
                self._partial_sinks[req_id] = on_partial
            self._lock.notify_all()
        if self.autostart:
            self.start()
        return RequestHandle(req_id, request.request_id, future)

    def _admit_or_hold(self, request: OmniDiffusionRequest, req_id: str, geometry: RequestGeometry) -> None:
        """Queue the request in the scheduler when its memory fits next to the admitted requests';
        else hold it (in arrival order) until they release theirs. Called with the lock held."""
        self._log_prefix_memory(req_id, geometry)
        if not self._memory_waiting and self.memory.try_reserve(req_id, request.sampling_params, geometry):
            try:
                self.scheduler.add_request(request, req_id=req_id, geometry=geometry)
            except Exception:
                self.memory.release(req_id)
                raise
            return
        if self.num_waiting >= self.config.max_queue_size:
            raise QueueFullError(f"{self.num_waiting} requests are waiting (max_queue_size)")
        logger.info(
            "request %s waits for memory (%d admitted requests hold it)", req_id, self.memory.num_reserved
        )
        self._memory_waiting.append((req_id, request, geometry))

    def _log_prefix_memory(self, req_id: str, geometry: RequestGeometry) -> None:
        """One admission line with the bytes the request's prefix KV cache is charged (families with one)."""
        if not geometry.num_prefix_cache_rows:
            return
        limit, arena = self.config.kv_cache_memory_bytes, self.memory.prefix_arena
        if arena is not None:
            where = f"prefix KV arena, {arena.num_free_rows} of {arena.capacity_rows} rows free"
        else:
            where = "the memory budget" if limit is None else f"{limit} bytes, --kv-cache-memory-bytes"
        logger.info(
            "request %s: prefix KV cache %d rows, %d bytes charged at admission (%d bytes held by admitted "
            "requests; limit %s)",
            req_id,
            geometry.num_prefix_cache_rows,
            self.memory.prefix_bytes(geometry.num_prefix_cache_rows),
            self.memory.reserved_prefix_bytes,
            where,
        )

    def _admit_memory_waiting(self) -> None:
        """Move held requests to the scheduler, in arrival order, while their memory fits."""
        failed = []
        with self._lock:
            while self._memory_waiting:
                req_id, request, geometry = self._memory_waiting[0]
                if not self.memory.try_reserve(req_id, request.sampling_params, geometry):
                    break
                self._memory_waiting.popleft()
                try:
                    self.scheduler.add_request(request, req_id=req_id, geometry=geometry)
                except Exception as exc:  # e.g. the scheduler's queue is full now
                    self.memory.release(req_id)
                    failed.append((req_id, self._futures.pop(req_id, None), exc))
            self._lock.notify_all()
        for req_id, future, exc in failed:
            self._release_lora(req_id)
            if future is not None and not future.done():
                future.set_exception(exc)

    def _acquire_lora(self, req_id: str, sp) -> None:
        """Resolve the request's adapter name to the engine's id and hold it until the request ends."""
        if sp.lora_request is None:
            return
        lora_id = self.lora.acquire(sp.lora_request)  # LoRANotFoundError when unloaded meanwhile
        sp.lora_request = dataclasses.replace(sp.lora_request, lora_int_id=lora_id)
        with self._lock:
            self._lora_ids[req_id] = lora_id

    def _release_lora(self, req_id: str) -> None:
        with self._lock:
            lora_id = self._lora_ids.pop(req_id, None)
        if lora_id is not None:
            self.lora.release(lora_id)

    async def generate(self, request: OmniDiffusionRequest) -> RequestOutput:
        """Run a request to completion; cancelling the awaiting task aborts it."""
        adding = asyncio.ensure_future(asyncio.to_thread(self.add_request, request))
        try:
            handle = await asyncio.shield(adding)
        except asyncio.CancelledError:
            adding.add_done_callback(self._abort_when_added)
            raise
        try:
            return await asyncio.wrap_future(handle.future)
        except asyncio.CancelledError:
            self.abort(handle.req_id)
            raise

    def _abort_when_added(self, adding: asyncio.Future) -> None:
        if not adding.cancelled() and adding.exception() is None:
            self.abort(adding.result().req_id)

    def abort(self, req_id: str) -> None:
        """Abort a waiting or running request by engine id; its slot is free for the next step."""
        future = None
        with self._lock:
            held = [i for i, (rid, _, _) in enumerate(self._memory_waiting) if rid == req_id]
            if held:
                del self._memory_waiting[held[0]]
                future = self._futures.pop(req_id, None)
            elif self.scheduler.abort_request(req_id):
                self._lock.notify_all()
        if held:
            self._release_lora(req_id)
            if future is not None and not future.done():
                future.set_exception(RequestAbortedError(f"Request {req_id} aborted."))

    # ---- loop -------------------------------------------------------------------------------

    def start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._stop = False
                self._thread = threading.Thread(target=self._loop, name="diffusion-engine", daemon=True)
                self._thread.start()

    def shutdown(self) -> None:
        """Stop the loop, answer every waiting client (aborted), stop the workers."""
        with self._lock:
            self._stop = True
            self._lock.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout=30)
        self._thread = None
        self._decoder.close(DECODE_DRAIN_TIMEOUT_S)
        self._fail_all("engine shut down")
        self.executor.shutdown()

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._stop and not self.scheduler.has_requests():
                    self._lock.wait(timeout=1.0)
                if self._stop:
                    break
                sched_out = self.scheduler.schedule()
                if sched_out.is_empty:
                    # Nothing runnable yet (e.g. only requests waiting on an incompatible batch).
                    self._lock.wait(timeout=0.01)
                    continue
            try:
                self.step_once(sched_out)
            except Exception:  # the loop must survive anything a step throws
                logger.exception("engine step failed")
        self._decoder.drain(DECODE_DRAIN_TIMEOUT_S)  # decodes under way still answer their clients
        self._fail_all("engine shut down")

    def step(self) -> StepStats | None:
        """Schedule and run one step on the calling thread (for tests and tools without the loop)."""
        with self._lock:
            sched_out = self.scheduler.schedule()
        if sched_out.is_empty:
            self._decoder.drain(0.05)  # a caller polling for a decoding request's future: let it end
            return None
        self.step_once(sched_out)
        return self._steps[-1] if sched_out.num_scheduled_reqs else None

    def step_once(self, sched_out) -> None:
        """Run one scheduled step and deliver what finished."""
        long_work = self._long_work(sched_out)
        if long_work:  # a step that will take a while beyond its denoise: say so before it starts
            logger.info("step %d: %s ...", sched_out.step_id, "; ".join(long_work))
        if sched_out.num_scheduled_reqs == 0:
            self.executor.free(sched_out.finished_req_ids)
            runner_out = ModelRunnerOutput(outputs=[])
        else:
            try:
                if self.config.step_execution:
                    runner_out = self.executor.execute_step(sched_out)
                else:
                    runner_out = self.executor.execute_request(sched_out)
            except Exception as exc:
                logger.exception("denoise step failed for %s", sched_out.scheduled_req_ids)
                self.executor.free(sched_out.scheduled_req_ids)
                runner_out = sched_out.all_failed(ErrorKind.DENOISE, f"denoise step failed: {exc}")
        with self._lock:
            finished = self.scheduler.update_from_output(sched_out, runner_out)
            num_running, num_waiting = self.scheduler.num_running, self.scheduler.num_waiting
            if sched_out.num_scheduled_reqs:
                runner_out.stats.num_paused = len(sched_out.paused_req_ids)
                runner_out.stats.deadline_ordered = sched_out.deadline_ordered
                self._steps.append(runner_out.stats)
        self.executor.free(f.req_id for f in finished)
        if long_work:
            logger.info("step %d: done in %.1f s", sched_out.step_id, runner_out.stats.step_time_s)
        if sched_out.num_scheduled_reqs:
            self._log_step(sched_out, runner_out.stats, num_running, num_waiting)
        decoding = {o.req_id for o in runner_out.outputs if o.decoding}
        for item in finished:
            if item.req_id in decoding:
                self._decodes.hold(item)  # delivered when its decode reports
            else:
                self._deliver(item)

    # ---- the decode worker's listener (its thread) --------------------------------------------

    def on_decoded(self, output: RunnerOutput) -> None:
        """A decoded (or failed) request from the decode worker: deliver it."""
        self._decodes.on_decoded(output)

    def on_partial(self, partial: PartialImage) -> None:
        """A streaming request's preview: to its receiver (none once the request was delivered)."""
        with self._lock:
            sink = self._partial_sinks.get(partial.req_id)
        if sink is not None:
            sink(partial)

    def _long_work(self, sched_out) -> list[str]:
        """What the step does beyond its denoise that may take seconds: encoding a new request's
        reference images (at least `LONG_WORK_PIXELS`). Decodes run beside the steps and announce
        themselves (decode_worker.py)."""
        work = []
        for new in sched_out.scheduled_new_reqs:
            images = (
                new.image if isinstance(new.image, list) else [new.image] if new.image is not None else []
            )
            pixels = sum(image.width * image.height for image in images)
            if pixels >= LONG_WORK_PIXELS:
                work.append(
                    f"encoding {len(images)} reference image(s) of {new.req_id} ({pixels / 1e6:.1f} MP)"
                )
        return work

    def _log_step(self, sched_out, stats: StepStats, num_running: int, num_waiting: int) -> None:
        """One line per step at DEBUG; at INFO every `log_step_interval` steps (0: never)."""
        interval = self.config.log_step_interval
        level = logging.INFO if interval and sched_out.step_id % interval == 0 else logging.DEBUG
        if self.config.log_stats and stats.num_reqs and logger.isEnabledFor(level):
            reqs = ", ".join(f"{req_id} {w}x{h}" for req_id, (h, w) in zip(stats.req_ids, stats.shapes))
            logger.log(
                level,
                "step %d: %d reqs [%s] %d seqs%s %d tokens path=%s %.1f ms "
                "| running=%d (%d sat out) waiting=%d%s",
                sched_out.step_id,
                stats.num_reqs,
                reqs,
                stats.num_seqs,
                f" ({stats.num_cached_seqs} cached)" if stats.num_cached_seqs else "",
                stats.num_tokens,
                stats.path.value,
                stats.step_time_s * 1e3,
                num_running,
                stats.num_paused,
                num_waiting,
                " (deadline order)" if stats.deadline_ordered else "",
            )
        self._notify_loggers("on_step", stats, num_running, num_waiting)

    def _notify_loggers(self, event: str, *args) -> None:
        for stat_logger in list(self.stat_loggers):
            try:
                getattr(stat_logger, event)(*args)
            except Exception:
                logger.exception("stat logger failed; dropping it")
                self.stat_loggers.remove(stat_logger)

    def _deliver(self, item: FinishedRequest) -> None:
        self._release_lora(item.req_id)
        self.memory.release(item.req_id)
        self._admit_memory_waiting()
        with self._lock:
            future = self._futures.pop(item.req_id, None)
            self._partial_sinks.pop(item.req_id, None)
        output = _request_output(item)
        self._notify_loggers("on_request_finished", output)
        if future is None or future.done():
            return
        if output.finish_reason is FinishReason.COMPLETED:
            future.set_result(output)
        elif output.finish_reason is FinishReason.ABORTED:
            future.set_exception(RequestAbortedError(f"Request {item.req.request_id} aborted.", output))
        else:
            future.set_exception(RequestFailedError(output.error or "request failed", output))

    def _fail_all(self, message: str) -> None:
        with self._lock:  # both maps taken under the lock that add_request writes them under
            futures, self._futures = self._futures, {}
            lora_ids, self._lora_ids = self._lora_ids, {}
            self._memory_waiting.clear()
            self._partial_sinks.clear()
        self._decodes.clear()
        for lora_id in lora_ids.values():
            self.lora.release(lora_id)
        for future in futures.values():
            if not future.done():
                future.set_exception(RequestAbortedError(message))


def _request_output(item: FinishedRequest) -> RequestOutput:
    """The `RequestOutput` of a request the scheduler reported finished."""
    sp = item.req.sampling_params
    reason = _FINISH_REASONS[item.status]
    return RequestOutput(
        req_id=item.req_id,
        request_id=item.req.request_id,
        finish_reason=reason,
        images=item.result.images if item.result is not None else None,
        seed=sp.seed,
        output_type=sp.output_type,
        height=sp.height,
        width=sp.width,
        num_steps_done=item.num_steps_done,
        error=item.error,
        error_kind=item.error_kind if reason is FinishReason.ERROR else None,
        timings=RequestTimings(
            item.arrival_time,
            item.first_scheduled_time,
            time.monotonic(),
            num_steps_sat_out=item.num_steps_sat_out,
            num_preemptions=item.num_preemptions,
            num_cached_steps=item.result.num_cached_steps if item.result is not None else None,
        ),
    )

"""DiffusionEngine: the background loop that runs one denoise step per iteration.

Front ends (the HTTP server, offline `Omni`) call `add_request` / `generate` /
`abort` from any thread; the loop thread owns the scheduler and the runner.
One iteration = `schedule()` -> `execute_step()` -> `update_from_output()`.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import copy
import logging
import threading
import time

from vllm_omni.config import OmniDiffusionConfig
from vllm_omni.diffusion.request import OmniDiffusionRequest, RequestStatus
from vllm_omni.diffusion.sched.interface import DiffusionOutput, ModelRunnerOutput, StepStats
from vllm_omni.diffusion.sched.scheduler import FinishedRequest, StepScheduler
from vllm_omni.diffusion.stats import (
    RequestAbortedError,
    RequestFailedError,
    RequestStats,
    StatLogger,
)

logger = logging.getLogger(__name__)

_STATUS_NAMES = {
    RequestStatus.FINISHED_COMPLETED: "completed",
    RequestStatus.FINISHED_ABORTED: "aborted",
    RequestStatus.FINISHED_ERROR: "error",
}


def _error_kind(message: str | None) -> str:
    text = (message or "").lower()
    for kind in ("decode", "encoding", "setup", "denoise"):
        if kind in text:
            return {"encoding": "encode"}.get(kind, kind)
    return "internal"


class DiffusionEngine:
    """Step-wise continuous batching engine for one diffusion pipeline."""

    def __init__(
        self,
        config: OmniDiffusionConfig,
        stat_loggers: list[StatLogger] | None = None,
        pipeline=None,
        autostart: bool = True,
    ):
        self.config = config
        self.autostart = autostart
        """Start the loop thread on the first request; tests set False and call `step()`."""
        self.stat_loggers: list[StatLogger] = list(stat_loggers or [])
        self.pipeline = pipeline if pipeline is not None else self._load_pipeline(config)
        transformer = self.pipeline.transformer
        if config.batch_invariant:
            from vllm_omni.diffusion.batch_invariant import make_batch_invariant

            logger.info("batch-invariant mode: %s", make_batch_invariant(transformer))
        elif not config.enforce_eager and self.pipeline.device.type == "cuda":
            transformer.enable_compile()
            logger.info(
                "transformer blocks: fused elementwise kernels via torch.compile (--enforce-eager to disable)"
            )
            self._warm_up_transformer()
        from vllm_omni.diffusion.distributed.executor import create_runner

        # One device: the model runner itself; several: an executor that drives one runner per rank.
        self.runner = create_runner(self.pipeline, config)
        self.scheduler = StepScheduler(
            config,
            supports_mixfusion=getattr(self.pipeline, "supports_mixfusion", False),
            text_token_counter=self._count_text_tokens,
        )
        self._lock = threading.Condition()
        self._futures: dict[str, concurrent.futures.Future] = {}
        self._arrivals: dict[str, float] = {}
        self._first_scheduled: dict[str, float] = {}
        self._steps: collections.deque[StepStats] = collections.deque(maxlen=1000)
        self._thread: threading.Thread | None = None
        self._stop = False
        self._step_id = 0
        logger.info(
            "engine ready: model=%s device=%s dtype=%s step_execution=%s max_num_seqs=%d "
            "mixfusion=%s batch_invariant=%s",
            config.model,
            self.pipeline.device,
            self.pipeline.dtype,
            config.step_execution,
            config.max_num_seqs,
            config.enable_mixfusion,
            config.batch_invariant,
        )

    def _warm_up_transformer(self) -> None:
        """Run small dense and packed forwards once, so compilation happens before the first request.

        Covers the shapes the compiled ops specialise on: one and several sequences, dense and packed.
        """
        import torch

        from vllm_omni.diffusion.models.qwen_image.packing import SequenceSpec, build_packed_layout

        transformer, device, dtype = self.pipeline.transformer, self.pipeline.device, self.pipeline.dtype
        cfg = transformer.config
        start = time.perf_counter()
        with torch.inference_mode():
            for grids in ([(1, 2, 2)], [(1, 2, 2), (1, 3, 2)]):
                specs = [SequenceSpec(num_txt_tokens=3 + i, img_shape=g) for i, g in enumerate(grids)]
                layout = build_packed_layout(specs, cfg.axes_dims_rope, device=device)
                img = torch.randn(layout.num_img_rows, cfg.in_channels, device=device, dtype=dtype)
                txt = torch.randn(layout.num_txt_rows, cfg.joint_attention_dim, device=device, dtype=dtype)
                transformer.forward_packed(img, txt, torch.rand(len(specs), device=device), layout)
            for batch in (1, 2):
                img = torch.randn(batch, 4, cfg.in_channels, device=device, dtype=dtype)
                txt = torch.randn(batch, 3, cfg.joint_attention_dim, device=device, dtype=dtype)
                mask = torch.ones(batch, 3, dtype=torch.long, device=device)
                mask[0, -1] = 0
                transformer(img, txt, mask, torch.rand(batch, device=device), [(1, 2, 2)] * batch)
        logger.info("transformer warm-up (compile) took %.1f s", time.perf_counter() - start)

    @staticmethod
    def _load_pipeline(config: OmniDiffusionConfig):
        import torch

        from vllm_omni.diffusion.models.qwen_image_edit.loader import load_step_pipeline

        if config.seed is not None:
            torch.manual_seed(config.seed)
        device, dtype = torch.device(config.resolve_device()), config.resolve_dtype()
        # Qwen-Image or Qwen-Image-Edit, from the checkpoint's model_index.json
        return load_step_pipeline(
            config.model,
            device=device,
            dtype=dtype,
            load_format=config.load_format,
            seed=config.seed,
            attn_backend=config.attention_backend,
        )

    def _count_text_tokens(self, req: OmniDiffusionRequest) -> tuple[int, int]:
        sp = req.sampling_params
        pos = min(self.pipeline.count_prompt_tokens(req.prompt), sp.max_sequence_length)
        neg = 0
        if req.do_classifier_free_guidance:
            neg = min(self.pipeline.count_prompt_tokens(req.negative_prompt), sp.max_sequence_length)
        return pos, neg

    # ---- front end --------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    def check_health(self) -> None:
        """Raise RuntimeError when the loop thread died (the server then answers /health with 503)."""
        thread = self._thread
        if thread is not None and not thread.is_alive() and not self._stop:
            raise RuntimeError("the engine loop thread has stopped")

    def recent_steps(self) -> list[StepStats]:
        """The last (up to 1000) steps, oldest first."""
        with self._lock:
            return list(self._steps)

    def validate_request(self, request: OmniDiffusionRequest) -> None:
        """Raise ValueError naming the field and the limit."""
        if not isinstance(request.prompt, str) or not request.prompt.strip():
            raise ValueError("prompt must be a non-empty string")
        if request.negative_prompt is not None and not isinstance(request.negative_prompt, str):
            raise ValueError("negative_prompt must be a string")
        request.sampling_params.validate(self.config.max_generated_image_size)
        if self.config.batch_invariant and request.sampling_params.seed is None:
            raise ValueError("seed is required in batch-invariant mode (VLLM_BATCH_INVARIANT=1)")
        if request.sampling_params.lora_request is not None:
            raise ValueError(
                "lora: LoRA adapters are not loaded on this server; send the request without 'lora'"
            )
        self.pipeline.check_prompt("prompt", request.prompt)
        if request.negative_prompt is not None:
            self.pipeline.check_prompt("negative_prompt", request.negative_prompt)
        from vllm_omni.diffusion.models.qwen_image_edit.pipeline import check_image_input

        check_image_input(
            self.pipeline, request.prompt, request.negative_prompt, request.image, request.sampling_params
        )

    def add_request(self, request: OmniDiffusionRequest) -> concurrent.futures.Future:
        """Queue a request; the future resolves to its `DiffusionOutput` or raises.

        Raises ValueError for invalid input and QueueFullError when the queue is full.
        """
        self.validate_request(request)
        # The engine owns its copy; the scheduler assigns a seed when none was given.
        request.sampling_params = copy.deepcopy(request.sampling_params)
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self.scheduler.add_request(request)  # raises QueueFullError at max_queue_size
            self._futures[request.request_id] = future
            self._arrivals[request.request_id] = time.monotonic()
            self._lock.notify_all()
        if self.autostart:
            self.start()
        return future

    async def generate(self, request: OmniDiffusionRequest) -> DiffusionOutput:
        """Run a request to completion; cancelling the awaiting task aborts it."""
        future = self.add_request(request)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            self.abort(request.request_id)
            raise

    def abort(self, req_id: str) -> None:
        """Abort a waiting or running request; its slot is free for the next step."""
        with self._lock:
            if self.scheduler.abort_request(req_id):
                self._lock.notify_all()

    # ---- loop -------------------------------------------------------------------------------

    def start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._stop = False
                self._thread = threading.Thread(target=self._loop, name="diffusion-engine", daemon=True)
                self._thread.start()

    def shutdown(self) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout=30)
        self._thread = None
        stop_workers = getattr(self.runner, "shutdown", None)
        if stop_workers is not None:
            stop_workers()

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
        self._fail_all("engine shut down")

    def step(self) -> StepStats | None:
        """Schedule and run one step on the calling thread (for tests and tools without the loop)."""
        with self._lock:
            sched_out = self.scheduler.schedule()
        if sched_out.is_empty:
            return None
        self.step_once(sched_out)
        return self._steps[-1] if sched_out.num_scheduled_reqs else None

    def step_once(self, sched_out) -> None:
        """Run one scheduled step and deliver what finished."""
        now = time.monotonic()
        for req_id in sched_out.scheduled_req_ids:
            self._first_scheduled.setdefault(req_id, now)
        if sched_out.num_scheduled_reqs == 0:
            self.runner.free(sched_out.finished_req_ids)
            runner_out = ModelRunnerOutput(outputs=[])
        else:
            try:
                if self.config.step_execution:
                    runner_out = self.runner.execute_step(sched_out)
                else:
                    runner_out = self.runner.execute_request(sched_out)
            except Exception as exc:
                logger.exception("denoise step failed for %s", sched_out.scheduled_req_ids)
                self.runner.free(sched_out.scheduled_req_ids)
                runner_out = self._all_failed(sched_out, f"denoise step failed: {exc}")
        with self._lock:
            finished = self.scheduler.update_from_output(sched_out, runner_out)
            num_running, num_waiting = self.scheduler.num_running, self.scheduler.num_waiting
            if sched_out.num_scheduled_reqs:
                self._steps.append(runner_out.stats)
        self.runner.free(f.req_id for f in finished)
        if sched_out.num_scheduled_reqs:
            self._log_step(sched_out.step_id, runner_out.stats, num_running, num_waiting)
        for item in finished:
            self._deliver(item)

    @staticmethod
    def _all_failed(sched_out, message: str) -> ModelRunnerOutput:
        from vllm_omni.diffusion.sched.interface import RunnerOutput

        return ModelRunnerOutput(
            outputs=[RunnerOutput(r, 0, finished=True, error=message) for r in sched_out.scheduled_req_ids]
        )

    def _log_step(self, step_id: int, stats: StepStats, num_running: int, num_waiting: int) -> None:
        if self.config.log_stats and stats.num_reqs:
            sizes = ",".join(f"{w}x{h}" for h, w in stats.shapes)
            logger.info(
                "step %d: %d reqs [%s] %d seqs %d tokens path=%s %.1f ms | running=%d waiting=%d",
                step_id,
                stats.num_reqs,
                sizes,
                stats.num_seqs,
                stats.num_tokens,
                stats.path,
                stats.step_time_s * 1e3,
                num_running,
                num_waiting,
            )
        for stat_logger in list(self.stat_loggers):
            try:
                stat_logger.on_step(stats, num_running, num_waiting)
            except Exception:
                logger.exception("stat logger failed; dropping it")
                self.stat_loggers.remove(stat_logger)

    def _deliver(self, item: FinishedRequest) -> None:
        with self._lock:
            future = self._futures.pop(item.req_id, None)
            arrival = self._arrivals.pop(item.req_id, time.monotonic())
            first = self._first_scheduled.pop(item.req_id, None)
        now = time.monotonic()
        status = _STATUS_NAMES.get(item.status, "error")
        kind = _error_kind(item.error) if status == "error" else None
        stats = RequestStats(
            req_id=item.req_id,
            status=status,
            num_images=len(item.result.images) if item.result is not None else 0,
            latency_s=now - arrival,
            queue_time_s=(first if first is not None else now) - arrival,
            error_kind=kind,
        )
        # NOTE(engine): stat loggers run before the future resolves, so the server can read a request's
        # queue and engine times when its response is built.
        for stat_logger in list(self.stat_loggers):
            try:
                stat_logger.on_request_finished(stats)
            except Exception:
                logger.exception("stat logger failed; dropping it")
                self.stat_loggers.remove(stat_logger)
        if future is None or future.done():
            return
        if item.status == RequestStatus.FINISHED_COMPLETED and item.result is not None:
            future.set_result(item.result)
        elif item.status == RequestStatus.FINISHED_ABORTED:
            future.set_exception(RequestAbortedError(f"Request {item.req_id} aborted."))
        else:
            future.set_exception(RequestFailedError(item.error or "request failed", kind=kind or "internal"))

    def _fail_all(self, message: str) -> None:
        with self._lock:
            futures, self._futures = self._futures, {}
        for future in futures.values():
            if not future.done():
                future.set_exception(RequestAbortedError(message))

"""Prometheus metrics for the server: a `StatLogger` the engine calls, plus server-side counters.

Every metric lives in the logger's own `CollectorRegistry`, so two apps in one
process (tests) never collide. Names start with `vllm_omni:` (vLLM uses `vllm:`).
The engine calls `on_step` / `on_request_finished` from its loop thread;
prometheus-client is thread-safe.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from vllm_omni.config import OmniDiffusionConfig
from vllm_omni.diffusion.outputs import FinishReason, RequestOutput
from vllm_omni.diffusion.sched.interface import StepStats

PREFIX = "vllm_omni:"
METRICS_CONTENT_TYPE = CONTENT_TYPE_LATEST

_COUNT_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256)
_TOKEN_BUCKETS = tuple(2**k for k in range(4, 21))  # 16 .. 1M
_STEP_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_COST_PROBE_TOKENS = (512, 1024, 2048, 4096, 8192, 16384)
"""Token counts at which `step_cost_model_seconds` shows the scheduler's predicted step time."""
_SIZE_CLASSES = ((256 * 256, "<=256x256"), (512 * 512, "<=512x512"), (768 * 768, "<=768x768"))
_SIZE_CLASSES += ((1024 * 1024, "<=1024x1024"), (1536 * 1536, "<=1536x1536"), (float("inf"), ">1536x1536"))
"""(most pixels, label) of the `size_class` label, smallest first."""


def size_class(height: int, width: int) -> str:
    """The `size_class` label of an image size."""
    return next(label for pixels, label in _SIZE_CLASSES if height * width <= pixels)


_REQUEST_SECONDS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 60, 120, 300, 600, 1800, 3600)


class PrometheusStatLogger:
    """Engine `StatLogger` exporting step and request metrics, with its own registry."""

    def __init__(
        self, config: OmniDiffusionConfig, model_name: str, registry: CollectorRegistry | None = None
    ):
        self.registry = registry if registry is not None else CollectorRegistry()
        self._build_metrics()
        self._model_name = model_name
        self._set_config_info(config, config.device, config.dtype, config.enable_mixfusion)
        self._batch_invariant.set(1 if config.batch_invariant else 0)
        self._cost_model = None
        """The scheduler's `StepCostModel` (set by `describe_engine`); shown at scrape time."""
        self._memory_budget = None
        """The engine's `MemoryBudget` (set by `describe_engine`); shown at scrape time."""

    def _set_config_info(self, config: OmniDiffusionConfig, device, dtype, enable_mixfusion) -> None:
        self._config_info.info(
            {
                "model": self._model_name,
                "step_execution": str(config.step_execution).lower(),
                "max_num_seqs": str(config.max_num_seqs),
                "scheduling_policy": config.scheduling_policy,
                "enable_mixfusion": str(enable_mixfusion).lower(),
                "dtype": str(dtype).removeprefix("torch."),
                "device": str(device),
            }
        )

    def describe_engine(self, engine) -> None:
        """Show in `engine_config_info` what runs: the resolved device and dtype, MixFusion on or off."""
        config = engine.config
        worker = getattr(getattr(engine, "executor", None), "driver_worker", None)
        pipeline = getattr(worker, "pipeline", None)
        device = getattr(worker, "device", None) or config.resolve_device()
        dtype = pipeline.dtype if pipeline is not None else config.resolve_dtype()
        self._cost_model = getattr(getattr(engine, "scheduler", None), "cost_model", None)
        self._memory_budget = getattr(engine, "memory", None)
        mixfusion = getattr(getattr(engine, "scheduler", None), "enable_mixfusion", None)
        if mixfusion is None:  # the scheduler's rule: the flag, else on when the pipeline supports it
            mixfusion = config.enable_mixfusion
        if mixfusion is None:
            mixfusion = pipeline is not None and pipeline.supports_mixfusion
        self._set_config_info(config, device, dtype, mixfusion)

    def _build_metrics(self) -> None:
        reg = self.registry

        def histogram(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(PREFIX + name, doc, buckets=buckets, registry=reg)

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=reg)

        def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=reg)

        self._running = gauge("num_requests_running", "Requests being denoised.")
        self._waiting = gauge("num_requests_waiting", "Requests waiting for a slot.")
        self._batch_invariant = gauge("batch_invariant_enabled", "1 when batch-invariant mode is on.")
        self._config_info = Info(PREFIX + "engine_config", "Engine configuration.", registry=reg)
        self._steps = counter("steps", "Engine steps run, by execution path.", ("path",))
        self._mixed_steps = counter(
            "mixed_resolution_steps", "Steps that ran two or more different resolutions."
        )
        self._compile_fallbacks = counter(
            "compile_fallbacks",
            "Compiled block ops that raised and ran eager instead (that shape stays eager).",
        )
        self._step_reqs = histogram("step_num_requests", "Requests per step.", _COUNT_BUCKETS)
        self._step_seqs = histogram(
            "step_num_sequences", "Sequences per step (CFG counts 2).", _COUNT_BUCKETS
        )
        self._step_tokens = histogram(
            "step_num_tokens", "Real tokens (text + image) per step.", _TOKEN_BUCKETS
        )
        self._step_shapes = histogram(
            "step_num_resolutions", "Distinct (height, width) per step.", _COUNT_BUCKETS
        )
        self._step_time = histogram("step_latency_seconds", "Wall time of one engine step.", _STEP_SECONDS)
        self._e2e = histogram(
            "e2e_request_latency_seconds", "Engine arrival to finish, per request.", _REQUEST_SECONDS
        )
        self._queue = histogram(
            "request_queue_time_seconds", "Engine arrival to first scheduled step.", _REQUEST_SECONDS
        )
        self._latency_by_size = Histogram(
            PREFIX + "request_latency_by_size_seconds",
            "Engine arrival to finish of completed requests, by image size class.",
            ["size_class"],
            buckets=_REQUEST_SECONDS,
            registry=reg,
        )
        self._sat_out = histogram(
            "request_steps_sat_out",
            "Steps a request was started but sat out (latency policy).",
            _COUNT_BUCKETS,
        )
        self._preemptions = counter("request_preemptions", "Times a request ran a step and sat out the next.")
        self._paused = gauge("num_requests_paused", "Started requests that sat the last step out.")
        self._cost_seconds = gauge(
            "step_cost_model_seconds",
            "The scheduler's predicted step time at a number of packed tokens.",
            ("num_tokens",),
        )
        self._saturation = gauge(
            "step_cost_saturation_tokens",
            "Packed tokens from which the cost model says the GPU is busy (adding work costs its own time).",
        )
        self._deadline_steps = counter(
            "steps_deadline_ordered",
            "Steps the latency policy built in deadline order (its tail guard overrode shortest-first).",
        )
        self._overhead = gauge(
            "request_overhead_seconds",
            "The cost model's per-request time outside denoise steps (prompt encoding, decode).",
        )
        self._memory = gauge(
            "memory_budget_bytes",
            "Request memory: 'budget' (what requests may hold: --gpu-memory-utilization of the free memory, "
            "re-measured when idle) and 'reserved' (charged to admitted requests).",
            ("kind",),
        )
        self._finished = counter("requests_finished", "Finished requests by status.", ("status",))
        self._images = counter("images_generated", "Images returned by completed requests.")
        self._cached_steps = counter(
            "request_cached_steps",
            "Step caching: steps a CFG branch of a finished request reused its residual.",
        )
        self._cached_seqs = counter(
            "step_cached_sequences", "Step caching: sequences that skipped their middle blocks in a step."
        )
        self._errors = counter(
            "request_errors",
            "Failed or refused requests by kind (engine failures and HTTP rejections).",
            ("kind",),
        )

    # ---- StatLogger protocol (engine loop thread) ------------------------------------------------

    def on_step(self, stats: StepStats, num_running: int, num_waiting: int) -> None:
        """Record one engine step."""
        self._running.set(num_running)
        self._waiting.set(num_waiting)
        if stats.num_reqs == 0:
            return
        num_shapes = len(set(stats.shapes))
        self._steps.labels(stats.path.value).inc()
        self._step_reqs.observe(stats.num_reqs)
        self._step_seqs.observe(stats.num_seqs)
        self._step_tokens.observe(stats.num_tokens)
        self._step_shapes.observe(num_shapes)
        self._step_time.observe(stats.step_time_s)
        self._paused.set(stats.num_paused)
        if stats.deadline_ordered:
            self._deadline_steps.inc()
        if stats.num_compile_fallbacks:
            self._compile_fallbacks.inc(stats.num_compile_fallbacks)
        if stats.num_cached_seqs:
            self._cached_seqs.inc(stats.num_cached_seqs)
        if num_shapes >= 2:
            self._mixed_steps.inc()

    def on_request_finished(self, output: RequestOutput) -> None:
        """Record one finished request (completed, aborted or failed)."""
        self._finished.labels(output.finish_reason.value).inc()
        timings = output.timings
        if timings.engine_s is not None:
            self._e2e.observe(timings.engine_s)
        if timings.queue_s is not None:
            self._queue.observe(timings.queue_s)
        self._sat_out.observe(timings.num_steps_sat_out)
        self._preemptions.inc(timings.num_preemptions)
        if timings.num_cached_steps:
            self._cached_steps.inc(sum(timings.num_cached_steps))
        if output.finish_reason is FinishReason.COMPLETED:
            self._images.inc(output.num_images)
            if timings.engine_s is not None:
                self._latency_by_size.labels(size_class(output.height, output.width)).observe(
                    timings.engine_s
                )
        elif output.finish_reason is FinishReason.ERROR:
            self._errors.labels(output.error_kind.value if output.error_kind else "internal").inc()

    # ---- server side ------------------------------------------------------------------------------

    def record_rejection(self, kind: str) -> None:
        """Count a request the server refused (kind: 'invalid_request', 'queue_full', ...)."""
        self._errors.labels(kind).inc()

    def set_queue_sizes(self, num_running: int, num_waiting: int) -> None:
        """Refresh the running / waiting gauges (called at scrape time)."""
        self._running.set(num_running)
        self._waiting.set(num_waiting)

    def render(self) -> bytes:
        """The registry in Prometheus text format (the cost model's gauges refreshed first)."""
        model = self._cost_model
        if model is not None:
            for num_tokens in _COST_PROBE_TOKENS:
                self._cost_seconds.labels(str(num_tokens)).set(model.step_time(num_tokens))
            self._overhead.set(model.request_overhead_s)
            saturation = model.saturation_tokens()
            if saturation is not None:
                self._saturation.set(saturation)
        budget = self._memory_budget
        if budget is not None:
            budget.refresh()  # measured again only while no request holds memory
            self._memory.labels("budget").set(budget.request_bytes)
            self._memory.labels("reserved").set(budget.reserved_bytes)
        return generate_latest(self.registry)

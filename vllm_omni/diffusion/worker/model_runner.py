"""The model runner: a persistent slot batch on the worker, one packed denoise step per call.

Per step::

    finished / aborted -> give their slots back
    new requests       -> encode prompts (together), draw noise, build schedules, take a slot
    all requests       -> the slots' StepPlan (cached until a slot changes)
                       -> one transformer forward: packed varlen (mixed shapes),
                          dense [B, S, C] (one shape), or serial (hooked blocks)
                       -> CFG combine and Euler step, vectorised over every request's rows
                          (each row with its own scale, sigma and timestep)
    denoised           -> latents copied out, slot freed, decode handed to the decode worker
                          (decode_worker.py: its own thread and CUDA stream, beside the steps)

A failure while handling one request (its encoding, its CFG/solver step, its decode) fails that
request only; the others keep running.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
from collections import deque
from dataclasses import dataclass

import torch

from vllm_omni.config import OmniDiffusionConfig
from vllm_omni.diffusion.cache.state import cache_rate, cache_summary, make_branches, num_cached_steps
from vllm_omni.diffusion.cache.step import SeqSubset, StepCache
from vllm_omni.diffusion.layout import SequenceSpec, build_packed_layout
from vllm_omni.diffusion.models import registry
from vllm_omni.diffusion.outputs import ErrorKind
from vllm_omni.diffusion.sched.cost_model import StepCostSample
from vllm_omni.diffusion.sched.interface import (
    ForwardPath,
    ModelRunnerOutput,
    NewRequestData,
    RunnerOutput,
    SchedulerOutput,
    StepStats,
)
from vllm_omni.diffusion.solvers.flow_match import flow_match_euler_step
from vllm_omni.diffusion.solvers.guidance import apply_guidance
from vllm_omni.diffusion.worker.cuda_graphs import CudaGraphConfig, CUDAGraphRunner, graphs_off_reason
from vllm_omni.diffusion.worker.decode_worker import DecodeJob, DecodeWorker
from vllm_omni.diffusion.worker.input_batch import InputBatch, StepPlan
from vllm_omni.diffusion.worker.request_state import DiffusionRequestState
from vllm_omni.inputs import preview_steps
from vllm_omni.lora.batch import LoRAMapping, SeqLoRA
from vllm_omni.lora.kernels import triton_available

logger = logging.getLogger(__name__)

MEASURED_LAYOUTS = ((64, 1), (128, 1), (256, 1), (256, 2), (256, 4), (512, 1), (768, 1), (1024, 1), (1328, 1))
"""(image side in pixels, requests) of the CFG layouts timed at start-up (`measure_step_costs`), by
tokens: what the step cost model starts from."""

MEASURE_BUDGET_S = 10.0
"""Start-up seconds `measure_step_costs` may spend before it stops measuring larger layouts (a large
GPU needs a few seconds for all of them)."""

CPU_MEASURED_LAYOUTS = MEASURED_LAYOUTS[:5]
"""A CPU times only the small layouts (up to four 256x256 CFG requests): where a CPU serves at all."""

CPU_MEASURE_BUDGET_S = 2.0

CPU_MEASURE_ROUNDS = 5
"""Start-up seconds the CPU measurement may spend: half of it warming up layouts (no larger one is added
after that), the rest timing rounds (at least one; the tiny model needs a fraction of it)."""

MAX_STEPS_AHEAD = 1
"""Steps the host may have queued on the GPU beyond the one it runs now (see `_pace`)."""


@dataclass
class QueuedStep:
    """A step whose GPU work may still run: its end event and, when it denoised, the CUDA events
    around its denoise work and its tokens (a cost-model sample once the step has finished)."""

    end: torch.cuda.Event
    denoise: tuple[torch.cuda.Event, torch.cuda.Event, int] | None


class DiffusionModelRunner:
    """Holds the slot batch and runs denoise steps of a step pipeline."""

    def __init__(self, pipeline, config: OmniDiffusionConfig, lora_manager=None):
        self.pipeline = pipeline
        self.config = config
        self.lora_manager = lora_manager
        """`LoRAManager` of the transformer when LoRA is enabled: each sequence's adapter per forward."""
        self.transformer = pipeline.transformer
        self.device = pipeline.device
        self.dtype = pipeline.dtype
        self.batch = InputBatch(max_num_reqs=config.resident_cap, device=self.device)
        """One slot per started request (`config.resident_cap`); a step runs all or some of them."""
        self.batch_invariant = config.batch_invariant
        self.decoder = DecodeWorker(pipeline, self.device, config.batch_invariant)
        """Decodes finished requests (and previews) beside the steps; see decode_worker.py."""
        self._previews: list[tuple[DiffusionRequestState, torch.Tensor]] = []
        """This step's x0 estimates [n, S, C] of requests that take a preview after it (`_finish`)."""
        self.use_dense_path = (
            not config.batch_invariant and registry.family_of(pipeline).capabilities.dense_forward
        )
        """Same-shape batches use the dense forward unless results must not depend on the batch (or the
        pipeline has none worth taking: Qwen-Image-2.1's dense forward cannot use its prefix cache)."""
        self.serial_fallback = self._blocks_have_hooks()
        if self.serial_fallback and pipeline.supports_image_input:
            raise ValueError(
                "image-edit models need the packed forward, but the transformer blocks carry forward "
                "hooks (e.g. a sharding wrapper); serve the edit model without them"
            )
        if self.serial_fallback:
            logger.warning(
                "transformer blocks carry forward hooks (e.g. a sharding wrapper): requests will run "
                "one by one instead of packed"
            )
        off = graphs_off_reason(
            self.transformer,
            self.device,
            config.enforce_eager,
            config.batch_invariant,
            pipeline.cuda_graphs_off_reason,
        )
        if off is None and self.serial_fallback:
            off = "serial fallback (hooked blocks)"
        if off is None and lora_manager is not None and not triton_available():
            off = "LoRA without triton (the graph-captured LoRA deltas are Triton kernels)"
        self._check_cache(off)
        self._cache_subsets: tuple[StepPlan | None, dict] = (None, {})
        """(the plan, its running-subset layouts): reused while the batch composition lasts."""
        self._num_cached_seqs = 0
        """Sequences that reused their cached residual in the last forward (step caching)."""
        self._queued_steps: deque[QueuedStep] = deque()
        """Steps whose GPU work may still run, oldest first (see `_pace`)."""
        self._cost_samples: list[StepCostSample] = []
        """Denoise times measured since the last step's output (the scheduler's cost model)."""
        graph_config = CudaGraphConfig.for_max_num_seqs(config.max_num_seqs, config.quantization.is_enabled)
        if off is None:
            graph_config = self._enable_prefix_arena(graph_config)
        self.graphs = CUDAGraphRunner(
            self.transformer,
            self.device,
            self.dtype,
            graph_config,
            off is None,
            lora_state=None if lora_manager is None else lora_manager.state,
        )
        """The transformer forwards: CUDA graph replay when a batch fits a bucket, else eager."""
        if off is None:
            self.graphs.capture_all()
        else:
            logger.info("CUDA graphs off: %s", off)
        self.startup_cost_samples: list[StepCostSample] = self.measure_step_costs()
        """Forward times of typical CFG layouts measured at start-up (the scheduler's cost model starts
        from them: without them it would pack nothing until it had learned from real steps)."""

    @property
    def num_transformer_blocks(self) -> int:
        """The transformer's blocks, what a step-cache segment counts in (0 when caching is off)."""
        if not self.config.cache.is_enabled:
            return 0
        return len(self.transformer.plans.block_list(self.transformer))

    @property
    def cache_row_bytes(self) -> int:
        """Bytes of one stream row of a kept step-cache residual, what the memory budget charges
        (0 when caching is off)."""
        if not self.config.cache.is_enabled:
            return 0
        return self.transformer.config.inner_dim * torch.empty((), dtype=self.dtype).element_size()

    def _check_cache(self, graphs_off: str | None) -> None:
        """ValueError when the server's step caching cannot run on this model; a log line when its
        steps run eager under CUDA graphs."""
        cache = self.config.cache
        if not cache.is_enabled:
            return
        family = registry.family_of(self.pipeline)
        if not family.capabilities.caching:  # the engine refused it already (`refusals`)
            raise ValueError(
                f"--cache-backend {cache.backend} is not supported for {family.capabilities.display_name}"
            )
        if self.serial_fallback:
            raise ValueError(f"--cache-backend {cache.backend} needs the packed forward (blocks carry hooks)")
        cache.params.check_model(self.num_transformer_blocks)
        if graphs_off is None:
            logger.info(
                "step caching (%s): steps with a caching request run eager (no CUDA graph buckets for "
                "the Fn / middle / Bn segments yet); steps without one replay graphs",
                cache.backend,
            )

    def _enable_prefix_arena(self, graph_config: CudaGraphConfig) -> CudaGraphConfig:
        """Before the graphs are built: move a transformer's prefix cache into fixed rows (its optional
        `enable_prefix_arena`, sized by --kv-cache-memory-bytes or its default; allocated now, so the
        memory budget measured after start-up leaves it out) and take its own second bucket axis."""
        enable = self.transformer.enable_prefix_arena
        if enable is not None:
            limit = self.config.kv_cache_memory_bytes
            arena = enable(limit, self.device, self.dtype)
            logger.info(
                "prefix KV arena: %d rows of %d bytes, %.2f GiB (%s)",
                arena.capacity_rows,
                arena.row_bytes,
                arena.num_bytes / 2**30,
                "--kv-cache-memory-bytes"
                if self.config.kv_cache_memory_bytes is not None
                else "default size",
            )
        axis = self.transformer.graph_context_axis
        if axis is None:
            return graph_config
        return dataclasses.replace(graph_config, txt_rows=axis.rows, txt_rows_per_seq=axis.max_rows_per_seq)

    @torch.inference_mode()
    def measure_step_costs(self, iters: int = 3, budget_s: float | None = None) -> list[StepCostSample]:
        """Time the forward of typical CFG layouts (every request a positive and a negative sequence
        of 32 text tokens), the median of `iters` after a warm-up: the start-up points of the
        scheduler's step cost model. Replays the captured graphs where a bucket fits, as real steps
        do: a few seconds on a large GPU. A CPU times only the small layouts, each warmed up once (its first
        forward of a shape pays one-off set-up), in `CPU_MEASURE_ROUNDS` interleaved rounds, and keeps
        each layout's fastest (another process on the machine only ever adds time), within
        `CPU_MEASURE_BUDGET_S`. Stops adding layouts after the one that passes `budget_s`, and at the
        first layout the model cannot run without a real request: the cost model then learns from
        real steps.
        (Qwen-Image-2.1 prefills a synthetic sequence's prefix inside the forward, so its start-up
        points include the prefix work its real steps skip: an overestimate the online samples correct.)"""
        on_cpu = self.device.type == "cpu"
        if budget_s is None:
            budget_s = CPU_MEASURE_BUDGET_S if on_cpu else MEASURE_BUDGET_S
        forwards, times, started = [], [], time.perf_counter()
        for k, (side, num_reqs) in enumerate(CPU_MEASURED_LAYOUTS if on_cpu else MEASURED_LAYOUTS):
            # a CPU measures two layouts at least: one point alone extrapolates proportionally (nothing
            # would pack), and a busy machine can spend the budget on the first
            if on_cpu and len(forwards) < 2:
                pass
            elif time.perf_counter() - started > (budget_s / 2 if on_cpu else budget_s):
                break
            forward, num_tokens = self._synthetic_forward(side, num_reqs)
            try:
                for _ in range(3 if k == 0 and not on_cpu else 1):  # warm-up (first calls pay lazy set-up)
                    forward()
            except Exception as exc:  # noqa: BLE001 - a measurement, never a reason not to start
                logger.info(
                    "step cost model: no start-up measurement for this model (%s); learning online", exc
                )
                break
            forwards.append((num_tokens, forward))
            times.append([] if on_cpu else [self._timed(forward) for _ in range(iters)])
        if on_cpu:  # interleaved rounds: another process's burst of work lands on every layout alike
            for k in range(max(iters, CPU_MEASURE_ROUNDS)):
                if k and time.perf_counter() - started > budget_s:
                    break
                for layout_times, (_, forward) in zip(times, forwards, strict=True):
                    layout_times.append(self._timed(forward))
        return [
            StepCostSample(num_tokens, min(t) if on_cpu else sorted(t)[len(t) // 2])
            for (num_tokens, _), t in zip(forwards, times, strict=True)
        ]

    def _timed(self, forward) -> float:
        """Seconds one call of `forward` takes on the device."""
        start = self._mark()
        forward()
        return self._span_s(start, self._mark())

    def _synthetic_forward(self, side: int, num_reqs: int):
        """A zero-input packed forward of `num_reqs` CFG requests of side x side pixels: (call, tokens)."""
        cfg = self.transformer.config
        grid = (1, side // 16, side // 16)
        specs = [SequenceSpec(32, grid, is_negative=bool(i % 2)) for i in range(2 * num_reqs)]
        layout = build_packed_layout(specs, self.transformer.position_tables, device=self.device)
        img = torch.zeros(layout.num_img_rows, cfg.in_channels, device=self.device, dtype=self.dtype)
        txt = torch.zeros(layout.num_txt_rows, cfg.joint_attention_dim, device=self.device, dtype=self.dtype)
        timesteps = torch.full((len(specs),), 0.5, device=self.device, dtype=self.dtype)
        return (lambda: self.graphs.forward_packed(img, txt, timesteps, layout)), layout.total_tokens

    def _blocks_have_hooks(self) -> bool:
        blocks = self.transformer.plans.block_list(self.transformer)
        return any(b._forward_hooks or b._forward_pre_hooks for b in blocks)

    def _num_compile_fallbacks(self) -> int:
        """Compiled-op fallbacks so far (the transformer's, also under a parallel wrapper)."""
        return self.transformer.num_compile_fallbacks

    @property
    def num_reqs(self) -> int:
        """Requests holding a slot."""
        return self.batch.num_reqs

    # ---- admission --------------------------------------------------------------------------

    def _add_requests(self, new_reqs: list[NewRequestData]) -> list[RunnerOutput]:
        """Create states for newly admitted requests and give them slots; return failures."""
        failures: list[RunnerOutput] = []
        if not new_reqs:
            return failures
        try:
            embeds = self._encode(new_reqs)
        except Exception as exc:  # one bad prompt must not fail the others: retry one by one
            logger.warning("batched prompt encoding failed (%s); encoding requests one by one", exc)
            embeds = {}
            for req in new_reqs:
                try:
                    embeds.update(self._encode([req]))
                except Exception as one_exc:
                    failures.append(
                        RunnerOutput.failed(
                            req.req_id, 0, ErrorKind.ENCODE, f"prompt encoding failed: {one_exc}"
                        )
                    )
        for req in new_reqs:
            if req.req_id not in embeds:
                continue
            try:
                self.batch.add_request(self._make_state(req, *embeds[req.req_id]))
            except Exception as exc:
                failures.append(
                    RunnerOutput.failed(req.req_id, 0, ErrorKind.SETUP, f"request setup failed: {exc}")
                )
        return failures

    def _encode(self, reqs: list[NewRequestData]) -> dict[str, tuple]:
        """Encode the positive (and negative) prompts of `reqs` in one text-encoder call (each alone in
        batch-invariant mode): {req_id: (prompt rows, negative rows or None, edit condition or None)}.
        Edit pipelines also encode each request's input image, with the VAE the decode worker shares."""
        vae_lock = self.decoder.vae_lock if self.pipeline.supports_image_input else None
        with vae_lock or contextlib.nullcontext():
            return self.pipeline.encode_requests(reqs, one_by_one=self.batch_invariant)

    def _make_state(
        self,
        req: NewRequestData,
        prompt_embeds: torch.Tensor,
        neg_embeds: torch.Tensor | None,
        condition=None,
    ) -> DiffusionRequestState:
        """`condition`: the edit pipeline's condition of the request's input images (`cond_latents`,
        `cond_shapes`), or None."""
        sp = req.sampling_params
        generator = torch.Generator("cpu").manual_seed(sp.seed)
        grid = req.geometry.latent_grid if req.geometry is not None else self.pipeline.latent_grid(sp)
        cache, branches = sp.resolve_cache(self.config.cache), None
        if cache.is_enabled:
            num_seqs = sp.num_outputs_per_prompt * (2 if neg_embeds is not None else 1)
            coefficients = self.transformer.plans.tea_cache_coefficients
            branches = make_branches(cache, num_seqs, self.num_transformer_blocks, coefficients)
        return DiffusionRequestState(
            req_id=req.req_id,
            params=sp,
            latents=self.pipeline.prepare_latents(sp, generator),
            prompt_embeds=prompt_embeds,
            negative_prompt_embeds=neg_embeds,
            schedule=self.pipeline.sigma_schedule(sp),
            generator=generator,
            latent_grid=grid,
            cond_latents=None if condition is None else condition.cond_latents,
            cond_shapes=() if condition is None else condition.cond_shapes,
            num_step_tokens=None if req.geometry is None else req.geometry.num_step_tokens,
            preview_steps=preview_steps(sp.num_inference_steps, sp.partial_images),
            cache_branches=branches,
        )

    def free(self, req_ids) -> None:
        """Give back the slots of requests that ended (finished, aborted, failed), and what the pipeline
        holds for them (`release`: Qwen-Image-2.1's prefix KV cache)."""
        req_ids = list(req_ids)
        for req_id in req_ids:
            self.batch.remove_request(req_id)
        if req_ids:
            self.pipeline.release(req_ids)

    # ---- the step ---------------------------------------------------------------------------

    def _pace(self) -> None:
        """Keep the host at most `MAX_STEPS_AHEAD` step ahead of the GPU.

        Nothing in a denoise step reads the device, so the host would otherwise queue steps until
        CUDA's launch queue fills: dozens of graph replays, seconds of GPU work at 512x512. A request
        admitted then would wait behind all of them, and an aborted one's queued steps would still
        run. Waiting for the step before the previous one keeps one step of look-ahead, enough to
        hide the host's scheduling and input work behind the GPU's current step.
        """
        while len(self._queued_steps) > MAX_STEPS_AHEAD:
            self._collect(self._queued_steps.popleft())

    def _collect(self, step: QueuedStep) -> None:
        """Wait for a queued step's GPU work; keep its denoise time for the cost model."""
        step.end.synchronize()
        if step.denoise is not None:
            start, end, num_tokens = step.denoise
            self._cost_samples.append(StepCostSample(num_tokens, self._span_s(start, end)))

    def _mark(self):
        """A point in the step's work: a recorded CUDA event, or the host clock on CPU."""
        if self.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _span_s(self, start, end) -> float:
        """Seconds between two `_mark()`s (waits for `end` on CUDA)."""
        if self.device.type != "cuda":
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def _step_queued(self, denoise: tuple | None) -> None:
        """Mark the end of this step's GPU work; `denoise`: (start mark, end mark, tokens) or None.

        On CPU every op has finished already: the denoise time is a sample now."""
        if self.device.type != "cuda":
            if denoise is not None:
                start, end, num_tokens = denoise
                self._cost_samples.append(StepCostSample(num_tokens, self._span_s(start, end)))
            return
        self._queued_steps.append(QueuedStep(self._mark(), denoise))

    @torch.inference_mode()
    def execute_step(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one denoise step for every scheduled request.

        `stats.step_time_s` includes the wait for the GPU in `_pace`, so in a steady state it is the
        GPU's time per step, not only the host's."""
        start = time.perf_counter()
        self._pace()
        self.free(sched_out.finished_req_ids)
        outputs = self._add_requests(sched_out.scheduled_new_reqs)
        failed_ids = {o.req_id for o in outputs}
        req_ids = []
        for req_id in sched_out.scheduled_req_ids:
            if req_id in failed_ids:
                continue
            if self.batch.get(req_id) is None:
                outputs.append(RunnerOutput.failed(req_id, 0, ErrorKind.INTERNAL, f"no state for {req_id}"))
            else:
                req_ids.append(req_id)
        stats = StepStats()
        if req_ids:
            plan = self.batch.plan(req_ids)
            stats = StepStats(
                num_reqs=len(plan.states),
                num_seqs=plan.num_seqs,
                num_tokens=sum(s.num_tokens() for s in plan.states),
                shapes=[(s.params.height, s.params.width) for s in plan.states],
                req_ids=[s.req_id for s in plan.states],
            )
            fallbacks = self._num_compile_fallbacks()
            denoise_start = self._mark()
            stats.path, failures = self._denoise(plan)
            stats.num_cached_seqs = self._num_cached_seqs
            # a step whose cached sequences skipped blocks is no sample of the full-step cost model
            denoise = None if self._num_cached_seqs else (denoise_start, self._mark(), stats.num_tokens)
            stats.num_compile_fallbacks = self._num_compile_fallbacks() - fallbacks
            outputs += failures
            failed_ids = {o.req_id for o in failures}
            outputs += self._finish([s for s in plan.states if s.req_id not in failed_ids])
        self.free(o.req_id for o in outputs if o.finished)
        self._step_queued(denoise if req_ids else None)
        stats.cost_samples, self._cost_samples = self._cost_samples, []
        stats.step_time_s = time.perf_counter() - start
        return ModelRunnerOutput(outputs=outputs, stats=stats)

    def _denoise(self, plan: StepPlan) -> tuple[ForwardPath, list[RunnerOutput]]:
        """One forward for the plan, then every request's CFG combine and Euler step.

        Returns the forward path taken and the failures of requests whose own step failed.
        """
        timesteps = self._timesteps(plan)
        self._num_cached_seqs = 0
        if self.serial_fallback:
            out, path = self._forward_serial(plan, timesteps), ForwardPath.SERIAL
        elif any(s.cache_branches is not None for s in plan.states):
            out, path = self._forward_cached(plan, timesteps), ForwardPath.PACKED
        else:
            dense = self.use_dense_path and plan.is_homogeneous and not self._graphs_prefer_packed(plan)
            out = self._forward(plan, timesteps, dense)
            path = ForwardPath.DENSE if dense else ForwardPath.PACKED
        if not self.batch_invariant:
            try:
                self._advance_all(plan, out)
                return path, []
            except Exception:  # isolate the culprit below
                logger.exception("vectorised solver step failed; stepping requests one by one")
                self._previews.clear()  # the per-request steps take them again
        return path, self._advance_each(plan, out)

    def _graphs_prefer_packed(self, plan: StepPlan) -> bool:
        """With CUDA graphs, a same-shape batch may run faster packed (see CUDAGraphRunner)."""
        txt_lens = [plan.text_of(ref).shape[0] for ref in plan.seq_refs]
        img_lens = [plan.states[ref.req_pos].num_img_tokens for ref in plan.seq_refs]
        return self.graphs.prefers_packed(txt_lens, img_lens)

    def _timesteps(self, plan: StepPlan) -> torch.Tensor:
        """Per-sequence transformer timestep [num_seqs]: `t` cast to the model dtype, then / 1000 (as
        diffusers), each request at its own step of its own schedule."""
        per_req = torch.tensor([s.timestep() for s in plan.states], dtype=torch.float32)
        per_seq = per_req[torch.tensor(plan.seq_req)].to(self.dtype) / 1000
        return per_seq.to(self.device, non_blocking=True)

    def _forward(self, plan: StepPlan, timesteps: torch.Tensor, dense: bool) -> torch.Tensor:
        """Velocity rows [num_fwd_img_rows, 64] for the plan's sequences, in sequence order."""
        img_rows = plan.image_rows(self.batch.latent_buf)
        seq_loras = self._seq_loras(plan)
        if dense:
            plan.prepare_dense()
            hidden_states = img_rows.view(plan.num_seqs, -1, img_rows.shape[-1])
            mapping = None
            if seq_loras is not None:
                mapping = LoRAMapping.for_dense(seq_loras, hidden_states.shape[1], plan.dense_txt.shape[1])
            with self._lora_step(mapping):
                out = self.graphs.forward_dense(
                    hidden_states=hidden_states,
                    encoder_hidden_states=plan.dense_txt,
                    encoder_hidden_states_mask=plan.dense_txt_mask,
                    timestep=timesteps,
                    img_shapes=plan.img_shapes,
                )
            return out.reshape(-1, out.shape[-1])
        plan.prepare_packed(self.transformer.position_tables, self.device)
        mapping = None if seq_loras is None else LoRAMapping.for_packed(seq_loras, plan.layout)
        with self._lora_step(mapping):
            return self.graphs.forward_packed(img_rows, plan.txt_rows, timesteps, plan.layout)

    def _forward_cached(self, plan: StepPlan, timesteps: torch.Tensor) -> torch.Tensor:
        """The packed forward, eager, with every sequence's step-cache decision (`StepCache`):
        velocity rows [num_fwd_img_rows, 64] as `_forward` returns them."""
        plan.prepare_packed(self.transformer.position_tables, self.device)
        if self._cache_subsets[0] is not plan:
            self._cache_subsets = (plan, {})
        branches = [plan.states[r.req_pos].cache_branch(r.image_index, r.is_negative) for r in plan.seq_refs]
        seq_loras = self._seq_loras(plan)
        scope = None if seq_loras is None else functools.partial(self._lora_subset, seq_loras)
        step_cache = StepCache(branches, plan.layout, subsets=self._cache_subsets[1], subset_scope=scope)
        img_rows = plan.image_rows(self.batch.latent_buf)
        mapping = None if seq_loras is None else LoRAMapping.for_packed(seq_loras, plan.layout)
        with self._lora_step(mapping):
            out = self.transformer.forward_packed(
                img_rows, plan.txt_rows, timesteps, plan.layout, cache=step_cache
            )
        self._num_cached_seqs = step_cache.num_cached
        return out

    def _lora_subset(self, seq_loras: list[SeqLoRA], seqs: tuple[int, ...], subset: SeqSubset):
        """Inside a step's LoRA scope: the deltas of the sequences `seqs` that run a block segment
        alone (cached sequences left), laid out for their rows only."""
        mapping = LoRAMapping.for_packed([seq_loras[i] for i in seqs], subset.layout)
        batch = self.lora_manager.batch(mapping, self.device) if mapping.has_adapters else None
        return self.lora_manager.state.activate(batch)

    def _seq_loras(self, plan: StepPlan) -> list[SeqLoRA] | None:
        """Each sequence's adapter and scale (None when LoRA is off)."""
        if self.lora_manager is None:
            return None
        return [SeqLoRA.of(plan.states[ref.req_pos].params) for ref in plan.seq_refs]

    def _lora_step(self, mapping: LoRAMapping | None):
        """Scope in which the transformer applies `mapping` (a no-op when LoRA is off). Entered with
        LoRA on even for a base-only step: loads and unloads wait for the forward."""
        if self.lora_manager is None:
            return contextlib.nullcontext()
        return self.lora_manager.activate(mapping, self.device)

    def _forward_serial(self, plan: StepPlan, timesteps: torch.Tensor) -> torch.Tensor:
        """One dense forward per sequence (blocks with hooks cannot take a packed batch)."""
        outs, seq_loras = [], self._seq_loras(plan)
        for i, ref in enumerate(plan.seq_refs):
            state, txt = plan.states[ref.req_pos], plan.text_of(ref)
            latents = state.latents[ref.image_index]
            mapping = None
            if seq_loras is not None:
                mapping = LoRAMapping.for_dense(seq_loras[i : i + 1], latents.shape[0], txt.shape[0])
            with self._lora_step(mapping):
                out = self.transformer(
                    hidden_states=latents[None],
                    encoder_hidden_states=txt[None],
                    encoder_hidden_states_mask=None,
                    timestep=timesteps[i : i + 1],
                    img_shapes=[state.img_shape],
                )
            outs.append(out[0])
        return torch.cat(outs)

    def _sigma_deltas(self, plan: StepPlan) -> torch.Tensor:
        """fp32 [num_reqs]: each request's `sigma_next - sigma` for its current step."""
        deltas = torch.tensor([s.sigma_delta() for s in plan.states], dtype=torch.float32)
        return deltas.to(self.device, non_blocking=True)

    def _advance_all(self, plan: StepPlan, out: torch.Tensor) -> None:
        """CFG-combine and Euler-step every request's rows at once (each row its own scale and sigma).

        The same `apply_guidance` and `flow_match_euler_step` the per-request path calls.
        """
        velocity = out.index_select(0, plan.pos_rows)  # [num_latent_rows, 64]
        if plan.cfg_rows.numel():
            pos = velocity.index_select(0, plan.cfg_rows)
            neg = out.index_select(0, plan.neg_rows)
            normalize = True if plan.cfg_normalize_rows is None else plan.cfg_normalize_rows
            velocity.index_copy_(0, plan.cfg_rows, apply_guidance(pos, neg, plan.cfg_scale_rows, normalize))
        row = 0  # the plan's latent rows: each request's images in a row, in plan order
        for state in plan.states if any(s.preview_steps for s in plan.states) else ():
            num_rows = state.num_images * state.num_img_tokens
            self._keep_x0(state, velocity[row : row + num_rows].view(state.latents.shape))
            row += num_rows
        dt = self._sigma_deltas(plan)[plan.latent_row_req].unsqueeze(-1)  # [num_plan_latent_rows, 1]
        latent_buf = self.batch.latent_buf
        if plan.latent_rows is None:  # the plan holds every slot: step the whole buffer in place
            latent_buf.copy_(flow_match_euler_step(latent_buf, velocity, torch.zeros_like(dt), dt))
        else:  # some requests sit this step out: step only the plan's rows
            latents = latent_buf.index_select(0, plan.latent_rows)
            stepped = flow_match_euler_step(latents, velocity, torch.zeros_like(dt), dt)
            latent_buf.index_copy_(0, plan.latent_rows, stepped)
        for state in plan.states:
            state.step_index += 1

    def _advance_each(self, plan: StepPlan, out: torch.Tensor) -> list[RunnerOutput]:
        """Per request: CFG combine and Euler step; a request whose step raises fails alone."""
        failures, seq = [], 0
        # each sequence's target rows (an edit sequence's condition rows follow them and are dropped)
        velocities = [
            v[: plan.states[r.req_pos].num_img_tokens]
            for v, r in zip(out.split(plan.seq_num_rows), plan.seq_refs)
        ]
        for state in plan.states:
            try:
                self._advance(state, velocities[seq : seq + state.num_seqs])
            except Exception as exc:
                logger.exception("solver step failed for request %s", state.req_id)
                failures.append(
                    RunnerOutput.failed(
                        state.req_id, state.step_index, ErrorKind.DENOISE, f"denoise step failed: {exc}"
                    )
                )
            seq += state.num_seqs
        return failures

    def _advance(self, state: DiffusionRequestState, velocities: list[torch.Tensor]) -> None:
        """CFG-combine this request's predictions and take its Euler step (in place)."""
        if state.do_cfg:
            pos, neg = torch.stack(velocities[0::2]), torch.stack(velocities[1::2])
            velocity = apply_guidance(pos, neg, state.params.true_cfg_scale, state.params.cfg_normalize)
        else:
            velocity = torch.stack(velocities)
        self._keep_x0(state, velocity)
        dt = torch.tensor(state.sigma_delta(), dtype=torch.float32, device=self.device)
        state.latents.copy_(flow_match_euler_step(state.latents, velocity, torch.zeros_like(dt), dt))
        state.step_index += 1

    # ---- hand-over to the decode worker ------------------------------------------------------

    def _keep_x0(self, state: DiffusionRequestState, velocity: torch.Tensor) -> None:
        """Before the Euler update: when this step ends at one of the request's preview points, keep its
        clean-image estimate `x0 = x_t - sigma_t * v` ([n, S, C], fp32 math as the update, then the
        model dtype), a side copy: the request's own latents and update are untouched. Requests that
        did not ask cost one tuple lookup."""
        if state.step_index + 1 not in state.preview_steps:
            return
        sigma = float(state.schedule.sigmas[state.step_index])
        x0 = state.latents.float() - sigma * velocity.float()
        self._previews.append((state, x0.to(state.latents.dtype)))

    def _finish(self, states: list[DiffusionRequestState]) -> list[RunnerOutput]:
        """Outputs for this step; requests that completed denoising go to the decode worker.

        Their latents are copied out of the slot buffer (on the compute stream, so before any later
        step writes the freed slot) and their output says `decoding`: the slot is free now, the
        images come from the worker's listener."""
        outputs, jobs = [], []
        alive = {s.req_id for s in states}  # a request that failed this step gets no preview
        previews, self._previews = self._previews, []
        for state, x0 in previews:
            if state.req_id in alive:
                index = state.preview_steps.index(state.step_index)
                jobs.append(self._decode_job(state, x0, partial_index=index))
        for state in states:
            if not state.is_denoised:
                outputs.append(RunnerOutput(state.req_id, state.step_index, cache_rate=cache_rate(state)))
                continue
            if self.config.cache.enable_summary and state.cache_branches is not None:
                logger.info("%s", cache_summary(state.req_id, state.cache_branches, state.step_index))
            jobs.append(self._decode_job(state, state.latents.clone()))
            outputs.append(RunnerOutput(state.req_id, state.step_index, finished=True, decoding=True))
        self.decoder.submit(jobs)
        return outputs

    def _decode_job(self, state: DiffusionRequestState, latents: torch.Tensor, **preview) -> DecodeJob:
        """A job for `latents` (a copy the job owns), ordered after the copy by an event on CUDA."""
        ready = None
        if self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        return DecodeJob(
            req_id=state.req_id,
            step_index=state.step_index,
            latents=latents,
            params=state.params,
            ready=ready,
            num_steps=state.schedule.num_steps,
            num_cached_steps=num_cached_steps(state.cache_branches),
            **preview,
        )

    # ---- request mode -----------------------------------------------------------------------

    def execute_request(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        """Request mode: run the scheduled request(s) through every step in one call."""
        out = self.execute_step(sched_out)
        total_time = out.stats.step_time_s
        first_stats = out.stats
        cached = SchedulerOutput(step_id=sched_out.step_id)
        done = [o for o in out.outputs if o.finished]
        while any(not o.finished for o in out.outputs):
            cached.scheduled_cached_req_ids = [o.req_id for o in out.outputs if not o.finished]
            out = self.execute_step(cached)
            done += [o for o in out.outputs if o.finished]
            total_time += out.stats.step_time_s
        first_stats.step_time_s = total_time
        return ModelRunnerOutput(outputs=done, stats=first_stats)

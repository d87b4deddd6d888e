"""The model runner: per-request state on the worker, one packed denoise step per call.

Per step::

    new requests  -> encode prompts (together), draw noise, build schedules
    all requests  -> InputBatch (cached while the composition is unchanged)
                  -> one transformer forward: packed varlen (mixed shapes),
                     dense [B, S, C] (one shape), or serial (hooked blocks)
                  -> per request: CFG combine, Euler step with its own sigmas
    finished      -> VAE decode (same-shape requests together)

A failure while handling one request (its encoding, its CFG/solver step, its
decode) fails that request only; the others keep running.
"""

from __future__ import annotations

import logging
import time

import torch

from vllm_omni.config import OmniDiffusionConfig
from vllm_omni.diffusion.sched.interface import (
    DiffusionOutput,
    ModelRunnerOutput,
    NewRequestData,
    RunnerOutput,
    SchedulerOutput,
    StepStats,
)
from vllm_omni.diffusion.solvers.flow_match import cfg_combine, flow_match_euler_step
from vllm_omni.diffusion.worker.input_batch import InputBatch
from vllm_omni.diffusion.worker.request_state import DiffusionRequestState

logger = logging.getLogger(__name__)


class DiffusionModelRunner:
    """Holds request states and runs denoise steps of a step pipeline."""

    def __init__(self, pipeline, config: OmniDiffusionConfig):
        self.pipeline = pipeline
        self.config = config
        self.transformer = pipeline.transformer
        self.device = pipeline.device
        self.dtype = pipeline.dtype
        self.states: dict[str, DiffusionRequestState] = {}
        self._batch: InputBatch | None = None
        self.batch_invariant = config.batch_invariant
        self.use_dense_path = not config.batch_invariant
        """Same-shape batches use the dense forward unless results must not depend on the batch."""
        self.serial_fallback = self._blocks_have_hooks()
        if self.serial_fallback:
            logger.warning(
                "transformer blocks carry forward hooks (e.g. a sharding wrapper): requests will run "
                "one by one instead of packed"
            )

    def _blocks_have_hooks(self) -> bool:
        blocks = getattr(self.transformer, "transformer_blocks", [])
        return any(b._forward_hooks or b._forward_pre_hooks for b in blocks)

    # ---- state management -------------------------------------------------------------------

    def _add_requests(self, new_reqs: list[NewRequestData]) -> dict[str, str]:
        """Create states for newly admitted requests; return {req_id: error} for those that failed."""
        errors: dict[str, str] = {}
        if not new_reqs:
            return errors
        try:
            embeds = self._encode(new_reqs)
        except Exception as exc:  # one bad prompt must not fail the others: retry one by one
            logger.warning("batched prompt encoding failed (%s); encoding requests one by one", exc)
            embeds = {}
            for req in new_reqs:
                try:
                    embeds.update(self._encode([req]))
                except Exception as one_exc:
                    errors[req.req_id] = f"prompt encoding failed: {one_exc}"
        for req in new_reqs:
            if req.req_id in errors:
                continue
            try:
                self.states[req.req_id] = self._make_state(req, *embeds[req.req_id])
            except Exception as exc:
                errors[req.req_id] = f"request setup failed: {exc}"
        return errors

    def _encode(self, reqs: list[NewRequestData]) -> dict[str, tuple]:
        """Encode the positive (and negative) prompts of `reqs` in one text-encoder call:
        {req_id: (prompt rows, negative rows or None, edit condition or None)}.

        In batch-invariant mode each prompt is encoded alone, so its embedding cannot
        depend on what it was padded with. Edit pipelines also encode each request's input image.
        """
        if getattr(self.pipeline, "supports_image_input", False):
            return self.pipeline.encode_requests(reqs, one_by_one=self.batch_invariant)
        texts, max_lens, owners = [], [], []
        for r in reqs:
            sp = r.sampling_params
            texts.append(r.prompt)
            max_lens.append(sp.max_sequence_length)
            owners.append((r.req_id, False))
            if sp.true_cfg_scale > 1.0 and r.negative_prompt is not None:
                texts.append(r.negative_prompt)
                max_lens.append(sp.max_sequence_length)
                owners.append((r.req_id, True))
        if self.batch_invariant:
            embeds = [self.pipeline.encode_prompts([t], [m])[0] for t, m in zip(texts, max_lens)]
        else:
            embeds = self.pipeline.encode_prompts(texts, max_lens)
        out: dict[str, list] = {r.req_id: [None, None] for r in reqs}
        for (req_id, is_neg), emb in zip(owners, embeds):
            out[req_id][1 if is_neg else 0] = emb
        return {k: (v[0], v[1], None) for k, v in out.items()}

    def _make_state(
        self,
        req: NewRequestData,
        prompt_embeds: torch.Tensor,
        neg_embeds: torch.Tensor | None,
        condition=None,
    ) -> DiffusionRequestState:
        sp = req.sampling_params
        generator = torch.Generator("cpu").manual_seed(sp.seed)
        schedule = self.pipeline.sigma_schedule(sp)
        return DiffusionRequestState(
            req_id=req.req_id,
            params=sp,
            latents=self.pipeline.prepare_latents(sp, generator),
            prompt_embeds=prompt_embeds,
            negative_prompt_embeds=neg_embeds,
            schedule=schedule,
            sigmas=schedule.sigmas.to(self.device),
            generator=generator,
            cond_latents=None if condition is None else condition.cond_latents,
            cond_shape=None if condition is None else condition.cond_shape,
        )

    def free(self, req_ids) -> None:
        """Drop the state of requests that ended (finished, aborted, failed)."""
        for req_id in req_ids:
            self.states.pop(req_id, None)

    # ---- the step ---------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_step(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one denoise step for every scheduled request."""
        start = time.perf_counter()
        self.free(sched_out.finished_req_ids)
        errors = self._add_requests(sched_out.scheduled_new_reqs)
        states = []
        for req_id in sched_out.scheduled_req_ids:
            if req_id in errors:
                continue
            state = self.states.get(req_id)
            if state is None:
                errors[req_id] = f"no state for request {req_id} on the worker"
            else:
                states.append(state)
        stats = StepStats(num_reqs=len(states), shapes=[(s.params.height, s.params.width) for s in states])
        outputs = [RunnerOutput(req_id, 0, finished=True, error=msg) for req_id, msg in errors.items()]
        to_denoise = [s for s in states if not s.is_denoised]
        failed: dict[str, str] = {}
        if to_denoise:
            stats.path, failed = self._denoise(to_denoise)
            stats.num_seqs = sum(s.num_seqs for s in to_denoise)
            stats.num_tokens = sum(s.num_tokens() for s in to_denoise)
        outputs += [RunnerOutput(r, self.states[r].step_index, True, error=e) for r, e in failed.items()]
        outputs += self._finish([s for s in states if s.req_id not in failed])
        self.free(o.req_id for o in outputs if o.finished)
        stats.step_time_s = time.perf_counter() - start
        return ModelRunnerOutput(outputs=outputs, stats=stats)

    def _denoise(self, states: list[DiffusionRequestState]) -> tuple[str, dict[str, str]]:
        """One forward for all states, then each request's CFG combine and Euler step.

        Returns the forward path taken and {req_id: error} for requests whose own step failed.
        """
        if self.serial_fallback:
            velocities = [v for s in states for v in self._forward([s], dense=s.cond_latents is None)]
            path = "serial"
        else:
            batch = self._input_batch(states)
            dense = self.use_dense_path and batch.is_homogeneous
            velocities = self._forward(states, dense=dense, batch=batch)
            path = "dense" if dense else "packed"
        failed: dict[str, str] = {}
        pos = 0
        for state in states:
            try:
                self._advance(state, velocities[pos : pos + state.num_seqs])
            except Exception as exc:  # this request's CFG/solver step failed: only it fails
                logger.exception("solver step failed for request %s", state.req_id)
                failed[state.req_id] = f"denoise step failed: {exc}"
            pos += state.num_seqs
        return path, failed

    def _input_batch(self, states: list[DiffusionRequestState]) -> InputBatch:
        key = InputBatch.composition_key(states)
        if self._batch is None or self._batch.req_ids != key:
            self._batch = InputBatch.build(states)
        return self._batch

    def _forward(
        self, states: list[DiffusionRequestState], dense: bool, batch: InputBatch | None = None
    ) -> list[torch.Tensor]:
        """Velocity per sequence, [num_img_tokens, 64] each, in the batch's sequence order."""
        batch = batch or InputBatch.build(states)
        latents = batch.gather_latents(states)
        timesteps = batch.timesteps(states, self.dtype).to(self.device)
        if dense:
            batch.prepare_dense(states)
            out = self.transformer(
                hidden_states=torch.stack(latents),
                encoder_hidden_states=batch.dense_txt,
                encoder_hidden_states_mask=batch.dense_txt_mask,
                timestep=timesteps,
                img_shapes=[states[r.req_pos].img_shape for r in batch.seq_refs],
            )
            return list(out.unbind(0))
        batch.prepare_packed(states, self.transformer.config.axes_dims_rope, self.device)
        out = self.transformer.forward_packed(torch.cat(latents), batch.txt_rows, timesteps, batch.layout)
        per_seq = out.split([x.shape[0] for x in latents])
        # edit sequences: only the target rows are the velocity; the condition rows are dropped
        return [v[: states[r.req_pos].num_img_tokens] for v, r in zip(per_seq, batch.seq_refs)]

    def _advance(self, state: DiffusionRequestState, velocities: list[torch.Tensor]) -> None:
        """CFG-combine this request's predictions and take its Euler step."""
        if state.do_cfg:
            pos, neg = torch.stack(velocities[0::2]), torch.stack(velocities[1::2])
            velocity = cfg_combine(pos, neg, state.params.true_cfg_scale, state.params.cfg_normalize)
        else:
            velocity = torch.stack(velocities)
        i = state.step_index
        state.latents = flow_match_euler_step(state.latents, velocity, state.sigmas[i], state.sigmas[i + 1])
        state.step_index += 1

    # ---- decode -----------------------------------------------------------------------------

    def _finish(self, states: list[DiffusionRequestState]) -> list[RunnerOutput]:
        """Outputs for this step; requests that completed denoising are decoded."""
        outputs, done = [], [s for s in states if s.is_denoised]
        for state in states:
            if not state.is_denoised:
                outputs.append(RunnerOutput(state.req_id, state.step_index))
        groups: dict[tuple[int, int, str], list[DiffusionRequestState]] = {}
        for state in done:
            key = (state.params.height, state.params.width, state.params.output_type)
            groups.setdefault(key, []).append(state)
        for group in groups.values():
            outputs += self._decode_group(group)
        return outputs

    def _decode_group(self, group: list[DiffusionRequestState]) -> list[RunnerOutput]:
        """Decode same-shape requests together; on failure, one by one so only the culprit fails."""
        if len(group) > 1 and not self.batch_invariant:
            try:
                images = self._decode(torch.cat([s.latents for s in group]), group[0])
                outputs, pos = [], 0
                for state in group:
                    chunk = images[pos : pos + state.num_images]
                    outputs.append(self._completed(state, chunk))
                    pos += state.num_images
                return outputs
            except Exception as exc:
                logger.warning("batched decode failed (%s); decoding one by one", exc)
        outputs = []
        for state in group:
            try:
                outputs.append(self._completed(state, self._decode(state.latents, state)))
            except Exception as exc:
                logger.exception("decode failed for request %s", state.req_id)
                outputs.append(
                    RunnerOutput(state.req_id, state.step_index, True, error=f"decode failed: {exc}")
                )
        return outputs

    def _decode(self, latents: torch.Tensor, like: DiffusionRequestState):
        sp = like.params
        return self.pipeline.decode(latents, sp.height, sp.width, sp.output_type)

    @staticmethod
    def _completed(state: DiffusionRequestState, images) -> RunnerOutput:
        sp = state.params
        result = DiffusionOutput(
            images=images, seed=sp.seed, output_type=sp.output_type, height=sp.height, width=sp.width
        )
        return RunnerOutput(state.req_id, state.step_index, finished=True, result=result)

    # ---- request mode -----------------------------------------------------------------------

    def execute_request(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        """Request mode: run the scheduled request(s) through every step in one call."""
        out = self.execute_step(sched_out)
        total = StepStats(**{**out.stats.__dict__})
        cached = SchedulerOutput(step_id=sched_out.step_id)
        while any(not o.finished for o in out.outputs):
            cached.scheduled_cached_req_ids = [o.req_id for o in out.outputs if not o.finished]
            done = [o for o in out.outputs if o.finished]
            out = self.execute_step(cached)
            out.outputs = done + out.outputs
            total.step_time_s += out.stats.step_time_s
        out.stats = total
        return out

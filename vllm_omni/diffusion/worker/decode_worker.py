"""The decode worker: VAE decodes beside the denoise steps, on a thread (and CUDA stream) of their own.

A request that finishes denoising hands its latents over and gives its slot back in the same step;
its images come later, from this worker::

    step loop (runner)                         decode worker (thread; on CUDA its own stream)
    ------------------                         -----------------------------------------------
    last Euler step of request r
    copy r's latents out of the slot buffer
    record `ready` on the compute stream  -->  wait for `ready` on the decode stream
    free r's slot; next step runs              VAE decode (same-shape requests together),
                                               postprocess to PIL / numpy on the host
                                               -> listener.on_decoded(RunnerOutput)

The copy is ordered before any later write to the slot buffer by the compute stream itself, and the
event orders the decode after the copy: no step ever waits for a decode. Requests whose jobs are
queued together and share a shape, output type and VAE modes decode in one VAE call (one by one in
batch-invariant mode, or when the batched call fails: only the culprit fails). Preview jobs (a
streaming request's x0 estimate, `partial_index` set) decode the same way and reach
`listener.on_partial`, always before their request's final image (a preview still queued when its
final image is queued is skipped).

The VAE is not safe to run twice at once (diffusers' causal-conv cache lives on the module), so a
pipeline that also VAE-encodes on the step loop (edit models) takes `vae_lock` around its encodes.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from vllm_omni.diffusion.outputs import ErrorKind, PartialImage
from vllm_omni.diffusion.sched.interface import DiffusionOutput, RunnerOutput

logger = logging.getLogger(__name__)

LONG_DECODE_PIXELS = 1024 * 1024
"""Pixels of final images from which a decode announces itself at INFO, and its time when done (seconds
on a CPU)."""


class DecodeListener(Protocol):
    """Who receives decoded results (the engine); called on the decode worker's thread."""

    def on_decoded(self, output: RunnerOutput) -> None:
        """A final result: finished with images, or failed (`ErrorKind.DECODE` / `DENOISE`)."""

    def on_partial(self, partial: PartialImage) -> None:
        """A streaming request's preview image."""


@dataclass
class DecodeJob:
    """One request's denoised latents, handed over by the step loop."""

    req_id: str
    step_index: int
    latents: torch.Tensor
    """[n, num_img_tokens, C] packed latents: a copy, owned by this job (never a slot-buffer view)."""
    params: Any
    """The request's `OmniDiffusionSamplingParams` (size, output type, seed)."""
    modes: Any = None
    """The request's VAE modes (`pipeline.vae_modes(params)`), set on the worker's thread: the only
    one that switches the VAE's modes, so the server's modes it reads are never a decode's."""
    ready: torch.cuda.Event | None = None
    """Recorded on the compute stream after the copy (CUDA); the decode waits for it."""
    partial_index: int | None = None
    """Set for a preview (a streaming request's x0 estimate): the index of its partial image."""
    num_steps: int = 0
    """The request's total steps (previews report progress with it)."""
    num_cached_steps: list[int] | None = None
    """Step caching: the request's cached steps per branch (its `DiffusionOutput`'s)."""

    @property
    def key(self) -> tuple:
        """Jobs with equal keys may share one VAE call."""
        sp = self.params
        return (self.partial_index is None, sp.height, sp.width, sp.output_type, self.modes)


class DecodeWorker:
    """A daemon thread that decodes `DecodeJob`s and reports them to its listener."""

    def __init__(self, pipeline, device: torch.device, batch_invariant: bool = False):
        self.pipeline = pipeline
        self.device = torch.device(device)
        self.batch_invariant = batch_invariant
        self.vae_lock = threading.Lock()
        """Held around every VAE call of this worker; the step loop takes it around VAE encodes."""
        self.listener: DecodeListener | None = None
        """None: nobody reads results (e.g. a parallel replica's non-driver rank), so nothing is decoded."""
        self._jobs: collections.deque[DecodeJob] = collections.deque()
        self._cond = threading.Condition()
        self._num_busy = 0
        """Jobs taken off the queue and not yet reported."""
        self._closed = False
        self._thread: threading.Thread | None = None
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    # ---- the step loop's side ---------------------------------------------------------------

    def submit(self, jobs: list[DecodeJob]) -> None:
        """Queue jobs (their latents already copied; on CUDA with `ready` recorded)."""
        if not jobs or self.listener is None:
            return
        with self._cond:
            if self._closed:
                raise RuntimeError("the decode worker is closed")
            self._jobs.extend(jobs)
            self._cond.notify_all()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="diffusion-decode", daemon=True)
                self._thread.start()

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every submitted job has been reported; False when `timeout` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._jobs and not self._num_busy, timeout)

    def close(self, timeout: float | None = 30.0) -> list[DecodeJob]:
        """Finish the queued jobs (up to `timeout`), then stop; return the jobs left undecoded."""
        self.drain(timeout)
        with self._cond:
            self._closed = True
            left, self._jobs = list(self._jobs), collections.deque()
            self._cond.notify_all()
        return left

    # ---- the worker thread ------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._jobs or self._closed)
                if self._closed and not self._jobs:
                    return
                # finals first (clients wait for them), then previews, each in submission order; a
                # preview whose final image is here too is skipped: it would come no sooner than the
                # final and delay it (OpenAI: fewer partials may come when the image is done first)
                queued, self._jobs = list(self._jobs), collections.deque()
                finals = {j.req_id for j in queued if j.partial_index is None}
                jobs = [j for j in queued if j.partial_index is None]
                jobs += [j for j in queued if j.partial_index is not None and j.req_id not in finals]
                self._num_busy = len(jobs)
            try:
                for group in self._groups(jobs):
                    try:
                        results = self._decode_group(group)
                    except Exception as exc:  # never leave a client without an answer
                        logger.exception("decode worker failed")
                        results = [_failed(j, exc) for j in group if j.partial_index is None]
                    self._report(results)
            finally:
                with self._cond:
                    self._num_busy = 0
                    self._cond.notify_all()

    def _groups(self, jobs: list[DecodeJob]) -> list[list[DecodeJob]]:
        """Jobs that may share a VAE call, in order of their first job."""
        groups: dict[tuple, list[DecodeJob]] = {}
        for job in jobs:
            try:
                job.modes = self.pipeline.vae_modes(job.params)
            except Exception:  # decoded alone, with the server's modes, if it decodes at all
                logger.exception("VAE modes of request %s", job.req_id)
                groups[("alone", id(job))] = [job]
                continue
            groups.setdefault(job.key, []).append(job)
        return list(groups.values())

    def _report(self, results: list[RunnerOutput | PartialImage]) -> None:
        listener = self.listener
        for result in results:
            try:
                if isinstance(result, PartialImage):
                    listener.on_partial(result)
                else:
                    listener.on_decoded(result)
            except Exception:
                logger.exception("decode listener failed for request %s", result.req_id)

    def _decode_group(self, group: list[DecodeJob]) -> list[RunnerOutput | PartialImage]:
        """Decode same-key jobs together; on failure one by one, so only the culprit fails."""
        with self._on_stream():
            for job in group:
                if job.ready is not None:
                    torch.cuda.current_stream(self.device).wait_event(job.ready)
                    # allocated on the compute stream: not reused before this stream's reads finish
                    job.latents.record_stream(self._stream)
            results, ok = [], []
            for job in group:
                if job.partial_index is None and not bool(torch.isfinite(job.latents).all()):
                    results.append(_non_finite(job))
                else:
                    ok.append(job)
            if len(ok) > 1 and not self.batch_invariant:
                try:
                    images = self._decode(torch.cat([j.latents for j in ok]), ok[0])
                    pos = 0
                    for job in ok:
                        n = job.latents.shape[0]
                        results.append(_result(job, images[pos : pos + n]))
                        pos += n
                    return results
                except Exception as exc:
                    logger.warning("batched decode failed (%s); decoding one by one", exc)
            for job in ok:
                try:
                    results.append(_result(job, self._decode(job.latents, job)))
                except Exception as exc:
                    logger.exception("decode failed for request %s", job.req_id)
                    if job.partial_index is None:  # a failed preview is only logged
                        results.append(_failed(job, exc))
            return results

    def _decode(self, latents: torch.Tensor, like: DecodeJob):
        sp = like.params
        num_images = latents.shape[0]
        long = like.partial_index is None and sp.output_type != "latent"
        long = long and num_images * sp.height * sp.width >= LONG_DECODE_PIXELS
        if long:
            logger.info(
                "decoding %d image(s) of %dx%d (%s) beside the steps ...",
                num_images,
                sp.width,
                sp.height,
                like.req_id,
            )
        start = time.perf_counter()
        with self.vae_lock:
            images = self.pipeline.decode(latents, sp.height, sp.width, sp.output_type, like.modes)
        if long:
            logger.info(
                "decoded %d image(s) of %s in %.1f s", num_images, like.req_id, time.perf_counter() - start
            )
        return images

    @contextlib.contextmanager
    def _on_stream(self):
        """The decode stream as the current stream, on the worker's device (CUDA; the current device
        and stream are per thread); nothing on CPU."""
        if self._stream is None:
            yield
            return
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            yield


def _result(job: DecodeJob, images) -> RunnerOutput | PartialImage:
    sp = job.params
    if job.partial_index is not None:
        return PartialImage(
            req_id=job.req_id,
            partial_image_index=job.partial_index,
            images=images,
            step_index=job.step_index,
            num_steps=job.num_steps,
        )
    result = DiffusionOutput(
        images=images,
        seed=sp.seed,
        output_type=sp.output_type,
        height=sp.height,
        width=sp.width,
        num_cached_steps=job.num_cached_steps,
    )
    return RunnerOutput(job.req_id, job.step_index, finished=True, result=result)


def _failed(job: DecodeJob, exc: Exception) -> RunnerOutput:
    return RunnerOutput.failed(job.req_id, job.step_index, ErrorKind.DECODE, f"decode failed: {exc}")


def _non_finite(job: DecodeJob) -> RunnerOutput:
    """The failure of a request whose latents are NaN / Inf after denoising (it alone fails: never
    a black image with success)."""
    logger.warning("request %s: latents are non-finite after %d steps", job.req_id, job.step_index)
    return RunnerOutput.failed(
        job.req_id,
        job.step_index,
        ErrorKind.DENOISE,
        f"denoising produced non-finite latents (NaN/Inf) after {job.step_index} steps, so there is "
        "no image to return; with --dtype float16 try bfloat16 or float32",
    )

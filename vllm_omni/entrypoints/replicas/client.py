"""`ReplicatedEngine`: what the OpenAI server holds instead of a `DiffusionEngine` when it serves N
data-parallel replicas. It has the engine's front-end contract (`generate`, `num_running`,
`num_waiting`, `recent_steps`, `config`, `family`, `check_health`, `shutdown`) and forwards each
request through a Ray Serve deployment handle to the replica `WorkRequestRouter` picks.

A request's work for the router is priced here, before it is routed, on the cost model of the first
replica (every replica runs the same model on the same kind of GPU): its steps x the step time at its
estimated tokens (`sched/batching.py`'s tokenizer-free estimate).

Faults: a replica that dies while it holds a request answers that request with `RequestAbortedError`
(HTTP 503 `request_aborted`), and it is not retried elsewhere: it may have run steps, and a
resend is the client's choice. A request not yet routed never reaches a dead replica: Serve routes only
to running ones, and restarts the dead one.
"""

from __future__ import annotations

import asyncio
import logging
from types import MappingProxyType

from vllm_omni.config import OmniDiffusionConfig
from vllm_omni.diffusion.errors import RequestAbortedError
from vllm_omni.diffusion.models import registry
from vllm_omni.diffusion.outputs import RequestOutput
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.diffusion.sched.batching import estimate_text_tokens, request_step_tokens
from vllm_omni.diffusion.sched.cost_model import StepCostModel

logger = logging.getLogger(__name__)


class ReplicatedEngine:
    """The engine-shaped front of N Ray Serve replicas (module docstring)."""

    lora = None
    """LoRA adapters are not served across replicas yet (`vllm serve` refuses the flags)."""

    def __init__(
        self, config: OmniDiffusionConfig, handle, app_name: str, router_key: str, num_replicas: int
    ):
        """`handle`: the replicas' `DeploymentHandle`; `router_key`: its `WorkRequestRouter`'s key."""
        self.config = config
        self.handle = handle
        self.app_name = app_name
        self.router_key = router_key
        self.num_replicas = num_replicas
        """Replicas asked for (the autoscaler's minimum when it scales)."""
        self.family = registry.family_for(config.model, config.load_format)
        family_defaults = self.family.capabilities.default_sampling_params
        self.default_sampling_params = MappingProxyType({**family_defaults, **config.default_sampling_params})
        """As each replica's engine: the model's defaults under the server's, read-only (HTTP builds a
        request's params on them)."""
        self.image_input = self.family.image_input
        self.supports_image_input = self.image_input is not None
        self.cost_model: StepCostModel | None = None
        """The first replica's step cost model (learnt at `start`, or at the first request)."""

    def start(self) -> None:
        """Learn the cost model from one replica (this also starts the handle's router); outside an
        event loop (the CLI's start). A Serve ingress skips it: the first request learns it."""
        self.cost_model = StepCostModel(self.handle.describe.remote().result().cost_samples)

    async def _ensure_cost_model(self) -> StepCostModel:
        if self.cost_model is None:
            self.cost_model = StepCostModel((await self.handle.describe.remote()).cost_samples)
        return self.cost_model

    def work_s(self, request: OmniDiffusionRequest, cost_model: StepCostModel) -> float:
        """Seconds of denoise work `request` brings, priced on `cost_model` (module docstring)."""
        num_pos, num_neg = estimate_text_tokens(request)
        tokens = request_step_tokens(request, num_pos, num_neg)
        return request.sampling_params.num_inference_steps * cost_model.step_time(tokens)

    async def generate(self, request: OmniDiffusionRequest) -> RequestOutput:
        """Run a request on the replica the router picks; cancelling the awaiting task cancels it
        there (the replica's engine aborts it)."""
        from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError

        lora = request.sampling_params.lora_request
        adapter = None if lora is None else lora.lora_name
        work_s = self.work_s(request, await self._ensure_cost_model())
        response = self.handle.generate.remote(request, work_s=work_s, adapter=adapter)
        try:
            return await response
        except asyncio.CancelledError:
            response.cancel()
            raise
        except RayTaskError as exc:  # the engine's own error (validation, queue full, failure)
            raise exc.cause from None
        except (ActorDiedError, ActorUnavailableError, RayActorError) as exc:
            logger.warning("request %s: its replica died (%s)", request.request_id, type(exc).__name__)
            raise RequestAbortedError(
                f"Request {request.request_id} aborted: the replica running it died; send it again "
                "(the other replicas serve, and the dead one restarts)"
            ) from None

    def _snapshot(self):
        from vllm_omni.entrypoints.replicas.ray_serve import ROUTERS

        router = ROUTERS.get(self.router_key)
        return [] if router is None else router.snapshot()

    @property
    def num_running(self) -> int:
        return sum(row.report.num_running for row in self._snapshot())

    @property
    def num_waiting(self) -> int:
        return sum(max(0, row.num_requests - row.report.num_running) for row in self._snapshot())

    def recent_steps(self) -> list:
        """Steps run on the replicas' GPUs are theirs; the front holds none."""
        return []

    def replica_states(self) -> dict[str, int]:
        """Serve's count of engine replicas per state (RUNNING, STARTING, ...)."""
        from ray import serve

        from vllm_omni.entrypoints.replicas.ray_serve import DEPLOYMENT_NAME

        app = serve.status().applications.get(self.app_name)
        deployment = None if app is None else app.deployments.get(DEPLOYMENT_NAME)
        if deployment is None:
            return {}
        return {str(getattr(k, "value", k)): v for k, v in deployment.replica_states.items()}

    def check_health(self) -> str:
        """'healthy', or 'degraded' while fewer replicas than asked for run; RuntimeError with none."""
        states = self.replica_states()
        running = states.get("RUNNING", 0)
        if running == 0:
            raise RuntimeError(f"no replica is running (replica states: {states})")
        return "healthy" if running >= self.num_replicas else "degraded"

    def shutdown(self) -> None:
        """Nothing here: the server deletes the Serve application (each replica drains its engine)."""

"""The two Ray Serve pieces of data-parallel serving: a replica running one `DiffusionEngine`, and a
`RequestRouter` that ranks replicas by remaining work with `ReplicaRouter`.

    caller process (the OpenAI server)                    Ray Serve replica k (one per GPU)
    handle.generate.remote(request, work_s=..., ...)      DiffusionReplica
      -> WorkRequestRouter.choose_replicas                  .generate: engine.generate(request)
           ReplicaRouter.choose(work_s, adapter)            .record_routing_stats: its ReplicaReport
           (ledger: last report + routed since)              (Serve polls it every
                                                              `ROUTING_STATS_PERIOD_S`)

Serve runs the router inside the process that holds the deployment handle, so the router-side ledger
sees every request that process sends. Ray imports stay inside this module: the rest of the package
runs without Ray.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import threading
from dataclasses import dataclass

from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from vllm_omni.config import OmniDiffusionConfig
from vllm_omni.diffusion.outputs import RequestOutput
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.diffusion.sched.cost_model import StepCostSample
from vllm_omni.entrypoints.replicas.routing import ReplicaReport, ReplicaRouter, RoutingDecision

logger = logging.getLogger(__name__)

DEPLOYMENT_NAME = "DiffusionReplica"
"""The engine replicas' Serve deployment (a Serve config overrides its options under this name)."""
ROUTING_STATS_PERIOD_S = 0.5
"""How often Serve's controller asks each replica for its report (Serve's default is 10 s; the ledger
covers decisions between two reports either way)."""


@dataclass(frozen=True)
class ReplicaInfo:
    """What the caller learns from a replica once: what the work estimate needs from an engine it
    does not hold."""

    cost_samples: list[StepCostSample]
    """The replica's step cost model points, to price a new request before it is routed."""


@dataclass(frozen=True)
class ReplicaRow:
    """The router's view of one running replica (the server's metrics and queue sizes)."""

    rank: int
    """Serve's rank of the replica: the `engine` label."""
    report: ReplicaReport
    """Its last report."""
    work_s: float
    """Ledger work: the report + requests routed to it since."""
    num_requests: int
    """Ledger requests: the report's + routed since."""
    pid: int
    """Its process (0 before its first report)."""


def report_to_stats(report: ReplicaReport, rank: int, pid: int) -> dict:
    """A report as Serve's routing stats (a plain dict); `rank` labels the replica's metrics, `pid`
    names its process (`replica_info`)."""
    stats = dataclasses.asdict(report)
    stats["adapters"] = sorted(report.adapters)
    stats["rank"], stats["pid"] = rank, pid
    return stats


def stats_to_report(stats: dict) -> ReplicaReport:
    return ReplicaReport(
        remaining_work_s=float(stats["remaining_work_s"]),
        num_requests=int(stats["num_requests"]),
        num_received=int(stats["num_received"]),
        adapters=frozenset(stats.get("adapters", ())),
        healthy=bool(stats.get("healthy", True)),
        num_running=int(stats.get("num_running", 0)),
    )


class DiffusionReplica:
    """One Ray Serve replica: a `DiffusionEngine` with its loop thread, and its report."""

    def __init__(self, config: OmniDiffusionConfig):
        from vllm_omni.diffusion.engine import DiffusionEngine

        logging.basicConfig(level=logging.INFO)
        self.engine = DiffusionEngine(config)
        self.engine.start()
        self.num_received = 0
        """Requests accepted so far: the report's `num_received` (the router's ledger sequence)."""
        try:
            self.rank = serve.get_replica_context().rank.rank
        except Exception:  # outside a Serve replica (a direct actor in a test)
            self.rank = 0

    def describe(self) -> ReplicaInfo:
        engine = self.engine
        return ReplicaInfo(cost_samples=engine.scheduler.cost_model.points())

    async def generate(
        self, request: OmniDiffusionRequest, work_s: float = 0.0, adapter: str | None = None
    ) -> RequestOutput:
        """Run one request; `work_s` and `adapter` are for the router (it reads them from the call)."""
        del work_s, adapter
        self.num_received += 1
        return await self.engine.generate(request)

    def record_routing_stats(self) -> dict:
        """Serve calls this every `ROUTING_STATS_PERIOD_S`; the router reads it as `routing_stats`."""
        engine = self.engine
        lora = engine.lora
        try:
            engine.check_health()
            healthy = True
        except RuntimeError:
            healthy = False
        report = ReplicaReport(
            remaining_work_s=engine.remaining_work_s(),
            num_requests=engine.num_running + engine.num_waiting,
            num_received=self.num_received,
            adapters=frozenset(e.name for e in lora.list_adapters()) if lora is not None else frozenset(),
            healthy=healthy,
            num_running=engine.num_running,
        )
        return report_to_stats(report, self.rank, os.getpid())

    def check_health(self) -> None:
        """Serve's health check: a replica whose engine loop died is restarted."""
        self.engine.check_health()

    def __del__(self):
        # Serve calls this on a graceful stop: answer waiting clients, stop the workers
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


ROUTERS: dict[str, WorkRequestRouter] = {}
"""The routers of this process by deployment key, for the server's metrics and health."""


class WorkRequestRouter(RequestRouter):
    """Serve's `RequestRouter` calling `ReplicaRouter.choose` (policy and margin from its kwargs)."""

    def initialize_state(self, key: str, policy: str = "work", lora_affinity_margin_s: float = 2.0, **_):
        self.router = ReplicaRouter(1, policy, lora_affinity_margin_s)
        self.router.ledgers.clear()  # replicas join as Serve lists them (`_index`)
        self.lock = threading.Lock()
        """The ledgers are read by the server's metrics thread and written on Serve's router loop."""
        self.indices: dict[str, int] = {}
        """Serve's replica id -> the router's index (a restarted replica is a new id, a new index)."""
        self.ranks: dict[int, int] = {}
        """The router's index -> the replica's rank (the `engine` label of its metrics)."""
        self.num_decisions: collections.Counter[int] = collections.Counter()
        """Requests routed per rank since the metrics last took them."""
        self.decisions: collections.deque[tuple[int, RoutingDecision]] = collections.deque(maxlen=4096)
        """(rank, decision) since the metrics last took them; bounded for a server nobody scrapes."""
        # Serve ships this class to the handle's process by value (cloudpickle), with a copy of this
        # module's globals: register in the imported module, where the server looks
        from vllm_omni.entrypoints.replicas import ray_serve

        ray_serve.ROUTERS[key] = self

    def _index(self, replica: RunningReplica) -> int:
        key = replica.replica_id.unique_id
        if key not in self.indices:
            self.indices[key] = self.router.add_replica()
        index = self.indices[key]
        stats = replica.routing_stats
        if stats:  # none before Serve's first poll of this replica
            self.router.report(index, stats_to_report(stats))
            self.ranks[index] = int(stats.get("rank", index))
        return index

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if pending_request is None or pending_request.metadata.call_method != "generate":
            return [candidate_replicas]  # `describe` and the like: any replica, nothing to account
        kwargs = pending_request.kwargs
        with self.lock:
            by_index = {self._index(r): r for r in candidate_replicas}
            try:
                decision = self.router.choose(
                    float(kwargs.get("work_s", 0.0)), kwargs.get("adapter"), candidates=list(by_index)
                )
            except RuntimeError:  # none healthy: Serve waits for a replica that is
                return []
            rank = self.ranks.get(decision.replica, decision.replica)
            self.num_decisions[rank] += 1
            self.decisions.append((rank, decision))
        return [[by_index[decision.replica]]]

    def snapshot(self) -> list[ReplicaRow]:
        """Every replica Serve lists as running, by rank."""
        with self.lock:
            rows = []
            for replica in self.curr_replicas.values():
                index = self._index(replica)
                ledger = self.router.ledgers[index]
                pid = int((replica.routing_stats or {}).get("pid", 0))
                rows.append(
                    ReplicaRow(
                        self.ranks.get(index, index), ledger.report, ledger.work_s, ledger.num_requests, pid
                    )
                )
            return sorted(rows, key=lambda row: row.rank)

    def take_decisions(self) -> tuple[dict[int, int], list[tuple[int, RoutingDecision]]]:
        """(requests routed per rank, the last 4096 (rank, decision)) since the last call."""
        with self.lock:
            counts, decisions = dict(self.num_decisions), list(self.decisions)
            self.num_decisions.clear()
            self.decisions.clear()
        return counts, decisions


def replica_deployment(
    config: OmniDiffusionConfig,
    num_replicas: int,
    key: str,
    policy: str = "work",
    num_gpus: float | None = None,
    num_cpus: float | None = None,
    max_ongoing_requests: int | None = None,
    autoscaling_config: dict | None = None,
):
    """The bound Serve application of `num_replicas` engines (or `autoscaling_config`'s range).

    `num_gpus`: per replica (default its parallel world size on CUDA, 0 on CPU; a fraction shares one
    GPU). A replica never refuses a request below its engine's own queue limit, so Serve's cap is the
    engine's (`max_ongoing_requests` default: max_num_seqs + max_queue_size)."""
    if num_gpus is None:  # a replica with tensor / sequence parallelism holds its world size of GPUs
        num_gpus = 0 if config.device == "cpu" else config.parallel_config.world_size
    options: dict = {"num_gpus": num_gpus}
    if num_cpus is not None:
        options["num_cpus"] = num_cpus
    deployment = serve.deployment(
        DiffusionReplica,
        name=DEPLOYMENT_NAME,
        ray_actor_options=options,
        max_ongoing_requests=max_ongoing_requests or config.max_num_seqs + config.max_queue_size,
        request_router_config=RequestRouterConfig(
            request_router_class=WorkRequestRouter,
            request_router_kwargs={"key": key, "policy": policy},
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
        ),
        health_check_period_s=2,
        graceful_shutdown_timeout_s=30,
    )
    if autoscaling_config is not None:
        deployment = deployment.options(autoscaling_config=autoscaling_config)
    else:
        deployment = deployment.options(num_replicas=num_replicas)
    return deployment.bind(config)

"""Per-replica series on the server's one `/metrics`, labelled `engine` (vLLM's label: the replica's
Serve rank), and the router's decisions.

    vllm_omni:replica_remaining_work_seconds{engine}   the replica's last report of its remaining work
    vllm_omni:replica_num_requests_running{engine}      its running requests (last report)
    vllm_omni:replica_num_requests_waiting{engine}      its waiting requests (last report + routed since)
    vllm_omni:replica_healthy{engine}                   1 when its engine loop runs
    vllm_omni:replica_info{engine, pid}                 1: the process serving that label
    vllm_omni:router_decisions_total{engine}            requests routed to it
    vllm_omni:router_work_at_decision_seconds{engine}   its ledger work when each was routed there

The gauges are read from the router at scrape time (a `prometheus_client` collector); the decisions
are taken from the router at scrape time too, so the router's loop never touches Prometheus.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

from vllm_omni.entrypoints.openai.metrics import PREFIX

WORK_BUCKETS_S = (0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)


class ReplicaMetrics:
    """The series above, in `registry` (the server's `PrometheusStatLogger.registry`)."""

    def __init__(self, client, registry: CollectorRegistry):
        """`client`: the `ReplicatedEngine` (its router's snapshot and decisions)."""
        self.client = client
        # first in the registry: its scrape moves the router's decisions into the two series below
        registry.register(self)
        self.decisions = Counter(
            PREFIX + "router_decisions", "Requests the router sent to each replica.", ["engine"],
            registry=registry,
        )  # fmt: skip
        self.work_at_decision = Histogram(
            PREFIX + "router_work_at_decision_seconds",
            "The chosen replica's queued work (router ledger) when a request was routed to it.",
            ["engine"],
            buckets=WORK_BUCKETS_S,
            registry=registry,
        )

    def describe(self):
        return []  # the names are known only at scrape; an empty list keeps register() from collecting

    def collect(self):
        from vllm_omni.entrypoints.replicas.ray_serve import ROUTERS

        router = ROUTERS.get(self.client.router_key)
        rows = [] if router is None else router.snapshot()
        if router is not None:
            counts, decisions = router.take_decisions()
            for rank, count in counts.items():
                self.decisions.labels(engine=str(rank)).inc(count)
            for rank, decision in decisions:
                self.work_at_decision.labels(engine=str(rank)).observe(decision.work_s_at_decision)
        families = {
            "work": GaugeMetricFamily(
                PREFIX + "replica_remaining_work_seconds",
                "Remaining denoise work (its report).",
                labels=["engine"],
            ),
            "running": GaugeMetricFamily(
                PREFIX + "replica_num_requests_running", "Running requests (its report).", labels=["engine"]
            ),
            "waiting": GaugeMetricFamily(
                PREFIX + "replica_num_requests_waiting",
                "Waiting requests (its report + requests routed to it since).",
                labels=["engine"],
            ),
            "healthy": GaugeMetricFamily(
                PREFIX + "replica_healthy", "1 when the replica's engine loop runs.", labels=["engine"]
            ),
        }
        info = GaugeMetricFamily(
            PREFIX + "replica_info", "The process serving each engine label.", labels=["engine", "pid"]
        )
        for row in rows:
            label, report = [str(row.rank)], row.report
            families["work"].add_metric(label, report.remaining_work_s)
            families["running"].add_metric(label, report.num_running)
            families["waiting"].add_metric(label, max(0, row.num_requests - report.num_running))
            families["healthy"].add_metric(label, 1.0 if report.healthy else 0.0)
            info.add_metric([str(row.rank), str(row.pid)], 1.0)
        yield from families.values()
        yield info

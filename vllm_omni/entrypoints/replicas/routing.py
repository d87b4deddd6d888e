"""Which data-parallel replica gets the next request: ranked by remaining work, not by request count.

A step-level engine knows how much denoise work each of its requests has left: remaining steps x the
step cost model's price of one step at that request's tokens. Across replicas that is the signal that
predicts when a new request would finish; "fewest requests" is the wrong one, because a 1536x1536
request is about ten times the work of a 512x512 one.

The router keeps a ledger per replica:

    ledger(r) = reported_work(r)                         the replica's last report (seconds of work)
              + sum(work of requests routed to r that    router-side accounting: a report is a snapshot,
                    the report had not yet counted)      and decisions come faster than reports

A replica's report carries `num_received`, how many requests routed by this router it had accepted
when it measured its work; routed requests with a sequence number at or below it are in the reported
figure and leave the pending list. So the ranking moves at every decision, without waiting for the
next poll, and never counts a request twice.

Policies (`--data-parallel-routing`):
- `work` (default): least ledger work; ties to fewer requests, then the lower replica index. A request
  naming a LoRA adapter prefers a replica that already holds it, unless that costs more than
  `lora_affinity_margin_s` of extra queued work over the best replica.
- `least-requests`: fewest requests (running + waiting + routed, not yet reported); ties to index.
- `round-robin`: in turn.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field


class RoutingPolicy(str, enum.Enum):
    """How the router ranks replicas (`--data-parallel-routing`)."""

    WORK = "work"
    LEAST_REQUESTS = "least-requests"
    ROUND_ROBIN = "round-robin"


@dataclass(frozen=True)
class ReplicaReport:
    """What one replica reports about itself (its engine's state at one instant)."""

    remaining_work_s: float
    """Sum over its running and waiting requests of remaining steps x its cost model's step time."""
    num_requests: int
    """Running + waiting requests."""
    num_received: int
    """Requests from this router it had accepted when it measured the two numbers above."""
    adapters: frozenset[str] = frozenset()
    """LoRA adapter names loaded on the replica."""
    healthy: bool = True
    num_running: int = 0
    """Of `num_requests`, those that have started (the rest wait)."""


@dataclass(frozen=True)
class RoutedRequest:
    """One request the router sent and the replica has not yet reported."""

    seq: int
    work_s: float


@dataclass
class ReplicaLedger:
    """The router's view of one replica."""

    report: ReplicaReport = field(default_factory=lambda: ReplicaReport(0.0, 0, 0))
    pending: list[RoutedRequest] = field(default_factory=list)
    num_sent: int = 0
    """Requests routed here so far (the next one's sequence number is this + 1)."""

    @property
    def work_s(self) -> float:
        return self.report.remaining_work_s + sum(r.work_s for r in self.pending)

    @property
    def num_requests(self) -> int:
        return self.report.num_requests + len(self.pending)


@dataclass(frozen=True)
class RoutingDecision:
    """The replica chosen for one request and what the router believed when it chose."""

    replica: int
    work_s_at_decision: float
    """The chosen replica's ledger work just before this request was added."""
    seq: int
    """The request's sequence number on that replica (what its report's `num_received` counts)."""


class ReplicaRouter:
    """Chooses a replica for each request and keeps the per-replica ledgers (module docstring)."""

    def __init__(
        self,
        num_replicas: int,
        policy: RoutingPolicy | str = RoutingPolicy.WORK,
        lora_affinity_margin_s: float = 2.0,
    ):
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        self.policy = RoutingPolicy(policy)
        self.lora_affinity_margin_s = lora_affinity_margin_s
        self.ledgers = [ReplicaLedger() for _ in range(num_replicas)]
        self._turn = itertools.count()

    def add_replica(self) -> int:
        """A new replica (one that scaled up, or came back under a new identity); returns its index."""
        self.ledgers.append(ReplicaLedger())
        return len(self.ledgers) - 1

    def report(self, replica: int, report: ReplicaReport) -> None:
        """A replica's new report: it replaces the last one; requests it counted leave the pending list."""
        ledger = self.ledgers[replica]
        ledger.report = report
        ledger.pending = [r for r in ledger.pending if r.seq > report.num_received]

    def choose(
        self, work_s: float, adapter: str | None = None, candidates: list[int] | None = None
    ) -> RoutingDecision:
        """The replica for a request of `work_s` seconds of work (naming `adapter`, if any), among
        `candidates` (default: all); the request is added to that replica's ledger at once.
        RuntimeError when no candidate is healthy."""
        indices = range(len(self.ledgers)) if candidates is None else candidates
        healthy = [i for i in indices if self.ledgers[i].report.healthy]
        if not healthy:
            raise RuntimeError("no healthy replica")
        replica = self._rank(healthy, adapter)
        ledger = self.ledgers[replica]
        before = ledger.work_s
        ledger.num_sent += 1
        ledger.pending.append(RoutedRequest(ledger.num_sent, work_s))
        return RoutingDecision(replica, before, ledger.num_sent)

    def _rank(self, healthy: list[int], adapter: str | None) -> int:
        if self.policy is RoutingPolicy.ROUND_ROBIN:
            ordered = sorted(healthy)
            return ordered[next(self._turn) % len(ordered)]
        if self.policy is RoutingPolicy.LEAST_REQUESTS:
            return min(healthy, key=lambda i: (self.ledgers[i].num_requests, i))
        best = min(healthy, key=lambda i: (self.ledgers[i].work_s, self.ledgers[i].num_requests, i))
        if adapter is None or adapter in self.ledgers[best].report.adapters:
            return best
        holders = [i for i in healthy if adapter in self.ledgers[i].report.adapters]
        if not holders:
            return best
        holder = min(holders, key=lambda i: (self.ledgers[i].work_s, self.ledgers[i].num_requests, i))
        margin = self.ledgers[holder].work_s - self.ledgers[best].work_s
        return holder if margin <= self.lora_affinity_margin_s else best

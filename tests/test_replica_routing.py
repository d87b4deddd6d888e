"""The data-parallel router: ranking by remaining work, router-side accounting, LoRA affinity, health,
and the N-replica simulation on the H200's step costs (benchmarks/diffusion/replica_simulation.py)."""

from __future__ import annotations

import pytest

from vllm_omni.entrypoints.replicas.routing import ReplicaReport, ReplicaRouter


def test_a_long_request_on_replica_0_sends_the_next_short_ones_to_replica_1():
    router = ReplicaRouter(2, "work")
    # replica 0 holds one long request (one 1536x1536 request: ~8 s of work), replica 1 two short ones
    router.report(0, ReplicaReport(remaining_work_s=8.0, num_requests=1, num_received=1))
    router.report(1, ReplicaReport(remaining_work_s=1.0, num_requests=2, num_received=2))
    assert [router.choose(0.5).replica for _ in range(4)] == [1, 1, 1, 1]
    # "fewest requests" would have sent the first one to replica 0, behind 8 s of work
    counting = ReplicaRouter(2, "least-requests")
    counting.report(0, ReplicaReport(8.0, 1, 1))
    counting.report(1, ReplicaReport(1.0, 2, 2))
    assert counting.choose(0.5).replica == 0


def test_router_side_accounting_moves_the_ranking_at_every_decision_without_reports():
    router = ReplicaRouter(3, "work")
    chosen = [router.choose(work).replica for work in (5.0, 1.0, 1.0, 1.0, 1.0)]
    # 5 s to replica 0, then the 1 s requests fill replicas 1 and 2 in turn (below replica 0's 5 s)
    assert chosen == [0, 1, 2, 1, 2]
    assert [ledger.work_s for ledger in router.ledgers] == [5.0, 2.0, 2.0]


def test_a_report_counts_each_routed_request_once():
    router = ReplicaRouter(2, "work")
    first, second = router.choose(3.0), router.choose(3.0)
    assert (first.replica, second.replica) == (0, 1)
    third = router.choose(2.0)
    assert third.replica == 0 and third.work_s_at_decision == 3.0 and third.seq == 2
    # replica 0 reports having accepted only its first request, which it priced at 2.5 s
    router.report(0, ReplicaReport(remaining_work_s=2.5, num_requests=1, num_received=1))
    assert router.ledgers[0].work_s == pytest.approx(2.5 + 2.0)  # the second (seq 2) is still pending
    assert router.ledgers[0].num_requests == 2
    router.report(0, ReplicaReport(remaining_work_s=4.0, num_requests=2, num_received=2))
    assert router.ledgers[0].work_s == 4.0 and router.ledgers[0].pending == []


def test_ties_go_to_fewer_requests_then_the_lower_index():
    router = ReplicaRouter(3, "work")
    router.report(0, ReplicaReport(2.0, 3, 3))
    router.report(1, ReplicaReport(2.0, 1, 1))
    router.report(2, ReplicaReport(2.0, 1, 1))
    assert router.choose(1.0).replica == 1


def test_lora_affinity_within_the_margin_and_not_beyond():
    router = ReplicaRouter(2, "work", lora_affinity_margin_s=2.0)
    router.report(0, ReplicaReport(1.0, 1, 0))
    router.report(1, ReplicaReport(2.5, 1, 0, adapters=frozenset({"ink"})))
    assert router.choose(1.0, adapter="ink").replica == 1  # 1.5 s more queued work: within the margin
    assert router.choose(1.0, adapter=None).replica == 0
    router.report(1, ReplicaReport(6.0, 3, 1, adapters=frozenset({"ink"})))
    assert router.choose(1.0, adapter="ink").replica == 0  # 4+ s more: not worth it
    assert router.choose(1.0, adapter="other").replica == 0  # nobody holds it: plain ranking


def test_unhealthy_replicas_get_nothing_and_none_healthy_is_an_error():
    for policy in ("work", "least-requests", "round-robin"):
        router = ReplicaRouter(3, policy)
        router.report(1, ReplicaReport(0.0, 0, 0, healthy=False))
        assert 1 not in {router.choose(1.0).replica for _ in range(6)}
        for k in (0, 2):
            router.report(k, ReplicaReport(0.0, 0, 0, healthy=False))
        with pytest.raises(RuntimeError, match="no healthy replica"):
            router.choose(1.0)


def test_round_robin_takes_turns_and_an_unknown_policy_is_refused():
    router = ReplicaRouter(3, "round-robin")
    assert [router.choose(1.0).replica for _ in range(5)] == [0, 1, 2, 0, 1]
    with pytest.raises(ValueError):
        ReplicaRouter(2, "random")
    with pytest.raises(ValueError, match="num_replicas"):
        ReplicaRouter(0)


def test_simulated_fleet_routed_by_work_beats_round_robin():
    from benchmarks.diffusion import replica_simulation as rs
    from benchmarks.diffusion import schedule_simulation as ss

    trace = rs.fleet_trace(0.9, 2, 120, seed=0)
    work = ss.summary(rs.simulate(trace, 2, "work"))
    turns = ss.summary(rs.simulate(trace, 2, "round-robin"))
    assert len(rs.simulate(trace, 2, "least-requests")) == len(trace)
    assert work["mean"] < turns["mean"] and work["p99"] < turns["p99"]

"""`vllm serve --data-parallel-*` without starting anything: which server runs with which options,
what is refused (exit 2, the flag named), and the engine's remaining work that replicas report."""

from __future__ import annotations

import asyncio

import pytest

from vllm_omni.config import OmniDiffusionConfig
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.entrypoints.cli import main as cli_main
from vllm_omni.entrypoints.replicas.routing import ReplicaReport, ReplicaRouter
from vllm_omni.inputs import OmniDiffusionSamplingParams


@pytest.fixture
def started(monkeypatch):
    """(which server, its arguments) for every start, with nothing started."""
    import vllm_omni.entrypoints.cli.startup_checks as startup_checks
    import vllm_omni.entrypoints.openai.api_server as api_server
    import vllm_omni.entrypoints.replicas.server as replica_server

    seen = []
    monkeypatch.setattr(api_server, "run_server", lambda config, args: seen.append(("one", config)))
    monkeypatch.setattr(
        replica_server, "run_replicated_server", lambda config, args, options: seen.append(("ray", options))
    )
    monkeypatch.setattr(startup_checks, "startup_errors", lambda config: [])
    return seen


def _run(argv: list[str]) -> int:
    try:
        return cli_main.main(["serve", "tiny-qwen-image", "--omni", *argv], prog="vllm")
    except SystemExit as exc:  # argparse errors
        return exc.code


def test_without_data_parallel_flags_one_engine_runs_as_before(started):
    assert _run([]) == 0 and [kind for kind, _ in started] == ["one"]


def test_data_parallel_ray_starts_replicas_with_the_flags_values(started):
    argv = ["-dp", "3", "-dpb", "ray", "--data-parallel-routing", "least-requests"]
    assert _run([*argv, "--ray-address", "10.0.0.1:6379", "--data-parallel-gpus-per-replica", "0.5"]) == 0
    ((kind, options),) = started
    assert kind == "ray"
    assert (options.num_replicas, options.routing, options.ray_address) == (
        3,
        "least-requests",
        "10.0.0.1:6379",
    )
    assert options.num_gpus_per_replica == 0.5


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--data-parallel-size", "2"], "--data-parallel-backend ray"),
        (["-dp", "0"], "--data-parallel-size must be >= 1"),
        (["-dp", "2", "-dpb", "ray", "--lora-modules", "a=/x"], "--lora-modules"),
        (
            ["-dp", "2", "-dpb", "ray", "--data-parallel-gpus-per-replica", "-1"],
            "--data-parallel-gpus-per-replica",
        ),
        (["-dp", "2", "-dpb", "ray", "--data-parallel-routing", "random"], "--data-parallel-routing"),
    ],
)
def test_what_cannot_run_is_refused_naming_the_flag(started, capsys, argv, needle):
    assert _run(argv) == 2 and not started
    assert needle in capsys.readouterr().err


def test_the_ray_backend_without_ray_installed_is_refused_with_the_install_line(started, capsys, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "ray" else find_spec(name, *a)
    )
    assert _run(["-dp", "2", "-dpb", "ray"]) == 2 and not started
    assert "pip install 'vllm-omni-step[ray]'" in capsys.readouterr().err


def test_ray_flags_with_one_engine_warn_once_and_run_it(started, capsys):
    assert _run(["--ray-address", "auto"]) == 0
    assert [kind for kind, _ in started] == ["one"]
    warned = [line for line in capsys.readouterr().err.splitlines() if "has no effect here" in line]
    assert len(warned) == 1 and "--ray-address has no effect here" in warned[0], warned


def test_router_chooses_among_candidates_and_takes_new_replicas():
    router = ReplicaRouter(2, "work")
    router.report(0, ReplicaReport(remaining_work_s=0.0, num_requests=0, num_received=0))
    router.report(1, ReplicaReport(remaining_work_s=9.0, num_requests=3, num_received=0))
    assert router.choose(1.0, candidates=[1]).replica == 1  # replica 0 is not running (Serve's list)
    fresh = router.add_replica()
    assert fresh == 2 and router.choose(1.0, candidates=[1, 2]).replica == 2
    with pytest.raises(RuntimeError):
        router.choose(1.0, candidates=[])


def test_engine_remaining_work_is_steps_left_times_its_cost_models_step_time(tiny_model_dir):
    from vllm_omni.diffusion.engine import DiffusionEngine

    config = OmniDiffusionConfig(
        model=str(tiny_model_dir), dtype="float32", device="cpu", step_execution=True
    )
    engine = DiffusionEngine(config, autostart=False)
    try:
        assert engine.remaining_work_s() == 0.0
        handles = [
            engine.add_request(
                OmniDiffusionRequest(
                    request_id=f"r{h}",
                    prompt="a cat",
                    sampling_params=OmniDiffusionSamplingParams(height=h, width=64, num_inference_steps=n),
                )
            )
            for h, n in ((64, 4), (128, 6))
        ]
        states = [engine.scheduler.get_state(h.req_id) for h in handles]
        step_time = engine.scheduler.cost_model.step_time

        def expected() -> float:
            return sum(s.num_steps_left * step_time(s.profile.num_step_tokens) for s in states)

        assert engine.remaining_work_s() == pytest.approx(expected()) and expected() > 0
        engine.step()  # a step lowers the steps left of what ran
        assert sum(s.num_steps_done for s in states) >= 1
        assert engine.remaining_work_s() == pytest.approx(expected())
    finally:
        engine.shutdown()


def test_serve_application_arguments_are_serve_flags():
    pytest.importorskip("ray.serve")
    from vllm_omni.entrypoints.replicas.serve_app import _argv

    argv = _argv(
        {"model": "tiny-qwen-image", "step_execution": "true", "enforce_eager": False, "max_num_seqs": 4}
    )
    assert argv == ["tiny-qwen-image", "--step-execution", "--max-num-seqs", "4"]
    with pytest.raises(ValueError, match="port"):
        _argv({"port": 9000})


def test_serve_router_ranks_replicas_by_their_reported_work_and_accounts_for_its_decisions():
    pytest.importorskip("ray.serve")
    from types import SimpleNamespace

    from vllm_omni.entrypoints.replicas.ray_serve import WorkRequestRouter, report_to_stats

    def replica(name: str, work_s: float, num_requests: int, rank: int) -> SimpleNamespace:
        report = ReplicaReport(remaining_work_s=work_s, num_requests=num_requests, num_received=num_requests)
        stats = report_to_stats(report, rank, pid=1000 + rank)
        return SimpleNamespace(replica_id=SimpleNamespace(unique_id=name), routing_stats=stats)

    def pending(method: str = "generate", work_s: float = 0.5) -> SimpleNamespace:
        return SimpleNamespace(kwargs={"work_s": work_s}, metadata=SimpleNamespace(call_method=method))

    # Serve builds the router in the handle's process; its own constructor needs a running Serve
    router = WorkRequestRouter.__new__(WorkRequestRouter)
    router.initialize_state(key="test-router")
    long_on_0, short_on_1 = replica("a", 8.0, 1, 0), replica("b", 1.0, 2, 1)
    chosen = [asyncio.run(router.choose_replicas([long_on_0, short_on_1], pending())) for _ in range(4)]
    assert [ranked[0][0] for ranked in chosen] == [short_on_1] * 4  # 1 + 4 x 0.5 s stays below 8 s
    assert router.take_decisions()[0] == {1: 4}
    # calls that are not requests (the client's `describe`) go anywhere and are not accounted
    assert asyncio.run(router.choose_replicas([long_on_0, short_on_1], pending("describe"))) == [
        [long_on_0, short_on_1]
    ]
    assert router.take_decisions()[0] == {}

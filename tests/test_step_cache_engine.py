"""Step caching in the engine: refusals, request mode, preemption, aborts, batch invariance (tiny
Qwen-Image, fp32 CPU). The decisions themselves are checked against cache-dit in
test_step_cache_vs_cache_dit.py and against TeaCache's formula in test_step_cache_teacache.py."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_omni.config import OmniDiffusionConfig
from vllm_omni.diffusion.cache.config import CacheConfig, CacheConfigError
from vllm_omni.diffusion.engine import DiffusionEngine
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.inputs import InvalidRequestError, OmniDiffusionSamplingParams

# 2 blocks: Fn=1 and Bn=0 leave block 1 as the middle; threshold 1 caches every step after warmup
ALWAYS = {
    "Fn_compute_blocks": 1,
    "Bn_compute_blocks": 0,
    "residual_diff_threshold": 1.0,
    "max_warmup_steps": 1,
}


def _config(tiny_model_dir, **kwargs) -> OmniDiffusionConfig:
    base = dict(model=str(tiny_model_dir), dtype="float32", device="cpu", log_stats=False)
    return OmniDiffusionConfig(**{**base, "cache_backend": "cache_dit", "cache_config": ALWAYS, **kwargs})


def _request(label, prompt, negative, side, steps, seed, extra=None):
    params = OmniDiffusionSamplingParams(
        height=side, width=side, num_inference_steps=steps, true_cfg_scale=4.0, seed=seed, output_type="np",
        extra_args=extra or {},
    )  # fmt: skip
    return OmniDiffusionRequest(label, prompt=prompt, negative_prompt=negative, sampling_params=params)


def _drain(engine, handles):
    while not all(h.done() for h in handles):
        engine.step()
    return [h.result() for h in handles]


@pytest.mark.parametrize(
    ("backend", "config", "needle"),
    [
        ("mag_cache", None, "supported: ['none', 'cache_dit', 'tea_cache']"),
        ("fast_cache", None, "is unknown"),
        ("cache_dit", {"Fn_compute_blocks": 0}, "Fn_compute_blocks must be an integer >= 1"),
        ("cache_dit", {"steps_computation_mask": [0, 1]}, "must start with 1"),
        ("cache_dit", {"steps_computation_policy": "x"}, "'dynamic' or 'static'"),
        ("tea_cache", {"rel_l1_thresh": 0}, "rel_l1_thresh must be a number > 0"),
        ("tea_cache", {"Fn_compute_blocks": 1}, "unknown tea_cache cache config key 'Fn_compute_blocks'"),
        ("none", {"rel_l1_thresh": 0.2}, "without a cache backend"),
    ],
)
def test_server_settings_are_refused_naming_the_key(backend, config, needle):
    with pytest.raises(ValueError, match=None) as info:
        OmniDiffusionConfig(cache_backend=backend, cache_config=config)
    assert needle in str(info.value)


def test_caching_refuses_what_it_cannot_run_with(tiny_model_dir):
    with pytest.raises(ValueError, match="runs on one device"):
        OmniDiffusionConfig(cache_backend="tea_cache", parallel_config={"tensor_parallel_size": 2})
    with pytest.raises(ValueError, match="exceeds the model's 2 transformer blocks"):
        DiffusionEngine(
            _config(tiny_model_dir, cache_config={"Fn_compute_blocks": 2, "Bn_compute_blocks": 1})
        )


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"cache_backend": "tea_cache"}, "extra_args.cache_backend"),
        ({"cache_config": {"Fn": 1}}, "extra_args.cache_config.Fn"),
        (
            {"cache_config": {"residual_diff_threshold": "high"}},
            "extra_args.cache_config.residual_diff_threshold",
        ),
        (
            {"cache_config": {"steps_computation_mask": [1, 0, 1]}},
            "extra_args.cache_config.steps_computation_mask",
        ),
        ({"cache_backend": "none", "cache_config": {"Fn_compute_blocks": 1}}, "extra_args.cache_config"),
        ({"cache_config": "Fn=1"}, "extra_args.cache_config"),
    ],
)
def test_request_settings_are_refused_naming_the_field(extra, param):
    server = CacheConfig.from_user("cache_dit", {"max_warmup_steps": 2})
    params = OmniDiffusionSamplingParams(num_inference_steps=4, extra_args=extra)
    with pytest.raises(InvalidRequestError) as info:
        params.resolve_cache(server) if isinstance(extra.get("cache_config", {}), dict) else params.validate()
    assert info.value.param == param, str(info.value)


def test_request_overrides_and_opt_out():
    server = CacheConfig.from_user("cache_dit", {"max_warmup_steps": 2})
    sp = OmniDiffusionSamplingParams(
        num_inference_steps=4, extra_args={"cache_config": {"Bn_compute_blocks": 3}}
    )
    resolved = sp.resolve_cache(server)
    assert (resolved.params.Bn_compute_blocks, resolved.params.max_warmup_steps) == (3, 2)
    sp = OmniDiffusionSamplingParams(extra_args={"cache_backend": "none"})
    assert not sp.resolve_cache(server).is_enabled
    with pytest.raises(CacheConfigError):
        CacheConfig().for_request("cache_dit")


def test_request_mode_gives_the_step_mode_image(tiny_model_dir):
    req = ("a red fox", "blurry", 48, 5, 7)
    step_engine = DiffusionEngine(_config(tiny_model_dir), autostart=False)
    request_engine = DiffusionEngine(_config(tiny_model_dir, step_execution=False), autostart=False)
    (a,) = _drain(step_engine, [step_engine.add_request(_request("a", *req))])
    (b,) = _drain(request_engine, [request_engine.add_request(_request("b", *req))])
    assert a.timings.num_cached_steps == b.timings.num_cached_steps == [4, 4]
    assert np.array_equal(a.images, b.images)


def test_a_preempted_cached_request_keeps_its_cache_state(tiny_model_dir):
    """Latency policy, one request per step: the long request sits out while shorter ones run; its
    branches (counters, residuals) stay in its slot, so image and cached steps equal its run alone."""
    config = _config(
        tiny_model_dir, max_num_seqs=1, max_num_resident_reqs=3, scheduling_policy="latency",
        scheduling_aging_factor=1e9, scheduling_deadline_factor=None,
        cache_config={**ALWAYS, "max_continuous_cached_steps": 2},
    )  # fmt: skip
    engine = DiffusionEngine(config, autostart=False)
    engine.scheduler.cost_model.observe = lambda num_tokens, seconds: None
    cases = {"long": ("a red cat", "blurry", 64, 6, 11), "short": ("a bowl of fruit", None, 32, 3, 13)}
    alone = {k: _drain(engine, [engine.add_request(_request(k, *c))])[0] for k, c in cases.items()}
    handles = [engine.add_request(_request("long", *cases["long"]))]
    engine.step()
    engine.step()
    handles.append(engine.add_request(_request("short", *cases["short"])))
    long, short = _drain(engine, handles)
    assert long.timings.num_steps_sat_out == 3, "the long request sat out while the short one ran"
    for label, out in (("long", long), ("short", short)):
        assert out.timings.num_cached_steps == alone[label].timings.num_cached_steps, label
        assert np.array_equal(out.images, alone[label].images), label
    assert long.timings.num_cached_steps == [4, 4]


def test_abort_frees_the_cache_state(tiny_model_dir):
    engine = DiffusionEngine(_config(tiny_model_dir), autostart=False)
    handle = engine.add_request(_request("x", "a cat", "dark", 32, 6, 1))
    engine.step()
    engine.step()
    runner = engine.executor.driver_worker.runner
    req_id = handle.req_id
    assert runner.batch.get(req_id).cache_branches[0].fn_residual is not None
    engine.abort(req_id)
    engine.step()
    assert runner.batch.get(req_id) is None and runner.num_reqs == 0


def test_batch_invariant_cached_image_is_bit_identical_alone_or_packed(tiny_model_dir):
    config = _config(tiny_model_dir, batch_invariant=True, max_num_seqs=4, mixfusion_min_chunk_tokens=1,
                     scheduling_policy="skip-ahead")  # fmt: skip
    engine = DiffusionEngine(config, autostart=False)
    cached = ("a lighthouse", "noise", 48, 4, 3)
    (alone,) = _drain(engine, [engine.add_request(_request("a", *cached))])
    others = [("a dog", None, 32, 4, 4, {"cache_backend": "none"}), ("a boat", "x", 64, 3, 5, None)]
    handles = [engine.add_request(_request("b", *cached))]
    handles += [engine.add_request(_request(f"o{i}", *o)) for i, o in enumerate(others)]
    packed = _drain(engine, handles)[0]
    assert packed.timings.num_cached_steps == alone.timings.num_cached_steps == [3, 3]
    assert np.array_equal(packed.images, alone.images)


def test_admission_charges_the_kept_residuals(tiny_model_dir):
    engine = DiffusionEngine(_config(tiny_model_dir), autostart=False)
    cached = _request("c", "a cat", "dark", 64, 4, 1)
    uncached = _request("u", "a cat", "dark", 64, 4, 1, {"cache_backend": "none"})
    for req in (cached, uncached):
        req.sampling_params.max_sequence_length = 64
    memory = engine.memory
    need = [memory.estimate(r.sampling_params, engine.validate_request(r)) for r in (cached, uncached)]
    # two sequences x (2 x 16 image rows + 64 text rows) x hidden 32 x fp32
    assert need[0].latent_bytes - need[1].latent_bytes == 2 * (2 * 16 + 64) * 32 * 4


def test_latency_policy_prices_a_static_mask_s_cached_steps(tiny_model_dir):
    """Remaining work counts a static mask's cached steps at (Fn + Bn) / blocks of a full step, and a
    request on a cached step adds only that share of its tokens to the step being built."""
    engine = DiffusionEngine(_config(tiny_model_dir, scheduling_policy="latency"), autostart=False)
    mask = {"steps_computation_mask": [1, 1, 0, 0], "steps_computation_policy": "static"}
    cached = engine.add_request(_request("m", "a cat", "dark", 32, 4, 1, {"cache_config": mask}))
    plain = engine.add_request(_request("p", "a cat", "dark", 32, 4, 1, {"cache_backend": "none"}))
    states = {h.req_id: engine.scheduler._requests[h.req_id] for h in (cached, plain)}
    profile = states[cached.req_id].profile
    assert profile.step_work == (1.0, 1.0, 0.5, 0.5)  # Fn=1, Bn=0 of 2 blocks
    assert profile.step_tokens(2) == round(profile.num_step_tokens / 2)
    policy, model = engine.scheduler.latency_policy, engine.scheduler.cost_model
    full = model.step_time(profile.num_step_tokens)
    half = model.step_time(profile.step_tokens(2))
    assert policy.remaining_work(states[cached.req_id]) == pytest.approx(2 * full + 2 * half)
    assert policy.remaining_work(states[plain.req_id]) == pytest.approx(4 * full)
    assert states[plain.req_id].profile.step_work is None


def test_http_response_timings_metrics_and_400s(tiny_model_dir):
    """Through the server: `timings.num_cached_steps` per branch, the Prometheus counters, and a 400 in
    OpenAI's error shape naming the refused per-request field."""
    import asyncio

    import httpx

    from vllm_omni.entrypoints.openai.api_server import ServerArgs, build_app
    from vllm_omni.entrypoints.openai.metrics import PrometheusStatLogger

    config = _config(tiny_model_dir)
    metrics_logger = PrometheusStatLogger(config, "tiny")
    engine = DiffusionEngine(config, stat_loggers=[metrics_logger])
    body = {"prompt": "a red cat", "negative_prompt": "blurry", "size": "32x32", "num_inference_steps": 4}

    async def send():
        app = build_app(engine, ServerArgs(model="tiny", api_key=None), metrics=metrics_logger)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=120) as client:
            ok = await client.post("/v1/images/generations", json=body)
            bad = await client.post(
                "/v1/images/generations", json={**body, "extra_args": {"cache_config": {"Fn": 2}}}
            )
            other = await client.post(
                "/v1/images/generations", json={**body, "extra_body": {"extra_args": {"cache_backend": "x"}}}
            )
            metrics = await client.get("/metrics")
            return ok, bad, other, metrics

    try:
        ok, bad, other, metrics = asyncio.run(send())
    finally:
        engine.shutdown()
    assert ok.status_code == 200, ok.text
    assert ok.json()["timings"]["num_cached_steps"] == [3, 3]
    for resp, param in ((bad, "extra_args.cache_config.Fn"), (other, "extra_args.cache_backend")):
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert "vllm_omni:request_cached_steps_total 6.0" in metrics.text
    assert "vllm_omni:step_cached_sequences_total 6.0" in metrics.text


def test_fp8_cached_request_packed_equals_alone(tiny_model_dir):
    """FP8 linears run through the same segments: a cached request's image packed with an uncached
    one equals its run alone (rows are quantised one by one)."""
    engine = DiffusionEngine(
        _config(tiny_model_dir, quantization="fp8", max_num_seqs=4, mixfusion_min_chunk_tokens=1,
                scheduling_policy="skip-ahead"),
        autostart=False,
    )  # fmt: skip
    cached = ("a red fox", "blurry", 48, 4, 3)
    (alone,) = _drain(engine, [engine.add_request(_request("a", *cached))])
    other = ("a dog", None, 32, 4, 4, {"cache_backend": "none"})
    packed, plain = _drain(
        engine, [engine.add_request(_request("b", *cached)), engine.add_request(_request("o", *other))]
    )
    assert packed.timings.num_cached_steps == alone.timings.num_cached_steps == [3, 3]
    assert plain.timings.num_cached_steps is None
    assert float(np.abs(packed.images - alone.images).max()) <= 1e-5


def test_summary_line_per_finished_request(tiny_model_dir, caplog):
    engine = DiffusionEngine(_config(tiny_model_dir, enable_cache_dit_summary=True), autostart=False)
    with caplog.at_level("INFO", logger="vllm_omni.diffusion.worker.model_runner"):
        _drain(engine, [engine.add_request(_request("s", "a cat", "dark", 32, 4, 1))])
    lines = [r.getMessage() for r in caplog.records if "cache summary" in r.getMessage()]
    assert len(lines) == 1
    assert "branch 0: 3/4 cached at steps [1, 2, 3]; branch 1: 3/4 cached at steps [1, 2, 3]" in lines[0]


def test_latency_policy_estimates_a_dynamic_request_s_cache_rate_online(tiny_model_dir):
    """Dynamic decisions are not known ahead: after each step the runner reports the share of the
    request's sequence-steps that were cached, and its remaining work counts steps at that rate."""
    engine = DiffusionEngine(_config(tiny_model_dir, scheduling_policy="latency"), autostart=False)
    dynamic = engine.add_request(_request("d", "a cat", "dark", 32, 6, 1))
    plain = engine.add_request(_request("p", "a cat", "dark", 32, 6, 1, {"cache_backend": "none"}))
    states = {h: engine.scheduler._requests[h.req_id] for h in (dynamic, plain)}
    assert (
        states[dynamic].profile.cached_step_share == 0.5 and states[plain].profile.cached_step_share is None
    )
    for _ in range(3):
        engine.step()
    d, p = states[dynamic], states[plain]
    assert d.num_steps_done == 3  # (the latency policy ran the shorter, cached request alone)
    assert d.cache_rate == pytest.approx(2 / 3)  # step 0 computed (warmup), steps 1 and 2 cached
    policy, model = engine.scheduler.latency_policy, engine.scheduler.cost_model
    tokens = d.profile.num_step_tokens
    expected = 3 * model.step_time(round(tokens * (1 - 2 / 3 * 0.5)))
    assert policy.remaining_work(d) == pytest.approx(expected)
    assert policy.remaining_work(p) == pytest.approx(p.num_steps_left * model.step_time(tokens))
    _drain(engine, [dynamic, plain])

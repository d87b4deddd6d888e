"""Batching rules without a scheduler loop: key narrowing, MixFusion toggles and plan, token cost, policies.

Reference numbers come from upstream vLLM-Omni (the MixFusion plan examples of its tests and PR #6711)
and from a brute-force gcd; nothing here needs torch or a model.
"""

from __future__ import annotations

import random

import pytest

from vllm_omni.config import OmniDiffusionConfig
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.diffusion.sched.batching import (
    TEXT_TOKEN_OVERHEAD,
    build_batching_profile,
    estimate_text_tokens,
    find_join_blocker,
    make_sampling_params_key,
    mixfusion_plan_ok,
    request_step_tokens,
    resolve_enable_mixfusion,
)
from vllm_omni.diffusion.sched.interface import SamplingParamsKey
from vllm_omni.diffusion.sched.policy import FifoPolicy, SkipAheadPolicy, make_admission_policy
from vllm_omni.diffusion.sched.scheduler import StepScheduler
from vllm_omni.inputs import OmniDiffusionSamplingParams


def make_req(
    req_id: str = "r",
    height: int = 512,
    width: int = 512,
    negative_prompt: str | None = "blurry",
    prompt: str = "a red cat",
    **sp_fields,
) -> OmniDiffusionRequest:
    sp = OmniDiffusionSamplingParams(height=height, width=width, **sp_fields)
    sp.validate()
    return OmniDiffusionRequest(req_id, prompt, negative_prompt, sp)


def key_of(
    req: OmniDiffusionRequest, server_default: bool = True, supports: bool = True
) -> SamplingParamsKey:
    return make_sampling_params_key(req, resolve_enable_mixfusion(req, server_default, supports))


# ------------------------------------------------------------------ key narrowing


def test_key_ignores_shape_cfg_scale_steps_seed_and_text_with_mixfusion():
    base = make_req("a", 512, 512, true_cfg_scale=4.0, num_inference_steps=50, seed=1)
    others = [
        make_req("b", 1024, 768, true_cfg_scale=7.5, num_inference_steps=20, seed=2),
        make_req("c", 256, 1024, prompt="a much longer prompt " * 20, negative_prompt="ugly, low quality"),
        make_req("d", 512, 512, cfg_normalize=False, guidance_scale=3.0, num_outputs_per_prompt=3),
    ]
    assert all(key_of(o) == key_of(base) for o in others)
    assert key_of(base) == SamplingParamsKey()
    assert hash(key_of(base)) == hash(key_of(others[0]))


def test_cfg_and_lora_are_not_barriers():
    """CFG on/off and LoRA only change how many sequences / which rows: they share a step."""
    cfg_on = make_req("a", true_cfg_scale=4.0)
    others = [
        make_req("b", true_cfg_scale=1.0),  # scale <= 1: no CFG
        make_req("c", negative_prompt=None),  # no negative prompt: no CFG
        make_req("d", lora_scale=0.5),
    ]
    for other in others:
        assert key_of(other) == key_of(cfg_on), other.request_id


def test_mixfusion_off_keeps_shape_in_key():
    a, b, c = make_req("a", 512, 512), make_req("b", 512, 768), make_req("c", 512, 512, true_cfg_scale=9.0)
    assert key_of(a, server_default=False) != key_of(b, server_default=False)
    assert key_of(a, server_default=False) == key_of(c, server_default=False)  # CFG scalar still not in key
    assert key_of(a, server_default=False) == SamplingParamsKey(height=512, width=512, num_frames=1)
    # A shape-keyed request never matches a shape-free one, even of the same shape.
    assert key_of(a, server_default=False) != key_of(a, server_default=True)


def test_per_request_extra_args_override_server_default_both_ways():
    off_req = make_req("a", extra_args={"enable_mixfusion": False})
    on_req = make_req("b", extra_args={"enable_mixfusion": True})
    assert resolve_enable_mixfusion(off_req, server_default=True, supports_mixfusion=True) is False
    assert resolve_enable_mixfusion(on_req, server_default=False, supports_mixfusion=True) is True
    assert key_of(off_req, server_default=True).height == 512
    assert key_of(on_req, server_default=False).height is None
    # A pipeline without MixFusion ignores the request's toggle: the shape stays in the key.
    assert resolve_enable_mixfusion(on_req, server_default=False, supports_mixfusion=False) is False
    assert key_of(on_req, server_default=False, supports=False).height == 512


# ------------------------------------------------------------------ capability gating


def test_capability_gating_at_construction():
    with pytest.raises(ValueError, match="does not support MixFusion.*drop --enable-mixfusion"):
        StepScheduler(OmniDiffusionConfig(enable_mixfusion=True), supports_mixfusion=False)
    assert StepScheduler(OmniDiffusionConfig(enable_mixfusion=None), supports_mixfusion=True).enable_mixfusion
    assert not StepScheduler(
        OmniDiffusionConfig(enable_mixfusion=None), supports_mixfusion=False
    ).enable_mixfusion
    assert not StepScheduler(
        OmniDiffusionConfig(enable_mixfusion=False), supports_mixfusion=True
    ).enable_mixfusion
    assert StepScheduler(OmniDiffusionConfig(enable_mixfusion=True), supports_mixfusion=True).enable_mixfusion


# ------------------------------------------------------------------ MixFusion plan


def test_plan_matches_upstream_examples():
    # Token grids from upstream's HunyuanImage3 MixFusion plan test: (64,64)+(52,76) -> chunk 16, 503 chunks.
    ok, reason = mixfusion_plan_ok([64 * 64, 52 * 76], 256, 128)
    assert not ok and "16" in reason and "mixfusion_min_chunk_tokens" in reason
    ok, reason = mixfusion_plan_ok([64 * 64, 52 * 76], 16, 128)
    assert not ok and "503 chunks" in reason and "mixfusion_max_chunks" in reason
    assert mixfusion_plan_ok([64 * 64, 52 * 76], 16, 503)[0]
    assert mixfusion_plan_ok([64 * 64, 32 * 32], 256, 128) == (
        True,
        "MixFusion plan accepted: chunk size 1024, 5 chunks",
    )
    # PR #6711's smoke test: 1024^2, 1024x768, 768x1024, 512^2 -> chunk_size=1024, chunk_count=11.
    counts = [(h // 16) * (w // 16) for h, w in [(1024, 1024), (1024, 768), (768, 1024), (512, 512)]]
    assert mixfusion_plan_ok(counts, 256, 128) == (
        True,
        "MixFusion plan accepted: chunk size 1024, 11 chunks",
    )


def test_plan_equal_counts_always_pass_and_bad_counts_raise():
    assert mixfusion_plan_ok([4, 4, 4], 256, 1)[0]  # tiny same-size images: no chunking needed
    assert mixfusion_plan_ok([], 256, 128)[0]
    with pytest.raises(ValueError, match="img_token_counts"):
        mixfusion_plan_ok([0, 16], 1, 10)


def test_plan_against_brute_force_gcd():
    rng = random.Random(0)
    for _ in range(200):
        counts = [rng.choice([16, 48, 64, 96, 256, 1024, 3952, 4096]) for _ in range(rng.randint(2, 5))]
        chunk = max(c for c in range(1, min(counts) + 1) if all(n % c == 0 for n in counts))
        min_chunk, max_chunks = rng.choice([1, 16, 64, 256]), rng.choice([4, 16, 128, 600])
        expected = len(set(counts)) == 1 or (chunk >= min_chunk and sum(counts) // chunk <= max_chunks)
        assert mixfusion_plan_ok(counts, min_chunk, max_chunks)[0] == expected, (
            counts,
            min_chunk,
            max_chunks,
        )


# ------------------------------------------------------------------ token cost


def test_step_tokens_count_cfg_twice_and_every_image():
    req = make_req("a", 512, 512, prompt="a red cat", negative_prompt="blurry", num_outputs_per_prompt=2)
    num_pos, num_neg = estimate_text_tokens(req)
    assert (num_pos, num_neg) == (3 + TEXT_TOKEN_OVERHEAD, 1 + TEXT_TOKEN_OVERHEAD)
    assert request_step_tokens(req, 20, 7) == 2 * ((1024 + 20) + (1024 + 7))
    no_cfg = make_req("b", 256, 512, negative_prompt=None)
    assert estimate_text_tokens(no_cfg)[1] == 0
    assert request_step_tokens(no_cfg, 20, 7) == 512 + 20
    capped = make_req("c", prompt="word " * 100, max_sequence_length=32)
    assert estimate_text_tokens(capped)[0] == 32


def test_profile_uses_counter_and_request_knobs():
    config = OmniDiffusionConfig(mixfusion_min_chunk_tokens=256, mixfusion_max_chunks=128)
    req = make_req("a", 512, 512, extra_args={"mixfusion_min_chunk_tokens": 16})
    profile = build_batching_profile(req, config, True, True, text_token_counter=lambda r: (100, 50))
    assert profile.num_step_tokens == (1024 + 100) + (1024 + 50)
    assert (profile.mixfusion_min_chunk_tokens, profile.mixfusion_max_chunks) == (16, 128)
    assert profile.img_token_counts == (1024,)


def test_default_plan_limits_are_off_and_mixfusions_restore_its_rejection():
    """No chunk limits by default (the varlen forward needs no chunks); 256 / 128 reject as MixFusion."""
    assert mixfusion_plan_ok([4096, 3952], None, None)[0]  # gcd 16: MixFusion would reject
    assert not mixfusion_plan_ok([4096, 3952], 256, 128)[0]
    assert mixfusion_plan_ok([4096, 1024], 256, 128)[0]
    default = OmniDiffusionConfig()
    assert (default.mixfusion_min_chunk_tokens, default.mixfusion_max_chunks) == (None, None)
    running = [build_batching_profile(make_req("a", 1024, 1024), default, True, True)]
    odd = build_batching_profile(make_req("d", 832, 1216), default, True, True)
    assert find_join_blocker(odd, running, running[0].key, None) is None


def test_join_blocker_reasons():
    config = OmniDiffusionConfig(mixfusion_min_chunk_tokens=256, mixfusion_max_chunks=128)

    def profile(req):
        return build_batching_profile(req, config, True, True)

    running = [profile(make_req("a", 1024, 1024))]
    key = running[0].key
    assert find_join_blocker(profile(make_req("b", 512, 512)), [], None, None) is None  # empty batch
    assert find_join_blocker(profile(make_req("b", 512, 512)), running, key, None) is None
    solo = make_req("c", 768, 768, extra_args={"enable_mixfusion": False})
    assert "key" in find_join_blocker(profile(solo), running, key, None)
    assert "chunk size" in find_join_blocker(profile(make_req("d", 832, 1216)), running, key, None)
    assert "max_num_batched_tokens" in find_join_blocker(
        profile(make_req("e", 1024, 1024)), running, key, 9000
    )


# ------------------------------------------------------------------ admission policies


def test_skip_ahead_aging_window():
    policy = SkipAheadPolicy(max_waiting_steps=3)
    assert policy.may_pass("h", 10)
    policy.on_passed(["h"], 10)
    policy.on_passed(["h"], 11)  # the clock starts at the first pass only
    assert [policy.may_pass("h", s) for s in range(10, 15)] == [True, True, True, False, False]
    assert policy.num_steps_aged("h", 14) == 4
    policy.forget("h")
    assert policy.may_pass("h", 100)


def test_policy_factory_and_fifo_equivalence():
    assert isinstance(make_admission_policy(OmniDiffusionConfig(scheduling_policy="fifo")), FifoPolicy)
    skip = make_admission_policy(OmniDiffusionConfig(scheduling_policy="skip-ahead", max_waiting_steps=7))
    assert isinstance(skip, SkipAheadPolicy) and skip.max_waiting_steps == 7
    assert not FifoPolicy().may_pass("h", 0)
    assert not SkipAheadPolicy(0).may_pass("h", 0)  # max_waiting_steps=0 is FIFO
    with pytest.raises(ValueError, match="max_waiting_steps"):
        SkipAheadPolicy(-1)

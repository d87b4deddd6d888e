"""Every attention backend vs a per-sequence SDPA reference over named batch specs, plus selection and
the ValueErrors that keep wrong geometry or a wrong backend from failing silently."""

from __future__ import annotations

import dataclasses
import inspect
import random
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from vllm_omni.diffusion.attention import (
    AttentionBackend,
    AttentionMetadata,
    FlashAttnBackend,
    SDPABackend,
    build_varlen_metadata,
    get_attn_backend,
)
from vllm_omni.diffusion.attention.backends.auto import AutoAttentionBackend
from vllm_omni.diffusion.attention.backends.flash_attn import varlen_kwargs

HAS_CUDA = torch.cuda.is_available()


@dataclass(frozen=True)
class BatchSpec:
    """Named packing pattern; lengths are drawn in [low, high] with the test's seed."""

    name: str
    num_seqs: int
    low: int
    high: int


BATCH_SPECS = [
    BatchSpec("single", 1, 30, 60),
    BatchSpec("uniform_small", 4, 8, 8),
    BatchSpec("many_short", 12, 1, 9),
    BatchSpec("mixed_long_short", 5, 1, 120),
    BatchSpec("cfg_like_pairs", 6, 20, 40),
]


def seq_lens_of(spec: BatchSpec, seed: int = 0) -> list[int]:
    rng = random.Random(f"{spec.name}-{seed}")
    return [rng.randint(spec.low, spec.high) for _ in range(spec.num_seqs)]


def packed_qkv(seq_lens, num_heads=3, head_dim=16, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    shape = (sum(seq_lens), num_heads, head_dim)
    return [torch.randn(shape, generator=gen).to(device=device, dtype=dtype) for _ in range(3)]


def reference_packed(q, k, v, seq_lens):
    """Per-sequence SDPA written here, independently of the backends."""
    outs, start = [], 0
    for n in seq_lens:
        s = slice(start, start + n)
        qs, ks, vs = (x[s].transpose(0, 1)[None] for x in (q, k, v))  # [1, H, n, D]
        outs.append(F.scaled_dot_product_attention(qs, ks, vs)[0].transpose(0, 1))
        start += n
    return torch.cat(outs)


def _block_diagonal_attention(q, k, v, cu_seqlens, scale):
    """What a varlen kernel computes, written as one masked attention over the whole buffer (not the
    per-sequence reference): keys outside the query's [cu[i], cu[i+1]) span get -inf. fp32 math."""
    seq_ids = torch.repeat_interleave(torch.arange(cu_seqlens.numel() - 1), torch.diff(cu_seqlens.cpu()))
    same_seq = seq_ids[:, None] == seq_ids[None, :]  # [T, T]
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    probs = scores.masked_fill(~same_seq[None], float("-inf")).softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v.float()).to(q.dtype)


def fake_varlen_torch_2_11(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None
):
    """torch 2.10/2.11 signature (no scale: the kernel's default 1/sqrt(D))."""
    assert not is_causal and return_aux is None
    return _block_diagonal_attention(query, key, value, cu_seq_q, query.shape[-1] ** -0.5)


def fake_varlen_torch_2_13(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1),
    enable_gqa=False, seqused_k=None, block_table=None, num_splits=None,
):  # fmt: skip
    """torch 2.13 signature (keyword-only scale, window_size, num_splits)."""
    assert scale == pytest.approx(query.shape[-1] ** -0.5) and window_size == (-1, -1)
    assert torch.equal(cu_seq_q, cu_seq_k) and max_q == max_k == int(torch.diff(cu_seq_q).max())
    return _block_diagonal_attention(query, key, value, cu_seq_q, scale)


def backend_cases():
    """(id, backend, dtype, device) for every backend runnable here."""
    cases = [
        ("sdpa_per_seq", SDPABackend("per_seq"), torch.float32, "cpu"),
        ("sdpa_mask", SDPABackend("mask"), torch.float32, "cpu"),
        (
            "flash_attn_torch2.11_sig",
            FlashAttnBackend(varlen_fn=fake_varlen_torch_2_11),
            torch.bfloat16,
            "cpu",
        ),
        (
            "flash_attn_torch2.13_sig",
            FlashAttnBackend(varlen_fn=fake_varlen_torch_2_13),
            torch.bfloat16,
            "cpu",
        ),
    ]
    if HAS_CUDA:
        cases += [
            ("sdpa_per_seq_cuda", SDPABackend("per_seq"), torch.bfloat16, "cuda"),
            ("flash_attn_cuda", FlashAttnBackend(), torch.bfloat16, "cuda"),
        ]
    return cases


@pytest.mark.parametrize("spec", BATCH_SPECS, ids=lambda s: s.name)
@pytest.mark.parametrize("case", backend_cases(), ids=lambda c: c[0])
def test_packed_backend_matches_per_sequence_reference(case, spec):
    _, backend, dtype, device = case
    seq_lens = seq_lens_of(spec)
    q, k, v = packed_qkv(seq_lens, dtype=dtype, device=device)
    metadata = build_varlen_metadata(seq_lens, device=device)
    out = backend.forward(q, k, v, metadata)
    ref = reference_packed(q.float().cpu(), k.float().cpu(), v.float().cpu(), seq_lens)
    # fp32: tight; half precision: at most 2x the error of rounding the reference itself to that dtype
    own_err = (ref.to(dtype).float() - ref).abs().max().item()
    assert out.shape == q.shape and out.dtype == dtype
    assert (out.float().cpu() - ref).abs().max().item() <= max(2 * own_err, 1e-5)


@pytest.mark.parametrize("case", backend_cases(), ids=lambda c: c[0])
def test_dense_backend_with_key_mask(case):
    _, backend, dtype, device = case
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 10, 2, 16, generator=gen).to(device=device, dtype=dtype) for _ in range(3))
    mask = torch.ones(2, 10, dtype=torch.bool, device=device)
    mask[1, 3:7] = False
    out = backend.forward(q, k, v, AttentionMetadata(is_varlen=False, attn_mask=mask))
    for b in range(2):  # a masked key must act exactly like a removed key
        keep = mask[b]
        qs, ks, vs = (x.float().transpose(0, 1)[None] for x in (q[b], k[b][keep], v[b][keep]))  # [1, H, n, D]
        ref = F.scaled_dot_product_attention(qs, ks, vs)[0].transpose(0, 1)  # [S, H, D]
        assert (out[b].float() - ref).abs().max().item() <= (1e-5 if dtype == torch.float32 else 2e-2)


def test_packed_isolation_bit_identical():
    """Changing one sequence's q/k/v leaves the others' outputs bit-identical (every CPU backend)."""
    seq_lens = seq_lens_of(BATCH_SPECS[3])
    for backend in (SDPABackend("per_seq"), SDPABackend("mask")):
        q, k, v = packed_qkv(seq_lens)
        metadata = build_varlen_metadata(seq_lens)
        before = backend.forward(q, k, v, metadata)
        start, end = seq_lens[0], seq_lens[0] + seq_lens[1]
        for x in (q, k, v):
            x[start:end] += 1.0
        after = backend.forward(q, k, v, metadata)
        assert torch.equal(before[:start], after[:start]) and torch.equal(before[end:], after[end:])
        assert not torch.equal(before[start:end], after[start:end])


def test_inconsistent_metadata_raises():
    q, k, v = packed_qkv([3, 4])
    backend = SDPABackend()
    bad_cu = build_varlen_metadata([3, 4])
    bad_cu.cu_seqlens_q = bad_cu.cu_seqlens_k = torch.tensor([0, 2, 7], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens"):
        backend.forward(q, k, v, bad_cu)
    wrong_dtype = build_varlen_metadata([3, 4])
    wrong_dtype.cu_seqlens_q = wrong_dtype.cu_seqlens_q.long()
    with pytest.raises(ValueError, match="int32"):
        backend.forward(q, k, v, wrong_dtype)
    with pytest.raises(ValueError, match="tokens"):
        backend.forward(q[:6], k[:6], v[:6], build_varlen_metadata([3, 4]))
    padded = build_varlen_metadata([3, 4])
    padded.padded_tokens = 2
    with pytest.raises(ValueError, match="padded_tokens"):
        backend.forward(q, k, v, padded)
    with pytest.raises(ValueError, match="max_seqlen_q"):
        backend.forward(q, k, v, dataclasses.replace(build_varlen_metadata([3, 4]), max_seqlen_q=3))
    with pytest.raises(ValueError, match=r"\[B, S, H, D\]"):
        backend.forward(q, k, v, AttentionMetadata(is_varlen=False))


def test_head_size_and_dtype_checks_name_the_fix():
    with pytest.raises(ValueError, match="SDPA"):
        FlashAttnBackend.validate_head_size(12)
    with pytest.raises(ValueError, match="SDPA"):
        FlashAttnBackend.validate_head_size(320)
    FlashAttnBackend.validate_head_size(128)
    SDPABackend.validate_head_size(12)
    with pytest.raises(ValueError, match="dtypes"):
        FlashAttnBackend.validate_dtype(torch.float32)
    fake = FlashAttnBackend(varlen_fn=fake_varlen_torch_2_13)
    q, k, v = packed_qkv([5], head_dim=12, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="head_dim=12"):
        fake.forward(q, k, v, build_varlen_metadata([5]))


def test_backend_without_varlen_is_refused_for_packed():
    class DenseOnly(AttentionBackend):
        name = "DENSE_ONLY"
        supported_dtypes = (torch.float32,)
        supported_devices = ("cpu",)

        def forward(self, q, k, v, metadata):
            self.check_inputs(q, k, v, metadata)
            return q

    q, k, v = packed_qkv([2, 3])
    with pytest.raises(ValueError, match="cannot keep packed sequences apart.*SDPA"):
        DenseOnly().forward(q, k, v, build_varlen_metadata([2, 3]))


def test_selection(monkeypatch):
    monkeypatch.delenv("DIFFUSION_ATTENTION_BACKEND", raising=False)
    for name in ("SDPA", "sdpa", "Torch_Sdpa"):
        assert isinstance(get_attn_backend(name, "cpu", 128), SDPABackend)
    assert isinstance(get_attn_backend(None, "cpu", 128), SDPABackend)  # CPU default
    with pytest.raises(ValueError, match="SDPA"):
        get_attn_backend("flash_attn", "cpu", 128)
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_attn_backend("XFORMERS", "cpu", 128)
    monkeypatch.setenv("DIFFUSION_ATTENTION_BACKEND", "FLASH_ATTN")
    with pytest.raises(ValueError, match="SDPA"):  # env honoured when no name is passed
        get_attn_backend(None, "cpu", 128)
    assert isinstance(get_attn_backend("SDPA", "cpu", 128), SDPABackend)  # explicit name wins
    if HAS_CUDA:
        monkeypatch.delenv("DIFFUSION_ATTENTION_BACKEND")
        assert isinstance(get_attn_backend(None, "cuda", 128, dtype=torch.bfloat16), AutoAttentionBackend)
        assert isinstance(get_attn_backend(None, "cuda", 128, dtype=torch.float32), SDPABackend)


def test_varlen_kwargs_adapt_to_this_torch():
    assert varlen_kwargs(fake_varlen_torch_2_11, 0.25, None) == {"is_causal": False}
    assert varlen_kwargs(fake_varlen_torch_2_13, 0.25, 1) == {"scale": 0.25, "num_splits": 1}
    with pytest.raises(ValueError, match="num_splits"):
        varlen_kwargs(fake_varlen_torch_2_11, 0.25, 1)
    varlen = pytest.importorskip("torch.nn.attention.varlen")
    params = inspect.signature(varlen.varlen_attn).parameters
    kwargs = varlen_kwargs(varlen.varlen_attn, 0.25, None)
    assert set(kwargs) <= set(params) and kwargs.get("is_causal", False) is False


def test_auto_chooses_per_batch_without_device_reads():
    """AUTO without FA3: one varlen call for many short sequences, per-sequence SDPA for few long ones,
    SDPA dense (FA3's share of the choice: the next test)."""
    auto = AutoAttentionBackend(use_fa3=False)  # on a Hopper GPU with fa3-fwd the default takes FA3
    assert auto.choose(build_varlen_metadata([320] * 16)) is auto.varlen
    assert auto.choose(build_varlen_metadata([4160, 3136, 1088])) is auto.per_sequence
    assert auto.choose(AttentionMetadata(is_varlen=False)) is auto.per_sequence
    with pytest.raises(ValueError, match="SDPA"):
        get_attn_backend("AUTO", "cpu", 128)  # needs a CUDA varlen kernel


def test_auto_takes_fa3_for_long_batches_and_inside_graphs():
    """With an FA3 kernel present: FA3 for >= 4096 tokens of long sequences and for every graph."""
    from vllm_omni.diffusion.attention.backends.fa3 import FlashAttn3Backend

    fa3 = FlashAttn3Backend(varlen_fn=lambda *a, **k: None)
    auto = AutoAttentionBackend(fa3=fa3)
    assert auto.choose(build_varlen_metadata([320] * 16)) is auto.varlen
    assert auto.choose(build_varlen_metadata([1088, 1088])) is auto.per_sequence
    assert auto.choose(build_varlen_metadata([4160, 4110])) is fa3
    assert auto.choose(build_varlen_metadata([1088] * 4)) is fa3
    graph = build_varlen_metadata([320] * 16)
    graph.for_graph = True
    assert auto.choose(graph) is fa3
    no_fa3 = AutoAttentionBackend(fa3=fa3, use_fa3=False)
    assert no_fa3.fa3 is None and no_fa3.choose(graph) is no_fa3.varlen
    # dense [B, S] calls: FA3 by the same rule, only without a key mask
    dense, masked = AttentionMetadata(is_varlen=False), AttentionMetadata(is_varlen=False, attn_mask=True)
    assert auto.choose(dense, (2, 4160)) is fa3 and auto.choose(dense, (1, 6953)) is fa3
    assert auto.choose(dense, (1, 4160)) is fa3 and auto.choose(dense, (8, 320)) is auto.per_sequence
    assert (
        auto.choose(dense, (2, 1088)) is auto.per_sequence
        and auto.choose(masked, (2, 4160)) is auto.per_sequence
    )
    assert no_fa3.choose(dense, (2, 4160)) is no_fa3.per_sequence


def test_fa3_runs_unmasked_dense_calls_as_packed_sequences():
    """A dense [B, S] call reaches the varlen kernel as B sequences of S and equals SDPA's dense
    result (the fake kernel is per-sequence SDPA over the boundaries it is given)."""
    from vllm_omni.diffusion.attention.backends.fa3 import FlashAttn3Backend
    from vllm_omni.diffusion.attention.backends.sdpa import sdpa_dense, sdpa_packed_per_seq

    def per_sequence(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs):
        assert torch.equal(cu_q, cu_k) and cu_q.dtype == torch.int32 and max_q == max_k == 5
        return sdpa_packed_per_seq(q, k, v, cu_q.diff().tolist())

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 5, 2, 16, generator=gen).bfloat16() for _ in range(3))  # its dtypes
    out = FlashAttn3Backend(varlen_fn=per_sequence).forward(q, k, v, AttentionMetadata(is_varlen=False))
    torch.testing.assert_close(out, sdpa_dense(q, k, v, None), atol=1e-2, rtol=1e-2)
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[1, 3:] = False  # a key mask goes to SDPA, which applies it
    masked = FlashAttn3Backend(varlen_fn=per_sequence).forward(
        q, k, v, AttentionMetadata(is_varlen=False, attn_mask=mask)
    )
    assert torch.equal(masked, sdpa_dense(q, k, v, mask))


def test_fa3_backend_passes_flash_attn_arguments():
    from vllm_omni.diffusion.attention.backends.fa3 import FlashAttn3Backend

    seen = {}

    def fake(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs):
        seen.update(cu=cu_q.tolist(), max=(max_q, max_k), **kwargs)
        return q * 2

    q = torch.randn(7, 2, 16, dtype=torch.bfloat16)
    out = FlashAttn3Backend(varlen_fn=fake).forward(q, q, q, build_varlen_metadata([3, 4]))
    assert torch.equal(out, q * 2) and seen["cu"] == [0, 3, 7] and seen["max"] == (4, 4)
    assert seen["causal"] is False and seen["num_splits"] == 1 and seen["softmax_scale"] == 0.25
    assert not FlashAttn3Backend.is_available(torch.device("cpu"))
    with pytest.raises(ValueError, match="CUDA"):
        get_attn_backend("FLASH_ATTN_3", "cpu", 128)


# ---- cross lengths: queries over more keys than themselves (Qwen-Image-2.1's cached prefix) ----


def reference_cross(q, k, v, q_lens, kv_lens):
    """Sequence i's queries over its own keys/values, per sequence, written here."""
    outs, q0, k0 = [], 0, 0
    for n, m in zip(q_lens, kv_lens):
        qs = q[q0 : q0 + n].transpose(0, 1)[None]  # [1, H, n, D]
        ks, vs = (x[k0 : k0 + m].transpose(0, 1)[None] for x in (k, v))  # [1, H, m, D]
        outs.append(F.scaled_dot_product_attention(qs, ks, vs)[0].transpose(0, 1))
        q0, k0 = q0 + n, k0 + m
    return torch.cat(outs)


def fake_cross_varlen(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs):
    """A varlen kernel written as masked attention from the two boundary lists it is given."""
    q_ids = torch.repeat_interleave(torch.arange(cu_q.numel() - 1), torch.diff(cu_q.cpu()))
    k_ids = torch.repeat_interleave(torch.arange(cu_k.numel() - 1), torch.diff(cu_k.cpu()))
    assert max_q == int(torch.diff(cu_q).max()) and max_k == int(torch.diff(cu_k).max())
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * q.shape[-1] ** -0.5
    probs = scores.masked_fill(q_ids[:, None] != k_ids[None, :], float("-inf")).softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v.float()).to(q.dtype)


def cross_backend_cases():
    from vllm_omni.diffusion.attention.backends.fa3 import FlashAttn3Backend

    cases = [
        ("sdpa_per_seq", SDPABackend("per_seq"), torch.float32, "cpu"),
        ("sdpa_mask", SDPABackend("mask"), torch.float32, "cpu"),
        ("flash_attn_plumbing", FlashAttnBackend(varlen_fn=fake_cross_varlen), torch.bfloat16, "cpu"),
        ("fa3_plumbing", FlashAttn3Backend(varlen_fn=fake_cross_varlen), torch.bfloat16, "cpu"),
    ]
    if HAS_CUDA:
        cases += [("sdpa_per_seq_cuda", SDPABackend("per_seq"), torch.bfloat16, "cuda")]
        if FlashAttnBackend.is_available(torch.device("cuda")):
            cases += [("flash_attn_cuda", FlashAttnBackend(), torch.bfloat16, "cuda")]
        if FlashAttn3Backend.is_available(torch.device("cuda")):
            cases += [("fa3_cuda", FlashAttn3Backend(), torch.bfloat16, "cuda")]
    return cases


@pytest.mark.parametrize("case", cross_backend_cases(), ids=lambda c: c[0])
def test_cross_length_varlen_keeps_each_sequence_to_its_own_keys(case):
    """q lengths [5, 9, 1] over kv lengths [12, 9, 30] (a prefix before each sequence's own rows):
    every backend equals the per-sequence reference, with `cu_seqlens_q != cu_seqlens_k`."""
    _, backend, dtype, device = case
    q_lens, kv_lens = [5, 9, 1], [12, 9, 30]
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(sum(q_lens), 3, 16, generator=gen).to(device=device, dtype=dtype)
    k, v = (torch.randn(sum(kv_lens), 3, 16, generator=gen).to(device=device, dtype=dtype) for _ in range(2))
    metadata = build_varlen_metadata(q_lens, device=device, kv_seq_lens=kv_lens)
    assert not torch.equal(metadata.cu_seqlens_q, metadata.cu_seqlens_k)
    out = backend.forward(q, k, v, metadata)
    ref = reference_cross(q.float().cpu(), k.float().cpu(), v.float().cpu(), q_lens, kv_lens)
    own_err = (ref.to(dtype).float() - ref).abs().max().item()
    assert out.shape == q.shape and (out.float().cpu() - ref).abs().max().item() <= max(2 * own_err, 1e-5)


def test_cross_length_metadata_is_checked():
    q = torch.randn(6, 2, 16)
    kv = torch.randn(10, 2, 16)
    with pytest.raises(ValueError, match="k has 10 tokens but the sequences hold 11"):
        SDPABackend().forward(q, kv, kv, build_varlen_metadata([2, 4], kv_seq_lens=[5, 6]))
    with pytest.raises(ValueError, match="kv_seq_lens has 1 lengths for 2 sequences"):
        SDPABackend().forward(q, kv, kv, build_varlen_metadata([2, 4], kv_seq_lens=[10]))
    with pytest.raises(ValueError, match="must have one shape"):  # self-attention still needs one shape
        SDPABackend().forward(q, kv, kv, build_varlen_metadata([2, 4]))

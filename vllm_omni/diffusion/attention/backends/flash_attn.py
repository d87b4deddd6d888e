"""FLASH_ATTN backend: one varlen kernel call for the whole packed buffer (CUDA only).

Kernel, in order of preference:
  1. `flash_attn.flash_attn_varlen_func` (the flash-attn package), when importable;
  2. `torch.nn.attention.varlen.varlen_attn` (torch >= 2.10, FA2 inside torch).

torch's `varlen_attn` changed its signature between releases (2.10/2.11: `is_causal` positional
keyword, no `scale`; 2.13: keyword-only `scale`, `window_size`, `num_splits`, ...). `_varlen_kwargs`
reads the signature once with `inspect` and passes only what this torch accepts; the seven leading
arguments (q, k, v, cu_seq_q, cu_seq_k, max_q, max_k) are positional in every release.

Dense `[B, S, H, D]`: `flash_attn_func` without a mask when flash-attn is installed, else SDPA (which
picks flash/cuDNN kernels on CUDA itself); a key mask always goes through SDPA.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from typing import ClassVar

import torch

from vllm_omni.diffusion.attention.backends.base import AttentionBackend
from vllm_omni.diffusion.attention.backends.sdpa import sdpa_dense
from vllm_omni.diffusion.attention.metadata import AttentionMetadata


@functools.cache
def _flash_attn_module():
    """The flash-attn package, or None."""
    try:
        import flash_attn
    except ImportError:
        return None
    return flash_attn


@functools.cache
def _torch_varlen_attn() -> Callable | None:
    """`torch.nn.attention.varlen.varlen_attn`, or None on torch without it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@functools.cache
def _param_names(fn: Callable) -> frozenset[str]:
    """Parameter names of `fn` (cached: inspect is too slow for every layer of every forward)."""
    return frozenset(inspect.signature(fn).parameters)


def varlen_kwargs(fn: Callable, softmax_scale: float, num_splits: int | None) -> dict:
    """Keyword arguments for torch's `varlen_attn` that this torch release accepts.

    Non-causal full attention with scale 1/sqrt(D) in every version; `num_splits=1` (batch invariance:
    the reduction order of a sequence does not depend on the longest sequence in the batch) only when
    asked for and supported.
    """
    params = _param_names(fn)
    kwargs: dict = {}
    if "is_causal" in params:
        kwargs["is_causal"] = False
    if "causal" in params:
        kwargs["causal"] = False
    if "scale" in params:
        kwargs["scale"] = softmax_scale
    elif "softmax_scale" in params:
        kwargs["softmax_scale"] = softmax_scale
    if num_splits is not None:
        if "num_splits" not in params:
            raise ValueError(
                "batch-invariant varlen attention needs torch's varlen_attn(num_splits=...) "
                "(torch >= 2.13); use attention_backend='SDPA' for batch-invariant mode on this torch"
            )
        kwargs["num_splits"] = num_splits
    return kwargs


class FlashAttnBackend(AttentionBackend):
    """Varlen flash attention (flash-attn package or torch's built-in FA2) on CUDA."""

    name: ClassVar[str] = "FLASH_ATTN"
    supports_varlen: ClassVar[bool] = True
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float16, torch.bfloat16)
    supported_devices: ClassVar[tuple[str, ...]] = ("cuda",)
    min_head_size: ClassVar[int] = 8
    max_head_size: ClassVar[int] = 256
    head_size_multiple: ClassVar[int] = 8

    def __init__(self, batch_invariant: bool = False, varlen_fn: Callable | None = None):
        """`batch_invariant`: fixed split-KV (num_splits=1) so a sequence's output does not depend on
        the rest of the batch. `varlen_fn`: override the kernel (tests; a torch-style signature)."""
        self.batch_invariant = batch_invariant
        self._varlen_fn = varlen_fn

    @classmethod
    def is_available(cls, device: torch.device) -> bool:
        has_kernel = _flash_attn_module() is not None or _torch_varlen_attn() is not None
        return device.type == "cuda" and torch.cuda.is_available() and has_kernel

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> str:
        if device.type != "cuda" or not torch.cuda.is_available():
            return f"it needs a CUDA device, got {device.type}"
        return "neither flash_attn nor torch.nn.attention.varlen (torch >= 2.10) is importable"

    def validate_batch_invariance(self) -> None:
        """Raise ValueError (naming SDPA) at selection time when batch invariance was asked for and
        the installed torch's varlen_attn cannot fix its split-KV (no `num_splits`)."""
        if self.batch_invariant and _flash_attn_module() is None and _torch_varlen_attn() is not None:
            varlen_kwargs(self._varlen_fn or _torch_varlen_attn(), 1.0, 1)

    def check_device(self, device: torch.device) -> None:
        if self._varlen_fn is None:  # an injected kernel runs wherever its author meant it to
            super().check_device(device)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        self.check_inputs(q, k, v, metadata)
        if metadata.is_varlen:
            return self._forward_varlen(q, k, v, metadata)
        fa = _flash_attn_module()
        if metadata.attn_mask is None and fa is not None:
            return fa.flash_attn_func(q, k, v, dropout_p=0.0, causal=False)
        return sdpa_dense(q, k, v, metadata.attn_mask)

    def _forward_varlen(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        # [total_tokens, H, D] in, [total_tokens, H, D] out
        scale = 1.0 / math.sqrt(q.shape[-1])
        cu_q, cu_k = metadata.cu_seqlens_q, metadata.cu_seqlens_k
        fa = _flash_attn_module() if self._varlen_fn is None else None
        if fa is not None:
            # FA2's varlen forward never splits KV; FA3-style builds expose num_splits.
            has_splits = "num_splits" in _param_names(fa.flash_attn_varlen_func)
            extra = {"num_splits": 1} if self.batch_invariant and has_splits else {}
            return fa.flash_attn_varlen_func(
                q, k, v, cu_q, cu_k, metadata.max_seqlen_q, metadata.max_seqlen_k,
                dropout_p=0.0, softmax_scale=scale, causal=False, **extra,
            )  # fmt: skip
        fn = self._varlen_fn or _torch_varlen_attn()
        kwargs = varlen_kwargs(fn, scale, 1 if self.batch_invariant else None)
        return fn(q, k, v, cu_q, cu_k, metadata.max_seqlen_q, metadata.max_seqlen_k, **kwargs)

    def __repr__(self) -> str:
        return f"FlashAttnBackend(batch_invariant={self.batch_invariant})"

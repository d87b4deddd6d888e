"""The attention backend interface: one small class per kernel family.

A backend takes q/k/v in flash-attn's layout and an `AttentionMetadata`:

    dense   q, k, v: [B, S, H, D]       metadata.is_varlen False, optional key mask attn_mask [B, S]
    packed  q, k, v: [total_tokens, H, D]  metadata.is_varlen True, cu_seqlens int32 [num_seqs + 1]

and returns `out` shaped like q. Softmax scale is 1/sqrt(D); attention is non-causal.

Each capability below is a class attribute with the silent failure it prevents; `check_inputs` turns
every violated capability into a ValueError that names the fix, so a wrong backend fails loudly at the
first call instead of producing plausible-looking garbage.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from vllm_omni.diffusion.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    """A kernel family that computes non-causal softmax attention, dense and/or packed."""

    name: ClassVar[str] = ""
    """Canonical name accepted by `get_attn_backend` (case-insensitive)."""

    supports_varlen: ClassVar[bool] = False
    """Can attend over packed sequences described by cu_seqlens without mixing them.

    Prevents: a backend that ignores cu_seqlens treating the whole packed buffer as one sequence,
    so every request silently attends to every other request's tokens."""

    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = ()
    """Activation dtypes the kernel computes correctly.

    Prevents: a kernel silently upcasting/downcasting (or reading fp32 memory as half), which gives
    results that look plausible but differ from the reference."""

    supported_devices: ClassVar[tuple[str, ...]] = ()
    """Device types (`torch.device.type`) the kernel runs on.

    Prevents: a CUDA-only kernel being picked on CPU and failing deep inside a forward, or a fallback
    path being taken silently and measured as if it were the fast kernel."""

    min_head_size: ClassVar[int] = 1
    max_head_size: ClassVar[int] = 1 << 30
    head_size_multiple: ClassVar[int] = 1
    """Head sizes the kernel takes: `min <= D <= max` and `D % multiple == 0`.

    Prevents: kernels that pad or truncate unsupported head sizes internally (wrong results or
    out-of-bounds reads) instead of refusing them."""

    @classmethod
    def is_available(cls, device: torch.device) -> bool:
        """Whether the kernel can run on `device` in this process (imports, device type)."""
        return device.type in cls.supported_devices

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> str:
        """Why `is_available(device)` is False (used in error messages)."""
        return f"{cls.name} runs on {list(cls.supported_devices)}, not on {device.type}"

    @classmethod
    def validate_available(cls, device: torch.device) -> None:
        """Raise ValueError naming SDPA when the kernel cannot run on `device`."""
        if not cls.is_available(device):
            raise ValueError(
                f"attention backend {cls.name} is not available: {cls.unavailable_reason(device)}; "
                "use attention_backend='SDPA' (or DIFFUSION_ATTENTION_BACKEND=SDPA)"
            )

    @classmethod
    def supports_head_size(cls, head_dim: int) -> bool:
        return cls.min_head_size <= head_dim <= cls.max_head_size and head_dim % cls.head_size_multiple == 0

    @classmethod
    def validate_head_size(cls, head_dim: int) -> None:
        """Raise ValueError naming the fix when the kernel cannot take heads of size `head_dim`."""
        if not cls.supports_head_size(head_dim):
            raise ValueError(
                f"attention backend {cls.name} supports head sizes {cls.min_head_size}..{cls.max_head_size} "
                f"that are multiples of {cls.head_size_multiple}, got head_dim={head_dim}; "
                "use attention_backend='SDPA', which takes any head size"
            )

    @classmethod
    def validate_dtype(cls, dtype: torch.dtype) -> None:
        """Raise ValueError naming the fix when the kernel cannot compute in `dtype`."""
        if dtype not in cls.supported_dtypes:
            names = [str(d).removeprefix("torch.") for d in cls.supported_dtypes]
            raise ValueError(
                f"attention backend {cls.name} supports dtypes {names}, got {dtype}; "
                "cast the model to one of them or use attention_backend='SDPA'"
            )

    def check_inputs(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: AttentionMetadata
    ) -> None:
        """Raise ValueError when q/k/v or metadata do not fit this backend (cheap: no device sync
        after the metadata's first validation)."""
        cross = metadata.is_varlen and metadata.kv_seq_lens is not None
        if k.shape != v.shape or (q.shape[1:] != k.shape[1:] if cross else q.shape != k.shape):
            what = "q's heads and head size, and k, v one shape" if cross else "one shape"
            raise ValueError(
                f"q, k, v must have {what}, got {list(q.shape)}, {list(k.shape)}, {list(v.shape)}"
            )
        if metadata.is_varlen:
            if not self.supports_varlen:
                raise ValueError(
                    f"attention backend {self.name} cannot keep packed sequences apart (no varlen); "
                    "use attention_backend='SDPA' or 'FLASH_ATTN'"
                )
            if q.dim() != 3:
                raise ValueError(f"packed q/k/v must be [total_tokens, H, D], got {list(q.shape)}")
            if metadata.padded_tokens != 0:
                raise ValueError(f"varlen attention needs padded_tokens == 0, got {metadata.padded_tokens}")
            metadata.validate(q.shape[0])
            if k.shape[0] != metadata.total_tokens_k:
                total_k = metadata.total_tokens_k
                raise ValueError(f"k has {k.shape[0]} tokens but the sequences hold {total_k}")
        else:
            if q.dim() != 4:
                raise ValueError(f"dense q/k/v must be [B, S, H, D], got {list(q.shape)}")
            mask = metadata.attn_mask
            if mask is not None and (mask.dtype != torch.bool or tuple(mask.shape) != tuple(q.shape[:2])):
                raise ValueError(
                    f"attn_mask must be bool [B, S] = {list(q.shape[:2])}, "
                    f"got {mask.dtype} {list(mask.shape)}"
                )
        self.validate_head_size(q.shape[-1])
        self.validate_dtype(q.dtype)
        self.check_device(q.device)

    def check_device(self, device: torch.device) -> None:
        """Raise ValueError naming SDPA when the activations live on a device this kernel cannot use."""
        if device.type not in self.supported_devices:
            self.validate_available(device)

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """Attention of q over k/v: dense [B, S, H, D] or packed [total_tokens, H, D]; returns q's shape."""

    def __call__(self, q, k, v, metadata: AttentionMetadata) -> torch.Tensor:
        return self.forward(q, k, v, metadata)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

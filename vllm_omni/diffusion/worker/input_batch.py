"""The step's input batch: which sequences run, and the packing plan for them.

Each request contributes one sequence per image, two with CFG (positive, then
negative). Everything that depends only on the batch *composition* (the
packing layout with its indices, cu_seqlens and RoPE tables, and the text rows)
is built once and reused while the same requests keep running; per step only
the image rows (latents) and the timesteps are gathered.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_omni.diffusion.models.qwen_image.packing import PackedLayout, SequenceSpec, build_packed_layout
from vllm_omni.diffusion.worker.request_state import DiffusionRequestState


@dataclass(frozen=True)
class SequenceRef:
    """Where a packed sequence comes from."""

    req_pos: int
    """Index of the request in the batch."""
    image_index: int
    """Which of the request's `num_outputs_per_prompt` images."""
    is_negative: bool


@dataclass
class InputBatch:
    """Composition-dependent inputs of the packed (or dense) forward."""

    req_ids: tuple[str, ...]
    seq_refs: list[SequenceRef]
    is_homogeneous: bool
    """All sequences have the same image shape: the dense `[B, S, C]` path can run."""
    layout: PackedLayout | None = None
    """Packed path: the layout (built lazily)."""
    txt_rows: torch.Tensor | None = None
    """Packed path: [num_txt_rows, joint_dim], sequences in order."""
    dense_txt: torch.Tensor | None = None
    """Dense path: [num_seqs, max_txt_len, joint_dim], zero padded."""
    dense_txt_mask: torch.Tensor | None = None
    """Dense path: [num_seqs, max_txt_len] long, 1 = real token; None when no text is padded."""

    @property
    def num_seqs(self) -> int:
        return len(self.seq_refs)

    @staticmethod
    def composition_key(states: list[DiffusionRequestState]) -> tuple[str, ...]:
        return tuple(s.req_id for s in states)

    @classmethod
    def build(cls, states: list[DiffusionRequestState]) -> InputBatch:
        refs = []
        for pos, state in enumerate(states):
            for k in range(state.num_images):
                refs.append(SequenceRef(pos, k, False))
                if state.do_cfg:
                    refs.append(SequenceRef(pos, k, True))
        shapes = {(s.img_shape, s.cond_shapes) for s in states}
        # NOTE(edit): the dense forward takes one grid per item, so edit batches always pack.
        is_homogeneous = len(shapes) == 1 and all(s.cond_latents is None for s in states)
        return cls(req_ids=cls.composition_key(states), seq_refs=refs, is_homogeneous=is_homogeneous)

    def _text(self, states: list[DiffusionRequestState], ref: SequenceRef) -> torch.Tensor:
        state = states[ref.req_pos]
        return state.negative_prompt_embeds if ref.is_negative else state.prompt_embeds

    def prepare_packed(self, states: list[DiffusionRequestState], axes_dims_rope, device) -> None:
        """Build the packing layout and text rows once for this composition."""
        if self.layout is not None:
            return
        specs = []
        for ref in self.seq_refs:
            state = states[ref.req_pos]
            specs.append(
                SequenceSpec(
                    num_txt_tokens=self._text(states, ref).shape[0],
                    img_shape=state.img_shape,
                    req_id=state.req_id,
                    is_negative=ref.is_negative,
                    cond_shapes=state.cond_shapes,
                )
            )
        self.layout = build_packed_layout(specs, axes_dims_rope=tuple(axes_dims_rope), device=device)
        self.txt_rows = torch.cat([self._text(states, ref) for ref in self.seq_refs], dim=0)

    def prepare_dense(self, states: list[DiffusionRequestState]) -> None:
        """Build the padded text batch and mask once for this composition."""
        if self.dense_txt is not None:
            return
        texts = [self._text(states, ref) for ref in self.seq_refs]
        max_len = max(t.shape[0] for t in texts)
        padded = texts[0].new_zeros(len(texts), max_len, texts[0].shape[1])
        mask = torch.zeros(len(texts), max_len, dtype=torch.long, device=texts[0].device)
        for i, t in enumerate(texts):
            padded[i, : t.shape[0]] = t
            mask[i, : t.shape[0]] = 1
        # Equal lengths need no mask, which lets SDPA pick its fastest (mask-free) kernel.
        same_len = all(t.shape[0] == max_len for t in texts)
        self.dense_txt, self.dense_txt_mask = padded, (None if same_len else mask)

    def gather_latents(self, states: list[DiffusionRequestState]) -> list[torch.Tensor]:
        """Each sequence's image-stream rows in sequence order: its current latents [num_img_tokens, 64],
        followed by the request's condition latents for edit models."""
        rows = []
        for ref in self.seq_refs:
            state = states[ref.req_pos]
            latents = state.latents[ref.image_index]
            rows.append(latents if state.cond_latents is None else torch.cat([latents, state.cond_latents]))
        return rows

    def timesteps(self, states: list[DiffusionRequestState], dtype: torch.dtype) -> torch.Tensor:
        """Per-sequence timestep [num_seqs] (each request at its own step of its own schedule)."""
        per_req = [s.timestep(dtype) for s in states]
        return torch.stack([per_req[ref.req_pos] for ref in self.seq_refs])

"""The persistent input batch: one slot per running request, and the step plan built from the slots.

Requests take a slot when they are admitted and give it back when they end (vLLM v1's persistent
batch). The slots own the only mutable per-step data, the latents: every running request's latents
live in one packed buffer, and each request's `latents` is a view into it, so the solver updates all
of them with one vectorised call and the forward reads them without a per-request gather:

    latent_buf [num_latent_rows, 64]:  | slot 0: img 0 | slot 0: img 1 | slot 2: img 0 | ...
    sequences (forward order):         | s0 pos | s0 neg | s0' pos | s0' neg | s2 pos | ...
    latent_rows[j]:   the plan's latent rows in latent_buf (all of them, in order, unless some
                      running requests sit the step out: the latency policy's preemption)
    seq_src_rows[r]:  latent row that forward image row r reads (a CFG image appears twice)
                      of [latent_buf ; plan.cond_buf]: an edit sequence's image rows are its target
                      (latent) rows, then its request's condition rows (cond_buf, after latent_buf)
    pos_rows[j]:      forward row holding plan latent row j's positive (or only) prediction
    neg_rows[c]:      forward row holding CFG plan latent row cfg_rows[c]'s negative prediction
    (j and cfg_rows index the plan's latent rows, i.e. latent_buf[latent_rows])

Everything that depends only on which slots run (the sequence list, these indices, the packing
layout with its cu_seqlens and RoPE tables, the text rows) is a `StepPlan`, rebuilt only when a slot
changes (`version`), never looked up by request ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_omni.diffusion.layout import PackedLayout, PositionTables, SequenceSpec, build_packed_layout
from vllm_omni.diffusion.worker.request_state import DiffusionRequestState


@dataclass(frozen=True)
class SequenceRef:
    """Where a packed sequence comes from."""

    req_pos: int
    """Index of the request in the plan (slot order)."""
    image_index: int
    """Which of the request's `num_outputs_per_prompt` images."""
    is_negative: bool


def _device_index(values, device: torch.device) -> torch.Tensor:
    """int64 host values -> device tensor (pinned, non-blocking on CUDA)."""
    t = torch.as_tensor(np.asarray(values, dtype=np.int64))
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


@dataclass
class StepPlan:
    """What one composition of running requests needs for its forwards; see the module docstring."""

    states: list[DiffusionRequestState]
    """The running requests, in slot order."""
    seq_refs: list[SequenceRef]
    is_homogeneous: bool
    """All sequences have the same image shape: the dense `[B, S, C]` path can run."""
    seq_src_rows: torch.Tensor
    """int64 [num_fwd_img_rows]: row of `latent_buf` (or, after it, of `cond_buf`) of every forward
    image row."""
    latent_rows: torch.Tensor | None
    """int64 [num_plan_latent_rows]: the plan's rows of `latent_buf`; None when the plan holds every
    slot (then the plan's latent rows are `latent_buf` itself, in order)."""
    pos_rows: torch.Tensor
    """int64 [num_plan_latent_rows]: forward row of every plan latent row's positive prediction."""
    cfg_rows: torch.Tensor
    """int64 [num_cfg_rows]: plan latent rows of CFG requests."""
    neg_rows: torch.Tensor
    """int64 [num_cfg_rows]: forward rows of their negative predictions."""
    cfg_scale_rows: torch.Tensor
    """fp32 [num_cfg_rows, 1]: each CFG row's request scale."""
    cfg_normalize_rows: torch.Tensor | None
    """bool [num_cfg_rows, 1], or None when every CFG request normalises (Qwen-Image's default)."""
    latent_row_req: torch.Tensor
    """int64 [num_plan_latent_rows]: request (plan position) of every plan latent row."""
    seq_req: list[int]
    """Host: request (plan position) of every sequence."""
    cond_buf: torch.Tensor | None = None
    """Edit models: [num_cond_rows, 64] condition latents of the plan's requests (read after latent_buf
    through `seq_src_rows`); None when no request has a condition image."""
    seq_num_rows: list[int] = field(default_factory=list)
    """Host: forward image rows of every sequence (target + condition)."""
    layout: PackedLayout | None = None
    txt_rows: torch.Tensor | None = None
    """Packed path: [num_txt_rows, joint_dim], sequences in order."""
    dense_txt: torch.Tensor | None = None
    """Dense path: [num_seqs, max_txt_len, joint_dim], zero padded."""
    dense_txt_mask: torch.Tensor | None = None
    """Dense path: [num_seqs, max_txt_len] long, 1 = real token; None when no text is padded."""

    @property
    def num_seqs(self) -> int:
        return len(self.seq_refs)

    def image_rows(self, latent_buf: torch.Tensor) -> torch.Tensor:
        """Forward image rows [num_fwd_img_rows, 64]: each sequence's latents (+ condition rows)."""
        source = latent_buf if self.cond_buf is None else torch.cat([latent_buf, self.cond_buf])
        return source.index_select(0, self.seq_src_rows)

    @property
    def img_shapes(self) -> list[tuple[int, int, int]]:
        """(frames, h, w) of every sequence."""
        return [self.states[r.req_pos].img_shape for r in self.seq_refs]

    def text_of(self, ref: SequenceRef) -> torch.Tensor:
        state = self.states[ref.req_pos]
        return state.negative_prompt_embeds if ref.is_negative else state.prompt_embeds

    def prepare_packed(self, positions: PositionTables, device: torch.device) -> None:
        """Build the packing layout and text rows once for this composition."""
        if self.layout is not None:
            return
        specs = []
        for ref in self.seq_refs:
            state = self.states[ref.req_pos]
            num_txt = self.text_of(ref).shape[0]
            spec = SequenceSpec(
                num_txt,
                state.img_shape,
                req_id=state.req_id,
                is_negative=ref.is_negative,
                cond_shapes=state.cond_shapes,
            )
            specs.append(spec)
        self.layout = build_packed_layout(specs, positions, device=device)
        self.txt_rows = torch.cat([self.text_of(ref) for ref in self.seq_refs], dim=0)

    def prepare_dense(self) -> None:
        """Build the padded text batch and mask once for this composition."""
        if self.dense_txt is not None:
            return
        texts = [self.text_of(ref) for ref in self.seq_refs]
        max_len = max(t.shape[0] for t in texts)
        padded = texts[0].new_zeros(len(texts), max_len, texts[0].shape[1])
        mask = torch.zeros(len(texts), max_len, dtype=torch.long, device=texts[0].device)
        for i, t in enumerate(texts):
            padded[i, : t.shape[0]] = t
            mask[i, : t.shape[0]] = 1
        # Equal lengths need no mask, which lets SDPA pick its fastest (mask-free) kernel.
        same_len = all(t.shape[0] == max_len for t in texts)
        self.dense_txt, self.dense_txt_mask = padded, (None if same_len else mask)


@dataclass
class InputBatch:
    """Fixed-capacity slots of running requests plus their packed latent buffer.

    `add_request` / `remove_request` change the slots and bump `version`; `plan()` returns the cached
    `StepPlan` until the next change. NOTE(runner): a request's `latents` must only be updated in
    place (or through `latent_buf`) while it holds a slot; `_repack` re-points them on every change.
    """

    max_num_reqs: int
    device: torch.device
    slots: list[DiffusionRequestState | None] = field(default_factory=list)
    slot_of: dict[str, int] = field(default_factory=dict)
    version: int = 0
    latent_buf: torch.Tensor | None = None
    """[num_latent_rows, 64]: every running request's latents, slot order."""
    _plan: StepPlan | None = None
    _plan_slots: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        self.slots = [None] * self.max_num_reqs

    @property
    def num_reqs(self) -> int:
        return len(self.slot_of)

    def get(self, req_id: str) -> DiffusionRequestState | None:
        slot = self.slot_of.get(req_id)
        return None if slot is None else self.slots[slot]

    def add_request(self, state: DiffusionRequestState) -> int:
        """Put a new request in the lowest free slot; return the slot."""
        if state.req_id in self.slot_of:
            raise ValueError(f"request {state.req_id} already holds slot {self.slot_of[state.req_id]}")
        try:
            slot = self.slots.index(None)
        except ValueError:
            raise RuntimeError(f"all {self.max_num_reqs} slots are taken (max_num_seqs)") from None
        self.slots[slot] = state
        self.slot_of[state.req_id] = slot
        self._changed()
        return slot

    def remove_request(self, req_id: str) -> DiffusionRequestState | None:
        """Free the request's slot; its `latents` become its own tensor again. None if not present."""
        slot = self.slot_of.pop(req_id, None)
        if slot is None:
            return None
        state = self.slots[slot]
        self.slots[slot] = None
        state.latents = state.latents.clone()
        self._changed()
        return state

    def _changed(self) -> None:
        self.version += 1
        self._plan = None
        self._repack()

    def _repack(self) -> None:
        """Move every running request's latents into one fresh packed buffer (slot order)."""
        states = [s for s in self.slots if s is not None]
        if not states:
            self.latent_buf = None
            return
        self.latent_buf = torch.cat([s.latents.reshape(-1, s.latents.shape[-1]) for s in states])
        row = 0
        for s in states:
            n, num_tokens, channels = s.latents.shape
            s.latents = self.latent_buf[row : row + n * num_tokens].view(n, num_tokens, channels)
            row += n * num_tokens

    def plan(self, req_ids) -> StepPlan:
        """The plan for the slots of `req_ids` (the step's requests: all running ones, or a subset
        when the latency policy lets some sit out), in slot order.

        Cached until a slot changes or another subset is asked for; KeyError for an id without a slot.
        """
        slots = tuple(sorted(self.slot_of[r] for r in req_ids))
        if self._plan is None or self._plan_slots != slots:
            self._plan = self._build_plan([self.slots[i] for i in slots])
            self._plan_slots = slots
        return self._plan

    def _buffer_offsets(self) -> dict[str, int]:
        """req_id -> first row of its latents in `latent_buf` (slot order, as `_repack` lays them)."""
        offsets, row = {}, 0
        for state in self.slots:
            if state is not None:
                offsets[state.req_id] = row
                row += state.latents.shape[0] * state.latents.shape[1]
        return offsets

    def _build_plan(self, states: list[DiffusionRequestState]) -> StepPlan:
        refs, seq_src, pos, cfg, neg, scales, normalize, row_req, seq_req = [], [], [], [], [], [], [], [], []
        latent_row = fwd_row = 0
        conds, cond_row = [], 0 if self.latent_buf is None else self.latent_buf.shape[0]
        seq_rows, buf_rows, offsets = [], [], self._buffer_offsets()
        for pos_in_plan, state in enumerate(states):
            n_tok = state.num_img_tokens
            buf_row = offsets[state.req_id]
            cond_rows = np.zeros(0, dtype=np.int64)
            if state.cond_latents is not None:  # edit: read after latent_buf, dropped from the output
                cond_rows = np.arange(cond_row, cond_row + state.cond_latents.shape[0])
                conds.append(state.cond_latents)
                cond_row += state.cond_latents.shape[0]
            n_fwd = n_tok + len(cond_rows)
            for k in range(state.num_images):
                rows = np.arange(latent_row, latent_row + n_tok)  # plan latent rows
                src = np.arange(buf_row + k * n_tok, buf_row + (k + 1) * n_tok)  # rows of latent_buf
                buf_rows.append(src)
                refs.append(SequenceRef(pos_in_plan, k, False))
                seq_src.append(np.concatenate([src, cond_rows]))
                pos.append(np.arange(fwd_row, fwd_row + n_tok))
                seq_req.append(pos_in_plan)
                seq_rows.append(n_fwd)
                fwd_row += n_fwd
                if state.do_cfg:
                    refs.append(SequenceRef(pos_in_plan, k, True))
                    seq_src.append(np.concatenate([src, cond_rows]))
                    cfg.append(rows)
                    neg.append(np.arange(fwd_row, fwd_row + n_tok))
                    scales.append(np.full(n_tok, state.params.true_cfg_scale, dtype=np.float32))
                    normalize.append(np.full(n_tok, bool(state.params.cfg_normalize)))
                    seq_req.append(pos_in_plan)
                    seq_rows.append(n_fwd)
                    fwd_row += n_fwd
                row_req.append(np.full(n_tok, pos_in_plan))
                latent_row += n_tok
        cat = lambda parts, dtype: np.concatenate(parts) if parts else np.zeros(0, dtype)  # noqa: E731
        all_buf_rows = cat(buf_rows, np.int64)
        holds_all = self.latent_buf is not None and np.array_equal(
            all_buf_rows, np.arange(self.latent_buf.shape[0])
        )
        norm_flags = cat(normalize, bool)
        normalize_rows = None
        if not norm_flags.all():
            normalize_rows = torch.from_numpy(norm_flags).view(-1, 1).to(self.device)
        return StepPlan(
            states=states,
            seq_refs=refs,
            # NOTE(edit): the dense forward takes one grid per item, so edit batches always pack
            is_homogeneous=len({s.img_shape for s in states}) == 1 and not conds,
            seq_src_rows=_device_index(cat(seq_src, np.int64), self.device),
            latent_rows=None if holds_all else _device_index(all_buf_rows, self.device),
            pos_rows=_device_index(cat(pos, np.int64), self.device),
            cfg_rows=_device_index(cat(cfg, np.int64), self.device),
            neg_rows=_device_index(cat(neg, np.int64), self.device),
            cfg_scale_rows=torch.from_numpy(cat(scales, np.float32)).view(-1, 1).to(self.device),
            cfg_normalize_rows=normalize_rows,
            latent_row_req=_device_index(cat(row_req, np.int64), self.device),
            seq_req=seq_req,
            cond_buf=torch.cat(conds) if conds else None,
            seq_num_rows=seq_rows,
        )

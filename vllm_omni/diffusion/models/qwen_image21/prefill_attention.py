"""The prefill's block-causal attention over one prefix, in row chunks of bounded score memory.

A prefix of L rows attends to itself once, at admission. One attention call with an [L, L] mask makes
CPU SDPA materialise the whole score matrix, [H, L, L] floats, plus the mask: an edit with 10 reference
images has about 41,000 prefix rows (each reference ~1024 slots x 4 rows), which is ~13 GB of scores
for the tiny model's 2 heads and ~1.7 GB of mask, more for the real model's heads. Query rows are
independent, so the prefill attends in chunks of query rows, each against the keys it can see: a chunk's
scores are at most `PREFILL_SCORE_BYTES`, and its mask is built for the chunk from the rows' block ids,
never for the whole prefix.

    chunk rows [s, e) -> keys [0, kv_end): kv_end = e, or the end of the image block row e - 1 lies in
    (an image row sees its whole block; nothing past that is visible to any row of the chunk)

A prefix whose whole score matrix fits the bound runs as one call, as before (is_causal for text).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PREFILL_SCORE_BYTES = 256 * 2**20
"""Most bytes of one chunk's attention scores ([H, rows, keys] in fp32) during a prefill."""


def rows_per_chunk(num_rows: int, num_heads: int, score_bytes: int | None = None) -> int:
    """Query rows one chunk may hold so its fp32 scores against all `num_rows` keys fit `score_bytes`
    (None: `PREFILL_SCORE_BYTES`, read at the call)."""
    score_bytes = PREFILL_SCORE_BYTES if score_bytes is None else score_bytes
    return max(1, score_bytes // (4 * num_heads * max(1, num_rows)))


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_ids: torch.Tensor | None,
    score_bytes: int | None = None,
) -> torch.Tensor:
    """Block-causal self-attention of one prefix: q, k, v [L, H, D] -> [L, H, D].

    `block_ids` long [L] (on q's device): -1 for text rows, the image's index for its rows (row i sees
    row j when j <= i or both are in one image block, `PrefixPlan.visibility`); None: causal.
    """
    num_rows, num_heads, _ = q.shape
    qh, kh, vh = (t.transpose(0, 1) for t in (q, k, v))  # [H, L, D]
    chunk = rows_per_chunk(num_rows, num_heads, score_bytes)
    if chunk >= num_rows and block_ids is None:
        return F.scaled_dot_product_attention(qh, kh, vh, is_causal=True).transpose(0, 1)
    block_end = _block_ends(block_ids, num_rows, q.device)
    out = []
    for start in range(0, num_rows, chunk):
        stop = min(num_rows, start + chunk)
        kv_end = int(block_end[stop - 1])
        rows = torch.arange(start, stop, device=q.device)[:, None]
        keys = torch.arange(kv_end, device=q.device)[None, :]
        visible = keys <= rows  # [rows, keys]
        if block_ids is not None:
            own = block_ids[start:stop, None]
            visible |= (own == block_ids[None, :kv_end]) & (own >= 0)
        out.append(
            F.scaled_dot_product_attention(
                qh[:, start:stop], kh[:, :kv_end], vh[:, :kv_end], attn_mask=visible
            )
        )
    return torch.cat(out, dim=1).transpose(0, 1)


def _block_ends(block_ids: torch.Tensor | None, num_rows: int, device) -> torch.Tensor:
    """long [L]: one past the last row row i can see (its block's end for an image row, else i + 1)."""
    ends = torch.arange(1, num_rows + 1, device=device)
    if block_ids is None:
        return ends
    for block in torch.unique(block_ids[block_ids >= 0]).tolist():
        where = (block_ids == block).nonzero().squeeze(1)
        ends[where] = int(where[-1]) + 1  # each image's rows are contiguous (`plan_prefix`)
    return ends

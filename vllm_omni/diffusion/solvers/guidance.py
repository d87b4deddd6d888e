"""True classifier-free guidance, as Qwen-Image does it: one implementation for a whole step's rows.

    comb = neg + scale * (pos - neg)                      per row, its request's own scale
    comb *= ||pos|| / ||comb||   (over channels)          per row where its request normalises

The packed step calls it once over every CFG row of the batch (`scale` an fp32 column, `normalize` a
bool column); a request stepped alone (batch-invariant mode, or to find the request whose step fails)
calls it over its own rows with its Python scale. Both round the same way: `scale * (pos - neg)` is
computed in fp32 and rounded once to the model dtype, as a Python-scalar multiply does, then the math
stays in the model dtype, as in diffusers.
"""

from __future__ import annotations

import torch


def apply_guidance(
    pos: torch.Tensor,
    neg: torch.Tensor,
    scale: float | torch.Tensor,
    normalize: bool | torch.Tensor = True,
) -> torch.Tensor:
    """Combine positive and negative predictions.

    Args:
        pos, neg: [..., C] predictions in the model dtype (e.g. [num_cfg_rows, C] or [n, S, C]).
        scale: the CFG scale: a float, or fp32 [..., 1] (one per row) broadcasting against `pos`.
        normalize: rescale each row to the positive prediction's L2 norm over channels; a bool, or a
            bool [..., 1] tensor (one per row).
    Returns:
        [..., C] in `pos`' dtype.
    """
    comb = neg + ((pos - neg).float() * scale).to(pos.dtype)
    if normalize is False:
        return comb
    normed = comb * (torch.norm(pos, dim=-1, keepdim=True) / torch.norm(comb, dim=-1, keepdim=True))
    if normalize is True:
        return normed
    return torch.where(normalize, normed, comb)

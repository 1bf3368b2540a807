"""Causal depthwise conv1d over a packed row that never reads across a document boundary.

The short convs of linear attention (kernel 4) and of the n-gram PLE (dilated) read the previous
``(K - 1) * dilation`` tokens. On a packed row the first tokens of a document would read the end of the
one before; here each tap is masked by the token's position inside its own document, so a document
packed after others gets the zero left-padding it gets alone.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch import Tensor


def positions_in_documents(lengths: Sequence[int], device: torch.device | str = "cpu") -> Tensor:
    """[T] long: each token's index inside its own document (0 at every document start)."""
    starts = torch.tensor([0, *itertools.accumulate(lengths)][:-1], device=device)
    total = int(sum(lengths))
    return torch.arange(total, device=device) - torch.repeat_interleave(starts, torch.tensor(lengths, device=device))


def causal_conv1d_packed(x_BCT: Tensor, weight_CK: Tensor, bias_C: Tensor | None, lengths: Sequence[int],
                         dilation: int = 1) -> Tensor:
    """out[t] = bias + sum_j w[j] x[t - (K-1-j) d], where only taps inside t's document count; [B, C, T].

    ``x_BCT``'s tokens are the documents of ``lengths`` back to back (B rows with the same layout). No
    activation: callers apply theirs.
    """
    k, t = weight_CK.shape[-1], x_BCT.shape[-1]
    if sum(lengths) != t:
        raise ValueError(f"documents of {sum(lengths)} tokens but the row has {t}")
    x = x_BCT.to(weight_CK.dtype).transpose(1, 2)  # [B, T, C]: callers' channels-last data, no copy
    pos = positions_in_documents(lengths, x.device)
    out = x * weight_CK[:, k - 1]  # the tap on the token itself
    for j in range(k - 1):
        shift = (k - 1 - j) * dilation
        if shift >= t:
            continue
        inside = (pos[shift:] >= shift)[:, None].to(x.dtype)  # the tap stays in the token's document
        out[:, shift:] += x[:, : t - shift] * inside * weight_CK[:, j]
    if bias_C is not None:
        out = out + bias_C
    return out.transpose(1, 2)

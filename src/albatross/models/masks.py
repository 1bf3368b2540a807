"""Attention masks for the sparse-attention families, built per document (never [T, T] over a packed row).

The packed-aware layers (``segments``) hand each document its own causal [1, 1, n, n] mask, so an
indexer's top-k only ever ranks keys of its own document, the same selection the document gets alone.
``select_keys`` turns a DSA indexer's top-k indices into the boolean mask transformers' eager / sdpa
paths apply, for attention implementations (albatross' ``varlen``) that receive the indices instead.
"""

from __future__ import annotations

import torch
from torch import Tensor


def select_keys(mask: Tensor | None, indices_BSK: Tensor, kv_length: int) -> Tensor:
    """Bool mask [B, 1, S, kv]: True where a query may attend, i.e. its top-k and ``mask`` both allow it.

    ``indices_BSK`` are key positions (int, -1 or out of range: none); ``mask`` is a [B, 1, S, kv] bool or
    additive float causal mask, or None.
    """
    b, s, _ = indices_BSK.shape
    valid = (indices_BSK >= 0) & (indices_BSK < kv_length)
    chosen = torch.zeros(b, s, kv_length + 1, dtype=torch.bool, device=indices_BSK.device)
    chosen.scatter_(-1, torch.where(valid, indices_BSK, kv_length).long(), True)
    chosen = chosen[..., :kv_length].unsqueeze(1)
    if mask is None:
        return chosen
    allowed = mask if mask.dtype == torch.bool else mask == 0
    return chosen & allowed

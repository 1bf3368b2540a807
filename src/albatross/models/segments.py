"""Run a token-mixing module on each packed document alone, so nothing it computes crosses a boundary.

A packed row [1, T] holds several documents. Attention is kept inside a document by masking, but the
hybrid families' other token mixers carry information along the row by construction: the linear-attention
recurrent state (gated delta-net, KDA), the causal conv1d before it, the n-gram embedding and its dilated
conv, the sparse-attention indexers' top-k over every earlier key. ``segmented`` swaps such a module's
``forward`` for one that cuts every per-token input at the document boundaries, runs the module's own
forward (its own weights, names and math) on each document with ``cache=None``, and concatenates the
outputs. A document alone through the swapped module is exactly the module as transformers ships it; a
packed row is exactly its documents one by one.

``replaced`` swaps a module's forward for a whole-row implementation that takes the document lengths
(``linear_attention``, ``ngram``). The boundaries come from a ``Layout`` shared by the swapped modules of
one model, set at the start of each forward of the decoder (``track_layout``) from ``cu_seq_lens_q`` or,
failing that, from ``position_ids`` restarting at 0. It stays set until the next forward, so activation checkpointing recomputes a layer with
the same boundaries in the backward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

_SEGMENTED = "_albatross_segmented"  # flag on a module whose forward ``segmented`` / ``replaced`` swapped
_LAYOUT = "_albatross_layout"  # the ``Layout`` a decoder's forward records (``track_layout``)
DROPPED_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "cu_seqlens", "seq_idx")


@dataclass
class Layout:
    """Tokens of each document of the current packed row; empty when the input is not a packed row."""

    lengths: list[int] = field(default_factory=list)

    @property
    def packed(self) -> bool:
        return len(self.lengths) > 1


def lengths_from(kwargs: dict[str, Any], position_ids: Tensor | None) -> list[int]:
    """Document lengths of a batch-1 row, from ``cu_seq_lens_q`` or from ``position_ids`` restarting at 0."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None:
        return [int(n) for n in (cu[1:] - cu[:-1]).tolist()]
    if position_ids is None or position_ids.dim() != 2 or position_ids.shape[0] != 1:
        return []
    pos = position_ids[0]
    if pos.numel() == 0 or int(pos[0]) != 0:  # a decode step continuing a cached sequence
        return []
    starts = torch.nonzero(pos == 0).flatten().tolist() + [pos.numel()]
    return [b - a for a, b in zip(starts[:-1], starts[1:], strict=True)]


def _doc_mask(mask: Tensor, n: int) -> Tensor:
    """The causal [1, 1, n, n] mask a document of n tokens gets alone, in ``mask``'s dtype."""
    allowed = torch.ones(n, n, dtype=torch.bool, device=mask.device).tril()[None, None]
    if mask.dtype == torch.bool:
        return allowed
    return torch.zeros(allowed.shape, dtype=mask.dtype, device=mask.device).masked_fill(
        ~allowed, torch.finfo(mask.dtype).min)


def _cut(value: Any, total: int, start: int, n: int) -> Any:
    """``value`` restricted to tokens [start, start + n) of a row of ``total`` tokens."""
    if isinstance(value, tuple):
        return tuple(_cut(v, total, start, n) for v in value)
    if not isinstance(value, Tensor) or value.dim() < 2:
        return value
    if value.dim() == 4 and value.shape[-2:] == (total, total):  # a [B, 1, T, T] attention mask
        return _doc_mask(value, n)
    if value.shape[1] == total:  # [B, T, ...]: hidden states, ids, masks, top-k indices, cos / sin
        return value[:, start:start + n]
    return value


def _pad_last(parts: list[Tensor]) -> list[Tensor]:
    """Widen per-document top-k index tensors to one width by repeating their last column (same set)."""
    width = max(p.shape[-1] for p in parts)
    return [p if p.shape[-1] == width else torch.cat([p, p[..., -1:].expand(*p.shape[:-1], width - p.shape[-1])],
                                                     dim=-1) for p in parts]


def _join(outs: list[Any]) -> Any:
    """Concatenate per-document outputs along the token dimension (tuples element-wise)."""
    first = outs[0]
    if isinstance(first, tuple):
        return tuple(_join([o[i] for o in outs]) for i in range(len(first)))
    if first is None or not isinstance(first, Tensor) or first.dim() < 2:
        return first
    if first.dim() == 3 and not first.is_floating_point():  # top-k indices [B, n, k]
        outs = _pad_last(outs)
    return torch.cat(outs, dim=1)


def _segmented_forward(original: Callable[..., Any], layout: Layout, *args: Any, **kwargs: Any) -> Any:
    if not layout.lengths:  # not a row of documents (e.g. a generation step): the module as shipped
        return original(*args, **kwargs)
    for key in DROPPED_KWARGS:  # boundaries are ours to apply; transformers' torch fallbacks refuse them
        kwargs.pop(key, None)
    if not layout.packed:
        return original(*args, **kwargs)
    if kwargs.get("cache") is not None:
        raise ValueError("a packed row cannot use a cache; call the model with use_cache=False")
    total, outs, start = sum(layout.lengths), [], 0
    for n in layout.lengths:
        doc_args = [_cut(a, total, start, n) for a in args]
        doc_kwargs = {k: _cut(v, total, start, n) for k, v in kwargs.items()}
        outs.append(original(*doc_args, **doc_kwargs))
        start += n
    return _join(outs)


def is_segmented(module: nn.Module) -> bool:
    """``module``'s forward is already ``segmented`` or ``replaced`` on rows of documents."""
    return bool(module.__dict__.get(_SEGMENTED, False))


def segmented(module: nn.Module, layout: Layout) -> nn.Module:
    """Make ``module`` run each document of a packed row alone (idempotent; parameters untouched)."""
    if is_segmented(module):
        return module
    module.forward = functools.partial(_segmented_forward, module.forward, layout)
    module.__dict__[_SEGMENTED] = True
    return module


def _tracking_forward(original: Callable[..., Any], layout: Layout, *args: Any, **kwargs: Any) -> Any:
    layout.lengths = lengths_from(kwargs, kwargs.get("position_ids"))
    return original(*args, **kwargs)


def track_layout(decoder: nn.Module, layout: Layout | None = None) -> Layout:
    """Have each forward of ``decoder`` record its packed row's document lengths in a ``Layout``.

    Returns the decoder's layout: the one it already tracks (so modules swapped earlier and later share
    it), else ``layout`` (or a new one).
    """
    current = decoder.__dict__.get(_LAYOUT)
    if isinstance(current, Layout):
        return current
    layout = layout if layout is not None else Layout()
    decoder.forward = functools.partial(_tracking_forward, decoder.forward, layout)
    decoder.__dict__[_LAYOUT] = layout
    return layout


def _has_cache(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    values = [*args, kwargs.get("cache"), kwargs.get("past_key_values")]
    return any(v is not None and hasattr(v, "get_seq_length") for v in values)  # a transformers Cache


def replaced_forward(original: Callable[..., Any], packed: Callable[..., Any], layout: Layout,
                      module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    if not layout.lengths or _has_cache(args, kwargs):
        return original(*args, **kwargs)
    for key in DROPPED_KWARGS:
        kwargs.pop(key, None)
    return packed(module, layout.lengths, *args, **kwargs)


def replaced(module: nn.Module, layout: Layout, packed: Callable[..., Any]) -> nn.Module:
    """On rows of documents, run ``packed(module, lengths, *args, **kwargs)`` (the module's own arguments)
    instead of its forward, which still serves generation with a cache and inputs that are not rows."""
    if is_segmented(module):
        return module
    module.forward = functools.partial(replaced_forward, module.forward, packed, layout, module)
    module.__dict__[_SEGMENTED] = True
    return module

"""KV caches of the built-in engine: the running batch's grid and the prefix cache kept across turns.

``Grid``: every running row owns one row of a ``DynamicCache`` (``[B, H, L, D]`` per layer) and of a mask
``mask_BL`` (1 = a real token). All rows end at column ``L``: a row that joins is left-padded, and columns a row
does not use (left padding, rejected draft tokens) are holes with mask 0. Positions are explicit per row, so
holes cost attention work but never change a result. ``compact`` squeezes the holes out when they waste much.

``PrefixCache``: the KV of finished requests, keyed by their token ids, bounded by a token budget (LRU). A new
request whose prompt extends a cached sequence prefills only the delta (the next turn of an attempt: previous
prompt + completion + observation), and one whose prompt is a prefix of a cached sequence (the other attempts
of a group) prefills only its last token. Both are used from the engine's worker thread only.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [B, H, L, D]

_GROWING_LAYER: type | None = None


def _growing_layer_class() -> type:
    """A ``DynamicLayer`` that appends into a buffer with spare capacity instead of concatenating.

    ``DynamicLayer`` copies the whole cache on every decode step (``torch.cat``); this one doubles its buffer
    when full, so a step writes only the new positions. ``keys`` / ``values`` are views of the filled part.
    """
    global _GROWING_LAYER
    if _GROWING_LAYER is not None:
        return _GROWING_LAYER
    from transformers.cache_utils import DynamicLayer

    class GrowingLayer(DynamicLayer):  # type: ignore[no-untyped-call]  # transformers' DynamicLayer is untyped
        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            super().lazy_initialization(key_states, value_states)
            self.length = 0
            self.buf_k: torch.Tensor | None = None
            self.buf_v: torch.Tensor | None = None

        def set_kv(self, k: torch.Tensor, v: torch.Tensor, spare: int = 16) -> None:
            """Replace the contents with ``k`` / ``v`` (``[B, H, L, D]``), keeping ``spare`` free columns."""
            if not self.is_initialized:
                self.lazy_initialization(k, v)
            shape = (*k.shape[:2], k.shape[2] + spare, k.shape[3])
            self.buf_k, self.buf_v = k.new_empty(shape), v.new_empty(shape)
            self.buf_k[..., : k.shape[2], :] = k
            self.buf_v[..., : v.shape[2], :] = v
            self._set_length(k.shape[2])

        def _set_length(self, n: int) -> None:
            assert self.buf_k is not None and self.buf_v is not None
            self.length = n
            self.keys, self.values = self.buf_k[..., :n, :], self.buf_v[..., :n, :]

        def _reserve(self, k: torch.Tensor, need: int) -> None:
            if self.buf_k is not None and need <= self.buf_k.shape[-2] and self.buf_k.shape[0] == k.shape[0]:
                return
            old = self.length
            capacity = max(2 * need, need + 16)
            keys, values = (self.keys, self.values) if old else (k[..., :0, :], k[..., :0, :])
            assert keys is not None and values is not None
            self.set_kv(keys, values, capacity - old)

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object,
                   **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            end = self.length + key_states.shape[-2]
            self._reserve(key_states, end)
            assert self.buf_k is not None and self.buf_v is not None
            self.buf_k[..., self.length : end, :] = key_states
            self.buf_v[..., self.length : end, :] = value_states
            self._set_length(end)
            assert self.keys is not None and self.values is not None  # views of the buffers (``_set_length``)
            return self.keys, self.values

        def get_seq_length(self) -> int:
            return self.length if self.is_initialized else 0

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            if self.get_seq_length() > 0:
                assert self.buf_k is not None and self.buf_v is not None
                self.buf_k, self.buf_v = self.buf_k[indices], self.buf_v[indices]
                self._set_length(self.length)

        def crop(self, tokens_to_remove: int) -> None:
            if tokens_to_remove < 0 and self.is_initialized:
                self._set_length(max(0, self.length + tokens_to_remove))
            else:
                super().crop(tokens_to_remove)

    _GROWING_LAYER = GrowingLayer
    return GrowingLayer


def new_cache(model: torch.nn.Module) -> object:
    """A ``DynamicCache`` whose layers are all growing full-attention layers; raise for other cache kinds."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    config = getattr(model, "config", None)  # transformers' model and cache: probed, they differ by version
    cache = DynamicCache(config=config) if config is not None else DynamicCache()
    layers = getattr(cache, "layers", None)
    if not layers or any(type(layer) is not DynamicLayer for layer in layers):
        kinds = sorted({type(layer).__name__ for layer in layers or []})
        raise ValueError(
            f"the built-in engine needs full-attention cache layers only; this model's cache has {kinds}"
        )
    grow = _growing_layer_class()
    for i in range(len(layers)):
        layers[i] = grow()
    return cache


def cache_kv(cache: object) -> KV:
    return [(layer.keys, layer.values) for layer in cache.layers]  # type: ignore[attr-defined]


def cache_from_kv(model: torch.nn.Module, kv: KV) -> object:
    cache = new_cache(model)
    for layer, (k, v) in zip(cache.layers, kv, strict=True):  # type: ignore[attr-defined]
        layer.set_kv(k, v)
    return cache


def _pad_left(t_BHLD: torch.Tensor, n: int) -> torch.Tensor:
    if n == 0:
        return t_BHLD
    pad = t_BHLD.new_zeros(t_BHLD.shape[0], t_BHLD.shape[1], n, t_BHLD.shape[3])
    return torch.cat([pad, t_BHLD], dim=2)


@dataclass
class Grid:
    """The running batch's KV cache and validity mask; see the module docstring."""

    cache: object
    mask_BL: torch.Tensor  # long, 1 = a real token

    @property
    def length(self) -> int:
        return int(self.mask_BL.shape[1])

    def append_mask(self, mask_BT: torch.Tensor) -> torch.Tensor:
        """The mask to pass to a forward pass that appends ``T`` columns; becomes this grid's mask."""
        self.mask_BL = torch.cat([self.mask_BL, mask_BT], dim=1)
        return self.mask_BL

    def select(self, idx_B: torch.Tensor) -> None:
        self.cache.batch_select_indices(idx_B)  # type: ignore[attr-defined]
        self.mask_BL = self.mask_BL[idx_B]

    def merge(self, other: Grid, model: torch.nn.Module) -> Grid:
        """Rows of ``self`` then rows of ``other``; the shorter grid is left-padded with holes."""
        width = max(self.length, other.length)
        kv = [
            (
                torch.cat([_pad_left(k1, width - self.length), _pad_left(k2, width - other.length)]),
                torch.cat([_pad_left(v1, width - self.length), _pad_left(v2, width - other.length)]),
            )
            for (k1, v1), (k2, v2) in zip(cache_kv(self.cache), cache_kv(other.cache), strict=True)
        ]
        mask = torch.cat(
            [_pad_mask(self.mask_BL, width - self.length), _pad_mask(other.mask_BL, width - other.length)]
        )
        return Grid(cache_from_kv(model, kv), mask)

    def pad_left(self, n: int, model: torch.nn.Module) -> None:
        """Add ``n`` hole columns on the left of every row."""
        kv = [(_pad_left(k, n), _pad_left(v, n)) for k, v in cache_kv(self.cache)]
        self.cache, self.mask_BL = cache_from_kv(model, kv), _pad_mask(self.mask_BL, n)

    def write_row(self, row: int, kv: KV) -> None:
        """Make ``row`` hold exactly ``kv`` (``[1, H, n, D]`` per layer), right-aligned; ``n <= length``."""
        n = kv[0][0].shape[2]
        self.mask_BL[row] = 0
        self.mask_BL[row, self.length - n :] = 1
        for (k, v), (new_k, new_v) in zip(cache_kv(self.cache), kv, strict=True):
            k[row, :, self.length - n :] = new_k[0]
            v[row, :, self.length - n :] = new_v[0]

    def row_kv(self, row: int, n: int) -> KV:
        """The first ``n`` real tokens of ``row``, contiguous (``[1, H, n, D]`` per layer, copies)."""
        cols = self.mask_BL[row].nonzero().squeeze(1)[:n]
        return [(k[row : row + 1, :, cols], v[row : row + 1, :, cols]) for k, v in cache_kv(self.cache)]

    def reclaimable(self) -> int:
        """Columns ``compact`` would drop: the grid's length minus the most real tokens any row has."""
        return self.length - int(self.mask_BL.sum(1).max()) if self.mask_BL.numel() else 0

    def compact(self, model: torch.nn.Module) -> None:
        """Move each row's real tokens to the right end (in order) and drop the columns no row needs."""
        counts_B = self.mask_BL.sum(1)
        width = int(counts_B.max()) if counts_B.numel() else 0
        # stable sort puts holes (0) before real tokens (1) and keeps the order of the real tokens
        order_BL = torch.sort(self.mask_BL, dim=1, stable=True).indices[:, self.length - width :]
        rows_B1 = torch.arange(order_BL.shape[0], device=order_BL.device)[:, None]
        # advanced indexing on dims 0 and 2 gives [B, L', H, D]; back to [B, H, L', D]
        kv = [
            (k[rows_B1, :, order_BL].transpose(1, 2), v[rows_B1, :, order_BL].transpose(1, 2))
            for k, v in cache_kv(self.cache)
        ]
        self.mask_BL = self.mask_BL.gather(1, order_BL)
        self.cache = cache_from_kv(model, kv)


def _pad_mask(mask_BL: torch.Tensor, n: int) -> torch.Tensor:
    return torch.cat([mask_BL.new_zeros(mask_BL.shape[0], n), mask_BL], dim=1) if n else mask_BL


def prefix_grid(model: torch.nn.Module, prefixes: Sequence[KV | None], device: torch.device) -> Grid | None:
    """A grid of the cached prefixes of joining rows (rows without one are all holes); None when none has one."""
    known = [p for p in prefixes if p is not None]
    if not known:
        return None
    width = max(p[0][0].shape[2] for p in known)
    mask = torch.zeros(len(prefixes), width, dtype=torch.long, device=device)
    kv: KV = []
    for layer in range(len(known[0])):
        k0, v0 = known[0][layer]
        ks = k0.new_zeros(len(prefixes), k0.shape[1], width, k0.shape[3])
        vs = v0.new_zeros(len(prefixes), v0.shape[1], width, v0.shape[3])
        for r, p in enumerate(prefixes):
            if p is not None:
                n = p[layer][0].shape[2]
                ks[r, :, width - n :], vs[r, :, width - n :] = p[layer][0][0], p[layer][1][0]
                mask[r, width - n :] = 1
        kv.append((ks, vs))
    return Grid(cache_from_kv(model, kv), mask)


# --------------------------------------------------------------------------------------------- prefix cache


@dataclass
class _Entry:
    ids: tuple[int, ...]
    kv: KV
    version: int


class PrefixCache:
    """Finished requests' KV by token ids, at most ``max_tokens`` tokens in all (least recently used goes first)."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._entries: OrderedDict[tuple[int, ...], _Entry] = OrderedDict()
        self.tokens = 0
        self.hits = 0
        self.lookups = 0

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self.tokens = 0

    def put(self, ids: Sequence[int], kv: KV, version: int) -> None:
        key = tuple(ids)
        if not key or len(key) > self.max_tokens:
            return
        for old in [k for k in self._entries if len(k) <= len(key) and key[: len(k)] == k]:
            self._drop(old)  # a cached prefix of the new sequence is superseded by it
        self._entries[key] = _Entry(key, kv, version)
        self.tokens += len(key)
        while self.tokens > self.max_tokens:
            self._drop(next(iter(self._entries)))

    def _drop(self, key: tuple[int, ...]) -> None:
        self.tokens -= len(self._entries.pop(key).ids)

    def lookup(self, prompt: Sequence[int], version: int) -> tuple[KV | None, int]:
        """The cached KV of the longest usable prefix of ``prompt`` (at most ``len(prompt) - 1`` tokens, so one
        token is left to prefill) under weights ``version``, and its length; ``(None, 0)`` when none."""
        self.lookups += 1
        prompt_t = tuple(prompt)
        best: _Entry | None = None
        best_n = 0
        for entry in self._entries.values():
            n = min(len(entry.ids), len(prompt_t) - 1)
            if n <= best_n or entry.version != version or entry.ids[n - 1] != prompt_t[n - 1]:
                continue
            if entry.ids[:n] == prompt_t[:n]:
                best, best_n = entry, n
        if best is None:
            return None, 0
        self.hits += 1
        self._entries.move_to_end(best.ids)
        return [(k[:, :, :best_n], v[:, :, :best_n]) for k, v in best.kv], best_n

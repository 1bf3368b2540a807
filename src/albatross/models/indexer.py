"""A vectorised QSA indexer and sparse attention over its selection (``qwen4_exp``), exact per document.

transformers' ``Qwen4ExpTextQSAIndexer`` loops in Python over batch x query positions: for each query it
takes the visible keys (one row of a dense [T, T] mask), mean-pools them in blocks of ``compress_ratio``,
normalises and ropes the pooled keys, scores them (relu of q . k per indexer head, summed), keeps the
top ``budget / compress_ratio`` blocks plus the incomplete tail block, and writes a [B, 1, T, T] boolean
mask that dense attention then applies. At 2K tokens that loop is most of a forward, and the masks are
quadratic in the context.

Here, per document of a packed row (the selection must be the document's alone, see docs/models.md):

- the pooled block keys do not depend on the query, so they are built once per document; every query's
  block scores are one matmul over a chunk of queries, blocks a query cannot see yet masked out;
- top-k runs on the chunk at once. Where the k-th and (k+1)-th scores tie (relu scores tie at 0), which
  of the tied blocks transformers keeps depends on ``topk`` over the query's own score vector, so those
  rows (and only those) are recomputed exactly as transformers does, one query at a time;
- attention reads only the selected keys, in query chunks: either (past ``DENSE_KEYS`` visible keys) each
  query gathers its at most ``budget + ratio - 1`` keys, the chunk checkpointed so the backward keeps no
  gathers, or (shorter) the chunk runs fused attention (``scaled_dot_product_attention``) over its visible
  keys under a [chunk, keys] selection mask. No [T, T] tensor exists anywhere; memory is linear in the
  context.

A document short enough that every query sees every earlier block (``n // ratio <= budget / ratio``)
selects everything visible, so it takes plain causal attention. The selection has no gradient (the
indexer only chooses keys), as in transformers.
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Callable
from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from albatross.models import CausalLM
from albatross.models.segments import Layout, is_segmented, lengths_from, replaced, track_layout

QUERY_CHUNK = 512  # queries scored / attended at once (bounds the [chunk, width] gathers)
FAST_INDEXER = "_albatross_fast_indexer"  # flag on an attention module run by ``qsa_attention_forward``
_SPARSE_MASKS = "_albatross_sparse_masks"  # flag on a decoder that skips the dense masks
DENSE_KEYS = 4096  # up to this many visible keys, a query chunk scores them all under a selection mask
ATTENTION_CLASSES = ("Qwen4ExpTextAttention",)


class QSAIndexer(Protocol):
    """The members of transformers' ``Qwen4ExpTextQSAIndexer`` read here."""

    compress_ratio: int
    block_topk: int
    index_head_dim: int
    index_n_heads: int
    index_kv_heads: int
    index_qk_proj: nn.Module
    q_layernorm: nn.Module
    k_layernorm: nn.Module


class QSAAttention(Protocol):
    """The members of transformers' ``Qwen4ExpTextAttention`` read here (matched by class name)."""

    head_dim: int
    scaling: float
    attention_dropout: float
    indexer: QSAIndexer
    q_proj: nn.Module
    k_proj: nn.Module
    v_proj: nn.Module
    o_proj: nn.Module
    q_norm: nn.Module
    k_norm: nn.Module


def _rope(module: object) -> Callable[..., Any]:
    """The modeling file's own ``apply_rotary_pos_emb`` (partial rotary and all), for bit-equal keys."""
    rope: Callable[..., Any] = sys.modules[type(module).__module__].apply_rotary_pos_emb  # transformers' module
    return rope


def block_keys(indexer: QSAIndexer, raw_keys_ND: Tensor, cos_NR: Tensor, sin_NR: Tensor) -> Tensor:
    """Pooled, normalised, roped keys of a document's complete blocks, [n // ratio, d] (as transformers)."""
    r, d = indexer.compress_ratio, indexer.index_head_dim
    nb = raw_keys_ND.shape[0] // r
    pooled = raw_keys_ND[: nb * r].view(nb, r, d).float().mean(dim=1).to(raw_keys_ND.dtype)
    pooled = indexer.k_layernorm(pooled)
    roped: Tensor = _rope(indexer)(pooled.unsqueeze(1), cos=cos_NR[: nb * r : r], sin=sin_NR[: nb * r : r])
    return roped.squeeze(1)


def _block_scores(q_CHD: Tensor, keys_BD: Tensor, d: int) -> Tensor:
    """relu(q . k) summed over indexer heads / sqrt(d): [C, blocks], in fp32."""
    return torch.matmul(q_CHD.float(), keys_BD.float().T).relu().sum(dim=1) / math.sqrt(d)


def _exact_row(q_HD: Tensor, keys_BD: Tensor, visible: int, k: int, d: int) -> Tensor:
    """One query's block top-k computed exactly as transformers' loop does (used where scores tie)."""
    scores = torch.matmul(q_HD.float(), keys_BD[:visible].float().transpose(-1, -2)).transpose(-1, -2)
    scores = torch.relu(scores).sum(dim=-1) / math.sqrt(d)
    return scores.topk(min(k, visible), dim=0).indices


def _chunk_blocks(q_CHD: Tensor, keys_BD: Tensor, first: int, r: int, k: int, d: int) -> Tensor:
    """Chosen block ids [C, k] (-1: none) of queries first..first+C-1 of a document."""
    c, nb = q_CHD.shape[0], keys_BD.shape[0]
    visible = (torch.arange(first, first + c, device=q_CHD.device) + 1) // r  # complete blocks each query sees
    scores = _block_scores(q_CHD, keys_BD, d)
    scores = scores.masked_fill(torch.arange(nb, device=scores.device)[None] >= visible[:, None], float("-inf"))
    top = scores.topk(min(k + 1, nb), dim=-1)
    chosen = top.indices[:, :k]
    chosen = torch.where(chosen < visible[:, None], chosen, -1)
    if nb > k:  # rows whose k-th and (k+1)-th scores tie: recompute as transformers does
        ties = torch.nonzero((visible > k) & (top.values[:, k - 1] == top.values[:, k])).flatten().tolist()
        for row in ties:
            chosen[row] = _exact_row(q_CHD[row], keys_BD, int(visible[row]), k, d)
    if chosen.shape[1] < k:
        chosen = F.pad(chosen, (0, k - chosen.shape[1]), value=-1)
    return chosen


def _tokens(blocks_CK: Tensor, first: int, r: int) -> Tensor:
    """Key positions [C, k * r + r - 1] of the chosen blocks and the incomplete tail block (-1: none)."""
    c = blocks_CK.shape[0]
    offsets = torch.arange(r, device=blocks_CK.device)
    from_blocks = torch.where(blocks_CK[..., None] >= 0, blocks_CK[..., None] * r + offsets, -1).flatten(1)
    query = torch.arange(first, first + c, device=blocks_CK.device)
    tail = ((query + 1) // r * r)[:, None] + offsets[None, : r - 1]
    return torch.cat([from_blocks, torch.where(tail <= query[:, None], tail, -1)], dim=1)


@torch.no_grad()
def qsa_select(indexer: QSAIndexer, hidden_ND: Tensor, cos_NR: Tensor, sin_NR: Tensor) -> Tensor:
    """Key positions each query of ONE document attends to, [n, k * ratio + ratio - 1] (-1: none).

    The same set per query as transformers' ``Qwen4ExpTextQSAIndexer`` on the document alone.
    """
    if indexer.index_kv_heads != 1:
        raise NotImplementedError("fast indexer: QSA with more than one indexer key head")
    n, d, r, k = hidden_ND.shape[0], indexer.index_head_dim, indexer.compress_ratio, indexer.block_topk
    q, raw = torch.split(indexer.index_qk_proj(hidden_ND), [indexer.index_n_heads * d, d], dim=-1)
    q = indexer.q_layernorm(q.reshape(n, -1, d))
    q = _rope(indexer)(q[None], cos=cos_NR[None], sin=sin_NR[None], unsqueeze_dim=2)[0]
    keys = block_keys(indexer, raw, cos_NR, sin_NR)
    parts = []
    for first in range(0, n, QUERY_CHUNK):
        blocks = _chunk_blocks(q[first:first + QUERY_CHUNK], keys, first, r, k, d)
        parts.append(_tokens(blocks, first, r))
    return torch.cat(parts)


def _attend(q_CHD: Tensor, k_NKD: Tensor, v_NKD: Tensor, idx_CW: Tensor, scaling: float) -> Tensor:
    """Softmax attention of each query over its own keys ``idx`` (-1: none), GQA: [C, heads, d]."""
    c, h, d = q_CHD.shape
    kv = k_NKD.shape[1]
    valid = idx_CW >= 0
    safe = idx_CW.clamp_min(0)
    keys, values = k_NKD[safe], v_NKD[safe]  # [C, W, kv, d]
    scores = torch.einsum("ckgd,cwkd->ckgw", q_CHD.view(c, kv, h // kv, d), keys) * scaling
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(values.dtype)
    return torch.einsum("ckgw,cwkd->ckgd", probs, values).reshape(c, h, d)


def _attend_masked(q_CHD: Tensor, k_NKD: Tensor, v_NKD: Tensor, idx_CW: Tensor, scaling: float) -> Tensor:
    """``_attend`` as one fused attention (``scaled_dot_product_attention``) over the chunk's visible keys
    under a [C, n] selection mask: on short documents that beats gathering W keys per query, and the fused
    kernel keeps only its inputs, output and log-sum-exp for the backward (no [C, n] scores)."""
    c, h, d = q_CHD.shape
    n, kv = k_NKD.shape[:2]
    allowed = torch.zeros(c, n + 1, dtype=torch.bool, device=idx_CW.device)
    allowed = allowed.scatter_(1, torch.where(idx_CW >= 0, idx_CW, n), True)[:, :n]
    out = F.scaled_dot_product_attention(q_CHD.transpose(0, 1)[None], k_NKD.transpose(0, 1)[None],
                                         v_NKD.transpose(0, 1)[None], attn_mask=allowed[None, None],
                                         scale=scaling, enable_gqa=h != kv)
    return out[0].transpose(0, 1)


def sparse_attention(q_NHD: Tensor, k_NKD: Tensor, v_NKD: Tensor, idx_NW: Tensor, scaling: float) -> Tensor:
    """Attention restricted to ``idx`` per query, in query chunks.

    A chunk whose queries see at most ``DENSE_KEYS`` keys runs fused attention over them all under a
    [chunk, keys] selection mask; longer ones gather each query's selected keys (memory and work linear
    in the context), each such chunk recomputed in the backward so it keeps no [chunk, W] gathers.
    """
    outs = []
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q_NHD, k_NKD, v_NKD))
    for s in range(0, q_NHD.shape[0], QUERY_CHUNK):
        end = min(s + QUERY_CHUNK, q_NHD.shape[0])
        if end <= DENSE_KEYS:
            outs.append(_attend_masked(q_NHD[s:end], k_NKD[:end], v_NKD[:end], idx_NW[s:end], scaling))
            continue
        args = (q_NHD[s:end], k_NKD, v_NKD, idx_NW[s:end], scaling)
        outs.append(checkpoint(_attend, *args, use_reentrant=False) if grad else _attend(*args))
    return torch.cat(outs)


def _causal(q_NHD: Tensor, k_NKD: Tensor, v_NKD: Tensor, scaling: float) -> Tensor:
    out = F.scaled_dot_product_attention(q_NHD.transpose(0, 1)[None], k_NKD.transpose(0, 1)[None],
                                         v_NKD.transpose(0, 1)[None], is_causal=True, scale=scaling,
                                         enable_gqa=q_NHD.shape[1] != k_NKD.shape[1])
    return out[0].transpose(0, 1)


def _document(module: QSAAttention, x_ND: Tensor, q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Attention output [n, heads, d] of one document."""
    indexer = module.indexer
    if x_ND.shape[0] // indexer.compress_ratio <= indexer.block_topk:  # every query keeps all it sees
        return _causal(q, k, v, module.scaling)
    idx = qsa_select(indexer, x_ND, cos, sin)
    return sparse_attention(q, k, v, idx, module.scaling)


def qsa_attention_forward(module: QSAAttention, lengths: list[int], hidden_states: Tensor,
                          position_embeddings: tuple[Tensor, Tensor], attention_mask: object = None,
                          cache: object = None, **kwargs: object) -> tuple[Tensor, None]:
    """``Qwen4ExpTextAttention.forward`` for a row of documents (batch 1): its weights, exact per document."""
    if hidden_states.shape[0] != 1:
        raise ValueError(f"fast indexer takes one packed row, got batch {hidden_states.shape[0]}")
    hd = module.head_dim
    shape = (*hidden_states.shape[:-1], -1, hd)
    query, gate = torch.chunk(module.q_proj(hidden_states).view(*hidden_states.shape[:-1], -1, hd * 2), 2, dim=-1)
    gate = gate.reshape(*hidden_states.shape[:-1], -1)
    query = module.q_norm(query.view(shape)).transpose(1, 2)
    key = module.k_norm(module.k_proj(hidden_states).view(shape)).transpose(1, 2)
    value = module.v_proj(hidden_states).view(shape).transpose(1, 2)
    cos, sin = (x[:, -hidden_states.shape[1]:] for x in position_embeddings)
    query, key = _rope(module)(query, key, cos, sin)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, heads, d]
    outs, start = [], 0
    for n in lengths:
        sl = slice(start, start + n)
        outs.append(_document(module, hidden_states[0, sl], q[sl], k[sl], v[sl], cos[0, sl], sin[0, sl]))
        start += n
    out = torch.cat(outs).reshape(*hidden_states.shape[:-1], -1) * torch.sigmoid(gate)
    projected: Tensor = module.o_proj(out)
    return projected, None


def _no_dense_masks(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Decoder forward: on a row of documents (no cache), skip transformers' [T, T] masks altogether.

    The indexed layers no longer read a mask (boundaries come from the layout), and a packed row has no
    padding, so the linear-attention / PLE padding mask is None too.
    """
    mask = kwargs.get("attention_mask")
    plain = mask is None or (isinstance(mask, Tensor) and (mask.dim() == 4 or bool(mask.all())))
    if kwargs.get("use_cache") is False and plain and lengths_from(kwargs, kwargs.get("position_ids")):
        kwargs["attention_mask"] = {"indexed_attention": None, "linear_attention": None}
    return original(*args, **kwargs)


def install_fast_indexer(model: CausalLM) -> int:
    """Run the QSA attention layers of ``model`` through ``qsa_attention_forward`` on rows of documents.

    Returns how many layers (the decoder's: an MTP head keeps its own); generation (a cache) and batches
    that are not rows of documents keep the shipped forward. Must run before ``prepare_for_packing``
    segments those layers.
    """
    decoder = model.get_decoder()
    layout: Layout = track_layout(decoder)
    modules = [m for m in decoder.modules() if type(m).__name__ in ATTENTION_CLASSES]  # not an MTP head's
    for module in modules:
        if is_segmented(module):
            raise RuntimeError("install the fast indexer before prepare_for_packing segments the attention")
        if cast(QSAAttention, module).attention_dropout:  # matched by class name
            raise NotImplementedError("fast indexer: attention dropout")
        replaced(module, layout, qsa_attention_forward)
        module.__dict__[FAST_INDEXER] = True  # its query chunks checkpoint themselves (models/hyper.py reads it)
    if modules and not decoder.__dict__.get(_SPARSE_MASKS, False):
        decoder.forward = functools.partial(_no_dense_masks, decoder.forward)
        decoder.__dict__[_SPARSE_MASKS] = True
    return len(modules)

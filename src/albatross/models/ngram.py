"""n-gram (PLE) embeddings and their dilated conv over a packed row, never crossing a document.

``qwen4_exp``'s per-layer embeddings hash each token with the ``ngram_size - 1`` tokens before it; a
token with fewer predecessors in its segment gets EOS in their place. transformers starts a segment only
after an EOS token, and a truncated rollout has none, so a packed document hashes the previous one's last
tokens. Here a segment also starts at every document start. The PLE's depthwise conv (dilation
``ngram_size``) runs through ``conv.causal_conv1d_packed``. The hash itself (multipliers, per-head prime
vocabularies and offsets) and every weight are the module's own.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from albatross.models.conv import causal_conv1d_packed, positions_in_documents


class NGramEmbedding(Protocol):
    """The members of transformers' ``Qwen4ExpTextNGramEmbedding`` read here."""

    eos_token_id: int
    ngram_size: int
    heads_per_ngram: int
    layer_multipliers: Tensor
    ngram_heads_vocab_sizes: Tensor
    ngram_heads_offsets: Tensor
    ngram_embedding: nn.Module


class PLELayer(Protocol):
    """The members of transformers' ``Qwen4ExpTextPLELayer`` read here."""

    hidden_size: int
    hc_count: int
    ple_embedding: NGramEmbedding
    key_proj: nn.Module
    value_proj: nn.Module
    norm_key: nn.Module
    norm_query: nn.Module
    norm_conv: nn.Module
    conv1d: nn.Conv1d


def shifted_ids(ids_T: Tensor, shift: int, lengths: Sequence[int], eos: int) -> Tensor:
    """Token ``shift`` places back inside the same segment (after the last EOS, within the document), else EOS."""
    if shift == 0:
        return ids_T
    t = ids_T.shape[0]
    positions = torch.arange(t, device=ids_T.device)
    doc_start = positions - positions_in_documents(lengths, ids_T.device)
    eos_at = torch.where(ids_T == eos, positions, -1)
    last_eos_before = torch.cat([eos_at.new_full((1,), -1), torch.cummax(eos_at, 0).values[:-1]])
    start = torch.maximum(doc_start, last_eos_before + 1)
    source = (positions - shift).clamp_min(0)
    return torch.where(positions - start >= shift, ids_T[source], ids_T.new_full((), eos))


def ngram_ids(embedding: NGramEmbedding, ids_T: Tensor, lengths: Sequence[int]) -> Tensor:
    """[T, heads] rows of the n-gram table for each token (orders 2..ngram_size, ``heads_per_ngram`` each)."""
    ids_T = ids_T.long()
    shifted = [shifted_ids(ids_T, s, lengths, embedding.eos_token_id) for s in range(embedding.ngram_size)]
    blocks = []
    for order in range(2, embedding.ngram_size + 1):
        mixed = shifted[0] * embedding.layer_multipliers[0]
        for back in range(1, order):
            mixed = torch.bitwise_xor(mixed, shifted[back] * embedding.layer_multipliers[back])
        heads = slice((order - 2) * embedding.heads_per_ngram, (order - 1) * embedding.heads_per_ngram)
        sizes, offsets = embedding.ngram_heads_vocab_sizes[heads], embedding.ngram_heads_offsets[heads]
        blocks.append(torch.remainder(mixed[:, None], sizes[None]) + offsets[None])
    return torch.cat(blocks, dim=-1)


def ple_forward(module: PLELayer, lengths: Sequence[int], hidden_states: Tensor, input_ids: Tensor,
                cache: object = None, conv_mask: Tensor | None = None) -> Tensor:
    """A ``qwen4_exp`` PLE layer on a packed row (batch 1): its output [1, T, hc_count * hidden]."""
    if hidden_states.shape[0] != 1:
        raise ValueError(f"a packed row has batch 1, got {hidden_states.shape[0]}")
    table = module.ple_embedding
    emb = table.ngram_embedding(ngram_ids(table, input_ids[0], lengths)).flatten(-2)[None]
    streams = (module.hc_count, module.hidden_size)
    key = module.norm_key(module.key_proj(emb)).unflatten(-1, streams)
    query = module.norm_query(hidden_states).unflatten(-1, streams)
    gate = (key * query).sum(-1, keepdim=True) / math.sqrt(module.hidden_size)
    gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
    gated = torch.sigmoid(gate) * module.value_proj(emb).unsqueeze(-2)
    normed, gated = module.norm_conv(gated.flatten(-2)), gated.flatten(-2)
    if conv_mask is not None:
        gated, normed = (x * conv_mask[:, :, None].to(x.dtype) for x in (gated, normed))
    conv = causal_conv1d_packed(normed.transpose(1, 2), module.conv1d.weight.squeeze(1), module.conv1d.bias,
                                lengths, dilation=module.conv1d.dilation[0])
    out: Tensor = gated + F.silu(conv).to(gated.dtype).transpose(1, 2)
    return out

"""The gated delta rule over a packed row, in plain torch, with the state reset at each document start.

Gated delta-net (``qwen3_next``, ``qwen4_exp``) keeps a per-head state S [d_k, d_v]; for each token,
S <- exp(g) S, then S <- S + k (beta (v - k^T S))^T, and the output is q^T S (q, k L2-normalised, q scaled
by d_k^-1/2). Chunked form: tokens go in chunks of C; within a chunk, with gamma the cumulative log decay
and A[i, j] = beta_i exp(gamma_i - gamma_j) k_i . k_j (j < i), the corrections are
delta = (I + A)^-1 (beta v) - (I + A)^-1 (beta exp(gamma) k) S0, the outputs
o_i = exp(gamma_i) q_i^T S0 + sum_{j <= i} exp(gamma_i - gamma_j) (q_i . k_j) delta_j, and the state carried
on is exp(gamma_C) S0 + sum_j exp(gamma_C - gamma_j) k_j delta_j^T. Each document is padded to a whole
number of chunks, so no chunk holds two documents, and the scan zeroes the state before every chunk that
starts a document: packed, a document computes what it computes alone. KDA (Kimi delta attention,
``glm5_next``) is the same rule with one decay per key channel instead of one per head.
``gated_delta_net_forward`` and ``kda_forward`` run a transformers GatedDeltaNet / KDA module (its own
weights, conv, gates, norm and projections) through this path, with ``conv.causal_conv1d_packed``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from albatross.models.conv import causal_conv1d_packed

CHUNK = 64


def _chunk_slots(lengths: Sequence[int], chunk: int, device: torch.device) -> tuple[Tensor, Tensor, int]:
    """Slot of each token in the chunk-padded layout [T], whether each chunk starts a document, #chunks."""
    chunks = [math.ceil(n / chunk) for n in lengths]
    first = torch.tensor([0, *itertools.accumulate(chunks)][:-1], device=device)
    starts = torch.zeros(sum(chunks), dtype=torch.bool, device=device)
    starts[first] = True
    within = torch.cat([torch.arange(n, device=device) for n in lengths])
    doc_first = torch.repeat_interleave(first, torch.tensor(lengths, device=device))
    return doc_first * chunk + within, starts, sum(chunks)


def _to_chunks(x_TH: Tensor, slots: Tensor, n_chunks: int, chunk: int) -> Tensor:
    """[T, H, ...] -> [H, N, C, ...], zero where a document's last chunk is padding."""
    out = x_TH.new_zeros(n_chunks * chunk, *x_TH.shape[1:])
    out[slots] = x_TH
    return out.view(n_chunks, chunk, *x_TH.shape[1:]).movedim(2, 0)


def _decays(gamma: Tensor, per_channel: bool) -> Tensor:
    """exp(gamma_i - gamma_j) for j <= i, else 0: [H, N, C, C] (or [H, N, C, C, d_k] per channel)."""
    c = gamma.shape[2]
    diff = gamma[:, :, :, None] - gamma[:, :, None, :]
    upper = torch.ones(c, c, dtype=torch.bool, device=gamma.device).triu(1)
    return diff.masked_fill(upper[..., None] if per_channel else upper, float("-inf")).exp()


def _pairs(x: Tensor, y: Tensor, decay: Tensor, per_channel: bool) -> Tensor:
    """sum_c x_ic y_jc exp(gamma_ic - gamma_jc) (per channel) or (x_i . y_j) exp(gamma_i - gamma_j)."""
    if per_channel:
        return torch.einsum("hnic,hnjc,hnijc->hnij", x, y, decay)
    return (x @ y.transpose(-1, -2)) * decay


def _intra_chunk(q: Tensor, k: Tensor, v: Tensor, gamma: Tensor, beta: Tensor) -> tuple[Tensor, ...]:
    """Per-chunk quantities of the chunked form, every chunk at once ([H, N, C, ...])."""
    c, per_channel = q.shape[2], gamma.dim() == k.dim()
    decay = _decays(gamma, per_channel)
    strictly_lower = torch.ones(c, c, dtype=torch.bool, device=q.device).tril(-1)
    a = (beta[..., :, None] * _pairs(k, k, decay, per_channel)).masked_fill(~strictly_lower, 0)
    system = a + torch.eye(c, dtype=q.dtype, device=q.device)
    rise = gamma.exp() if per_channel else gamma.exp()[..., None]
    u = torch.linalg.solve_triangular(system, beta[..., None] * v, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, beta[..., None] * rise * k, upper=False, unitriangular=True)
    return u, w, _pairs(q, k, decay, per_channel), rise


def gated_delta_rule_packed(q_THK: Tensor, k_THK: Tensor, v_THV: Tensor, g: Tensor, beta_TH: Tensor,
                            lengths: Sequence[int], chunk: int = CHUNK) -> Tensor:
    """Outputs [T, H, d_v] (fp32) of the gated delta rule, each document of ``lengths`` from a zero state.

    q, k: [T, H, d_k] raw (normalised here); v: [T, H, d_v]; beta in (0, 1); g: log decay (<= 0), one per
    head [T, H] (gated delta-net) or one per key channel [T, H, d_k] (KDA, Kimi delta attention).
    """
    dtype = torch.float32
    q = _l2norm(q_THK.to(dtype)) * q_THK.shape[-1] ** -0.5
    k = _l2norm(k_THK.to(dtype))
    slots, starts, n = _chunk_slots(lengths, chunk, q.device)
    q, k, v = (_to_chunks(x, slots, n, chunk) for x in (q, k, v_THV.to(dtype)))
    g, beta = (_to_chunks(x.to(dtype), slots, n, chunk) for x in (g, beta_TH))
    gamma = g.cumsum(2)  # cumulative log decay inside each chunk
    u, w, qk, rise = _intra_chunk(q, k, v, gamma, beta)
    state = q.new_zeros(q.shape[0], q.shape[-1], v.shape[-1])
    outs = []
    for i, first in enumerate(starts.tolist()):
        if first:
            state = torch.zeros_like(state)
        delta = u[:, i] - w[:, i] @ state
        outs.append((q[:, i] * rise[:, i]) @ state + qk[:, i] @ delta)
        last = gamma[:, i, -1:]  # [H, 1] or [H, 1, d_k]
        fall = (last - gamma[:, i]).exp()
        carried = (k[:, i] * (fall if fall.dim() == 3 else fall[..., None])).transpose(-1, -2)
        keep = last.exp() if last.dim() == 3 else last.exp()[..., None]  # [H, 1 or d_k, 1] over state rows
        state = state * keep.transpose(-1, -2) + carried @ delta
    out = torch.stack(outs, 1).reshape(q.shape[0], n * chunk, -1)  # [H, N*C, d_v]
    return out[:, slots].transpose(0, 1)


def _l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _projections(module: Any, h_BTD: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(conv input [B, T, conv_dim], z [B, T, Hv, dv], b, a [B, T, Hv]) for both GatedDeltaNet layouts."""
    bsz, t, _ = h_BTD.shape
    if hasattr(module, "in_proj_qkvz"):  # qwen3_next: interleaved per key-head group
        q, k, v, z, b, a = module.fix_query_key_value_ordering(module.in_proj_qkvz(h_BTD), module.in_proj_ba(h_BTD))
        mixed = torch.cat([x.reshape(bsz, t, -1) for x in (q, k, v)], dim=-1)
        return mixed, z, b, a
    z = module.in_proj_z(h_BTD).reshape(bsz, t, -1, module.head_v_dim)
    return module.in_proj_qkv(h_BTD), z, module.in_proj_b(h_BTD), module.in_proj_a(h_BTD)


def gated_delta_net_forward(module: Any, lengths: Sequence[int], hidden_states: Tensor, cache: Any = None,
                            attention_mask: Tensor | None = None, **kwargs: Any) -> Tensor:
    """A transformers GatedDeltaNet's training forward on a packed row (batch 1), documents kept apart."""
    from transformers.activations import ACT2FN

    if hidden_states.shape[0] != 1:
        raise ValueError(f"a packed row has batch 1, got {hidden_states.shape[0]}")
    if attention_mask is not None and attention_mask.dim() == 2:
        hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
    mixed, z, b, a = _projections(module, hidden_states)
    conv = causal_conv1d_packed(mixed.transpose(1, 2), module.conv1d.weight.squeeze(1), module.conv1d.bias, lengths)
    mixed = ACT2FN[module.activation](conv).to(hidden_states.dtype).transpose(1, 2)[0]
    q, k, v = torch.split(mixed, [module.key_dim, module.key_dim, module.value_dim], dim=-1)
    q, k = (x.reshape(x.shape[0], -1, module.head_k_dim) for x in (q, k))
    v = v.reshape(v.shape[0], -1, module.head_v_dim)
    if module.num_v_heads != module.num_k_heads:
        rep = module.num_v_heads // module.num_k_heads
        q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
    g = -module.A_log.float().exp() * F.softplus(a[0].float() + module.dt_bias)
    core = gated_delta_rule_packed(q, k, v, g, b[0].sigmoid(), lengths).to(hidden_states.dtype)
    core = module.norm(core.reshape(-1, module.head_v_dim), z.reshape(-1, module.head_v_dim))
    return module.out_proj(core.reshape(1, hidden_states.shape[1], -1))


def kda_forward(module: Any, lengths: Sequence[int], hidden_states: Tensor, cache: Any = None,
                attention_mask: Tensor | None = None, **kwargs: Any) -> Tensor:
    """A transformers KDA layer's (``glm5_next`` linear attention) training forward on a packed row."""
    from transformers.activations import ACT2FN

    if hidden_states.shape[0] != 1:
        raise ValueError(f"a packed row has batch 1, got {hidden_states.shape[0]}")
    if attention_mask is not None and attention_mask.dim() == 2:
        hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
    t, heads = hidden_states.shape[1], (-1, module.head_dim)
    mixed = torch.cat([module.q_proj(hidden_states), module.k_proj(hidden_states), module.v_proj(hidden_states)], dim=-1)
    conv = causal_conv1d_packed(mixed.transpose(1, 2), module.conv1d.weight.squeeze(1), module.conv1d.bias, lengths)
    mixed = ACT2FN[module.activation](conv).to(hidden_states.dtype).transpose(1, 2)[0]
    q, k, v = (x.reshape(t, *heads) for x in torch.split(mixed, [module.qkv_dim] * 3, dim=-1))
    g = module.forget_gate(hidden_states)[0]  # [T, H, d_k]: one log decay per key channel
    beta = torch.sigmoid(module.b_proj(hidden_states))[0]
    core = gated_delta_rule_packed(q, k, v, g, beta, lengths).to(hidden_states.dtype)
    gate = module.g_b_proj(module.g_a_proj(hidden_states)).view(1, t, *heads)
    return module.o_proj(module.o_norm(core[None], gate).reshape(1, t, -1))



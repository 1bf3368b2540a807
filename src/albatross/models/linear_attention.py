"""The gated delta rule over a packed row, in plain torch, each document from a zero state.

Gated delta-net (``qwen3_next``, ``qwen4_exp``) keeps a per-head state S [d_k, d_v]; for each token,
S <- exp(g) S, then S <- S + k (beta (v - k^T S))^T, and the output is q^T S (q, k L2-normalised, q scaled
by d_k^-1/2). Chunked form: tokens go in chunks of C; within a chunk, with gamma the cumulative log decay
and A[i, j] = beta_i exp(gamma_i - gamma_j) k_i . k_j (j < i), the corrections are
delta = (I + A)^-1 (beta v) - (I + A)^-1 (beta exp(gamma) k) S0, the outputs
o_i = exp(gamma_i) q_i^T S0 + sum_{j <= i} exp(gamma_i - gamma_j) (q_i . k_j) delta_j, and the state carried
on is exp(gamma_C) S0 + sum_j exp(gamma_C - gamma_j) k_j delta_j^T. KDA (Kimi delta attention,
``glm5_next``) is the same rule with one decay per key channel instead of one per head.

Each document is padded to a whole number of chunks, so no chunk holds two documents. Documents are
independent, so the scan runs over the chunk index *within* a document, all documents at once: the
chunks are laid out step-major (every document's chunk 0, then every chunk 1, ...; documents ordered by
their number of chunks, longest first, so the documents still running at step m are a prefix), and step
m is one batched update of the states of the documents that have an m-th chunk. A packed row of D
documents takes as many sequential steps as its longest document has chunks, not as the row has, and
each document starts from a zero state without any reset. Everything that does not need the state
(the intra-chunk solves, decays and products, and the outputs from the states entering each chunk) is
computed for all chunks at once, outside the scan. ``gated_delta_net_forward`` and ``kda_forward`` run a
transformers GatedDeltaNet / KDA module (its own weights, conv, gates, norm and projections) through
this path, with ``conv.causal_conv1d_packed``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol, TypeGuard, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from albatross.models.conv import causal_conv1d_packed, positions_in_documents

CHUNK = 64  # tokens per chunk on a GPU (the chunked kernels' size)
CPU_CHUNK = 32  # on a CPU: the [H, N, C, C] intra-chunk tensors are memory-bound passes there, and halving C
# halves them (T x H x C elements) for twice the scan steps (docs/benchmarks.md, trainer study)


def chunk_size(device: torch.device | str) -> int:
    return CPU_CHUNK if torch.device(device).type == "cpu" else CHUNK


def scan_layout(lengths: Sequence[int], chunk: int, device: torch.device | str = "cpu") -> tuple[Tensor, list[int]]:
    """(slot of each token in the step-major chunk layout [T], documents active at each scan step).

    Documents sorted by chunk count (longest first, stable); step m holds chunk m of the first
    ``active[m]`` of them, at chunk positions ``sum(active[:m]) + rank``.
    """
    chunks = [math.ceil(n / chunk) for n in lengths]
    order = sorted(range(len(lengths)), key=lambda d: -chunks[d])
    rank = [0] * len(lengths)
    for r, d in enumerate(order):
        rank[d] = r
    active = [sum(1 for c in chunks if c > m) for m in range(max(chunks, default=0))]
    step_start = torch.tensor([0, *active], device=device).cumsum(0)[:-1]
    within = positions_in_documents(lengths, device)
    rank_t = torch.repeat_interleave(torch.tensor(rank, device=device), torch.tensor(lengths, device=device))
    slots = (step_start[within // chunk] + rank_t) * chunk + within % chunk
    return slots, active


def _to_chunks(x_TH: Tensor, slots: Tensor, n_chunks: int, chunk: int) -> Tensor:
    """[T, H, ...] -> [H, N, C, ...], zero where a document's last chunk is padding."""
    out = x_TH.new_zeros(n_chunks * chunk, *x_TH.shape[1:])
    out[slots] = x_TH
    return out.view(n_chunks, chunk, *x_TH.shape[1:]).movedim(2, 0)


EXP_FLOOR = -87.0  # exp of this is still a normal fp32 (1.6e-38); below it the CPU's exp takes a 30x slower path


class _Decays(torch.autograd.Function):
    """exp(gamma_i - gamma_j) for j <= i, else 0: [H, N, C, C] (or [H, N, C, C, d_k] per channel).

    The exponent is floored at ``EXP_FLOOR``, the upper triangle set to 0 before the exp and zeroed after it:
    exp of -inf or of a value whose result is subnormal runs 3-30x slower on a CPU, and a decay under
    1.6e-38 is 0 to fp32 tolerance in every sum it enters. One fresh [.., C, C] buffer and in-place passes;
    the backward is d gamma_i = sum_j G_ij D_ij - sum_j G_ji D_ji (autograd's clamp / mask / exp / sub chain
    took about twice the passes over the same buffers).
    """

    @staticmethod
    def forward(ctx: Any, gamma: Tensor) -> Tensor:
        c = gamma.shape[2]
        upper = torch.ones(c, c, dtype=torch.bool, device=gamma.device).triu(1)
        upper = upper[..., None] if gamma.dim() == 4 else upper
        diff = (gamma[:, :, :, None] - gamma[:, :, None, :]).clamp_(min=EXP_FLOOR)
        decay = diff.masked_fill_(upper, 0.0).exp_().masked_fill_(upper, 0.0)
        ctx.save_for_backward(decay)
        return decay

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        decay: Tensor
        (decay,) = ctx.saved_tensors
        weighted = grad * decay
        return weighted.sum(3) - weighted.sum(2)


def _pairs(x: Tensor, y: Tensor, decay: Tensor, per_channel: bool) -> Tensor:
    """sum_c x_ic y_jc exp(gamma_ic - gamma_jc) (per channel) or (x_i . y_j) exp(gamma_i - gamma_j)."""
    if per_channel:
        return torch.einsum("hnic,hnjc,hnijc->hnij", x, y, decay)
    return (x @ y.transpose(-1, -2)) * decay


def unit_lower_inverse(t: Tensor) -> Tensor:
    """Inverse of unit lower-triangular matrices [..., C, C] (C a power of two; the diagonal is taken as 1).

    Recursive block inversion, all blocks of a level at once: for [[T11, 0], [T21, T22]] the inverse is
    [[X11, 0], [-X22 T21 X11, X22]]. log2(C) levels of batched matmuls instead of C small triangular
    solves per matrix (a batched ``solve_triangular`` runs one LAPACK call per matrix on a CPU), each level
    writing its blocks into one [..., C, C] result in place.
    """
    c = t.shape[-1]
    if c & (c - 1):
        raise ValueError(f"chunk size must be a power of two, got {c}")
    x = t.new_zeros(t.shape)
    x.diagonal(dim1=-2, dim2=-1).fill_(1.0)
    b = 1
    while b < c:  # the diagonal blocks of size b are inverted; fill the lower-left block of each 2b block
        nb = c // (2 * b)
        t_blocks = torch.diagonal(_blocks(t, nb, 2 * b), dim1=-4, dim2=-2)
        x_blocks = torch.diagonal(_blocks(x, nb, 2 * b), dim1=-4, dim2=-2)
        if b == 1:  # X11 = X22 = 1
            x_blocks[..., 1:, :1, :] = -t_blocks[..., 1:, :1, :]
        else:  # [..., 2b, 2b, nb] views; blocks moved to [..., nb, b, b] for the matmuls
            lower, x11, x22 = (blocks.movedim(-1, -3) for blocks in (
                t_blocks[..., b:, :b, :], x_blocks[..., :b, :b, :], x_blocks[..., b:, b:, :]))
            x_blocks[..., b:, :b, :] = (-(x22 @ lower) @ x11).movedim(-3, -1)
        b *= 2
    return x


def _blocks(t: Tensor, n: int, size: int) -> Tensor:
    """[..., n x size, n x size] viewed as [..., n, size, n, size]."""
    return torch.unflatten(torch.unflatten(t, -2, (n, size)), -1, (n, size))


class UnitLowerSolve(torch.autograd.Function):
    """X = T^-1 R for unit lower-triangular T (only its strictly lower part is read), as
    ``solve_triangular(T, R, upper=False, unitriangular=True)`` with explicit inverses: the forward and
    both gradients (dR = T^-T dX, dT = -tril(dR X^T, -1)) are batched matmuls."""

    @staticmethod
    def forward(ctx: Any, t: Tensor, r: Tensor) -> Tensor:
        inverse = unit_lower_inverse(t)
        x = inverse @ r
        ctx.save_for_backward(inverse, x)
        return x

    @staticmethod
    def backward(ctx: Any, grad_x: Tensor) -> tuple[Tensor | None, Tensor | None]:
        inverse, x = ctx.saved_tensors
        grad_r = inverse.transpose(-1, -2) @ grad_x
        grad_t = -(grad_r @ x.transpose(-1, -2)).tril(-1) if ctx.needs_input_grad[0] else None
        return grad_t, grad_r


def _intra_chunk(q: Tensor, k: Tensor, v: Tensor, gamma: Tensor, beta: Tensor) -> tuple[Tensor, ...]:
    """Per-chunk quantities of the chunked form, every chunk at once ([H, N, C, ...])."""
    per_channel = gamma.dim() == k.dim()
    decay: Tensor = _Decays.apply(gamma)  # type: ignore[no-untyped-call]  # torch's Function.apply is unannotated
    # I + A with A_ij = beta_i decay_ij k_i . k_j below the diagonal; the solve reads only that strictly lower
    # part, so the diagonal and the (zero) upper triangle are left as they come
    system = beta[..., :, None] * _pairs(k, k, decay, per_channel)
    rise = gamma.exp() if per_channel else gamma.exp()[..., None]
    rhs = beta[..., None] * torch.cat([v, rise * k], dim=-1)  # one solve for both right-hand sides
    solved: Tensor = UnitLowerSolve.apply(system, rhs)  # type: ignore[no-untyped-call]  # torch's Function.apply is unannotated
    u, w = torch.split(solved, [v.shape[-1], k.shape[-1]], dim=-1)
    return u, w, _pairs(q, k, decay, per_channel), rise


def _scan(u: Tensor, w: Tensor, carried_T: Tensor, keep: Tensor, active: list[int]) -> tuple[Tensor, Tensor]:
    """(state entering each chunk [H, N, d_k, d_v], correction delta of each chunk [H, N, C, d_v]).

    Step m updates the states of the ``active[m]`` documents that have an m-th chunk (a prefix):
    delta = u - w S, S <- keep * S + carried^T delta.
    """
    h, dk, dv = u.shape[0], w.shape[-1], u.shape[-1]
    state = u.new_zeros(h, active[0] if active else 0, dk, dv)
    states, deltas = [], []
    steps = zip(active, *(torch.split(x, active, dim=1) for x in (u, w, carried_T, keep)), strict=True)
    for n, u_m, w_m, c_m, keep_m in steps:
        state = state[:, :n] if n < state.shape[1] else state
        delta = u_m - w_m @ state
        states.append(state)
        deltas.append(delta)
        state = state * keep_m + c_m @ delta
    return torch.cat(states, dim=1), torch.cat(deltas, dim=1)


def gated_delta_rule_packed(q_THK: Tensor, k_THK: Tensor, v_THV: Tensor, g: Tensor, beta_TH: Tensor,
                            lengths: Sequence[int], chunk: int | None = None) -> Tensor:
    """Outputs [T, H, d_v] (fp32) of the gated delta rule, each document of ``lengths`` from a zero state.

    q, k: [T, H, d_k] raw (normalised here); v: [T, H, d_v]; beta in (0, 1); g: log decay (<= 0), one per
    head [T, H] (gated delta-net) or one per key channel [T, H, d_k] (KDA, Kimi delta attention).
    """
    dtype = torch.float32
    chunk = chunk or chunk_size(q_THK.device)
    q = _l2norm(q_THK.to(dtype)) * q_THK.shape[-1] ** -0.5
    k = _l2norm(k_THK.to(dtype))
    slots, active = scan_layout(lengths, chunk, q.device)
    n = sum(active)
    q, k, v = (_to_chunks(x, slots, n, chunk) for x in (q, k, v_THV.to(dtype)))
    g, beta = (_to_chunks(x.to(dtype), slots, n, chunk) for x in (g, beta_TH))
    gamma = g.cumsum(2)  # cumulative log decay inside each chunk
    u, w, qk, rise = _intra_chunk(q, k, v, gamma, beta)
    last = gamma[:, :, -1:]  # [H, N, 1] or [H, N, 1, d_k]
    per_channel = last.dim() == 4
    fall = (last - gamma).exp()
    carried_T = (k * (fall if per_channel else fall[..., None])).transpose(-1, -2)  # [H, N, d_k, C]
    keep = last.exp().transpose(-1, -2) if per_channel else last.exp()[..., None]  # over the state's rows
    states, delta = _scan(u, w, carried_T, keep, active)
    out = (q * rise) @ states + qk @ delta  # [H, N, C, d_v]
    return out.reshape(q.shape[0], n * chunk, -1)[:, slots].transpose(0, 1)


def _l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


class GatedDeltaNet(Protocol):
    """The members of transformers' GatedDeltaNet layers (``qwen3_next``, ``qwen4_exp``) read here, besides
    their input projections (``InterleavedProjections`` or ``SplitProjections``)."""

    activation: str
    key_dim: int
    value_dim: int
    head_k_dim: int
    head_v_dim: int
    num_k_heads: int
    num_v_heads: int
    A_log: Tensor
    dt_bias: Tensor
    conv1d: nn.Conv1d
    norm: nn.Module
    out_proj: nn.Module


class InterleavedProjections(Protocol):
    """``qwen3_next``'s input projections: q, k, v, z and b, a interleaved per key-head group."""

    in_proj_qkvz: nn.Module
    in_proj_ba: nn.Module

    def fix_query_key_value_ordering(self, qkvz: Tensor, ba: Tensor) -> tuple[Tensor, ...]: ...


class SplitProjections(Protocol):
    """The other GatedDeltaNet layout: one projection each for qkv, z, b and a."""

    in_proj_qkv: nn.Module
    in_proj_z: nn.Module
    in_proj_b: nn.Module
    in_proj_a: nn.Module


class KimiDeltaAttention(Protocol):
    """The members of transformers' KDA layer (``Glm5NextTextLinearAttention``) read here."""

    activation: str
    head_dim: int
    qkv_dim: int
    conv1d: nn.Conv1d
    q_proj: nn.Module
    k_proj: nn.Module
    v_proj: nn.Module
    b_proj: nn.Module
    forget_gate: nn.Module
    g_a_proj: nn.Module
    g_b_proj: nn.Module
    o_norm: nn.Module
    o_proj: nn.Module


def _interleaved(module: object) -> TypeGuard[InterleavedProjections]:
    return hasattr(module, "in_proj_qkvz")  # a transformers layer: which of the two layouts


def _projections(module: GatedDeltaNet, h_BTD: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(conv input [B, T, conv_dim], z [B, T, Hv, dv], b, a [B, T, Hv]) for both GatedDeltaNet layouts."""
    bsz, t, _ = h_BTD.shape
    if _interleaved(module):  # qwen3_next: interleaved per key-head group
        q, k, v, z, b, a = module.fix_query_key_value_ordering(module.in_proj_qkvz(h_BTD), module.in_proj_ba(h_BTD))
        mixed = torch.cat([x.reshape(bsz, t, -1) for x in (q, k, v)], dim=-1)
        return mixed, z, b, a
    split = cast(SplitProjections, module)  # not interleaved: the split layout
    z = split.in_proj_z(h_BTD).reshape(bsz, t, -1, module.head_v_dim)
    return split.in_proj_qkv(h_BTD), z, split.in_proj_b(h_BTD), split.in_proj_a(h_BTD)


def gated_delta_net_forward(module: GatedDeltaNet, lengths: Sequence[int], hidden_states: Tensor,
                            cache: object = None, attention_mask: Tensor | None = None, **kwargs: object) -> Tensor:
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
    out: Tensor = module.out_proj(core.reshape(1, hidden_states.shape[1], -1))
    return out


def kda_forward(module: KimiDeltaAttention, lengths: Sequence[int], hidden_states: Tensor, cache: object = None,
                attention_mask: Tensor | None = None, **kwargs: object) -> Tensor:
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
    out: Tensor = module.o_proj(module.o_norm(core[None], gate).reshape(1, t, -1))
    return out



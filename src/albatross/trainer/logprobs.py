"""Per-token log-probs and entropy of the targets, computed in chunks over tokens.

The LM head is applied to ``chunk_size`` tokens at a time, so the full [tokens x vocab] logits are never
held at once (at a 151,936-token vocabulary they would take 19 GB at 32K tokens in fp32). For a linear
head (every transformers causal LM) each chunk is one autograd function, ``LinearLogprobs``, which
writes the softmax gradient analytically, (onehot - p) * g, instead of back-propagating through
log_softmax, gather and the entropy: far fewer passes over [C, V] buffers (one exp in the forward, none
in a kept backward). What it keeps for the backward depends on the size of the micro-batch's logits
(``recompute``):

- small (under ``KEEP_BYTES``, e.g. a small vocabulary; on a CPU also each chunk's [C, V] under
  ``MMAP_BYTES``): the chunk's [C, V] probabilities are kept and the backward reuses them (no second LM-head
  matmul);
- large: only the chunk's log-sum-exp is kept and the backward recomputes the chunk's logits, so memory
  stays at a couple of [C, V] buffers in the backward too. On a CPU those buffers are a per-thread
  workspace reused by every chunk (``_Workspace``): fresh buffers past glibc's mmap ceiling (``MMAP_BYTES``)
  are new pages the kernel faults in and zeroes, which cost more than the second matmul (at a 16K
  vocabulary, one chunk's forward and backward took 10-30% less time recomputed into the workspace than kept
  in fresh buffers).

Any other head falls back to ``torch.utils.checkpoint`` around the plain computation.

``TokenLogprobs`` wraps any transformers causal LM as one module whose forward goes from token ids to
these per-token values; it is the root the trainer shards with FSDP2, so the embedding, final norm and
LM head are gathered by the root's hooks while each decoder layer is gathered by its own.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from albatross.config import default
from albatross.trainer.model import decoder_of

if TYPE_CHECKING:
    from transformers import PreTrainedModel

KEEP_BYTES = 256 << 20  # keep [T, V] fp32 probabilities for the backward below this size (per micro-batch)
MMAP_BYTES = 32 << 20  # glibc's largest mmap threshold: a fresh buffer this large is always new pages


def _chunk_logprobs(
    hidden_CH: Tensor, targets_C: Tensor, lm_head: nn.Module, temperature: float, softcap: float | None
) -> tuple[Tensor, Tensor]:
    """Plain autograd reference for any head: logits, log_softmax, gather, entropy."""
    logits_CV = lm_head(hidden_CH).float()
    if softcap is not None:  # Gemma-style final logit soft-capping
        logits_CV = torch.tanh(logits_CV / softcap) * softcap
    if temperature != 1.0:
        logits_CV = logits_CV / temperature
    logp_CV = torch.log_softmax(logits_CV, dim=-1)
    logp_C = logp_CV.gather(-1, targets_C.unsqueeze(-1)).squeeze(-1)
    entropy_C = -(logp_CV.exp() * logp_CV).sum(-1)
    return logp_C, entropy_C


def _autocast_dtype(device: torch.device, fallback: torch.dtype) -> torch.dtype:
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return fallback


class _Workspace(threading.local):
    """Reusable [C, V] fp32 buffers for the head's temporaries on a CPU, per thread.

    A [1024, 151936] fp32 chunk is 594 MiB, far past glibc's 32 MiB mmap ceiling, so every fresh one is new
    pages that the kernel faults in and zeroes: at a 16K vocabulary that made an ``exp`` into a fresh buffer
    5x slower than into a used one, and the LM-head matmul 1.8x. Only buffers whose contents die within one
    forward or one backward of one chunk come from here (never what a chunk keeps for its backward); a GPU
    has its caching allocator and gets fresh tensors.
    """

    def __init__(self) -> None:
        self.buffers: dict[tuple[int, torch.dtype], Tensor] = {}

    def get(self, slot: int, rows: int, cols: int, like: Tensor) -> Tensor:
        if like.device.type != "cpu":
            return like.new_empty(rows, cols, dtype=torch.float32)
        buf = self.buffers.get((slot, torch.float32))
        if buf is None or buf.numel() < rows * cols:
            buf = self.buffers[(slot, torch.float32)] = torch.empty(rows * cols, dtype=torch.float32)
        return buf[: rows * cols].view(rows, cols)


_WORKSPACE = _Workspace()


def _logits(hidden_CH: Tensor, weight_VH: Tensor, bias_V: Tensor | None, dtype: torch.dtype,
            into: bool = False) -> Tensor:
    """fp32 logits h W^T + b; ``into``: in the workspace (CPU, fp32 weights) rather than a fresh tensor."""
    if into and hidden_CH.device.type == "cpu" and dtype == torch.float32 == weight_VH.dtype == hidden_CH.dtype:
        out = _WORKSPACE.get(0, hidden_CH.shape[0], weight_VH.shape[0], hidden_CH)
        torch.mm(hidden_CH, weight_VH.T, out=out)
        return out if bias_V is None else out.add_(bias_V)
    bias = None if bias_V is None else bias_V.to(dtype)
    return torch.nn.functional.linear(hidden_CH.to(dtype), weight_VH.to(dtype), bias).float()


def _scaled(raw_CV: Tensor, temperature: float, softcap: float | None) -> Tensor:
    """z = softcap(raw) / temperature, in place when there is no soft-cap."""
    z = raw_CV if softcap is None else torch.tanh(raw_CV / softcap).mul_(softcap)
    return z.div_(temperature) if temperature != 1.0 else z


def _log_softmax_(z_CV: Tensor, scratch: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """(log p, p, log-sum-exp) of logits z with one exp pass; log p overwrites ``z_CV``; ``scratch``: p in the
    workspace (the caller keeps neither)."""
    top = z_CV.amax(dim=-1, keepdim=True)
    shifted = z_CV.sub_(top)
    rows, cols = shifted.shape
    p_CV = torch.exp(shifted, out=_WORKSPACE.get(1, rows, cols, shifted)) if scratch else shifted.exp()
    total = p_CV.sum(dim=-1, keepdim=True)
    p_CV.div_(total)
    log_total = total.log_()
    return shifted.sub_(log_total), p_CV, (top + log_total).squeeze(-1)


def _grad_z(p_CV: Tensor, logp_CV: Tensor | None, entropy_C: Tensor, targets_C: Tensor, g_logp: Tensor | None,
            g_ent: Tensor | None, inplace: bool) -> Tensor:
    """dL/dz_j = g_logp [j = t] - p_j (g_logp + g_ent (log p_j + H)); may overwrite ``p_CV`` (``inplace``).

    ``logp_CV`` None: log p is taken from p (p log p as ``xlogy``, 0 where p underflowed)."""
    g_logp = torch.zeros_like(entropy_C) if g_logp is None else g_logp
    if g_ent is None:
        grad = (p_CV.mul_ if inplace else p_CV.mul)(-g_logp[:, None])
    else:
        p_logp = p_CV * logp_CV if logp_CV is not None else torch.xlogy(p_CV, p_CV)
        grad = p_logp.add_(p_CV * entropy_C[:, None]).mul_(g_ent[:, None]).add_(p_CV * g_logp[:, None]).neg_()
    return grad.scatter_add_(-1, targets_C[:, None], g_logp[:, None])


class LinearLogprobs(torch.autograd.Function):
    """Target log-probs and entropies of one chunk of a linear LM head, with an analytic backward.

    z = softcap(h W^T + b) / temperature, p = softmax(z); d logp_t / dz_j = [j = t] - p_j and
    d H / dz_j = -p_j (log p_j + H). With ``recompute`` the backward rebuilds log p from the saved
    log-sum-exp; otherwise the forward keeps the chunk's [C, V] probabilities.
    """

    @staticmethod
    def forward(ctx: Any, hidden_CH: Tensor, weight_VH: Tensor, bias_V: Tensor | None, targets_C: Tensor,
                temperature: float, softcap: float | None, recompute: bool) -> tuple[Tensor, Tensor]:
        dtype = _autocast_dtype(hidden_CH.device, weight_VH.dtype)
        with torch.autocast(hidden_CH.device.type, enabled=False):
            z_CV = _scaled(_logits(hidden_CH, weight_VH, bias_V, dtype, into=True), temperature, softcap)
            logp_CV, p_CV, lse_C = _log_softmax_(z_CV, scratch=recompute)
            logp_C = logp_CV.gather(-1, targets_C[:, None])[:, 0]
            entropy_C = -torch.einsum("cv,cv->c", p_CV, logp_CV)
        kept = lse_C if recompute else p_CV
        ctx.save_for_backward(hidden_CH, weight_VH, bias_V, targets_C, kept, entropy_C)
        ctx.config = (dtype, temperature, softcap, recompute)
        ctx.set_materialize_grads(False)
        return logp_C, entropy_C

    @staticmethod
    def backward(ctx: Any, g_logp: Tensor | None, g_ent: Tensor | None) -> tuple[Tensor | None, ...]:
        hidden_CH, weight_VH, bias_V, targets_C, kept, entropy_C = ctx.saved_tensors
        dtype, temperature, softcap, recompute = ctx.config
        if g_logp is None and g_ent is None:
            return (None,) * 7
        with torch.autocast(hidden_CH.device.type, enabled=False):
            raw_CV = _logits(hidden_CH, weight_VH, bias_V, dtype, into=softcap is None) if recompute or softcap \
                else None
            slope_CV = None if softcap is None or raw_CV is None else 1 - torch.tanh(raw_CV / softcap).square_()
            logp_CV: Tensor | None = None
            p_CV: Tensor = kept
            if recompute and raw_CV is not None:  # without an entropy gradient log p is not needed: p overwrites it
                scaled_CV = _scaled(raw_CV, temperature, softcap).sub_(kept[:, None])
                rows, cols = scaled_CV.shape
                p_CV, logp_CV = ((scaled_CV.exp_(), None) if g_ent is None
                                 else (torch.exp(scaled_CV, out=_WORKSPACE.get(1, rows, cols, scaled_CV)), scaled_CV))
            grad_CV = _grad_z(p_CV, logp_CV, entropy_C, targets_C, g_logp, g_ent, inplace=recompute)
            if slope_CV is not None:
                grad_CV.mul_(slope_CV)
            if temperature != 1.0:
                grad_CV.div_(temperature)
            return LinearLogprobs._input_grads(ctx, grad_CV, hidden_CH, weight_VH, bias_V, dtype)

    @staticmethod
    def _input_grads(ctx: Any, grad_CV: Tensor, hidden_CH: Tensor, weight_VH: Tensor, bias_V: Tensor | None,
                     dtype: torch.dtype) -> tuple[Tensor | None, ...]:
        g = grad_CV.to(dtype)
        g_hidden = (g @ weight_VH.to(dtype)).to(hidden_CH.dtype) if ctx.needs_input_grad[0] else None
        g_weight = (g.T @ hidden_CH.to(dtype)).to(weight_VH.dtype) if ctx.needs_input_grad[1] else None
        g_bias = grad_CV.sum(0).to(bias_V.dtype) if bias_V is not None and ctx.needs_input_grad[2] else None
        return g_hidden, g_weight, g_bias, None, None, None, None


def _one_chunk(hidden_CH: Tensor, targets_C: Tensor, lm_head: nn.Module, temperature: float,
               softcap: float | None, recompute: bool) -> tuple[Tensor, Tensor]:
    if type(lm_head) is nn.Linear:
        out: tuple[Tensor, Tensor] = LinearLogprobs.apply(  # type: ignore[no-untyped-call]  # torch: untyped
            hidden_CH, lm_head.weight, lm_head.bias, targets_C, temperature, softcap, recompute)
        return out
    needs_grad = torch.is_grad_enabled() and (
        hidden_CH.requires_grad or any(p.requires_grad for p in lm_head.parameters())
    )
    args = (hidden_CH, targets_C, lm_head, temperature, softcap)
    return checkpoint(_chunk_logprobs, *args, use_reentrant=False) if needs_grad else _chunk_logprobs(*args)


def _vocab_size(lm_head: nn.Module) -> int:
    # any torch head: a Linear's weight, or a custom module's out_features
    weight = getattr(lm_head, "weight", None)
    return int(weight.shape[0]) if weight is not None else int(getattr(lm_head, "out_features", 1 << 30))


def chunked_logprobs(
    hidden_TH: Tensor,
    lm_head: nn.Module,
    targets_T: Tensor,
    *,
    chunk_size: int = default("trainer", "logprob_chunk"),
    temperature: float = 1.0,
    softcap: float | None = None,
    entropy_grad: bool = False,
    recompute: bool | None = None,
) -> tuple[Tensor, Tensor]:
    """Log-prob of each target token (float32, differentiable) and the entropy at each position.

    ``hidden_TH``: final hidden states [T, H]; ``targets_T``: next-token ids [T]; ``temperature`` must
    match the one the rollout sampled with so trainer and rollout log-probs are comparable. The entropy
    is detached unless ``entropy_grad`` (for an entropy bonus). ``recompute``: recompute the logits in
    the backward instead of keeping [T, V] probabilities (None: when those would pass ``KEEP_BYTES``, or on
    a CPU when one chunk's would pass ``MMAP_BYTES``).
    """
    if hidden_TH.shape[0] != targets_T.shape[0]:
        raise ValueError(f"hidden has {hidden_TH.shape[0]} tokens but targets {targets_T.shape[0]}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if recompute is None:
        vocab = _vocab_size(lm_head)
        # a CPU recomputes into its reused workspace faster than it fills fresh kept buffers past the mmap ceiling
        big_chunks = hidden_TH.device.type == "cpu" and min(chunk_size, hidden_TH.shape[0]) * vocab * 4 >= MMAP_BYTES
        recompute = big_chunks or hidden_TH.shape[0] * vocab * 4 > KEEP_BYTES
    logps, ents = [], []
    for start in range(0, hidden_TH.shape[0], chunk_size):
        h, t = hidden_TH[start : start + chunk_size], targets_T[start : start + chunk_size]
        lp, ent = _one_chunk(h, t, lm_head, temperature, softcap, recompute)
        logps.append(lp)
        ents.append(ent if entropy_grad else ent.detach())
    if not logps:
        empty = hidden_TH.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat(logps), torch.cat(ents)


def full_logprobs(
    hidden_TH: Tensor, lm_head: nn.Module, targets_T: Tensor, *, temperature: float = 1.0,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor]:
    """The straightforward reference: the whole [T, V] logits at once, plain autograd."""
    logp_T, entropy_T = _chunk_logprobs(hidden_TH, targets_T, lm_head, temperature, softcap)
    return logp_T, entropy_T.detach()


class TokenLogprobs(nn.Module):
    """A causal LM as a module from (input ids, positions, targets) to per-token log-probs and entropies.

    Model-agnostic over transformers causal LMs: hidden states come from ``model.get_decoder()`` and the
    head from ``model.get_output_embeddings()``. ``chunk_size=None`` computes the full logits at once
    (the reference path the benchmark compares against). ``exact_packing`` (default) first applies
    ``albatross.models.prepare_for_packing``, so the hybrid families' linear attention, convs, n-gram
    embeddings and indexers never cross a packed document boundary; False keeps the modules as shipped.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        chunk_size: int | None = default("trainer", "logprob_chunk"),
        temperature: float = 1.0,
        entropy_grad: bool = False,
        recompute: bool | None = None,
        exact_packing: bool = True,
    ) -> None:
        super().__init__()
        if exact_packing:
            from albatross.models import prepare_for_packing

            prepare_for_packing(model)
        self.model = model
        self.chunk_size = chunk_size
        self.temperature = temperature
        self.entropy_grad = entropy_grad
        self.recompute = recompute
        # a transformers config field only some families have (gemma)
        self.softcap: float | None = getattr(model.config, "final_logit_softcapping", None)

    def forward(
        self, input_ids: Tensor, position_ids: Tensor, targets: Tensor, routing: Tensor | None = None,
        score_mask: Tensor | None = None, **attention: Any,
    ) -> tuple[Tensor, Tensor]:
        """``routing``: experts recorded by the engine per input position (``models/routing.py``): replayed.
        ``score_mask`` ([T] bool): apply the LM head only where it is set (the loss tokens); elsewhere the
        log-prob and entropy are 0, with no gradient. A mask with nothing set scores the first position, so
        the head and every layer are still in the graph (an FSDP rank's padding micro-batch must run the
        same backward as the others)."""
        from albatross.models import routing as replay

        current = replay.install(self.model) if routing is not None else replay.installed(self.model)
        if current is not None:
            replay.set_forced(current, routing)
        out = decoder_of(self.model)(
            input_ids=input_ids, position_ids=position_ids, use_cache=False, **attention
        )
        hidden_TH = out.last_hidden_state[0]
        if score_mask is None:
            return self._score(hidden_TH, targets)
        where = score_mask.reshape(-1).nonzero().squeeze(-1)
        if where.numel() == 0:
            where = where.new_zeros(1)
        logp, entropy = self._score(hidden_TH.index_select(0, where), targets.reshape(-1).index_select(0, where))
        zeros = logp.new_zeros(hidden_TH.shape[0])
        return zeros.index_copy(0, where, logp), zeros.index_copy(0, where, entropy)

    def _score(self, hidden_TH: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        """Log-probs and entropies of ``targets`` from the final hidden states: the LM head in chunks."""
        head: nn.Module = self.model.get_output_embeddings()  # type: ignore[no-untyped-call]  # transformers
        if self.chunk_size is None:
            return full_logprobs(hidden_TH, head, targets, temperature=self.temperature, softcap=self.softcap)
        return chunked_logprobs(
            hidden_TH, head, targets, chunk_size=self.chunk_size, temperature=self.temperature,
            softcap=self.softcap, entropy_grad=self.entropy_grad, recompute=self.recompute,
        )

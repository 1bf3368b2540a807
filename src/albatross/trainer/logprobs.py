"""Per-token log-probs and entropy of the targets, computed in chunks over tokens.

The LM head is applied to ``chunk_size`` tokens at a time, so the full [tokens x vocab] logits are never
held at once (at a 151,936-token vocabulary they would take 19 GB at 32K tokens in fp32). With grad
enabled each chunk runs under ``torch.utils.checkpoint``: its logits are dropped after the forward and
recomputed in the backward, so memory stays chunked in the backward too.

``TokenLogprobs`` wraps any transformers causal LM as one module whose forward goes from token ids to
these per-token values; it is the root the trainer shards with FSDP2, so the embedding, final norm and
LM head are gathered by the root's hooks while each decoder layer is gathered by its own.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint


def _chunk_logprobs(
    hidden_CH: Tensor, targets_C: Tensor, lm_head: nn.Module, temperature: float, softcap: float | None
) -> tuple[Tensor, Tensor]:
    logits_CV = lm_head(hidden_CH).float()
    if softcap is not None:  # Gemma-style final logit soft-capping
        logits_CV = torch.tanh(logits_CV / softcap) * softcap
    if temperature != 1.0:
        logits_CV = logits_CV / temperature
    logp_CV = torch.log_softmax(logits_CV, dim=-1)
    logp_C = logp_CV.gather(-1, targets_C.unsqueeze(-1)).squeeze(-1)
    entropy_C = -(logp_CV.exp() * logp_CV).sum(-1)
    return logp_C, entropy_C


def chunked_logprobs(
    hidden_TH: Tensor,
    lm_head: nn.Module,
    targets_T: Tensor,
    *,
    chunk_size: int = 1024,
    temperature: float = 1.0,
    softcap: float | None = None,
    entropy_grad: bool = False,
) -> tuple[Tensor, Tensor]:
    """Log-prob of each target token (float32, differentiable) and the entropy at each position.

    ``hidden_TH``: final hidden states [T, H]; ``targets_T``: next-token ids [T]; ``temperature`` must
    match the one the rollout sampled with so trainer and rollout log-probs are comparable. The entropy
    is detached unless ``entropy_grad`` (for an entropy bonus).
    """
    if hidden_TH.shape[0] != targets_T.shape[0]:
        raise ValueError(f"hidden has {hidden_TH.shape[0]} tokens but targets {targets_T.shape[0]}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    use_ckpt = torch.is_grad_enabled() and (
        hidden_TH.requires_grad or any(p.requires_grad for p in lm_head.parameters())
    )
    logps, ents = [], []
    for start in range(0, hidden_TH.shape[0], chunk_size):
        h, t = hidden_TH[start : start + chunk_size], targets_T[start : start + chunk_size]
        args = (h, t, lm_head, temperature, softcap)
        lp, ent = checkpoint(_chunk_logprobs, *args, use_reentrant=False) if use_ckpt else _chunk_logprobs(*args)
        logps.append(lp)
        ents.append(ent if entropy_grad else ent.detach())
    if not logps:
        empty = hidden_TH.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat(logps), torch.cat(ents)


def full_logprobs(
    hidden_TH: Tensor, lm_head: nn.Module, targets_T: Tensor, *, temperature: float = 1.0
) -> tuple[Tensor, Tensor]:
    """The straightforward reference: the whole [T, V] logits at once (for tests and the benchmark)."""
    logp_TV = torch.log_softmax(lm_head(hidden_TH).float() / temperature, dim=-1)
    entropy_T = -(logp_TV.exp() * logp_TV).sum(-1)
    return logp_TV.gather(-1, targets_T.unsqueeze(-1)).squeeze(-1), entropy_T.detach()


class TokenLogprobs(nn.Module):
    """A causal LM as a module from (input ids, positions, targets) to per-token log-probs and entropies.

    Model-agnostic over transformers causal LMs: hidden states come from ``model.get_decoder()`` and the
    head from ``model.get_output_embeddings()``. ``chunk_size=None`` computes the full logits at once
    (the reference path the benchmark compares against).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        chunk_size: int | None = 1024,
        temperature: float = 1.0,
        entropy_grad: bool = False,
    ) -> None:
        super().__init__()
        self.model = model
        self.chunk_size = chunk_size
        self.temperature = temperature
        self.entropy_grad = entropy_grad
        self.softcap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)

    def forward(
        self, input_ids: Tensor, position_ids: Tensor, targets: Tensor, **attention: Any
    ) -> tuple[Tensor, Tensor]:
        out = self.model.get_decoder()(
            input_ids=input_ids, position_ids=position_ids, use_cache=False, **attention
        )
        hidden_TH = out.last_hidden_state[0]
        head = self.model.get_output_embeddings()
        if self.chunk_size is None:
            return full_logprobs(hidden_TH, head, targets, temperature=self.temperature)
        return chunked_logprobs(
            hidden_TH, head, targets, chunk_size=self.chunk_size, temperature=self.temperature,
            softcap=self.softcap, entropy_grad=self.entropy_grad,
        )

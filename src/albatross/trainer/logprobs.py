"""Per-token log-probs and entropy of the targets, computed in chunks over tokens.

The LM head is applied to ``chunk_size`` tokens at a time, so the full [tokens x vocab] logits are never
held at once. With grad enabled each chunk runs under ``torch.utils.checkpoint``: its logits are dropped
after the forward and recomputed in the backward, so memory stays chunked in the backward too.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint


def _chunk_logprobs(
    hidden_CH: Tensor, targets_C: Tensor, lm_head: nn.Module, temperature: float
) -> tuple[Tensor, Tensor]:
    logits_CV = lm_head(hidden_CH).float()
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
) -> tuple[Tensor, Tensor]:
    """Log-prob of each target token (float32, differentiable) and the entropy at each position (detached).

    ``hidden_TH``: final hidden states [T, H]; ``targets_T``: next-token ids [T]; ``temperature`` must
    match the one the rollout sampled with so trainer and rollout log-probs are comparable.
    """
    if hidden_TH.shape[0] != targets_T.shape[0]:
        raise ValueError(f"hidden has {hidden_TH.shape[0]} tokens but targets {targets_T.shape[0]}")
    use_ckpt = torch.is_grad_enabled() and (
        hidden_TH.requires_grad or any(p.requires_grad for p in lm_head.parameters())
    )
    logps, ents = [], []
    for start in range(0, hidden_TH.shape[0], chunk_size):
        h, t = hidden_TH[start : start + chunk_size], targets_T[start : start + chunk_size]
        if use_ckpt:
            lp, ent = checkpoint(_chunk_logprobs, h, t, lm_head, temperature, use_reentrant=False)
        else:
            lp, ent = _chunk_logprobs(h, t, lm_head, temperature)
        logps.append(lp)
        ents.append(ent.detach())
    if not logps:
        empty = hidden_TH.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat(logps), torch.cat(ents)

"""Speculative decoding without a draft model: n-gram prompt lookup, verified in one forward pass.

Drafts: the longest suffix (``n_max`` down to ``n_min`` tokens) of a row's context (prompt + generated) that
occurred before is looked up in a per-row index, and the tokens that followed its most recent occurrence are
proposed. Agents copy file names, paths and commands from their context, so such drafts are often right.

Verification of draft tokens ``d_1..d_K`` (the draft "distribution" q is a point mass on ``d_j``):
- greedy rows accept ``d_j`` while it equals the argmax, so the output is the greedy output, token for token;
- sampled rows accept ``d_j`` with probability ``min(1, p(d_j) / q(d_j)) = p(d_j)``; at the first rejection
  the token is drawn from the residual ``norm(max(0, p - q))`` = ``p`` without ``d_j``, renormalised; when all
  drafts are accepted a bonus token is drawn from ``p`` at the next position. Every output token is then
  distributed exactly as in plain sampling, and its log-prob is ``log p(token)``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from albatross.engine.builtin.sampling import SamplingTensors, draw


class NgramIndex:
    """Where each n-gram of a token sequence last occurred with a continuation (``n_min <= n <= n_max``)."""

    def __init__(self, n_min: int = 1, n_max: int = 3) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= n_min <= n_max, got n_min={n_min}, n_max={n_max}")
        self.n_min, self.n_max = n_min, n_max
        self.tokens: list[int] = []
        self._next: dict[tuple[int, ...], int] = {}  # n-gram -> index of the token after its last occurrence

    def extend(self, ids: Iterable[int]) -> None:
        toks, table = self.tokens, self._next
        for tok in ids:
            i = len(toks)
            for n in range(self.n_min, min(self.n_max, i) + 1):
                table[tuple(toks[i - n : i])] = i
            toks.append(tok)

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the last earlier occurrence of the longest matching suffix."""
        toks = self.tokens
        if k <= 0:
            return []
        for n in range(min(self.n_max, len(toks)), self.n_min - 1, -1):
            start = self._next.get(tuple(toks[len(toks) - n :]))
            if start is not None:
                return toks[start : start + k]
        return []


@dataclass
class Verdict:
    """Outcome of verifying one step's drafts, per row."""

    accepted_B: torch.Tensor  # long: draft tokens accepted
    draft_logprobs_BK: torch.Tensor  # log p of each draft token at its position
    final_ids_B: torch.Tensor  # the token drawn after the accepted drafts (residual or bonus)
    final_logprobs_B: torch.Tensor  # its log p (under p, not the residual)


def verify(
    logp_BTV: torch.Tensor, drafts_BK: torch.Tensor, n_drafts_B: torch.Tensor, st: SamplingTensors,
    index_B: torch.Tensor,
) -> Verdict:
    """Accept/reject ``drafts_BK`` (padded with -1) against the sampling distributions ``logp_BTV``
    (``T = K + 1`` positions); ``index_B`` is the index of each row's next output token (for its uniforms)."""
    B, K = drafts_BK.shape
    rows_B = torch.arange(B, device=logp_BTV.device)
    safe_BK = drafts_BK.clamp(min=0)
    draft_lp_BK = logp_BTV[:, :K].gather(2, safe_BK[..., None]).squeeze(2)
    width = st.uniforms_B2T.shape[2]
    token_BK = (index_B[:, None] + torch.arange(K, device=index_B.device)).clamp(max=width - 1)
    u_accept_BK = st.uniforms_B2T[:, 1].gather(1, token_BK)
    ok_BK = torch.where(
        st.greedy_B[:, None], safe_BK == logp_BTV[:, :K].argmax(-1), u_accept_BK < draft_lp_BK.exp()
    )
    ok_BK &= torch.arange(K, device=ok_BK.device)[None, :] < n_drafts_B[:, None]
    accepted_B = ok_BK.long().cumprod(1).sum(1)
    final_logp_BV = logp_BTV[rows_B, accepted_B]
    rejected_B = accepted_B < n_drafts_B
    residual_BV = final_logp_BV.clone()
    rejected_ids = safe_BK[rows_B, accepted_B.clamp(max=K - 1)]
    residual_BV[rows_B[rejected_B], rejected_ids[rejected_B]] = float("-inf")
    u_B = st.uniforms_B2T[:, 0].gather(1, (index_B + accepted_B).clamp(max=width - 1)[:, None]).squeeze(1)
    final_B = draw(residual_BV.log_softmax(-1), u_B, st.greedy_B)
    return Verdict(accepted_B, draft_lp_BK, final_B, final_logp_BV.gather(1, final_B[:, None]).squeeze(1))

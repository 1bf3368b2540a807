"""Sampling for the running batch: all rows at once, no Python loop over the batch.

- temperature 0 is greedy; its log-prob is ``log_softmax(logits)`` of the chosen id.
- otherwise the distribution sampled from is ``softmax(logits / T)`` restricted to the top-k ids, then to the
  top-p nucleus of that (renormalised after top-k), renormalised. The returned log-prob is the log of that
  truncated, renormalised distribution at the sampled id; for T = 1 with no top-k / top-p it is exactly
  ``log_softmax(logits)``.
- every request owns two streams of uniforms drawn once from its own ``torch.Generator`` (seeded with
  ``SamplingParams.seed`` when given): ``sample`` for the inverse-CDF draw of its n-th token and ``accept`` for
  the accept/reject test of a drafted n-th token (speculative decoding). A seeded request therefore gives the
  same ids whatever else is in the batch, and whenever it joined. The streams hold ``max_tokens`` values each,
  so ``max_tokens`` must be bounded before a request gets here: the scheduler clamps it to the positions its
  prompt leaves in the model (a request of ``max_tokens = 10**9`` would otherwise allocate 8 GB up front).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from albatross.engine.base import SamplingParams


def request_uniforms(params: SamplingParams, seed_source: torch.Generator) -> torch.Tensor:
    """``[2, max(1, max_tokens)]``: row 0 the sampling uniforms, row 1 the accept/reject uniforms."""
    seed = params.seed
    if seed is None:
        seed = int(torch.randint(0, 2**62, (1,), generator=seed_source))
    generator = torch.Generator().manual_seed(seed)
    n = max(1, params.max_tokens)
    sample_u = torch.rand(n, generator=generator)
    return torch.stack([sample_u, torch.rand(n, generator=generator)])


@dataclass
class SamplingTensors:
    """Per-row sampling parameters of the running rows, as tensors (row r of every field is one request)."""

    greedy_B: torch.Tensor  # bool
    temperature_B: torch.Tensor  # float; 1 for greedy rows
    top_k_B: torch.Tensor  # long; vocab size when off or greedy
    top_p_B: torch.Tensor  # float; 1 when off or greedy
    uniforms_B2T: torch.Tensor  # float in [0, 1): [row, stream (0 sample, 1 accept), token index]
    max_tokens_B: torch.Tensor  # long
    stop_ids_BS: torch.Tensor  # long, padded with -1
    truncate: bool  # any row uses top-k or top-p
    k_max: int  # largest top_k (vocab size when some row has none): only the k_max best ids can be sampled
    all_greedy: bool

    def repeat(self, n: int) -> SamplingTensors:
        """Each row repeated ``n`` times in a row (for scoring ``n`` positions per row)."""

        def rep(t: torch.Tensor) -> torch.Tensor:
            return t.repeat_interleave(n, dim=0)

        return SamplingTensors(
            rep(self.greedy_B), rep(self.temperature_B), rep(self.top_k_B), rep(self.top_p_B),
            rep(self.uniforms_B2T), rep(self.max_tokens_B), rep(self.stop_ids_BS), self.truncate,
            self.k_max, self.all_greedy,
        )


def build_sampling_tensors(
    params: Sequence[SamplingParams], uniforms: Sequence[torch.Tensor], vocab: int, device: torch.device
) -> SamplingTensors:
    greedy = [p.temperature == 0 for p in params]
    top_k = [vocab if g or p.top_k == 0 else min(p.top_k, vocab) for p, g in zip(params, greedy, strict=True)]
    top_p = [1.0 if g else p.top_p for p, g in zip(params, greedy, strict=True)]
    n_stop = max(1, max(len(p.stop_token_ids) for p in params))
    stops = [list(p.stop_token_ids) + [-1] * (n_stop - len(p.stop_token_ids)) for p in params]
    width = max(u.shape[1] for u in uniforms)
    padded = torch.zeros(len(uniforms), 2, width)
    for r, u in enumerate(uniforms):
        padded[r, :, : u.shape[1]] = u

    def tensor(values: Sequence[float] | Sequence[Sequence[int]], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    return SamplingTensors(
        greedy_B=tensor(greedy, torch.bool),
        temperature_B=tensor(
            [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)], torch.float32
        ),
        top_k_B=tensor(top_k, torch.long),
        top_p_B=tensor(top_p, torch.float32),
        uniforms_B2T=padded.to(device),
        max_tokens_B=tensor([p.max_tokens for p in params], torch.long),
        stop_ids_BS=tensor(stops, torch.long),
        truncate=any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p),
        k_max=max(top_k),
        all_greedy=all(greedy),
    )


def _support_sorted(sorted_BK: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Which of the sorted logits survive top-k and then the top-p nucleus of the renormalised top-k."""
    rank_K = torch.arange(sorted_BK.shape[-1], device=sorted_BK.device)
    keep_BK = rank_K[None, :] < st.top_k_B[:, None]
    probs_BK = sorted_BK.masked_fill(~keep_BK, float("-inf")).softmax(-1)
    mass_before_BK = probs_BK.cumsum(-1) - probs_BK
    return keep_BK & ((mass_before_BK < st.top_p_B[:, None]) | (st.top_p_B[:, None] >= 1.0))


def _truncate(scaled_BV: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Set logits outside each row's top-k / top-p support to -inf, keeping vocabulary order."""
    if st.k_max < scaled_BV.shape[-1]:  # every row has a top-k: a partial sort is enough
        sorted_BK, order_BK = scaled_BV.topk(st.k_max, dim=-1, sorted=True)
    else:
        sorted_BK, order_BK = scaled_BV.sort(-1, descending=True)
    keep_BV = torch.zeros_like(scaled_BV, dtype=torch.bool).scatter_(
        1, order_BK, _support_sorted(sorted_BK, st)
    )
    return scaled_BV.masked_fill(~keep_BV, float("-inf"))


def log_distribution(logits_BV: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """``log`` of each row's sampling distribution (tempered, truncated, renormalised); greedy rows: log_softmax."""
    scaled_BV = logits_BV.float() / st.temperature_B[:, None]
    if st.truncate:
        scaled_BV = _truncate(scaled_BV, st)
    return scaled_BV.log_softmax(-1)


def draw(logp_BV: torch.Tensor, u_B: torch.Tensor, greedy_B: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw from ``exp(logp_BV)`` with uniforms ``u_B`` (argmax for greedy rows).

    The CDF runs over the vocabulary in id order, so a row's id depends only on its own distribution and
    uniform, not on the rest of the batch."""
    cdf_BV = logp_BV.exp().cumsum(-1)
    x_B1 = (u_B * cdf_BV[:, -1]).unsqueeze(1)
    ids_B = torch.searchsorted(cdf_BV, x_B1, right=True).squeeze(1).clamp_(max=logp_BV.shape[-1] - 1)
    ids_B = torch.where(greedy_B, logp_BV.argmax(-1), ids_B)
    logprobs_B = logp_BV.gather(1, ids_B[:, None]).squeeze(1)
    # float rounding at the top of the CDF can land on an excluded id; take the row's best id instead
    return torch.where(torch.isinf(logprobs_B), logp_BV.argmax(-1), ids_B)


def sample(
    logits_BV: torch.Tensor, st: SamplingTensors, index_B: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one id per row (its ``index_B``-th token); return ``(ids_B, logprobs_B)``."""
    if st.all_greedy:
        logp_BV = logits_BV.float().log_softmax(-1)
        ids_B = logp_BV.argmax(-1)
        return ids_B, logp_BV.gather(1, ids_B[:, None]).squeeze(1)
    logp_BV = log_distribution(logits_BV, st)
    index_B = index_B.clamp(max=st.uniforms_B2T.shape[2] - 1)  # free slots run past their (unused) uniforms
    u_B = st.uniforms_B2T[:, 0].gather(1, index_B[:, None]).squeeze(1)
    ids_B = draw(logp_BV, u_B, st.greedy_B)
    return ids_B, logp_BV.gather(1, ids_B[:, None]).squeeze(1)

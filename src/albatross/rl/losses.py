"""Policy-gradient losses over packed tokens: truncated importance sampling and variants to compare.

All variants share one signature. Inputs are 1-D tensors over the tokens of a micro-batch:
``logprobs_new`` (trainer log-probs, with grad), ``logprobs_old`` (rollout log-probs), ``advantages``
(the trajectory's advantage on each token), ``loss_mask`` (1 for tokens to train on) and ``versions``
(policy version that generated each token). Shared knobs:

- ``max_staleness``: a token with current_version - version > max_staleness gives no gradient.
- ``p_floor``: loss floor; a negative-advantage token whose current probability is below ``p_floor``
  gives no gradient, so rare tokens are not pushed to zero (0 turns it off).
- ``n_floor``: the loss is -sum(...) / max(num_batch_tokens, n_floor), so small batches do not take
  larger steps (1 turns it off; set it near the typical batch token count).

Every knob's default is the ``[rl]`` config field's (``albatross config`` lists them); ``loss_knobs``
maps a config section to the knobs of its chosen loss.

``num_batch_tokens`` is the number of loss-mask tokens in the *whole* batch (stale ones included), so
summing the losses of the micro-batches gives the loss of the batch exactly. It defaults to the
micro-batch's own count.

Metrics are floats over the micro-batch's loss tokens: ``tokens``, ``active_tokens`` (fresh and not
floored), ``stale_tokens_dropped``, ``floored_tokens``, ``staleness_mean``, ``staleness_max``,
``mismatch_kl`` (mean of r - log r - 1 with r = exp(new - old)), ``ratio_max``,
``truncated_fraction`` (share of loss tokens whose importance weight was cut by the variant), and the
staleness histogram of the tokens kept, ``staleness_hist/<k>`` (count of tokens k versions old).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor

from albatross.config import RLConfig, default

LossOutput = tuple[Tensor, dict[str, float]]


class LossFn(Protocol):
    def __call__(
        self,
        logprobs_new: Tensor,
        logprobs_old: Tensor,
        advantages: Tensor,
        loss_mask: Tensor,
        versions: Tensor,
        *,
        current_version: int,
        num_batch_tokens: int | None = None,
    ) -> LossOutput: ...


def _token_masks(
    logprobs_new: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    versions: Tensor,
    current_version: int,
    max_staleness: int,
    p_floor: float,
) -> tuple[Tensor, dict[str, float]]:
    """Boolean mask of tokens that give gradient (loss mask, fresh, above the floor), and its metrics."""
    mask = loss_mask.bool()
    staleness = (current_version - versions).to(torch.float32)
    stale = mask & (staleness > max_staleness)
    prob = logprobs_new.detach().exp()
    floored = mask & ~stale & (advantages < 0) & (prob < p_floor)
    active = mask & ~stale & ~floored
    n = int(mask.sum())
    metrics = {
        "tokens": float(n),
        "active_tokens": float(active.sum()),
        "stale_tokens_dropped": float(stale.sum()),
        "floored_tokens": float(floored.sum()),
        "staleness_mean": float(staleness[mask].mean()) if n else 0.0,
        "staleness_max": float(staleness[mask].max()) if n else 0.0,
        **_staleness_hist(staleness[mask & ~stale]),
    }
    return active, metrics


def _staleness_hist(staleness: Tensor) -> dict[str, float]:
    """Counts of fresh loss tokens per staleness value: ``staleness_hist/<k>``."""
    values, counts = torch.unique(staleness.to(torch.long), return_counts=True)
    return {f"staleness_hist/{int(v)}": float(c) for v, c in zip(values, counts, strict=True)}


def mismatch_kl(log_ratio: Tensor, mask: Tensor) -> float:
    """Trainer/rollout mismatch over ``mask`` tokens: mean of the k3 KL estimate r - log r - 1 (0: none)."""
    lr = log_ratio.detach()[mask.bool()]
    return float((lr.exp() - lr - 1).mean()) if lr.numel() else 0.0


def _ratio_metrics(log_ratio: Tensor, mask: Tensor) -> dict[str, float]:
    """Trainer/rollout mismatch over loss tokens: k3 KL estimate r - log r - 1, and the largest ratio."""
    lr = log_ratio.detach()[mask.bool()]
    if lr.numel() == 0:
        return {"mismatch_kl": 0.0, "ratio_max": 0.0}
    return {"mismatch_kl": mismatch_kl(log_ratio, mask), "ratio_max": float(lr.exp().max())}


def _reduce(
    surrogate: Tensor, active: Tensor, loss_mask: Tensor, num_batch_tokens: int | None, n_floor: int
) -> Tensor:
    """-sum over active tokens of the per-token surrogate, divided by max(N, n_floor)."""
    n = int(loss_mask.sum()) if num_batch_tokens is None else num_batch_tokens
    return -(surrogate * active).sum() / max(n, n_floor, 1)


def _assemble(
    surrogate: Tensor,
    cut: Tensor,
    log_ratio: Tensor,
    active: Tensor,
    metrics: dict[str, float],
    loss_mask: Tensor,
    num_batch_tokens: int | None,
    n_floor: int,
) -> LossOutput:
    """Shared tail of every variant: reduce the surrogate and collect metrics."""
    loss = _reduce(surrogate, active, loss_mask, num_batch_tokens, n_floor)
    metrics = {**metrics, **_ratio_metrics(log_ratio, loss_mask)}
    metrics["truncated_fraction"] = float((cut & active).sum()) / max(metrics["tokens"], 1.0)
    metrics["loss"] = float(loss.detach())
    return loss, metrics


def tis_loss(
    logprobs_new: Tensor,
    logprobs_old: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    versions: Tensor,
    *,
    current_version: int,
    num_batch_tokens: int | None = None,
    cap: float = default("rl", "is_cap"),
    max_staleness: int = default("rl", "max_staleness"),
    p_floor: float = default("rl", "p_floor"),
    n_floor: int = default("rl", "n_floor"),
) -> LossOutput:
    """Truncated importance sampling: -sum_t m_t * sg(min(r_t, cap)) * A_t * logp_t / max(N, n_floor)."""
    active, metrics = _token_masks(
        logprobs_new, advantages, loss_mask, versions, current_version, max_staleness, p_floor
    )
    log_ratio = logprobs_new - logprobs_old
    ratio = log_ratio.detach().exp()
    weight = ratio.clamp(max=cap)
    surrogate = weight * advantages * logprobs_new
    cut = ratio > cap
    return _assemble(surrogate, cut, log_ratio, active, metrics, loss_mask, num_batch_tokens, n_floor)


def ppo_clip_loss(
    logprobs_new: Tensor,
    logprobs_old: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    versions: Tensor,
    *,
    current_version: int,
    num_batch_tokens: int | None = None,
    eps_low: float = default("rl", "clip_low"),
    eps_high: float = default("rl", "clip_high"),
    max_staleness: int = default("rl", "max_staleness"),
    p_floor: float = default("rl", "p_floor"),
    n_floor: int = default("rl", "n_floor"),
) -> LossOutput:
    """PPO clip: surrogate min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A); clipped tokens give no gradient."""
    active, metrics = _token_masks(
        logprobs_new, advantages, loss_mask, versions, current_version, max_staleness, p_floor
    )
    log_ratio = logprobs_new - logprobs_old
    ratio = log_ratio.exp()
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * advantages
    surrogate = torch.minimum(unclipped, clipped)
    cut = (clipped < unclipped).detach()
    return _assemble(surrogate, cut, log_ratio, active, metrics, loss_mask, num_batch_tokens, n_floor)


def masked_is_loss(
    logprobs_new: Tensor,
    logprobs_old: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    versions: Tensor,
    *,
    current_version: int,
    num_batch_tokens: int | None = None,
    lo: float = default("rl", "mask_low"),
    hi: float = default("rl", "mask_high"),
    max_staleness: int = default("rl", "max_staleness"),
    p_floor: float = default("rl", "p_floor"),
    n_floor: int = default("rl", "n_floor"),
) -> LossOutput:
    """Masked IS: weight sg(r) inside [lo, hi]; tokens whose ratio falls outside are dropped."""
    active, metrics = _token_masks(
        logprobs_new, advantages, loss_mask, versions, current_version, max_staleness, p_floor
    )
    log_ratio = logprobs_new - logprobs_old
    ratio = log_ratio.detach().exp()
    cut = (ratio < lo) | (ratio > hi)
    surrogate = torch.where(cut, torch.zeros_like(ratio), ratio) * advantages * logprobs_new
    return _assemble(surrogate, cut, log_ratio, active, metrics, loss_mask, num_batch_tokens, n_floor)


def cispo_loss(
    logprobs_new: Tensor,
    logprobs_old: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    versions: Tensor,
    *,
    current_version: int,
    num_batch_tokens: int | None = None,
    eps_low: float = default("rl", "clip_low"),
    eps_high: float = default("rl", "clip_high"),
    max_staleness: int = default("rl", "max_staleness"),
    p_floor: float = default("rl", "p_floor"),
    n_floor: int = default("rl", "n_floor"),
) -> LossOutput:
    """CISPO: weight sg(clip(r, 1 - eps_low, 1 + eps_high)); unlike PPO, clipped tokens keep their gradient."""
    active, metrics = _token_masks(
        logprobs_new, advantages, loss_mask, versions, current_version, max_staleness, p_floor
    )
    log_ratio = logprobs_new - logprobs_old
    ratio = log_ratio.detach().exp()
    weight = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    cut = weight != ratio
    surrogate = weight * advantages * logprobs_new
    return _assemble(surrogate, cut, log_ratio, active, metrics, loss_mask, num_batch_tokens, n_floor)


def kl_penalty(
    logprobs_new: Tensor,
    logprobs_old: Tensor,
    loss_mask: Tensor,
    *,
    coef: float,
    num_batch_tokens: int | None = None,
) -> LossOutput:
    """Optional KL term (off by default): coef * sum_t m_t (r_t - log r_t - 1) / N, r_t = exp(new - old).

    On tokens sampled from the rollout policy mu this is the k3 estimate of KL(mu || pi_theta); its
    gradient pulls the trainer towards the rollout policy. N as in the policy losses.
    """
    log_ratio = logprobs_new - logprobs_old
    k3 = log_ratio.exp() - log_ratio - 1
    n = int(loss_mask.sum()) if num_batch_tokens is None else num_batch_tokens
    value = coef * (k3 * loss_mask).sum() / max(n, 1)
    return value, {"kl_penalty": float(value.detach())}


def entropy_bonus(
    entropy: Tensor, loss_mask: Tensor, *, coef: float, num_batch_tokens: int | None = None
) -> LossOutput:
    """Optional entropy term (off by default): -coef * sum_t m_t H_t / N; minimising it raises entropy."""
    n = int(loss_mask.sum()) if num_batch_tokens is None else num_batch_tokens
    value = -coef * (entropy * loss_mask).sum() / max(n, 1)
    return value, {"entropy_bonus": float(value.detach())}


def sft_loss(logprobs: Tensor, loss_mask: Tensor, *, num_batch_tokens: int | None = None) -> LossOutput:
    """Masked cross-entropy: -sum_t m_t * logp_t / N, N the batch's loss-token count (for the warm start)."""
    n = int(loss_mask.sum()) if num_batch_tokens is None else num_batch_tokens
    loss = -(logprobs * loss_mask).sum() / max(n, 1)
    return loss, {"loss": float(loss.detach()), "tokens": float(loss_mask.sum())}


LOSSES: dict[str, Callable[..., LossOutput]] = {
    "tis": tis_loss,
    "ppo_clip": ppo_clip_loss,
    "masked_is": masked_is_loss,
    "cispo": cispo_loss,
}


def get_loss_fn(name: str, **knobs: object) -> LossFn:
    """The loss variant ``name`` with its knobs bound; bad names or knobs fail here, at start-up."""
    if name not in LOSSES:
        raise ValueError(f"unknown loss {name!r}; choose one of {sorted(LOSSES)}")
    fn = LOSSES[name]
    try:
        inspect.signature(fn).bind_partial(**knobs)
    except TypeError as e:
        raise ValueError(f"loss {name!r}: {e}") from None
    return functools.partial(fn, **knobs)


def _variant_knobs(rl: RLConfig) -> dict[str, object]:
    """The knobs of ``rl.loss`` alone, by its own parameter names."""
    match rl.loss:
        case "tis":
            return {"cap": rl.is_cap}
        case "ppo_clip" | "cispo":
            return {"eps_low": rl.clip_low, "eps_high": rl.clip_high}
        case "masked_is":
            return {"lo": rl.mask_low, "hi": rl.mask_high}


def loss_knobs(rl: RLConfig) -> dict[str, object]:
    """The knobs of ``rl.loss`` read from an ``[rl]`` config section."""
    return {"max_staleness": rl.max_staleness, "p_floor": rl.p_floor, "n_floor": rl.n_floor, **_variant_knobs(rl)}

"""Scoring a complete group of attempts: partial credit, the efficiency term, advantages, the zero-signal drop
(DESIGN.md, the recipe as implemented); the variant and its knobs are chosen once, from ``[rl]``."""

from __future__ import annotations

from albatross.config import RLConfig
from albatross.records import STATUS_INFRA_ERROR, Group
from albatross.rl.advantages import get_advantage_fn, is_zero_signal
from albatross.rl.rewards import efficiency_adjust, efficiency_penalties, partial_credit, score


class GroupScorer:
    """Scores a complete group (DESIGN.md: partial credit, efficiency, advantages), chosen once."""

    def __init__(self, cfg: RLConfig, test_weights: dict[str, dict[str, float]] | None = None) -> None:
        self.cfg = cfg
        self.test_weights = test_weights or {}
        kw: dict[str, object] = {"std_normalize": cfg.std_normalize} if cfg.advantage == "grpo" else {}
        if cfg.advantage == "topk":
            kw = {"k": cfg.topk}
        self.advantage_fn = get_advantage_fn(cfg.advantage, success_offset=cfg.success_offset,
                                             cap_failures=cfg.cap_failures, **kw)

    def score_group(self, group: Group) -> Group:
        trajs = group.trajectories
        assert all(t.status != STATUS_INFRA_ERROR for t in trajs), "infra errors are never scored"
        weights = self.test_weights.get(group.task_id)
        successes = [t.reward.success for t in trajs]
        scores = []
        for t in trajs:
            t.reward.partial_credit = partial_credit(t.reward.metrics, weights)
            scores.append(score(t.reward.success, t.reward.partial_credit, c=self.cfg.partial_credit_c))
        tokens = [t.completion_tokens for t in trajs]
        scores, _ = efficiency_adjust(scores, successes, tokens, lam=self.cfg.efficiency_lambda)
        penalties = efficiency_penalties(successes, tokens, lam=self.cfg.efficiency_lambda)
        for t, s, pen in zip(trajs, scores, penalties, strict=True):
            t.reward.score, t.reward.efficiency = float(s), float(pen)
        if is_zero_signal(scores, successes):
            group.dropped = "zero_signal"
            group.advantages = [0.0] * len(trajs)
            return group
        advantages, _ = self.advantage_fn(scores, successes)
        neg = self.cfg.negative_scale
        group.advantages = [float(a) if a >= 0 else float(a) * neg for a in advantages]
        return group

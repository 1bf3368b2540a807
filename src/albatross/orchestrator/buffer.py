"""From finished attempts to trainer batches: scoring, advantages, zero-signal drop, staleness counts."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from albatross.config import RLConfig
from albatross.records import STATUS_INFRA_ERROR, Batch, Group, TrainSample, Trajectory
from albatross.rl.advantages import get_advantage_fn, is_zero_signal
from albatross.rl.rewards import efficiency_adjust, efficiency_penalties, partial_credit, score


class GroupScorer:
    """Scores a complete group (DESIGN.md: partial credit, efficiency, advantages), chosen once."""

    def __init__(self, cfg: RLConfig, test_weights: dict[str, dict[str, float]] | None = None) -> None:
        self.cfg = cfg
        self.test_weights = test_weights or {}
        kw = {"std_normalize": cfg.std_normalize} if cfg.advantage == "grpo" else {}
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


@dataclass
class BatchBuilder:
    """Collects kept groups until ``groups_per_step`` are ready, then emits a Batch."""

    groups_per_step: int
    pending: list[Group] = field(default_factory=list)
    counts: Counter = field(default_factory=Counter)  # over the whole run
    window: Counter = field(default_factory=Counter)  # since the last batch: sent with it, logged per step

    def add(self, group: Group) -> Batch | None:
        counts = ["groups"] + ([f"dropped_{group.dropped}"] if group.dropped else [])
        self.counts.update(counts)
        self.window.update(counts)
        if group.dropped:
            return None
        self.pending.append(group)
        if len(self.pending) < self.groups_per_step:
            return None
        groups, self.pending = self.pending[: self.groups_per_step], self.pending[self.groups_per_step:]
        batch = make_batch(groups)
        batch.info = {"groups_seen": self.window["groups"], "groups_trained": len(groups),
                      **{k: v for k, v in self.window.items() if k.startswith("dropped_")}}
        self.window.clear()
        return batch


def make_batch(groups: list[Group]) -> Batch:
    samples: list[TrainSample] = []
    min_version = 1 << 30
    for g in groups:
        for traj, adv in zip(g.trajectories, g.advantages, strict=True):
            for s in traj.samples:
                if s.num_model_tokens == 0:
                    continue
                samples.append(TrainSample(sample=s, advantage=adv, task_id=traj.task_id))
                min_version = min(min_version, min(v for v in s.versions if v >= 0))
    return Batch(samples=samples, groups=len(groups), min_version=min_version if samples else 0)


def group_complete(trajs: list[Trajectory], size: int) -> bool:
    return sum(t.status != STATUS_INFRA_ERROR for t in trajs) >= size

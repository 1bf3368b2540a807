"""From finished attempts to trainer batches: scoring, advantages, zero-signal drop, the staleness bound.

The staleness bound holds for every trained token: the trainer consumes batches in the order they are sent,
one version per step, so the version a batch will be trained at is known when it is formed. A group whose
oldest model token would be more than ``max_staleness`` versions old by then is dropped (``dropped_stale``)
instead of trained. Admission control keeps that rare: it starts a group only while it could be trained
in time if groups finished in the order they started; a slow attempt that is overtaken by later groups
(a long-tailed command) is what the check at batch time catches.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field, replace

from albatross.records import STATUS_INFRA_ERROR, Batch, Group, Sample, TrainSample, Trajectory


def admissible(untrained_batches: int, groups_in_flight: int, groups_per_step: int, max_staleness: int) -> bool:
    """Whether a group started now is trained within ``max_staleness`` versions, if groups finish in the
    order they started: the batches not yet trained plus the batches the groups ahead of it (pending and
    in flight) and itself will fill. ``max_staleness`` 0 (sync) admits while nothing is untrained."""
    steps = untrained_batches + math.ceil((groups_in_flight + 1) / groups_per_step)
    return steps <= max(1, max_staleness)


def oldest_version(group: Group) -> int | None:
    """The oldest policy version of any model token of the group (None: no model token)."""
    versions = [v for t in group.trajectories for s in t.samples for v in s.versions if v >= 0]
    return min(versions) if versions else None


@dataclass
class BatchBuilder:
    """Collects kept groups until ``groups_per_step`` are ready, then emits a Batch.

    ``add(group, train_version)`` is told the version the next batch will be trained at; with
    ``max_staleness`` set, a group (new or pending) with a token older than that bound allows is dropped
    as ``stale``, so no batch ever carries a token the loss would have to mask for staleness.
    """

    groups_per_step: int
    max_staleness: int | None = None
    mask_after_error: bool = False  # ``rl.mask_after_error``: see ``credited``
    pending: list[Group] = field(default_factory=list)
    counts: Counter = field(default_factory=Counter)  # over the whole run
    window: Counter = field(default_factory=Counter)  # since the last batch: sent with it, logged per step

    def _count(self, group: Group, seen: bool = True) -> None:
        counts = (["groups"] if seen else []) + ([f"dropped_{group.dropped}"] if group.dropped else [])
        self.counts.update(counts)
        self.window.update(counts)

    def _too_stale(self, group: Group, train_version: int | None) -> bool:
        if self.max_staleness is None or train_version is None:
            return False
        oldest = oldest_version(group)
        return oldest is not None and train_version - oldest > self.max_staleness

    def add(self, group: Group, train_version: int | None = None) -> Batch | None:
        if not group.dropped and self._too_stale(group, train_version):
            group.dropped = "stale"
        self._count(group)
        for old in [g for g in self.pending if self._too_stale(g, train_version)]:
            old.dropped = "stale"
            self.pending.remove(old)
            self._count(old, seen=False)
        if group.dropped:
            return None
        self.pending.append(group)
        if len(self.pending) < self.groups_per_step:
            return None
        groups, self.pending = self.pending[: self.groups_per_step], self.pending[self.groups_per_step:]
        batch = make_batch(groups, self.mask_after_error)
        batch.info = {"groups_seen": self.window["groups"], "groups_trained": len(groups),
                      **{k: v for k, v in self.window.items() if k.startswith("dropped_")}}
        if train_version is not None:
            batch.info["train_version"] = train_version
        self.window.clear()
        return batch


def make_batch(groups: list[Group], mask_after_error: bool = False) -> Batch:
    samples: list[TrainSample] = []
    min_version = 1 << 30
    for g in groups:
        for traj, adv in zip(g.trajectories, g.advantages, strict=True):
            for s in credited(traj, adv, mask_after_error):
                if s.num_model_tokens == 0:
                    continue
                samples.append(TrainSample(sample=s, advantage=adv, task_id=traj.task_id))
                min_version = min(min_version, min(v for v in s.versions if v >= 0))
    return Batch(samples=samples, groups=len(groups), min_version=min_version if samples else 0)


def credited(traj: Trajectory, advantage: float, mask_after_error: bool) -> list[Sample]:
    """The trajectory's samples as they are trained. With ``mask_after_error`` and a negative advantage, the
    actions after the attempt's first failed one (malformed, nonzero exit, timeout) leave the loss mask: the
    failure is pushed down where it happened, not in the states it led to, which the policy rarely reaches
    again and where pushing every action down only raises the entropy (``rl.mask_after_error``)."""
    first = next((i for i, t in enumerate(traj.turns) if t.failed), None) if mask_after_error and advantage < 0 else None
    if first is None:
        return traj.samples
    samples = [replace(s, loss_mask=list(s.loss_mask)) for s in traj.samples]
    for turn in traj.turns[first + 1:]:
        if turn.sample >= 0:
            mask = samples[turn.sample].loss_mask
            mask[turn.start:turn.start + turn.completion_tokens] = [0] * turn.completion_tokens
    return samples


def group_complete(trajs: list[Trajectory], size: int) -> bool:
    return sum(t.status != STATUS_INFRA_ERROR for t in trajs) >= size

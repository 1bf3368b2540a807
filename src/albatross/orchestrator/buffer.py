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

from albatross.records import Batch, Group, Sample, TrainSample


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
    credit: str = "all"  # ``rl.credit``: see ``credited``
    pending: list[Group] = field(default_factory=list)
    counts: Counter[str] = field(default_factory=Counter)  # over the whole run
    window: Counter[str] = field(default_factory=Counter)  # since the last batch: sent with it, logged per step

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
        batch = make_batch(groups, self.credit)
        batch.info = {"groups_seen": self.window["groups"], "groups_trained": len(groups),
                      **{k: v for k, v in self.window.items() if k.startswith("dropped_")}}
        if train_version is not None:
            batch.info["train_version"] = train_version
        self.window.clear()
        return batch


def make_batch(groups: list[Group], credit: str = "all") -> Batch:
    """The trainer's batch of kept groups: every model sample with its trajectory's advantage, its loss mask as
    ``credited`` leaves it (``rl.credit``)."""
    samples: list[TrainSample] = []
    min_version = 1 << 30
    for g in groups:
        for traj, adv, trained in zip(g.trajectories, g.advantages, credited(g, credit), strict=True):
            for s in trained:
                if s.num_model_tokens == 0:
                    continue
                samples.append(TrainSample(sample=s, advantage=adv, task_id=traj.task_id))
                min_version = min(min_version, min(v for v in s.versions if v >= 0))
    return Batch(samples=samples, groups=len(groups), min_version=min_version if samples else 0)


def credited(group: Group, credit: str) -> list[list[Sample]]:
    """Each trajectory's samples as they are trained (``rl.credit``). ``all``: every model token. ``divergence``:
    an attempt with a negative advantage keeps its model tokens only up to the point where it left the path of
    the group's attempts with a positive advantage (the longest token prefix it shares with one of them), the
    choice there included: the failure is pushed down where it went wrong, not in the states it led to, which
    the policy rarely reaches again and where pushing every token down spreads the failure to what successes
    share (the end of a turn, a fence) and raises the entropy."""
    samples = [t.samples for t in group.trajectories]
    if credit == "all":
        return samples
    if credit != "divergence":
        raise ValueError(f"rl.credit: expected 'all' or 'divergence', got {credit!r}")
    better = [s for s, a in zip(samples, group.advantages, strict=True) if a > 0]
    if not better:
        return samples
    return [s if a >= 0 else _until_divergence(s, better) for s, a in zip(samples, group.advantages, strict=True)]


def _until_divergence(samples: list[Sample], better: list[list[Sample]]) -> list[Sample]:
    """``samples`` with the loss mask cleared after the first token no ``better`` trajectory shares (sample by
    sample: the samples after the diverging one leave the loss entirely)."""
    out = [replace(s, loss_mask=list(s.loss_mask)) for s in samples]
    for k, sample in enumerate(out):
        peers = [b[k].token_ids for b in better if len(b) > k]
        shared = max((_common_prefix(sample.token_ids, p) for p in peers), default=0)
        if shared < len(sample.token_ids) or not peers:
            cut = shared + 1 if peers else 0  # the first diverging token stays in the loss (when it is a model's)
            sample.loss_mask[cut:] = [0] * (len(sample.loss_mask) - cut)
            for later in out[k + 1:]:
                later.loss_mask[:] = [0] * len(later.loss_mask)
            break
    return out


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n

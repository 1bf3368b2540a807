"""Probe rows: what one training group of a task looks like (``pipeline/probe.py`` runs the attempts), scored
by the training scorer (``GroupScorer``: partial credit with the no-op gate's test weights, the efficiency
term, the zero-signal rule); ``filter.py`` keeps the tasks whose pass rate lies in a band.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from albatross.records import STATUS_INFRA_ERROR, Group, Trajectory
from albatross.tasks.format import Task

MIN_ATTEMPTS = 4  # DESIGN.md: every candidate task is probed at least 4 times


@dataclass
class ProbeRow:
    task: str
    path: str
    attempts: int  # scored attempts (infrastructure errors excluded)
    successes: int
    mean_score: float
    zero_signal: bool  # the group of these attempts would be dropped as zero-signal
    infra_errors: int = 0
    statuses: dict[str, int] = field(default_factory=dict)

    @property
    def pass_rate(self) -> float:
        return self.successes / self.attempts if self.attempts else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "pass_rate": round(self.pass_rate, 4)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ProbeRow:
        fields = {k: data[k] for k in ("task", "path", "attempts", "successes", "mean_score", "zero_signal")}
        return cls(**fields, infra_errors=int(data.get("infra_errors", 0)), statuses=dict(data.get("statuses", {})))


class GroupScoring(Protocol):
    """What scores a group (``rl.scoring.GroupScorer``)."""

    def score_group(self, group: Group) -> Group: ...


def score_row(task: Task, trajs: list[Trajectory], scorer: GroupScoring, infra_errors: int = 0) -> ProbeRow:
    """One task's probe row: its scored attempts form one group, scored as training scores groups."""
    scored = [t for t in trajs if t.status != STATUS_INFRA_ERROR]
    statuses = dict(Counter(t.status for t in trajs))
    path = str(task.source_path or task.path)
    if not scored:
        return ProbeRow(task.id, path, 0, 0, 0.0, True, infra_errors, statuses)
    group = scorer.score_group(Group(task.id, f"probe-{task.id}", scored))
    mean = sum(t.reward.score for t in scored) / len(scored)
    return ProbeRow(task.id, path, len(scored), sum(t.success for t in scored), round(mean, 4),
                    group.dropped == "zero_signal", infra_errors, statuses)


def format_table(rows: list[ProbeRow]) -> str:
    width = max([len(r.task) for r in rows] + [4])
    lines = [f"{'task':<{width}}  attempts  passes  pass_rate  mean_score  zero_signal  infra"]
    for r in rows:
        lines.append(f"{r.task:<{width}}  {r.attempts:>8}  {r.successes:>6}  {r.pass_rate:>9.3f}  "
                     f"{r.mean_score:>10.3f}  {'yes' if r.zero_signal else 'no':>11}  {r.infra_errors:>5}")
    mean = sum(r.pass_rate for r in rows) / len(rows) if rows else 0.0
    zero = sum(r.zero_signal for r in rows)
    lines += ["", f"{len(rows)} tasks: mean pass rate {mean:.3f}; zero-signal groups {zero}/{len(rows)}"]
    return "\n".join(lines)


def write_json(path: str | Path, rows: list[ProbeRow], config: dict[str, Any]) -> None:
    data = {"config": config, "tasks": [r.to_dict() for r in rows]}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=2) + "\n")


def read_json(path: str | Path) -> tuple[list[ProbeRow], dict[str, Any]]:
    """The rows and config of a ``tasks probe --json`` file. Raises ``ValueError`` naming the problem."""
    try:
        data = json.loads(Path(path).read_text())
        return [ProbeRow.from_dict(r) for r in data["tasks"]], dict(data.get("config", {}))
    except FileNotFoundError:
        raise
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a probe table ({type(e).__name__}: {e})") from None

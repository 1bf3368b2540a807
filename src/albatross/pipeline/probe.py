"""Probe tasks under exactly the training configuration: N >= 4 attempts each, one group per task.

The attempts go through the training harness (``build_agent``: the same chat format, turn and token budgets,
sampling and sandbox limits) and ``run_with_retries`` (infrastructure errors retried, never scored); each task's
group is scored as training scores groups (``tasks/probe.py`` ``score_row``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from albatross.harness.agent import AttemptSpec
from albatross.harness.retry import run_with_retries
from albatross.tasks.format import Task
from albatross.tasks.probe import MIN_ATTEMPTS, ProbeRow, score_row


def probe(agent: Any, tasks: list[Task], attempts: int, scorer: Any, retries: int = 3, workers: int = 8,
          progress: Callable[[ProbeRow], None] | None = None) -> list[ProbeRow]:
    """Run ``attempts`` attempts at every task with ``agent`` and score each task's group with
    ``scorer`` (a ``GroupScorer``). Rows come back in task order."""
    if attempts < MIN_ATTEMPTS:
        raise ValueError(f"attempts must be at least {MIN_ATTEMPTS} (DESIGN.md: probe each task >= 4 times)")
    counts: dict[str, Counter] = {t.id: Counter() for t in tasks}
    specs = [AttemptSpec(t, f"probe-{t.id}", i) for t in tasks for i in range(attempts)]
    with ThreadPoolExecutor(max(1, workers), thread_name_prefix="probe") as pool:
        futures = [pool.submit(run_with_retries, agent, s, retries, counts[s.task.id]) for s in specs]
        rows = []
        for i, task in enumerate(tasks):
            trajs = [f.result() for f in futures[i * attempts:(i + 1) * attempts]]
            rows.append(score_row(task, trajs, scorer, counts[task.id]["infra_error_attempts"]))
            if progress is not None:
                progress(rows[-1])
    return rows

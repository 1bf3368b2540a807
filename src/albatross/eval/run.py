"""Evaluate a policy on tasks with the same harness and sandbox as training."""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from math import comb
from pathlib import Path

from albatross.harness.agent import Agent, AttemptSpec
from albatross.records import STATUS_INFRA_ERROR, Trajectory, append_jsonl
from albatross.tasks.format import Task


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n trials with c successes (Chen et al., 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


@dataclass
class EvalResult:
    trajectories: list[Trajectory]
    counts: Counter = field(default_factory=Counter)

    def per_task(self) -> dict[str, list[bool]]:
        out: dict[str, list[bool]] = {}
        for t in self.trajectories:
            if t.status != STATUS_INFRA_ERROR:
                out.setdefault(t.task_id, []).append(t.success)
        return out

    @property
    def pass_at_1(self) -> float:
        tasks = self.per_task()
        if not tasks:
            return 0.0
        return sum(sum(v) / len(v) for v in tasks.values()) / len(tasks)

    @property
    def tokens_per_solve(self) -> float:
        """Mean generated tokens of the solved attempts (0 when none solved)."""
        solved = [t.completion_tokens for t in self.trajectories if t.success]
        return sum(solved) / len(solved) if solved else 0.0

    @property
    def infra_errors(self) -> int:
        return self.counts["infra_error_attempts"]


def evaluate(agent: Agent, tasks: list[Task], trials: int, workers: int = 16,
             out_jsonl: Path | None = None, retries: int = 3, progress=None) -> EvalResult:
    """Run every task ``trials`` times; infrastructure errors are retried and never count as failures."""
    from albatross.orchestrator.loop import run_with_retries

    counts: Counter = Counter()
    specs = [AttemptSpec(task, f"eval-{task.id}", i) for task in tasks for i in range(trials)]
    trajs: list[Trajectory] = []
    with ThreadPoolExecutor(workers, thread_name_prefix="eval") as pool:
        futures = [pool.submit(run_with_retries, agent, s, retries, counts) for s in specs]
        for i, f in enumerate(futures):
            traj = f.result()
            trajs.append(traj)
            if out_jsonl is not None:
                append_jsonl(out_jsonl, traj.to_dict())
            if progress is not None:
                progress(i + 1, len(futures))
    return EvalResult(trajs, counts)

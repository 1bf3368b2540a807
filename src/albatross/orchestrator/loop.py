"""The asynchronous loop: attempts keep running in sandboxes while the trainer steps in its own process.

Rollout threads run attempts (the engine batches their generate calls); finished groups are scored and
packed into batches on a bounded queue; the trainer process steps and exports weights v+1; the engine
loads them between decode steps, so every token carries the version that produced it. Tokens more than
``max_staleness`` versions old get no gradient (masked in the loss and counted).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import queue
import random
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from albatross.config import RunConfig
from albatross.harness.agent import Agent, AttemptSpec
from albatross.orchestrator.buffer import BatchBuilder, GroupScorer
from albatross.orchestrator.trainer_worker import trainer_main
from albatross.records import STATUS_INFRA_ERROR, Group, Trajectory, append_jsonl
from albatross.tasks.format import Task


def run_with_retries(agent: Agent, spec: AttemptSpec, retries: int, counts: Counter) -> Trajectory:
    """Run an attempt; an infrastructure error is retried on a fresh fork, never scored."""
    traj = agent.run(spec)
    for _ in range(retries):
        if traj.status != STATUS_INFRA_ERROR:
            break
        counts["infra_error_attempts"] += 1
        traj = agent.run(spec)
    if traj.status == STATUS_INFRA_ERROR:
        counts["infra_error_attempts"] += 1
    return traj


class TaskSampler:
    """Cycles through tasks in a seeded shuffled order; its position is part of a run's state."""

    def __init__(self, tasks: list[Task], seed: int) -> None:
        self.tasks, self.rng, self.order, self.pos = tasks, random.Random(seed), [], 0

    def next(self) -> Task:
        if self.pos >= len(self.order):
            self.order = list(range(len(self.tasks)))
            self.rng.shuffle(self.order)
            self.pos = 0
        self.pos += 1
        return self.tasks[self.order[self.pos - 1]]


@dataclass
class _PendingGroup:
    task: Task
    group_id: str
    futures: list[Future]


@dataclass
class LoopState:
    step: int = 0
    counts: Counter = field(default_factory=Counter)
    max_staleness_seen: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)


class AsyncLoop:
    """One training run: ``run()`` returns the final state; metrics and attempts go to ``run_dir``."""

    def __init__(self, cfg: RunConfig, agent: Agent, engine, tasks: list[Task], model_dir: Path,
                 run_dir: Path, log: Callable[[str], None] = print) -> None:
        self.cfg, self.agent, self.engine, self.tasks = cfg, agent, engine, tasks
        self.model_dir, self.run_dir, self.log = Path(model_dir), Path(run_dir), log
        self.scorer = GroupScorer(cfg.rl)
        self.builder = BatchBuilder(cfg.orchestrator.groups_per_step)
        self.sampler = TaskSampler(tasks, cfg.seed)
        self.state = LoopState()
        self._group_seq = 0
        self._batches_sent = 0
        self._start_version = engine.version
        self._window = Counter()  # attempts and solves since the last step

    def run(self) -> LoopState:
        ctx = mp.get_context("spawn")
        batch_q, result_q = ctx.Queue(maxsize=self.cfg.orchestrator.queue_size), ctx.Queue()
        weights_dir = self.run_dir / "weights"
        proc = ctx.Process(target=trainer_main, daemon=True, name="albatross-trainer",
                           args=(str(self.model_dir), str(weights_dir), self.cfg.model_dump_json(),
                                 batch_q, result_q, self.engine.version))
        proc.start()
        pool = ThreadPoolExecutor(self.cfg.orchestrator.rollout_workers, thread_name_prefix="rollout")
        try:
            self._wait_ready(result_q, proc)
            self._drive(pool, batch_q, result_q, proc)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            try:
                batch_q.put(None, timeout=5)
            except queue.Full:
                pass
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
                proc.join()
        return self.state

    def _wait_ready(self, result_q, proc) -> None:
        while True:
            try:
                msg = result_q.get(timeout=1.0)
            except queue.Empty:
                if not proc.is_alive():
                    raise RuntimeError("trainer process died during start-up") from None
                continue
            if "error" in msg:
                raise RuntimeError(f"trainer failed to start:\n{msg['error']}")
            return

    def _drive(self, pool, batch_q, result_q, proc) -> None:
        oc = self.cfg.orchestrator
        start = time.monotonic()
        inflight: list[_PendingGroup] = []
        ready_batches: list = []
        max_inflight = oc.groups_per_step * (oc.queue_size + 1)
        stopping = False
        while True:
            elapsed = time.monotonic() - start
            enough = self._batches_sent >= oc.max_steps
            stopping = stopping or enough or elapsed > oc.max_minutes * 60
            if stopping and not inflight and not ready_batches:
                break
            while not stopping and len(inflight) < max_inflight and len(ready_batches) < 1:
                inflight.append(self._start_group(pool))
            inflight = self._collect(inflight, ready_batches)
            while ready_batches:
                try:
                    batch_q.put_nowait(ready_batches[0])
                    ready_batches.pop(0)
                except queue.Full:
                    break
            if stopping:
                ready_batches.clear()
            self._drain_results(result_q, proc, block=False)
            if stopping and self.state.step >= oc.max_steps and not inflight:
                break
            time.sleep(0.02)
        self._finish_inflight_steps(batch_q, result_q, proc)

    def _finish_inflight_steps(self, batch_q, result_q, proc) -> None:
        """Let the trainer finish the batches already queued so no finished step is lost."""
        deadline = time.monotonic() + 120
        while self.state.step < self._batches_sent and time.monotonic() < deadline and proc.is_alive():
            self._drain_results(result_q, proc, block=True)

    def _start_group(self, pool) -> _PendingGroup:
        task = self.sampler.next()
        gid = f"g{self._group_seq:05d}"
        self._group_seq += 1
        retries = self.cfg.sandbox.max_infra_retries
        futures = [pool.submit(run_with_retries, self.agent, AttemptSpec(task, gid, i), retries,
                               self.state.counts) for i in range(self.cfg.orchestrator.group_size)]
        return _PendingGroup(task, gid, futures)

    def _collect(self, inflight: list[_PendingGroup], ready_batches: list) -> list[_PendingGroup]:
        still = []
        for pg in inflight:
            if not all(f.done() for f in pg.futures):
                still.append(pg)
                continue
            trajs = [f.result() for f in pg.futures]
            batch = self._finish_group(pg, trajs)
            if batch is not None and self._batches_sent < self.cfg.orchestrator.max_steps:
                ready_batches.append(batch)
                self._batches_sent += 1
        return still

    def _finish_group(self, pg: _PendingGroup, trajs: list[Trajectory]):
        ok = [t for t in trajs if t.status != STATUS_INFRA_ERROR]
        group = Group(pg.task.id, pg.group_id, ok)
        if len(ok) < len(trajs):
            group.dropped = "infra_error"
        else:
            self.scorer.score_group(group)
        self.state.counts["attempts"] += len(trajs)
        self.state.counts["solved"] += sum(t.success for t in ok)
        self._window["attempts"] += len(ok)
        self._window["solved"] += sum(t.success for t in ok)
        for t, adv in zip(group.trajectories, group.advantages or [0.0] * len(ok), strict=False):
            append_jsonl(self.run_dir / "trajectories.jsonl", {**t.to_dict(), "advantage": adv,
                                                                 "dropped": group.dropped})
        return self.builder.add(group)

    def _drain_results(self, result_q, proc, block: bool) -> None:
        while True:
            try:
                msg = result_q.get(timeout=1.0) if block else result_q.get_nowait()
            except queue.Empty:
                if not proc.is_alive() and self.state.step < self._batches_sent:
                    raise RuntimeError("trainer process died; the run can be resumed") from None
                return
            if "error" in msg:
                raise RuntimeError(f"trainer failed:\n{msg['error']}")
            self._on_step(msg)
            if block:
                return

    def _window_pass_rate(self) -> float:
        """Pass rate of the attempts finished since the last step (the last value if none finished)."""
        if self._window["attempts"]:
            self._last_pass_rate = self._window["solved"] / self._window["attempts"]
        return getattr(self, "_last_pass_rate", 0.0)

    def _on_step(self, msg: dict[str, Any]) -> None:
        self.engine.update_weights(msg["path"], msg["version"])
        self.state.step = int(msg["version"]) - self._start_version
        self.state.max_staleness_seen = max(self.state.max_staleness_seen, int(msg.get("staleness_max", 0)))
        self.state.counts["dropped_stale_tokens"] += int(msg.get("stale_tokens_dropped", 0))
        c = self.state.counts
        record = {"step": self.state.step, "version": msg["version"], "time": time.time(),
                  "pass_rate": self._window_pass_rate(),
                  "groups": self.builder.counts["groups"],
                  "zero_signal_groups": self.builder.counts["dropped_zero_signal"],
                  "infra_error_attempts": c["infra_error_attempts"],
                  **{k: v for k, v in msg.items() if isinstance(v, (int, float)) and k != "version"}}
        self._window.clear()
        self.state.history.append(record)
        append_jsonl(self.run_dir / "metrics.jsonl", record)
        self.log(_progress_line(record, self.cfg.orchestrator.max_steps))


def _progress_line(r: dict[str, Any], max_steps: int) -> str:
    return (f"[train] step {r['step']:>3}/{max_steps}  loss {r.get('loss', 0.0):+.4f}  "
            f"pass {r['pass_rate']:.2f}  stale max {r.get('staleness_max', 0)}  "
            f"kl {r.get('mismatch_kl', 0.0):.4f}  tok/s {r.get('tokens_per_s', 0.0):.0f}")


def dump_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")

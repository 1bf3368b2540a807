"""The asynchronous loop: attempts keep running in sandboxes while the trainer steps in its own process.

Rollout threads run attempts (the engine batches their generate calls); finished groups are scored and
packed into batches on a bounded queue; the trainer process steps and exports weights v+1; the engine
loads them between decode steps, so every token carries the version that produced it. A new group is
admitted only while it can still be trained within ``max_staleness`` versions; a finished group that was
overtaken by later ones and would be trained with a token older than that is dropped (``dropped_stale``,
see ``buffer.py``), so no trained token is ever older than the bound. The loss still masks such tokens
(``stale_tokens_dropped``), as a second guard that stays at zero.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import queue
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from albatross.config import RunConfig
from albatross.engine.base import Engine
from albatross.harness.agent import AgentLoop, AttemptSpec
from albatross.orchestrator.buffer import BatchBuilder, admissible
from albatross.orchestrator.launcher import (
    BatchQueue,
    Launcher,
    LocalLauncher,
    ResultQueue,
    Rollouts,
    TrainerProcess,
)
from albatross.orchestrator.metrics import MetricsSink
from albatross.orchestrator.state import (
    MixSampler,
    RunState,
    TaskSampler,
    count_lines,
    prune_before,
    prune_weights,
    truncate_lines,
)
from albatross.records import STATUS_INFRA_ERROR, Batch, Group, Trajectory, append_jsonl
from albatross.rl.scoring import GroupScorer
from albatross.tasks.format import Task


class TrainerDied(RuntimeError):
    """The trainer process failed; the run stopped with everything needed to resume."""


@dataclass(frozen=True)
class StepEvent:
    """One finished trainer step, as the loop hands it to its observers.

    ``weights`` is the directory of the exported version (the loop prunes old versions after the observers
    return, keeping ``trainer.keep_versions``: copy it there if it is to be kept); ``record`` is the row
    written to ``metrics.jsonl`` (its ``time`` is ``time.time()`` when the step was recorded)."""

    step: int
    version: int
    weights: str
    record: dict[str, Any]


class StepObserver(Protocol):
    """Watches a run of ``AsyncLoop`` (pass it as ``observers=``): benchmarks and users' scripts measure or keep
    things with it without changing the loop. Both methods run on the loop's scheduling thread: keep them short."""

    def on_start(self) -> None:
        """The scheduling loop starts: the trainer is ready and the time budget (``max_minutes``) starts now."""

    def on_step(self, event: StepEvent) -> None:
        """A trainer step finished; the engine already serves ``event.version``."""


@dataclass
class _PendingGroup:
    task: Task
    group_id: str
    futures: list[Future[Trajectory]]


class AsyncLoop:
    """One training run: ``run()`` returns the final state; metrics and attempts go to ``run_dir``."""

    def __init__(self, cfg: RunConfig, agent: AgentLoop, engine: Engine, tasks: list[Task], model_dir: Path,
                 run_dir: Path, log: Callable[[str], None] = print, resume: bool = False,
                 launcher: Launcher | None = None, sink: MetricsSink | None = None,
                 sources: dict[str, str] | None = None, weights: dict[str, float] | None = None,
                 observers: Sequence[StepObserver] = ()) -> None:
        """``sources`` (task id -> source name) and ``weights`` (source name -> weight): a task mix
        (``tasks.mix``), drawn from by ``MixSampler`` and reported per source; None: one pool of tasks.
        ``observers``: told when the scheduling loop starts and after every trainer step (``StepObserver``)."""
        self.cfg, self.agent, self.engine, self.tasks = cfg, agent, engine, tasks
        self.observers = list(observers)
        self.sources = sources or {}
        self._given_sink = sink  # the run's sink (driver), else one of its own
        self.stop_reason = "not started"
        self.launcher: Launcher = launcher or LocalLauncher()
        self.model_dir, self.run_dir, self.log = Path(model_dir), Path(run_dir), log
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.scorer = GroupScorer(cfg.rl, rl_test_weights(cfg.rl.test_weights))
        self.builder = BatchBuilder(cfg.orchestrator.groups_per_step, max_staleness=cfg.rl.max_staleness,
                                    credit=cfg.rl.credit)
        self.sampler = _sampler(tasks, self.sources, weights or {}, cfg.seed)
        self.state = RunState(version=engine.version)
        self.counts: Counter[str] = Counter()
        self._window: Counter[str] = Counter()  # attempts, solves, rewards since the last step
        self._batches_sent = 0
        self._last_pass_rate = self._last_reward = 0.0
        self._t0 = time.monotonic()
        self._busy_mark = (time.monotonic(), self._engine_busy())
        self._pending: dict[str, RunState] = {}  # checkpoints being written -> the state they belong to
        self._saved: RunState | None = None  # the state of the last checkpoint on disk
        self._checkpoint_figures: dict[str, Any] = {}  # the last written checkpoint's, for the next step record
        self.final_weights = ""  # the last version as a directory, once the trainer has written it
        self.final_adapter = ""  # with [trainer.lora]: the last adapter (PEFT format), once the trainer wrote it
        self.parameter_counts: dict[str, int] = {}  # the trainer's ``parameters`` and ``trainable_parameters``
        if resume:
            self._restore()
        self._start_version = self.state.version - self.state.step

    # ---- resume -------------------------------------------------------------------------------
    def _restore(self) -> None:
        saved = RunState.load(self.run_dir)
        if saved is None:  # no checkpoint was written: what the stopped run logged is not counted
            for name in ("trajectories.jsonl", "metrics.jsonl"):
                truncate_lines(self.run_dir / name, 0)
            self.log(f"[resume] no {self.run_dir}/state.json yet (no checkpoint was written): starting the run "
                     "from the beginning")
            return
        self.state = self._saved = saved
        self.counts = Counter(saved.counts)
        self.builder.counts = Counter(saved.batch_counts)
        self.sampler.restore(saved.sampler)
        self._batches_sent = saved.step
        for name, n in saved.lines.items():
            truncate_lines(self.run_dir / name, n)
        # the engines get the checkpoint's weights from the trainer, which sends them before its first step
        self.log(f"[resume] from step {saved.step} (version {saved.version}); in-flight attempts re-run")

    def _snapshot(self, checkpoint: str) -> RunState:
        """The run's state now, for the checkpoint the trainer is writing (saved once that is on disk)."""
        s = self.state
        return dataclasses.replace(
            s, counts=dict(self.counts), batch_counts=dict(self.builder.counts), sampler=self.sampler.state(),
            trainer_checkpoint=checkpoint, elapsed_s=s.elapsed_s + time.monotonic() - self._t0,
            lines={name: count_lines(self.run_dir / name) for name in ("trajectories.jsonl", "metrics.jsonl")})

    def _on_checkpoint(self, msg: dict[str, Any]) -> None:
        """A checkpoint is on disk: its state becomes ``state.json``; older checkpoints go."""
        if "checkpoint_error" in msg:
            self.log(f"[checkpoint] failed: {msg['checkpoint_error']}")
            return
        snapshot = self._pending.pop(msg["checkpoint_done"], None)
        if snapshot is None:
            return
        snapshot.save(self.run_dir)
        self._saved = snapshot
        prune_before(self.run_dir, snapshot.version, self.cfg.trainer.keep_versions)
        self._checkpoint_figures = {"checkpoint_bytes": int(msg["bytes"]),
                                    "checkpoint_write_s": round(float(msg["seconds"]), 2)}
        self.log(f"[checkpoint] version {snapshot.version}: {int(msg['bytes']) / 2**30:.2f} GiB written in "
                 f"{float(msg['seconds']):.1f} s, in the background ({msg['checkpoint_done']})")

    # ---- processes ----------------------------------------------------------------------------
    def run(self) -> RunState:
        batch_q, result_q = self.launcher.queues(self.cfg.orchestrator.queue_size)
        proc = self.launcher.start_trainer((str(self.model_dir), str(self.run_dir), self.cfg.model_dump_json(),
                                            batch_q, result_q, self.state.version, self.state.trainer_checkpoint))
        self._trainer_pid = proc.pid or 0  # a started process has its pid
        self._pids: dict[str, int] = {}
        self._write_pids()
        self.sink = self._given_sink or MetricsSink(self.run_dir, self.cfg.orchestrator.max_steps, self.log,
                                                    self.cfg.orchestrator.wandb_project, self.cfg.model_dump(),
                                                    max_minutes=self.cfg.orchestrator.max_minutes)
        self.sink.start_training(self.state.step, self.state.elapsed_s)
        pool = self.launcher.rollouts(self.agent, self.cfg, self.counts)
        try:
            self._wait_ready(result_q, proc)
            self._drive(pool, batch_q, result_q, proc)
            self._finish_trainer(result_q, proc, batch_q)
        except KeyboardInterrupt:
            self.stop_reason = "Ctrl-C"
            self.log(f"[train] interrupted (Ctrl-C) at step {self.state.step}; resume with "
                     f"`albatross train --resume {self.run_dir.parent}`")
            raise
        finally:
            pool.shutdown()
            _stop_trainer(proc, batch_q)
            self.sink.end_training()
            if self._given_sink is None:
                self.sink.close()
        return self.state

    def _write_pids(self) -> None:
        """``pids.json``: the processes this run started (trainer, engine replicas, sandbox helpers), so
        that tests and operators can find them; rewritten when one is restarted."""
        pids = {"orchestrator": os.getpid(), "trainer": self._trainer_pid}
        for part in (self.engine, self.agent.backend, self.launcher):
            pids.update(part.pids())
        if pids != self._pids:
            self._pids = pids
            tmp = self.run_dir / "pids.json.tmp"
            tmp.write_text(json.dumps(pids))
            tmp.replace(self.run_dir / "pids.json")

    def _wait_ready(self, result_q: ResultQueue, proc: TrainerProcess) -> None:
        while True:
            try:
                msg = result_q.get(timeout=1.0)
            except queue.Empty:
                if not proc.is_alive():
                    raise TrainerDied(f"trainer process exited with code {proc.exitcode} during start-up") \
                        from None
                continue
            if "error" in msg:
                raise TrainerDied(f"trainer failed to start:\n{msg['error']}")
            self.parameter_counts = {k: int(msg[k]) for k in ("parameters", "trainable_parameters") if k in msg}
            if "path" in msg:  # a resumed trainer sent its checkpoint's weights
                self.engine.update_weights(msg["path"], msg["version"])
            return

    def _finish_trainer(self, result_q: ResultQueue, proc: TrainerProcess, batch_q: BatchQueue) -> None:
        """A run that ended normally: the trainer writes the last version as a directory (``final_weights``),
        its checkpoints in flight land, then it exits."""
        from albatross.orchestrator.trainer_worker import FINISH

        batch_q.put(FINISH)
        deadline = time.monotonic() + 3600
        while not self.final_weights and time.monotonic() < deadline:
            self._drain_results(result_q, proc, block=True)
        saved = self._saved
        if saved is not None and saved.step == self.state.step:
            # the last step's checkpoint is the run's end: its state counts every attempt run, those that
            # finished after that step included (a resume has nothing left to do)
            self._snapshot(saved.trainer_checkpoint).save(self.run_dir)

    # ---- the scheduling loop ------------------------------------------------------------------
    def _drive(self, pool: Rollouts, batch_q: BatchQueue, result_q: ResultQueue, proc: TrainerProcess) -> None:
        oc = self.cfg.orchestrator
        for observer in self.observers:
            observer.on_start()
        deadline = time.monotonic() + oc.max_minutes * 60 - self.state.elapsed_s
        inflight: list[_PendingGroup] = []
        ready: list[Batch] = []
        while True:
            out_of_time = time.monotonic() > deadline
            stopping = out_of_time or self._batches_sent + len(ready) >= oc.max_steps
            if out_of_time:
                ready.clear()  # not trained: the time budget is spent
            if stopping and not inflight and not ready:
                # why training stops, said when it does (progress.py's phase line)
                self.stop_reason = (f"max_steps ({oc.max_steps}) reached" if self._batches_sent >= oc.max_steps
                                    else f"max_minutes ({oc.max_minutes:g}) reached")
                break
            while not stopping and not ready and self._admit(inflight, len(ready)):
                inflight.append(self._start_group(pool))
            inflight = self._collect(inflight, ready)
            while ready:
                try:
                    batch_q.put_nowait(ready[0])
                except queue.Full:
                    break
                ready.pop(0)
                self._batches_sent += 1
            self._drain_results(result_q, proc, block=False)
            self._write_pids()
            self.sink.status(self._status(inflight))
            time.sleep(0.02)
        self._finish_queued_steps(result_q, proc)

    def _admit(self, inflight: list[_PendingGroup], n_ready: int) -> bool:
        """Start a group only if it can still be trained within ``max_staleness`` versions: count the
        batches not yet trained and the groups ahead of it (pending and in flight)."""
        oc = self.cfg.orchestrator
        untrained = self._batches_sent + n_ready - self.state.step
        ahead = len(self.builder.pending) + len(inflight)
        if self._batches_sent + n_ready + math.ceil((ahead + 1) / oc.groups_per_step) > oc.max_steps:
            return False
        return admissible(untrained, ahead, oc.groups_per_step, self.cfg.rl.max_staleness)

    def _train_version(self, n_ready: int) -> int:
        """The version the next batch formed will be trained at: the trainer steps through the batches in
        the order they are sent, one version each, from the version it started with."""
        return self._start_version + self._batches_sent + n_ready

    def _start_group(self, pool: Rollouts) -> _PendingGroup:
        task = self.tasks[self.sampler.next()]
        gid = f"g{self.state.group_seq:06d}"
        self.state.group_seq += 1
        futures = [pool.submit(AttemptSpec(task, gid, i)) for i in range(self.cfg.orchestrator.group_size)]
        return _PendingGroup(task, gid, futures)

    def _collect(self, inflight: list[_PendingGroup], ready: list[Batch]) -> list[_PendingGroup]:
        still = []
        for pg in inflight:
            if not all(f.done() for f in pg.futures):
                still.append(pg)
                continue
            batch = self._finish_group(pg, [f.result() for f in pg.futures], self._train_version(len(ready)))
            if batch is not None and self._batches_sent + len(ready) < self.cfg.orchestrator.max_steps:
                ready.append(batch)
        return still

    def _finish_group(self, pg: _PendingGroup, trajs: list[Trajectory], train_version: int) -> Batch | None:
        ok = [t for t in trajs if t.status != STATUS_INFRA_ERROR]
        group = Group(pg.task.id, pg.group_id, ok)
        if len(ok) < len(trajs):
            group.dropped = "infra_error"
        else:
            self.scorer.score_group(group)
        self.counts["attempts"] += len(trajs)
        self.counts["solved"] += sum(t.success for t in ok)
        self.counts["completion_tokens"] += sum(t.completion_tokens for t in ok)
        self._window.update(attempts=len(ok), solved=sum(t.success for t in ok))
        self._window["reward_x1000"] += int(1000 * sum(t.reward.score for t in ok))
        source = self.sources.get(pg.task.id)
        if source is not None:  # a task mix: the same figures per source
            self._window.update({f"source/{source}/attempts": len(ok),
                                 f"source/{source}/solved": sum(t.success for t in ok),
                                 f"source/{source}/reward_x1000": int(1000 * sum(t.reward.score for t in ok))})
            self.counts[f"source/{source}/groups"] += 1
        batch = self.builder.add(group, train_version)
        advantages = group.advantages or [0.0] * len(ok)
        extra = {"source": source} if source is not None else {}
        for t, adv in zip(group.trajectories, advantages, strict=True):
            append_jsonl(self.run_dir / "trajectories.jsonl",
                         {**t.to_dict(), "advantage": adv, "dropped": group.dropped, **extra})
        return batch

    # ---- trainer results ----------------------------------------------------------------------
    def _drain_results(self, result_q: ResultQueue, proc: TrainerProcess, block: bool) -> None:
        while True:
            try:
                msg = result_q.get(timeout=1.0) if block else result_q.get_nowait()
            except queue.Empty:
                if not proc.is_alive():
                    raise TrainerDied(f"trainer process exited with code {proc.exitcode}; resume with "
                                      f"`albatross train --resume {self.run_dir.parent}`") from None
                return
            if "error" in msg:
                raise TrainerDied(f"trainer failed:\n{msg['error']}")
            if "final" in msg:
                self.final_weights = str(msg["final"])
                self.final_adapter = str(msg.get("adapter") or "")
            elif "checkpoint_done" in msg or "checkpoint_error" in msg:
                self._on_checkpoint(msg)
            else:
                self._on_step(msg)
            if block:
                return

    def _finish_queued_steps(self, result_q: ResultQueue, proc: TrainerProcess) -> None:
        """Let the trainer finish the batches already queued, so no finished step is lost."""
        deadline = time.monotonic() + 300
        while self.state.step < self._batches_sent and time.monotonic() < deadline:
            self._drain_results(result_q, proc, block=True)

    def _on_step(self, msg: dict[str, Any]) -> None:
        self.engine.update_weights(msg["path"], msg["version"])
        self.state.version = int(msg["version"])
        self.state.step = self.state.version - self._start_version
        self.state.max_staleness_seen = max(self.state.max_staleness_seen, int(msg.get("staleness_max", 0)))
        self.counts["dropped_stale_tokens"] += int(msg.get("stale_tokens_dropped", 0))
        planned = msg.get("batch/train_version")
        if planned is not None and int(planned) != self.state.version - 1:  # the staleness check assumed it
            self.counts["train_version_mismatches"] += 1
            self.log(f"[train] step {self.state.step} trained at version {self.state.version - 1}, "
                     f"not the planned {int(planned)}: the staleness bound may not hold")
        record = {**self._step_record(msg), **self._checkpoint_figures}
        self._checkpoint_figures = {}
        self.sink.step(record)
        event = StepEvent(self.state.step, self.state.version, str(msg["path"]), record)
        for observer in self.observers:
            observer.on_step(event)
        prune_weights(self.run_dir, self.state.version, self.cfg.trainer.keep_versions)
        if msg.get("checkpoint"):
            self._pending[msg["checkpoint"]] = self._snapshot(msg["checkpoint"])

    def _step_record(self, msg: dict[str, Any]) -> dict[str, Any]:
        c, w, bc = self.counts, self._window, self.builder.counts
        if w["attempts"]:  # no attempt finished since the last step: show the last window's figures
            self._last_pass_rate = w["solved"] / w["attempts"]
            self._last_reward = w["reward_x1000"] / 1000 / w["attempts"]
        elapsed = self.state.elapsed_s + time.monotonic() - self._t0
        record = {
            "step": self.state.step, "version": self.state.version, "time": time.time(),
            "pass_rate": self._last_pass_rate,
            "reward_mean": self._last_reward,
            "groups": bc["groups"], "zero_signal_groups": bc["dropped_zero_signal"],
            "zero_signal_share": bc["dropped_zero_signal"] / max(1, bc["groups"]),
            "infra_dropped_groups": bc["dropped_infra_error"],
            "stale_dropped_groups": bc["dropped_stale"],
            "infra_error_attempts": c["infra_error_attempts"],
            "engine_restarts": self.engine.restarts,
            **({} if (idle := self._engine_idle_share()) is None else {"engine_idle_share": idle}),
            "sandbox_restarts": self.agent.backend.restarts,
            "dropped_stale_tokens_total": c["dropped_stale_tokens"],
            "queue_depth": self._batches_sent - self.state.step,
            "engine_tokens_per_s": c["completion_tokens"] / max(elapsed, 1e-6),
            "lr": self.cfg.trainer.lr,  # constant (no schedule); a trainer that reports its own overrides it
            "trainer_idle_share": msg.get("trainer_wait_s", 0.0) / max(msg.get("seconds", 0.0)
                                                                     + msg.get("trainer_wait_s", 0.0), 1e-6),
            **{k: v for k, v in msg.items() if isinstance(v, (int, float)) and k != "version"},
            **self._source_record(),
        }
        self._window.clear()
        return record

    def _source_record(self) -> dict[str, float]:
        """Per source of a task mix: pass rate and mean reward of the attempts since the last step, groups so far."""
        out: dict[str, float] = {}
        for name in sorted(set(self.sources.values())):
            n = self._window[f"source/{name}/attempts"]
            if n:
                out[f"source/{name}/pass_rate"] = self._window[f"source/{name}/solved"] / n
                out[f"source/{name}/reward_mean"] = self._window[f"source/{name}/reward_x1000"] / 1000 / n
            out[f"source/{name}/groups"] = self.counts[f"source/{name}/groups"]
        return out

    def _engine_busy(self) -> float | None:
        busy = self.engine.busy_seconds
        return None if busy is None else float(busy)

    def _engine_idle_share(self) -> float | None:
        """Share of the wall time since the last step that the engine replicas spent idle."""
        now, busy = time.monotonic(), self._engine_busy()
        (then, before), self._busy_mark = self._busy_mark, (now, busy)
        if busy is None or before is None or now <= then:
            return None
        capacity = (now - then) * self.engine.num_replicas
        return min(1.0, max(0.0, 1.0 - max(0.0, busy - before) / capacity))

    def _status(self, inflight: list[_PendingGroup]) -> dict[str, Any]:
        return {"step": f"{self.state.step}/{self.cfg.orchestrator.max_steps}",
                "pass": self._last_pass_rate, "groups in flight": len(inflight),
                "batches waiting": self._batches_sent - self.state.step,
                "attempts": self.counts["attempts"], "infra": self.counts["infra_error_attempts"],
                **({"engine restarts": self.engine.restarts} if self.engine.restarts else {})}


def _sampler(tasks: list[Task], sources: dict[str, str], weights: dict[str, float],
             seed: int) -> TaskSampler | MixSampler:
    """One seeded cycle over the tasks, or (a task mix) a ``MixSampler`` over the sources with a weight."""
    if not sources:
        return TaskSampler(len(tasks), seed)
    names = [n for n in dict.fromkeys(sources[t.id] for t in tasks) if weights.get(n, 0) > 0]
    groups = [[i for i, t in enumerate(tasks) if sources[t.id] == n] for n in names]
    return MixSampler(groups, [weights[n] for n in names], seed)


def rl_test_weights(path: str) -> dict[str, dict[str, float]] | None:
    """The per-test weights of ``rl.test_weights`` (a gates report), or None when it is empty."""
    if not path:
        return None
    from albatross.tasks.gates import load_test_weights

    if not Path(path).is_file():
        raise FileNotFoundError(f"{path}: rl.test_weights report not found")
    return load_test_weights(path)


def _stop_trainer(proc: TrainerProcess, batch_q: BatchQueue) -> None:
    """Ask the trainer to finish, then make sure it is gone (by the pid we started)."""
    if proc.is_alive():
        try:
            batch_q.put(None, timeout=5)
        except queue.Full:
            pass
        proc.join(timeout=30)
    if proc.is_alive():
        proc.kill()
    proc.join()

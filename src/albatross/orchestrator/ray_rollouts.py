"""Rollouts as Ray actors: ``RolloutWorker``s run attempts on their nodes (each its own sandbox backend and an engine
pool over the engine actors), ``RayRollouts`` sends them the driver's attempts with the task directories shipped as
objects (``TaskShipper``), and keeps a run going when a worker's node is lost."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import os
import threading
from collections import Counter
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol

from albatross.config import RunConfig
from albatross.engine.pool import EnginePool, LocalReplica
from albatross.harness.agent import AgentLoop, AttemptSpec
from albatross.orchestrator.ray_engines import RayEngineClient
from albatross.orchestrator.ray_files import materialize, node_root, pack_tree
from albatross.orchestrator.ray_node import node_id, node_load, ray_module
from albatross.records import STATUS_INFRA_ERROR, Trajectory

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from albatross.tasks.format import Task

# Ray's actor handles and object refs are ``Any`` here: Ray builds them at run time (``ray.remote``), untyped.


class Fleet(Protocol):
    """What ``RayRollouts`` uses of the run (``ray_backend.RayRun``)."""

    cfg: RunConfig
    workers: list[Any]
    placement: dict[str, Any]

    def engine_handles(self) -> tuple[int, list[Any]]:
        """The engine actors now, and a number that changes whenever one of them is started again."""
        ...


class RolloutWorker:
    """Runs attempts on its node: its own sandbox backend, an agent, an engine pool over the engine actors the
    driver names with each attempt (they change when one is started again), tasks written below its node's
    directory from the trees the driver ships."""

    def __init__(self, cfg_json: str, tokenizer: PreTrainedTokenizerBase, hide_paths: list[str]) -> None:
        from albatross.sandbox import backend_from_config

        self.cfg = RunConfig.model_validate_json(cfg_json)
        self.tokenizer = tokenizer
        # attempts see neither the driver's paths nor what was shipped to this node (other tasks' tests)
        self.backend = backend_from_config(self.cfg.sandbox, hide_paths=[*hide_paths, str(node_root())])
        self.retries = self.cfg.sandbox.max_infra_retries
        self.generation = -1
        self.engine: EnginePool | None = None
        self.agent: AgentLoop | None = None
        self._lock = threading.Lock()

    def ready(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "node": node_id()}

    def load(self) -> dict[str, float]:
        return node_load()

    def _agent(self, generation: int, engines: list[Any]) -> AgentLoop:
        from albatross.harness.agent import build_agent

        with self._lock:
            if generation != self.generation or self.agent is None:
                old = self.engine
                self.engine = EnginePool([LocalReplica(RayEngineClient(h)) for h in engines], log=lambda _: None)
                self.agent = build_agent(self.cfg, self.engine, self.backend, self.tokenizer)
                self.generation = generation
                if old is not None:
                    old.close()  # its clients only name actors; attempts holding a session finish with them
            return self.agent

    def run(self, spec: AttemptSpec, trees: dict[str, Any], generation: int,
            engines: list[Any]) -> tuple[Trajectory, dict[str, int]]:
        from albatross.harness.retry import run_with_retries
        from albatross.orchestrator.ray_files import localize_task

        values = ray_module().get(list(trees.values()))
        local = {root: materialize(tree, node_root() / "tasks") for root, tree in zip(trees, values, strict=True)}
        spec = dataclasses.replace(spec, task=localize_task(spec.task, local))
        counts: Counter[str] = Counter()
        traj = run_with_retries(self._agent(generation, engines), spec, self.retries, counts)
        return traj, dict(counts)

    def close(self) -> None:
        self.backend.close()
        if self.engine is not None:
            self.engine.close()


class TaskShipper:
    """Every task's directories as objects, packed once per task (``ray_files.task_roots``)."""

    def __init__(self) -> None:
        self._refs: dict[str, tuple[Task, dict[str, Any]]] = {}
        self._lock = threading.Lock()

    def ship(self, task: Task) -> tuple[Task, dict[str, Any]]:
        """``task`` with absolute paths, and an object of each of its root directories by path."""
        from albatross.orchestrator.ray_files import resolve_task, task_roots

        with self._lock:
            if task.id not in self._refs:
                ray, resolved = ray_module(), resolve_task(task)
                self._refs[task.id] = (resolved, {str(root): ray.put(pack_tree(root)) for root in task_roots(resolved)})
            return self._refs[task.id]


class RayRollouts:
    """Attempts spread over the rollout workers, ``orchestrator.rollout_workers`` at once (the others wait here, not
    on a worker): each to the live worker whose node has the most free cores per attempt it runs (memory-starved
    nodes last). A worker lost mid-attempt sets aside every worker of its node until Ray has started them again;
    the attempts it held are run again on the workers left (infrastructure errors, never scored)."""

    def __init__(self, run: Fleet, counts: Counter[str]) -> None:
        self.run, self.counts = run, counts
        n = len(run.workers)
        self.outstanding = [0] * n
        self.up = [True] * n
        self.nodes = [run.placement.get(f"rollout{i}", "") for i in range(n)]
        self.loads: list[dict[str, float]] = [{"free_cores": 1.0, "mem_gib": 8.0}] * n
        self.slots = run.cfg.orchestrator.rollout_workers
        self.waiting: collections.deque[tuple[AttemptSpec, Future[Trajectory], int]] = collections.deque()
        self.tasks = TaskShipper()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._turn = itertools.count()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._dispatch, name="ray-dispatch", daemon=True),
                         threading.Thread(target=self._measure, name="ray-load", daemon=True)]
        for t in self._threads:
            t.start()

    def _measure(self) -> None:
        ray = ray_module()
        while not self._stop.is_set():
            for i, w in enumerate(self.run.workers):
                if self.up[i]:
                    try:
                        self.loads[i] = ray.get(w.load.remote(), timeout=5)
                    except Exception:  # noqa: BLE001 - a lost worker: the attempt that finds it sets it aside
                        pass
            self._stop.wait(5.0)

    def _pick(self) -> int | None:
        """The live worker with the lowest share of its node's free cores (called under the lock)."""
        turn, live = next(self._turn), [k for k in range(len(self.up)) if self.up[k]]
        if not live:
            return None

        def cost(k: int) -> tuple[float, int]:
            load = self.loads[k]
            share = (1 + self.outstanding[k]) / max(0.25, load["free_cores"])
            return share * (1 if load["mem_gib"] >= 1 else 4), (k - turn) % len(self.up)

        return min(live, key=cost)

    def submit(self, spec: AttemptSpec) -> Future[Trajectory]:
        out: Future[Trajectory] = Future()
        with self._lock:
            self.waiting.append((spec, out, self.run.cfg.sandbox.max_infra_retries))
            self._wake.notify_all()
        return out

    def _dispatch(self) -> None:
        """Send waiting attempts while fewer than ``slots`` run and a worker is live."""
        while True:
            with self._lock:
                i = None
                while not self._stop.is_set():
                    i = self._pick() if self.waiting and sum(self.outstanding) < self.slots else None
                    if i is not None:
                        break
                    self._wake.wait(1.0)
                if i is None:  # stopped: what still waits ends as an infrastructure error, never scored
                    left, self.waiting = list(self.waiting), collections.deque()
                else:
                    left = []
                    item = self.waiting.popleft()
                    self.outstanding[i] += 1
            for spec, out, _ in left:
                out.set_result(Trajectory(task_id=spec.task.id, group_id=spec.group_id, attempt=spec.attempt,
                                          status=STATUS_INFRA_ERROR, error="RolloutWorkerDied: the run stopped"))
            if i is None:
                return
            self._send(i, *item)

    def _send(self, worker: int, spec: AttemptSpec, out: Future[Trajectory], tries_left: int) -> None:
        generation, engines = self.run.engine_handles()
        task, trees = self.tasks.ship(spec.task)
        ref = self.run.workers[worker].run.remote(dataclasses.replace(spec, task=task), trees, generation, engines)

        def done(f: Future[tuple[Trajectory, dict[str, int]]]) -> None:
            try:
                traj, counts = f.result()
            except Exception as e:  # noqa: BLE001 - the worker (or its node) died: an infrastructure error
                self._lost(worker)
                with self._lock:
                    self.outstanding[worker] -= 1
                    self.counts.update({"infra_error_attempts": 1, "infra_error:RolloutWorkerDied": 1})
                    if tries_left > 0 and not self._stop.is_set():  # first in line for a live worker
                        self.waiting.appendleft((spec, out, tries_left - 1))
                        self._wake.notify_all()
                        return
                out.set_result(Trajectory(task_id=spec.task.id, group_id=spec.group_id, attempt=spec.attempt,
                                          status=STATUS_INFRA_ERROR, error=f"RolloutWorkerDied: {type(e).__name__}"))
                return
            with self._lock:
                self.outstanding[worker] -= 1
                self.counts.update(counts)
                self._wake.notify_all()
            out.set_result(traj)

        ref.future().add_done_callback(done)

    def _lost(self, worker: int) -> None:
        """Set aside ``worker`` and every worker on its node (lost with it), each until Ray has it back."""
        with self._lock:
            gone = [k for k in range(len(self.up)) if self.up[k] and (k == worker or self.nodes[k] == self.nodes[worker])]
            for k in gone:
                self.up[k] = False
        for k in gone:
            threading.Thread(target=self._revive, args=(k,), daemon=True).start()

    def _revive(self, i: int) -> None:
        """Wait until Ray has started worker ``i`` again (on a node left), then send it attempts again."""
        ray = ray_module()
        while not self._stop.is_set():
            try:
                info = ray.get(self.run.workers[i].ready.remote(), timeout=30)
            except Exception:  # noqa: BLE001 - still being started again
                self._stop.wait(1.0)
                continue
            with self._lock:
                self.up[i], self.nodes[i] = True, info["node"]
                self._wake.notify_all()
            return

    def shutdown(self) -> None:
        with self._lock:
            self._stop.set()  # the workers live as long as the RayRun; RayRun.close stops them
            self._wake.notify_all()
        self._threads[0].join(timeout=10)

"""`--backend ray`: the same run with its parts as Ray actors on an existing cluster, no shared filesystem needed.

- trainer: ``trainer.gpus`` rank actors in one placement group (``ray.trainer_placement``, ``ray.trainer_cpus`` /
  ``ray.trainer_gpus`` / ``ray.trainer_resources`` each): an FSDP2 group whose rendezvous is rank 0's node; rank 0
  takes the batches from a ``ray.util.queue`` queue and reports on another;
- engines: ``engine.replicas`` actors (``ray.engine_*``), each running the engine of ``[engine]`` on its node: a
  vLLM or SGLang server it launches and supervises (``engine.tensor_parallel_size`` GPUs), or the built-in engine on
  the actor's device. They form the same ``EnginePool`` as on one machine (sticky sessions, weight versions); an
  actor lost with its node is started again elsewhere and loads the newest weights;
- rollouts: ``ray.rollout_workers`` actors on the nodes with the most free CPUs (those without GPUs first), each
  with its own sandbox backend and an engine pool over the replicas; each attempt goes to the worker whose node
  has the most free cores per attempt running there. A worker lost with its node costs only its attempts in
  flight, which are run again on another worker (infrastructure errors, never scored).

Nothing travels as a path between nodes (``ray_files``): the model directory, every task's directories, each
weight version and each checkpoint go through Ray's object store as ``Tree`` values and are written below each
node's own directory (``ray_files.node_root()``). Each trainer rank writes its part of a checkpoint into its own
directory; the driver copies the union into the run directory, where ``--resume`` finds it (and ships it back).
The orchestrator (admission control, scoring, batching, metrics, evaluations) stays in the driver. Ray is optional
(``pip install 'albatross[ray]'``); nothing here imports it until a run asks for it.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import os
import shutil
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from albatross.config import ConfigError, RunConfig
from albatross.engine.base import Completion, EngineError, SamplingParams, SingleEngine
from albatross.engine.pool import EnginePool, LocalReplica, load_newest
from albatross.harness.agent import AgentLoop, AttemptSpec
from albatross.orchestrator.launcher import BatchQueue, ResultQueue
from albatross.orchestrator.ray_files import Tree, materialize, node_root, pack_tree, write_tree
from albatross.records import STATUS_INFRA_ERROR, Trajectory

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from albatross.tasks.format import Task

# Ray's actor handles and object refs are ``Any`` here: Ray builds them at run time (``ray.remote``), untyped.

PLACEMENT_FILE = "ray_placement.json"  # <run_dir>/: the node of every actor, the versions each engine loaded


def _ray() -> ModuleType:
    try:
        import ray
    except ImportError as e:
        raise RuntimeError("orchestrator.backend = 'ray' needs Ray: pip install 'albatross[ray]'") from e
    return ray


def _node_id() -> str:
    return str(_ray().get_runtime_context().get_node_id())


def node_dir(tag: str, part: str) -> Path:
    """``part``'s own directory for run ``tag`` on this node (emptied: a restarted actor starts clean)."""
    path = node_root() / _node_id()[:12] / tag / part
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def _models() -> Path:
    return node_root() / "models"


def _inside(root: Path, rel: str) -> Path:
    """``root / rel``, refusing a ``rel`` that leaves ``root``."""
    path = (root / rel).resolve()
    if not path.is_relative_to(root.resolve()):
        raise ValueError(f"{rel}: outside {root}")
    return path


def merge_trees(parts: list[Tree]) -> Tree:
    """The union of trees (each rank's part of a checkpoint); where two hold the same path, the first's file."""
    files: dict[str, tuple[str, int, bytes]] = {}
    for tree in reversed(parts):
        files.update({f[0]: f for f in tree.files})
    return Tree(tuple(sorted(files.values())))


# ---------------------------------------------------------------------------------------------- engines


class EngineActor:
    """The engine of ``[engine]`` (one replica: a launched vLLM / SGLang server, supervised, or the built-in engine
    on this actor's device) serving the model shipped to it; weight versions arrive as ``Tree`` values."""

    def __init__(self, cfg_json: str, model: Tree, tag: str, index: int) -> None:
        from albatross.engine.launch import make_engine

        cfg = RunConfig.model_validate_json(cfg_json)
        self.dir = node_dir(tag, f"engine{index}")
        self.keep = cfg.trainer.keep_versions
        self.loaded: list[dict[str, Any]] = []
        self._closed = threading.Event()
        one = cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"replicas": 1})})
        if cfg.engine.type == "builtin":
            import torch

            torch.set_num_threads(cfg.engine.threads)
        self.engine = make_engine(one, materialize(model, _models()), self.dir, log=lambda _: None, trainer_gpus=0)

    def ready(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "node": _node_id(), "dir": str(self.dir)}

    def wait_closed(self) -> None:
        """Returns when the actor is closed; fails when it dies (how the driver's pool sees a lost replica)."""
        self._closed.wait()

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        return self.engine.generate(prompts, params)

    def update_weights(self, tree: Tree | None, rel: str, version: int) -> int:
        """Write ``tree`` (a weight version or adapter; ``None``: only the label moves) below this actor's
        directory at ``rel`` and load it."""
        from albatross.orchestrator.state import prune_weights

        if tree is None:
            self.engine.update_weights("", version)
            return self.engine.version
        path = write_tree(tree, _inside(self.dir, rel))
        self.engine.update_weights(str(path), version)
        self.loaded.append({"version": version, "path": str(path)})
        prune_weights(self.dir, version, self.keep)
        return self.engine.version

    def busy_seconds(self) -> float | None:
        return self.engine.busy_seconds

    def history(self) -> list[dict[str, Any]]:
        return list(self.loaded)

    def close(self) -> None:
        try:
            self.engine.close()
        finally:
            self._closed.set()


class WeightSource:
    """Where the engines get weight versions: the trainer's rank 0 actor, by path relative to its directory; one
    object per version, fetched once per node by Ray however many engines load it."""

    def __init__(self) -> None:
        self.rank0: Any = None
        self.home = ""
        self._refs: dict[str, Any] = {}
        self._lock = threading.Lock()

    def attach(self, rank0: Any, home: str) -> None:
        self.rank0, self.home = rank0, home

    def relative(self, path: str) -> str:
        return str(Path(path).relative_to(self.home))

    def ref(self, path: str) -> tuple[Any, str]:
        """The object holding ``path``'s tree, and ``path`` relative to the trainer's directory."""
        if self.rank0 is None:
            raise EngineError(f"{path}: no trainer to fetch weights from yet")
        rel = self.relative(path)
        with self._lock:
            if rel not in self._refs:
                self._refs[rel] = self.rank0.read_tree.remote(rel)
                for old in list(self._refs)[:-4]:  # the last few: a restarted replica may ask again
                    del self._refs[old]
            return self._refs[rel], rel


class RayEngineClient(SingleEngine):
    """``Engine`` over one engine actor; a dead actor is an ``EngineError`` (an infrastructure error)."""

    def __init__(self, handle: Any, source: WeightSource | None = None, version: int = 0) -> None:
        self.handle, self.source, self.version = handle, source, version

    def _get(self, ref: Any) -> Any:
        ray = _ray()
        try:
            return ray.get(ref)
        except ray.exceptions.RayError as e:
            raise EngineError(f"engine actor: {type(e).__name__}: {str(e).splitlines()[0][:300]}") from e

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        completions: list[Completion] = self._get(self.handle.generate.remote(prompts, params))
        return completions

    def update_weights(self, path: str, version: int) -> None:
        if not path:
            self._get(self.handle.update_weights.remote(None, "", version))
        else:
            if self.source is None:
                raise EngineError("this engine client cannot load weights (a rollout worker's)")
            ref, rel = self.source.ref(path)
            self._get(self.handle.update_weights.remote(ref, rel, version))
        self.version = version

    @property
    def busy_seconds(self) -> float | None:
        try:
            busy = self._get(self.handle.busy_seconds.remote())
        except EngineError:
            return None
        return None if busy is None else float(busy)

    def close(self) -> None:
        pass  # the actor belongs to its replica


class RayReplica:
    """One engine actor as the pool's ``Replica``: started (and started again when lost) by the pool, on the node
    Ray picks; alive while its ``wait_closed`` call is pending."""

    def __init__(self, spawn: Callable[[], Any], source: WeightSource, start_timeout_s: float) -> None:
        self.spawn, self.source, self.start_timeout_s = spawn, source, start_timeout_s
        self.engine: RayEngineClient | None = None
        self.actor: Any = spawn()  # placed now, so that every replica starts at once
        self.url = ""
        self.info: dict[str, Any] = {}
        self._life: Any = None

    @property
    def pid(self) -> int | None:
        return self.info.get("pid")

    def alive(self) -> bool:
        return self._life is not None and not _ray().wait([self._life], timeout=0)[0]

    def exit_code(self) -> int | None:
        return None if self.alive() else 1

    def start(self, newest: Callable[[], tuple[str, int] | None]) -> None:
        ray = _ray()
        self.engine = None
        if self.actor is None:
            self.actor = self.spawn()
        try:
            self.info = ray.get(self.actor.ready.remote(), timeout=self.start_timeout_s)
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayError) as e:
            self.close()
            raise EngineError(f"engine actor did not start ({type(e).__name__}: {str(e).splitlines()[0][:300]})") \
                from None
        self._life = self.actor.wait_closed.remote()
        self.engine = load_newest(RayEngineClient(self.actor, self.source), newest)

    def history(self) -> list[dict[str, Any]]:
        if self.actor is None:
            return []
        try:
            loaded: list[dict[str, Any]] = _ray().get(self.actor.history.remote(), timeout=30)
            return loaded
        except Exception:  # noqa: BLE001 - a lost actor has no history to give
            return []

    def close(self) -> None:
        ray = _ray()
        if self.actor is not None:
            try:
                ray.get(self.actor.close.remote(), timeout=60)
            except Exception:  # noqa: BLE001 - dead already, or stuck: killed below
                pass
            ray.kill(self.actor, no_restart=True)
        self.actor, self.engine, self._life = None, None, None


# ---------------------------------------------------------------------------------------------- rollouts


def node_load() -> dict[str, float]:
    """This node's free cores (CPUs less the 1-minute load) and available memory in GiB."""
    cpus = len(os.sched_getaffinity(0))
    mem = 0.0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                mem = int(line.split()[1]) / 2**20
    except OSError:
        pass
    return {"free_cores": max(0.0, cpus - os.getloadavg()[0]), "mem_gib": mem}


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
        return {"pid": os.getpid(), "node": _node_id()}

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

        values = _ray().get(list(trees.values()))
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
                ray, resolved = _ray(), resolve_task(task)
                self._refs[task.id] = (resolved, {str(root): ray.put(pack_tree(root)) for root in task_roots(resolved)})
            return self._refs[task.id]


class RayRollouts:
    """Attempts spread over the rollout workers, ``orchestrator.rollout_workers`` at once (the others wait here, not
    on a worker): each to the live worker whose node has the most free cores per attempt it runs (memory-starved
    nodes last). A worker lost mid-attempt sets aside every worker of its node until Ray has started them again;
    the attempts it held are run again on the workers left (infrastructure errors, never scored)."""

    def __init__(self, run: RayRun, counts: Counter[str]) -> None:
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
        ray = _ray()
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
        ray = _ray()
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


# ---------------------------------------------------------------------------------------------- trainer


class TrainerRank:
    """One trainer rank on its node, in its own directory; also serves the files it wrote (weight versions,
    its part of each checkpoint) to the engines and the driver."""

    def __init__(self, tag: str, rank: int) -> None:
        self.rank = rank
        self.dir = node_dir(tag, f"trainer{rank}")

    def ready(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "node": _node_id(), "dir": str(self.dir)}

    def rendezvous(self) -> tuple[str, int]:
        """This node's address and a free port on it (rank 0's: the group's ``MASTER_ADDR``/``MASTER_PORT``)."""
        import socket

        with socket.socket() as s:
            s.bind(("", 0))
            port = int(s.getsockname()[1])
        return str(_ray().util.get_node_ip_address()), port

    def run(self, model: Tree, cfg_json: str, batch_q: Any, result_q: Any, version: int, resume: Tree | None,
            resume_rel: str, world: int, master: tuple[str, int]) -> None:
        from albatross.orchestrator.trainer_worker import serve_rank

        model_dir = materialize(model, _models())
        ckpt = str(write_tree(resume, _inside(self.dir, resume_rel))) if resume is not None else ""
        os.environ.update({"MASTER_ADDR": master[0], "MASTER_PORT": str(master[1])})
        serve_rank(str(model_dir), str(self.dir), cfg_json, batch_q, result_q, version, ckpt, self.rank, world)

    def read_tree(self, rel: str, wait_s: float = 120.0) -> Tree:
        """The files at ``rel`` in this rank's directory (a checkpoint part still being renamed is waited for)."""
        path = _inside(self.dir, rel)
        deadline = time.monotonic() + wait_s
        while not path.is_dir() and time.monotonic() < deadline:
            time.sleep(0.2)
        if not path.is_dir():
            raise FileNotFoundError(f"trainer rank {self.rank}: no {rel}")
        return pack_tree(path)

    def prune(self, version: int, keep: int, checkpoints: bool) -> None:
        from albatross.orchestrator.state import prune_before, prune_weights

        (prune_before if checkpoints else prune_weights)(self.dir, version, keep)


class TrainerGroup:
    """The trainer's rank actors seen as the process handle the loop expects (is_alive, join, kill, exitcode):
    it ends when every rank has; a rank that fails ends it with exit code 1."""

    def __init__(self, ranks: list[Any], refs: list[Any], pid: int) -> None:
        self.ranks, self.refs, self.pid = ranks, refs, pid

    def _finished(self, timeout: float = 0) -> tuple[list[Any], bool]:
        ray = _ray()
        done, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=timeout)
        failed = False
        for ref in done:
            try:
                ray.get(ref)
            except Exception:  # noqa: BLE001 - the rank died or raised: the loop reports the run's end
                failed = True
        return done, failed

    def is_alive(self) -> bool:
        done, failed = self._finished()
        return len(done) < len(self.refs) and not failed

    @property
    def exitcode(self) -> int | None:
        done, failed = self._finished()
        if failed:
            return 1
        return 0 if len(done) == len(self.refs) else None

    def join(self, timeout: float | None = None) -> None:
        self._finished(timeout if timeout is not None else 1e9)

    def kill(self) -> None:
        for actor in self.ranks:
            _ray().kill(actor, no_restart=True)


class RayResults:
    """The trainer's result queue, its paths made the driver's: a checkpoint is copied (the union of every rank's
    part) into the run directory, so is the final version and adapter; the trainer's nodes keep only what the
    loop keeps."""

    def __init__(self, queue: Any, run: RayRun) -> None:
        self.queue, self.run = queue, run

    def get(self, block: bool = True, timeout: float | None = None) -> dict[str, Any]:
        msg: dict[str, Any] = self.queue.get(block=block, timeout=timeout)
        return self.run.translate(msg)

    def get_nowait(self) -> dict[str, Any]:
        return self.get(block=False)


# ---------------------------------------------------------------------------------------------- a run


def engine_actor_gpus(cfg: RunConfig) -> float:
    """GPUs of one engine actor: ``ray.engine_gpus``; a vLLM / SGLang server on GPUs takes
    ``engine.tensor_parallel_size`` of them."""
    ec, gpus = cfg.engine, cfg.ray.engine_gpus
    if ec.type != "builtin" and gpus and gpus != ec.tensor_parallel_size:
        raise ConfigError(f"ray.engine_gpus: a {ec.type} server of engine.tensor_parallel_size "
                          f"{ec.tensor_parallel_size} takes {ec.tensor_parallel_size} GPU(s), not {gpus:g}")
    return gpus


def check_ray_config(cfg: RunConfig) -> None:
    """What a Ray run cannot do, as one-line config errors."""
    if cfg.engine.weight_sync == "nccl":
        raise ConfigError("engine.weight_sync: nccl is not available across Ray nodes yet; use \"filesystem\" "
                          "(weights go through Ray's object store)")
    if cfg.engine.urls:
        raise ConfigError("engine.urls: servers attached by URL are not Ray actors; leave it empty with "
                          "orchestrator.backend = \"ray\"")
    if cfg.trainer.device == "cuda" and not cfg.ray.trainer_gpus:
        raise ConfigError(f"ray.trainer_gpus: 0 with trainer.device = {cfg.trainer.device!r}; a GPU trainer takes "
                          "1 GPU per rank (set ray.trainer_gpus = 1, or trainer.device = \"cpu\")")
    engine_actor_gpus(cfg)


def check_resources(cfg: RunConfig, resources: dict[str, float], nodes: int = 1) -> None:
    """Actors that cannot all be placed would wait forever: say so at start-up, naming the fields."""
    rc, n, world = cfg.ray, cfg.engine.replicas, cfg.trainer.gpus
    for kind, field, need in (
        ("CPU", "cpus", world * rc.trainer_cpus + n * rc.engine_cpus + rc.rollout_workers * rc.worker_cpus),
        ("GPU", "gpus", world * rc.trainer_gpus + n * engine_actor_gpus(cfg)),
    ):
        have = resources.get(kind, 0.0)
        if need > have + 1e-9:
            raise ConfigError(
                f"ray: the run's actors need {need:g} {kind}s (trainer.gpus x ray.trainer_{field} + engine.replicas x "
                f"ray.engine_{field}" + (" + ray.rollout_workers x ray.worker_cpus" if kind == "CPU" else "")
                + f") but the cluster has {have:g}")
    if rc.trainer_placement == "strict_spread" and world > nodes:
        raise ConfigError(f"ray.trainer_placement: strict_spread puts each of the {world} trainer ranks "
                          f"(trainer.gpus) on its own node, and the cluster has {nodes}")


def _options(cpus: float, gpus: float, resources: dict[str, float]) -> dict[str, Any]:
    out: dict[str, Any] = {"num_cpus": cpus, "num_gpus": gpus}
    if resources:
        out["resources"] = dict(resources)
    return out


class RayRun:
    """Connects to (or starts) Ray and owns the run's actors; also the loop's launcher."""

    name = "ray"

    def __init__(self, cfg: RunConfig, model_dir: Path, run_dir: Path, tokenizer: PreTrainedTokenizerBase,
                 hide_paths: list[str], log: Callable[[str], None] = print) -> None:
        ray = _ray()
        check_ray_config(cfg)
        self.cfg, self.run_dir, self.log = cfg, Path(run_dir), log
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.tag = f"{self.run_dir.parent.name}-{os.urandom(4).hex()}"
        rc = cfg.ray
        self._connected = False
        if not ray.is_initialized():
            if rc.address:
                ray.init(address=rc.address, log_to_driver=False)
            else:
                ray.init(include_dashboard=False, log_to_driver=False)
            self._connected = True
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        resources = ray.cluster_resources()
        log(f"[ray] cluster: {resources.get('CPU', 0):g} CPUs, {resources.get('GPU', 0):g} GPUs, "
            f"{len(nodes)} node(s)")
        check_resources(cfg, resources, len(nodes))
        self.placement: dict[str, Any] = {"driver": _node_id()}
        self._trainer: TrainerGroup | None = None
        self.workers: list[Any] = []
        self.worker_pids: list[int] = []
        self.ranks: list[Any] = []
        self.rank_info: list[dict[str, Any]] = []
        self.replicas: list[RayReplica] = []
        self.source = WeightSource()
        self._pool: EnginePool | None = None
        self._group: Any = None
        self.generation = 0
        try:
            self._start(cfg, model_dir, tokenizer, hide_paths)
        except BaseException:
            self.close()
            raise

    def _start(self, cfg: RunConfig, model_dir: Path, tokenizer: PreTrainedTokenizerBase,
               hide_paths: list[str]) -> None:
        ray, rc = _ray(), cfg.ray
        t0 = time.monotonic()
        self.model = ray.put(pack_tree(model_dir))
        self.log(f"[ray] model shipped through the object store in {time.monotonic() - t0:.1f} s")
        self._place_trainer(cfg)
        cfg_json = cfg.model_dump_json()
        engine_cls = ray.remote(EngineActor).options(
            **_options(rc.engine_cpus, engine_actor_gpus(cfg), rc.engine_resources), max_restarts=0,
            max_concurrency=max(8, cfg.orchestrator.rollout_workers + 4))
        def spawner(i: int) -> Callable[[], Any]:
            return lambda: engine_cls.remote(cfg_json, self.model, self.tag, i)

        replicas = [RayReplica(spawner(i), self.source, cfg.engine.start_timeout_s)
                    for i in range(cfg.engine.replicas)]
        self.replicas = replicas
        self._pool = EnginePool.started(replicas, log=self.log)
        self._pool.on_restart = self._engines_moved
        for i, r in enumerate(replicas):
            self.placement[f"engine{i}"] = r.info.get("node", "")
        self._start_workers(cfg, tokenizer, hide_paths)
        self.log(f"[ray] {cfg.engine.replicas} {cfg.engine.type} engine replica(s), {len(self.workers)} rollout "
                 f"worker(s), {cfg.trainer.gpus} trainer rank(s) on nodes "
                 f"{sorted({self.placement[f'trainer{i}'][:8] for i in range(cfg.trainer.gpus)})}")
        self._write_placement()

    def _place_trainer(self, cfg: RunConfig) -> None:
        """The trainer ranks' placement group and actors (placed before the rollout workers pick nodes)."""
        ray, rc = _ray(), cfg.ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = {k: v for k, v in {"CPU": rc.trainer_cpus, "GPU": rc.trainer_gpus, **rc.trainer_resources}.items()
                  if v}
        world = cfg.trainer.gpus
        self._group = placement_group([dict(bundle) for _ in range(world)], strategy=rc.trainer_placement.upper())
        try:
            ray.get(self._group.ready(), timeout=600)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(f"the {world} trainer rank(s) were not placed within 10 minutes "
                               f"(ray.trainer_placement = {rc.trainer_placement!r}, {bundle} each)") from None
        rank_cls = ray.remote(TrainerRank)
        self.ranks = [rank_cls.options(
            **_options(rc.trainer_cpus, rc.trainer_gpus, rc.trainer_resources), max_concurrency=4,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self._group, placement_group_bundle_index=i),
        ).remote(self.tag, i) for i in range(world)]
        self.rank_info = ray.get([r.ready.remote() for r in self.ranks])
        for i, info in enumerate(self.rank_info):
            self.placement[f"trainer{i}"] = info["node"]

    def _start_workers(self, cfg: RunConfig, tokenizer: PreTrainedTokenizerBase, hide_paths: list[str]) -> None:
        ray, rc = _ray(), cfg.ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        per_worker = -(-cfg.orchestrator.rollout_workers // rc.rollout_workers)
        worker_cls = ray.remote(RolloutWorker)
        nodes = [] if rc.worker_resources else self._worker_nodes(cfg)
        cfg_json = cfg.model_dump_json()
        for i in range(rc.rollout_workers):
            options: dict[str, Any] = {**_options(rc.worker_cpus, 0, rc.worker_resources),
                                       "max_concurrency": per_worker + 2, "max_restarts": -1}
            if nodes:  # soft: a worker whose node is lost starts again on another
                options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(nodes[i], soft=True)
            self.workers.append(worker_cls.options(**options).remote(cfg_json, tokenizer, hide_paths))
        infos = ray.get([w.ready.remote() for w in self.workers])
        self.worker_pids = [info["pid"] for info in infos]
        for i, info in enumerate(infos):
            self.placement[f"rollout{i}"] = info["node"]

    def _worker_nodes(self, cfg: RunConfig) -> list[str]:
        """A node for each rollout worker: those without GPUs (all if every node has some), the most free CPUs
        (after the trainer's and the engines' reservations) first."""
        ray, rc = _ray(), cfg.ray
        alive = [n for n in ray.nodes() if n.get("Alive")]
        cpu_only = [n for n in alive if not n["Resources"].get("GPU")] or alive
        used: dict[str, float] = {}
        for part, node in self.placement.items():
            if part.startswith("trainer"):
                used[node] = used.get(node, 0.0) + rc.trainer_cpus
            elif part.startswith("engine"):
                used[node] = used.get(node, 0.0) + rc.engine_cpus
        free = {n["NodeID"]: n["Resources"].get("CPU", 0.0) - used.get(n["NodeID"], 0.0) for n in cpu_only}
        out = []
        for _ in range(rc.rollout_workers):
            best = max(free, key=lambda k: free[k])
            out.append(best)
            free[best] -= rc.worker_cpus
        return out

    @property
    def engine(self) -> EnginePool:
        """The pool of the engine actors (the driver's engine: the loop's weight versions, the evaluations)."""
        if self._pool is None:
            raise RuntimeError("the Ray run's engines are not started")
        return self._pool

    def _engines_moved(self, pool: EnginePool) -> None:
        """A replica was started again (on whichever node Ray picked): the workers get the new handles."""
        self.generation += 1
        for i, r in enumerate(self.replicas):
            self.placement[f"engine{i}"] = r.info.get("node", "")
        self._write_placement()

    def engine_handles(self) -> tuple[int, list[Any]]:
        return self.generation, [r.actor for r in self.replicas if r.actor is not None]

    def _write_placement(self, **extra: Any) -> None:
        path = self.run_dir / PLACEMENT_FILE
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps({**self.placement, **extra}, indent=1, sort_keys=True) + "\n")
        tmp.replace(path)

    # the loop's launcher ----------------------------------------------------------------------------
    def queues(self, maxsize: int) -> tuple[BatchQueue, ResultQueue]:
        from ray.util.queue import Queue
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        # on the driver's node: a queue on a node that is lost would take the run with it
        here = {"num_cpus": 0, "scheduling_strategy": NodeAffinitySchedulingStrategy(self.placement["driver"], False)}
        batches = Queue(maxsize=maxsize, actor_options=dict(here))
        return batches, RayResults(Queue(actor_options=dict(here)), self)

    def start_trainer(self, args: tuple[Any, ...]) -> TrainerGroup:
        """Start ``trainer_worker.trainer_main(*args)``'s work on the rank actors: the model and a resumed
        checkpoint (a directory of the driver's) are shipped to each."""
        ray = _ray()
        _model_dir, _run_dir, cfg_json, batch_q, result_q, version, resume_ckpt = args
        results = result_q.queue if isinstance(result_q, RayResults) else result_q
        resume, rel = None, ""
        if resume_ckpt:
            resume, rel = ray.put(pack_tree(Path(resume_ckpt))), str(Path(resume_ckpt).relative_to(self.run_dir))
        master = ray.get(self.ranks[0].rendezvous.remote())
        world = len(self.ranks)
        refs = [r.run.remote(self.model, cfg_json, batch_q, results, version, resume, rel, world, master)
                for r in self.ranks]
        self.source.attach(self.ranks[0], self.rank_info[0]["dir"])
        self._trainer = TrainerGroup(self.ranks, refs, self.rank_info[0]["pid"])
        return self._trainer

    def translate(self, msg: dict[str, Any]) -> dict[str, Any]:
        """A trainer message with the driver's paths (``RayResults``)."""
        ray, keep = _ray(), self.cfg.trainer.keep_versions
        if not self.ranks:
            return msg
        if msg.get("checkpoint"):
            msg["checkpoint"] = str(self._mirror_path(msg["checkpoint"]))
        if "checkpoint_done" in msg:
            rel = self.source.relative(msg["checkpoint_done"])
            parts = ray.get([r.read_tree.remote(rel) for r in self.ranks])
            dest = write_tree(merge_trees(parts), self.run_dir / rel)
            msg["checkpoint_done"] = str(dest)
            for r in self.ranks:  # the driver holds it now; the loop prunes its own copies
                r.prune.remote(int(msg["version"]), keep, True)
        for key in ("final", "adapter"):
            if msg.get(key):
                rel = self.source.relative(msg[key])
                msg[key] = str(write_tree(ray.get(self.ranks[0].read_tree.remote(rel)), self.run_dir / rel))
        if msg.get("path"):  # a step: older versions go on the trainer's node, as here
            self.ranks[0].prune.remote(int(msg["version"]), keep, False)
        return msg

    def _mirror_path(self, path: str) -> Path:
        return self.run_dir / self.source.relative(path)

    def rollouts(self, agent: AgentLoop, cfg: RunConfig, counts: Counter[str]) -> RayRollouts:
        return RayRollouts(self, counts)  # each worker has its own agent, built from the run's config

    def pids(self) -> dict[str, int]:
        out = {name: pid for name, pid in self.engine.pids().items()}
        out.update({f"rollout{i}": pid for i, pid in enumerate(self.worker_pids)})
        out.update({f"trainer_rank{i}": info["pid"] for i, info in enumerate(self.rank_info) if i})
        return out

    def close(self) -> None:
        ray = _ray()
        if self.replicas:  # where everything ended up, and the versions each engine loaded (and from where)
            try:
                at_end = [info["node"] for info in ray.get([w.ready.remote() for w in self.workers], timeout=60)]
            except Exception:  # noqa: BLE001 - a worker still being started again elsewhere
                at_end = []
            self._write_placement(engine_versions=[r.history() for r in self.replicas], rollout_nodes_at_end=at_end)
        try:
            ray.get([w.close.remote() for w in self.workers], timeout=120)  # sandboxes cleaned up in place
        except Exception as e:  # noqa: BLE001 - still kill them below
            self.log(f"[ray] a rollout worker did not close cleanly: {type(e).__name__}")
        for actor in self.workers:
            ray.kill(actor, no_restart=True)
        if self._pool is not None:
            self._pool.close()
        else:
            for r in self.replicas:
                r.close()
        if self._trainer is not None:
            self._trainer.kill()
        for actor in self.ranks:
            ray.kill(actor, no_restart=True)
        if self._group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._group)
        if self._connected:
            ray.shutdown()

"""`--backend ray`: the same run with its parts as Ray actors on an existing cluster.

- trainer: one actor (``ray.trainer_cpus`` / ``ray.trainer_gpus``) running the trainer process's main
  loop; batches in and step results out over ``ray.util.queue`` queues;
- engines: ``engine.replicas`` actors, each a built-in engine (``ray.engine_cpus`` / ``ray.engine_gpus``),
  restarted by Ray if their process dies (a restarted replica loads the newest exported weights);
- rollouts: ``ray.rollout_workers`` actors, each with its own sandbox backend on its node and an engine
  pool over the replicas (attempts stay on one replica); ``orchestrator.rollout_workers`` attempts run
  at once over all of them.

The orchestrator (admission control, scoring, batching, metrics, checkpoints) stays in the driver.
Weights and checkpoints are files in the run directory: on several nodes it must be on a filesystem
every node mounts at the same path (NFS, a shared volume), and so must the task directories.
Ray is optional (``pip install 'albatross[ray]'``); nothing here imports it until a run asks for it.
"""

from __future__ import annotations

import itertools
import math
import os
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from albatross.config import RunConfig
from albatross.engine.base import Completion, EngineError, SamplingParams, SingleEngine
from albatross.engine.pool import EnginePool, LocalReplica
from albatross.harness.agent import AgentLoop, AttemptSpec
from albatross.orchestrator.launcher import BatchQueue, ResultQueue
from albatross.records import STATUS_INFRA_ERROR, Trajectory

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Ray's actor handles and object refs are ``Any`` here: Ray builds them at run time (``ray.remote``), untyped.


def _ray() -> ModuleType:
    try:
        import ray
    except ImportError as e:
        raise RuntimeError("orchestrator.backend = 'ray' needs Ray: pip install 'albatross[ray]'") from e
    return ray


# ---------------------------------------------------------------------------------------------- actors


class EngineActor:
    """A built-in engine in a Ray actor; a restarted actor starts from the newest exported weights."""

    def __init__(self, model_dir: str, weights_root: str, max_batch_size: int, threads: int) -> None:
        import torch

        from albatross.engine.builtin import BuiltinEngine
        from albatross.trainer.checkpoint import latest_version, version_dir

        torch.set_num_threads(threads)
        self.engine = BuiltinEngine(model_dir, max_batch_size=max_batch_size)
        version = latest_version(weights_root)
        if version is not None:
            self.engine.update_weights(str(version_dir(weights_root, version)), version)

    def pid(self) -> int:
        return os.getpid()

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        return self.engine.generate(prompts, params)

    def update_weights(self, path: str, version: int) -> int:
        self.engine.update_weights(path, version)
        return self.engine.version

    def busy_seconds(self) -> float:
        return self.engine.busy_seconds


class RayEngineClient(SingleEngine):
    """``Engine`` over one engine actor; a dead or restarting actor is an ``EngineError``."""

    def __init__(self, handle: Any, version: int = 0) -> None:
        self.handle, self.version = handle, version

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
        self._get(self.handle.update_weights.remote(path, version))
        self.version = version

    @property
    def busy_seconds(self) -> float:
        try:
            return float(self._get(self.handle.busy_seconds.remote()))
        except EngineError:
            return 0.0

    def close(self) -> None:
        pass


def engine_pool(handles: list[Any], version: int = 0, log: Callable[[str], None] = print) -> EnginePool:
    return EnginePool([LocalReplica(RayEngineClient(h, version)) for h in handles], version, log)


class RolloutWorker:
    """Runs attempts on its node: its own sandbox backend, an agent, an engine pool over the replicas."""

    def __init__(self, cfg_json: str, tokenizer: PreTrainedTokenizerBase, engines: list[Any],
                 hide_paths: list[str]) -> None:
        from albatross.config import RunConfig
        from albatross.harness.agent import build_agent
        from albatross.sandbox import backend_from_config

        cfg = RunConfig.model_validate_json(cfg_json)
        self.backend = backend_from_config(cfg.sandbox, hide_paths=hide_paths)
        self.engine = engine_pool(engines, log=lambda _: None)
        self.agent = build_agent(cfg, self.engine, self.backend, tokenizer)
        self.retries = cfg.sandbox.max_infra_retries

    def pid(self) -> int:
        return os.getpid()

    def run(self, spec: AttemptSpec) -> tuple[Trajectory, dict[str, int]]:
        from albatross.harness.retry import run_with_retries

        counts: Counter[str] = Counter()
        traj = run_with_retries(self.agent, spec, self.retries, counts)
        return traj, dict(counts)

    def close(self) -> None:
        self.backend.close()
        self.engine.close()


class TrainerActor:
    def pid(self) -> int:
        return os.getpid()

    def run(self, args: tuple[Any, ...]) -> None:
        from albatross.orchestrator.trainer_worker import trainer_main

        trainer_main(*args)


# ---------------------------------------------------------------------------------------------- handles


class TrainerHandle:
    """The trainer actor seen as the process handle the loop expects (is_alive, join, kill, exitcode)."""

    def __init__(self, actor: Any, args: tuple[Any, ...]) -> None:
        ray = _ray()
        self.actor = actor
        try:
            self.pid = ray.get(actor.pid.remote(), timeout=600)
        except ray.exceptions.GetTimeoutError:
            ray.kill(actor, no_restart=True)
            raise RuntimeError("the trainer actor was not placed within 10 minutes (cluster resources?)") from None
        self.ref = actor.run.remote(args)

    def _done(self, timeout: float = 0) -> bool:
        ready, _ = _ray().wait([self.ref], timeout=timeout)
        return bool(ready)

    def is_alive(self) -> bool:
        return not self._done()

    @property
    def exitcode(self) -> int | None:
        if not self._done():
            return None
        try:
            _ray().get(self.ref)
        except Exception:  # noqa: BLE001 - the actor died or raised: the loop reports it
            return 1
        return 0

    def join(self, timeout: float | None = None) -> None:
        self._done(timeout if timeout is not None else 1e9)

    def kill(self) -> None:
        _ray().kill(self.actor, no_restart=True)


class RayRollouts:
    """Attempts spread over the rollout workers (the one with fewest attempts outstanding first)."""

    def __init__(self, workers: list[Any], counts: Counter[str]) -> None:
        self.workers, self.counts = workers, counts
        self.outstanding = [0] * len(workers)
        self._lock = threading.Lock()
        self._turn = itertools.count()

    def submit(self, spec: AttemptSpec) -> Future[Trajectory]:
        with self._lock:
            turn, n = next(self._turn), len(self.workers)
            i = min(range(n), key=lambda k: (self.outstanding[k], (k - turn) % n))
            self.outstanding[i] += 1
        out: Future[Trajectory] = Future()
        ref = self.workers[i].run.remote(spec)

        def done(f: Future[tuple[Trajectory, dict[str, int]]]) -> None:
            with self._lock:
                self.outstanding[i] -= 1
            try:
                traj, counts = f.result()
            except Exception as e:  # noqa: BLE001 - the worker died: an infrastructure error, retried
                traj = Trajectory(task_id=spec.task.id, group_id=spec.group_id, attempt=spec.attempt,
                                  status=STATUS_INFRA_ERROR, error=f"RolloutWorkerDied: {type(e).__name__}")
                counts = {"infra_error_attempts": 1, "infra_error:RolloutWorkerDied": 1}
            with self._lock:
                self.counts.update(counts)
            out.set_result(traj)

        ref.future().add_done_callback(done)
        return out

    def shutdown(self) -> None:
        pass  # the workers live as long as the RayRun; RayRun.close stops them


# ---------------------------------------------------------------------------------------------- a run


def check_resources(cfg: RunConfig, resources: dict[str, float]) -> None:
    """Actors that cannot all be placed would wait forever: say so at start-up, naming the fields."""
    from albatross.config import ConfigError

    rc, n = cfg.ray, cfg.engine.replicas
    for kind, field, need in (
        ("CPU", "cpus", rc.trainer_cpus + n * rc.engine_cpus + rc.rollout_workers * rc.worker_cpus),
        ("GPU", "gpus", rc.trainer_gpus + n * rc.engine_gpus),
    ):
        have = resources.get(kind, 0.0)
        if need > have + 1e-9:
            raise ConfigError(
                f"ray: the run's actors need {need:g} {kind}s (ray.trainer_{field} + engine.replicas x "
                f"ray.engine_{field}" + (" + ray.rollout_workers x ray.worker_cpus" if kind == "CPU" else "")
                + f") but the cluster has {have:g}")


class RayRun:
    """Connects to (or starts) Ray and owns the run's actors; also the loop's launcher."""

    name = "ray"

    def __init__(self, cfg: RunConfig, model_dir: Path, run_dir: Path, tokenizer: PreTrainedTokenizerBase,
                 hide_paths: list[str], log: Callable[[str], None] = print) -> None:
        ray = _ray()
        self.cfg, self.run_dir, self.log = cfg, Path(run_dir), log
        rc = cfg.ray
        self._connected = False
        if not ray.is_initialized():
            if rc.address:
                ray.init(address=rc.address, log_to_driver=False)
            else:
                ray.init(include_dashboard=False, log_to_driver=False)
            self._connected = True
        resources = ray.cluster_resources()
        log(f"[ray] cluster: {resources.get('CPU', 0):g} CPUs, {resources.get('GPU', 0):g} GPUs, "
            f"{len(ray.nodes())} node(s)")
        check_resources(cfg, resources)
        from albatross.trainer.weights.base import ADAPTERS_DIR

        ec = cfg.engine
        engine_cls = ray.remote(EngineActor).options(
            num_cpus=rc.engine_cpus, num_gpus=rc.engine_gpus, max_restarts=-1, max_task_retries=0,
            max_concurrency=max(8, cfg.orchestrator.rollout_workers))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        weights = str(self.run_dir / (ADAPTERS_DIR if cfg.trainer.lora.sends_adapter else "weights"))
        self.engines = [engine_cls.remote(str(model_dir), weights, ec.max_batch_size, ec.threads)
                        for _ in range(ec.replicas)]
        self.engine_pids = ray.get([e.pid.remote() for e in self.engines])
        self.engine = engine_pool(self.engines, log=log)
        per_worker = math.ceil(cfg.orchestrator.rollout_workers / rc.rollout_workers)
        worker_cls = ray.remote(RolloutWorker).options(num_cpus=rc.worker_cpus, max_concurrency=per_worker,
                                                       max_restarts=-1)
        cfg_json = cfg.model_dump_json()
        self.workers = [worker_cls.remote(cfg_json, tokenizer, self.engines, hide_paths)
                        for _ in range(rc.rollout_workers)]
        self.worker_pids = ray.get([w.pid.remote() for w in self.workers])
        log(f"[ray] {len(self.engines)} engine replica(s), {len(self.workers)} rollout worker(s) of "
            f"{per_worker} attempts each")
        self._trainer: TrainerHandle | None = None

    # the loop's launcher ----------------------------------------------------------------------------
    def queues(self, maxsize: int) -> tuple[BatchQueue, ResultQueue]:
        from ray.util.queue import Queue

        return Queue(maxsize=maxsize, actor_options={"num_cpus": 0}), Queue(actor_options={"num_cpus": 0})

    def start_trainer(self, args: tuple[Any, ...]) -> TrainerHandle:
        ray, rc = _ray(), self.cfg.ray
        actor = ray.remote(TrainerActor).options(num_cpus=rc.trainer_cpus, num_gpus=rc.trainer_gpus).remote()
        self._trainer = TrainerHandle(actor, args)
        return self._trainer

    def rollouts(self, agent: AgentLoop, cfg: RunConfig, counts: Counter[str]) -> RayRollouts:
        return RayRollouts(self.workers, counts)  # each worker has its own agent, built from the run's config

    def pids(self) -> dict[str, int]:
        out = {f"engine{i}": pid for i, pid in enumerate(self.engine_pids)}
        out.update({f"rollout{i}": pid for i, pid in enumerate(self.worker_pids)})
        return out

    def close(self) -> None:
        ray = _ray()
        try:
            ray.get([w.close.remote() for w in self.workers], timeout=120)  # sandboxes cleaned up in place
        except Exception as e:  # noqa: BLE001 - still kill them below
            self.log(f"[ray] a rollout worker did not close cleanly: {type(e).__name__}")
        for actor in [*self.workers, *self.engines]:
            ray.kill(actor, no_restart=True)
        if self._trainer is not None:
            self._trainer.kill()
        self.engine.close()
        if self._connected:
            ray.shutdown()

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

import json
import os
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from albatross.config import ConfigError, RunConfig
from albatross.engine.pool import EnginePool
from albatross.harness.agent import AgentLoop
from albatross.orchestrator.launcher import BatchQueue, ResultQueue
from albatross.orchestrator.ray_engines import EngineActor, RayReplica, WeightSource
from albatross.orchestrator.ray_files import Tree, pack_tree, write_tree
from albatross.orchestrator.ray_node import node_id, ray_module
from albatross.orchestrator.ray_rollouts import RayRollouts, RolloutWorker
from albatross.orchestrator.ray_trainer import TrainerGroup, TrainerRank

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Ray's actor handles and object refs are ``Any`` here: Ray builds them at run time (``ray.remote``), untyped.

PLACEMENT_FILE = "ray_placement.json"  # <run_dir>/: the node of every actor, the versions each engine loaded


def merge_trees(parts: list[Tree]) -> Tree:
    """The union of trees (each rank's part of a checkpoint); where two hold the same path, the first's file."""
    files: dict[str, tuple[str, int, bytes]] = {}
    for tree in reversed(parts):
        files.update({f[0]: f for f in tree.files})
    return Tree(tuple(sorted(files.values())))


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
        ray = ray_module()
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
        self.placement: dict[str, Any] = {"driver": node_id()}
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
        ray, rc = ray_module(), cfg.ray
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
        ray, rc = ray_module(), cfg.ray
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
        ray, rc = ray_module(), cfg.ray
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
        ray, rc = ray_module(), cfg.ray
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
        ray = ray_module()
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
        ray, keep = ray_module(), self.cfg.trainer.keep_versions
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
        ray = ray_module()
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

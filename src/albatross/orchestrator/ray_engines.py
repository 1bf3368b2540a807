"""Engines as Ray actors: each runs the engine of ``[engine]`` on its node (a vLLM / SGLang server it launches and
supervises, or the built-in engine on the actor's device); the driver's ``EnginePool`` holds them as ``RayReplica``s,
starting one again (on a node Ray picks) when it is lost. Weight versions reach them as ``Tree`` objects fetched from
the trainer's rank 0 (``WeightSource``), written below each engine's own directory."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from albatross.config import RunConfig
from albatross.engine.base import Completion, EngineError, SamplingParams, SingleEngine
from albatross.engine.pool import load_newest
from albatross.orchestrator.ray_files import Tree, materialize, write_tree
from albatross.orchestrator.ray_node import inside, models_dir, node_dir, node_id, ray_module

# Ray's actor handles and object refs are ``Any`` here: Ray builds them at run time (``ray.remote``), untyped.


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
        self.engine = make_engine(one, materialize(model, models_dir()), self.dir, log=lambda _: None, trainer_gpus=0)

    def ready(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "node": node_id(), "dir": str(self.dir)}

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
        path = write_tree(tree, inside(self.dir, rel))
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
        ray = ray_module()
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
        return self._life is not None and not ray_module().wait([self._life], timeout=0)[0]

    def exit_code(self) -> int | None:
        return None if self.alive() else 1

    def start(self, newest: Callable[[], tuple[str, int] | None]) -> None:
        ray = ray_module()
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
            loaded: list[dict[str, Any]] = ray_module().get(self.actor.history.remote(), timeout=30)
            return loaded
        except Exception:  # noqa: BLE001 - a lost actor has no history to give
            return []

    def close(self) -> None:
        ray = ray_module()
        if self.actor is not None:
            try:
                ray.get(self.actor.close.remote(), timeout=60)
            except Exception:  # noqa: BLE001 - dead already, or stuck: killed below
                pass
            ray.kill(self.actor, no_restart=True)
        self.actor, self.engine, self._life = None, None, None

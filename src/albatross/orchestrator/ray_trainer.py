"""The trainer as Ray actors: one ``TrainerRank`` per rank of an FSDP2 group (a placement group of the driver's),
each in its own directory on its node, serving the files it wrote (weight versions, its part of each checkpoint);
``TrainerGroup`` is the group as the process handle the loop expects."""

from __future__ import annotations

import os
import time
from typing import Any

from albatross.orchestrator.ray_files import Tree, materialize, pack_tree, write_tree
from albatross.orchestrator.ray_node import inside, models_dir, node_dir, node_id, ray_module

# Ray's actor handles and object refs are ``Any`` here: Ray builds them at run time (``ray.remote``), untyped.


class TrainerRank:
    """One trainer rank on its node, in its own directory; also serves the files it wrote (weight versions,
    its part of each checkpoint) to the engines and the driver."""

    def __init__(self, tag: str, rank: int) -> None:
        self.rank = rank
        self.dir = node_dir(tag, f"trainer{rank}")

    def ready(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "node": node_id(), "dir": str(self.dir)}

    def rendezvous(self) -> tuple[str, int]:
        """This node's address and a free port on it (rank 0's: the group's ``MASTER_ADDR``/``MASTER_PORT``)."""
        from albatross.trainer.weights.comm import free_port

        return str(ray_module().util.get_node_ip_address()), free_port()

    def run(self, model: Tree, cfg_json: str, batch_q: Any, result_q: Any, version: int, resume: Tree | None,
            resume_rel: str, world: int, master: tuple[str, int]) -> None:
        from albatross.orchestrator.trainer_worker import serve_rank

        model_dir = materialize(model, models_dir())
        ckpt = str(write_tree(resume, inside(self.dir, resume_rel))) if resume is not None else ""
        os.environ.update({"MASTER_ADDR": master[0], "MASTER_PORT": str(master[1])})
        serve_rank(str(model_dir), str(self.dir), cfg_json, batch_q, result_q, version, ckpt, self.rank, world)

    def read_tree(self, rel: str, wait_s: float = 120.0) -> Tree:
        """The files at ``rel`` in this rank's directory (a checkpoint part still being renamed is waited for)."""
        path = inside(self.dir, rel)
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
        ray = ray_module()
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
            ray_module().kill(actor, no_restart=True)

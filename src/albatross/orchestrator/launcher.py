"""Where the parts of a run live: the ``Launcher`` seam, with two siblings. ``LocalLauncher`` (here): the trainer
in a spawned process, rollouts on threads of the orchestrator's process. ``RayRun`` (``ray_backend.py``): the
trainer, engine replicas and rollout workers as Ray actors. The loop (``loop.py``) is the same for both."""

from __future__ import annotations

import multiprocessing as mp
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

from albatross.harness.agent import AgentLoop, AttemptSpec
from albatross.harness.retry import run_with_retries
from albatross.orchestrator.trainer_worker import trainer_main


class Rollouts(Protocol):
    def submit(self, spec: AttemptSpec) -> Future: ...

    def shutdown(self) -> None: ...


class Launcher(Protocol):
    """Every member the loop uses of where a run's parts live."""

    name: str

    def queues(self, maxsize: int) -> tuple[Any, Any]:
        """The batch queue (bounded by ``maxsize``) to the trainer and its result queue."""
        ...

    def start_trainer(self, args: tuple) -> Any:
        """Start ``trainer_worker.trainer_main(*args)``; a handle with ``pid``, ``is_alive``, ``join``, ``kill``,
        ``exitcode``."""
        ...

    def rollouts(self, loop: Any) -> Rollouts:
        """Where attempts run: ``submit(spec) -> Future[Trajectory]``."""
        ...

    def pids(self) -> dict[str, int]:
        """Processes (actors) it started, for ``run/pids.json``."""
        ...


class ThreadRollouts:
    """Attempts on threads of this process (the sandboxes run on this machine)."""

    def __init__(self, agent: AgentLoop, workers: int, retries: int, counts: Counter) -> None:
        self.agent, self.retries, self.counts = agent, retries, counts
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="rollout")

    def submit(self, spec: AttemptSpec) -> Future:
        return self.pool.submit(run_with_retries, self.agent, spec, self.retries, self.counts)

    def shutdown(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


class LocalLauncher:
    """The trainer in a spawned process (which starts its own FSDP ranks), rollouts on threads here."""

    name = "local"

    def pids(self) -> dict[str, int]:
        return {}  # the loop records the trainer's pid itself

    def queues(self, maxsize: int):
        ctx = mp.get_context("spawn")
        return ctx.Queue(maxsize=maxsize), ctx.Queue()

    def start_trainer(self, args: tuple):
        proc = mp.get_context("spawn").Process(target=trainer_main, daemon=True, name="albatross-trainer",
                                               args=args)
        proc.start()
        return proc

    def rollouts(self, loop: Any) -> ThreadRollouts:
        return ThreadRollouts(loop.agent, loop.cfg.orchestrator.rollout_workers,
                              loop.cfg.sandbox.max_infra_retries, loop.counts)

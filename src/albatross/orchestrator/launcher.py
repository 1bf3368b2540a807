"""Where the parts of a run live: the ``Launcher`` seam, with two siblings. ``LocalLauncher`` (here): the trainer
in a spawned process, rollouts on threads of the orchestrator's process. ``RayRun`` (``ray_backend.py``): the
trainer, engine replicas and rollout workers as Ray actors. The loop (``loop.py``) is the same for both."""

from __future__ import annotations

import multiprocessing as mp
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

from albatross.config import RunConfig
from albatross.harness.agent import AgentLoop, AttemptSpec
from albatross.harness.retry import run_with_retries
from albatross.orchestrator.trainer_worker import trainer_main
from albatross.records import Trajectory


class Rollouts(Protocol):
    """Where attempts run."""

    def submit(self, spec: AttemptSpec) -> Future[Trajectory]: ...

    def shutdown(self) -> None: ...


class BatchQueue(Protocol):
    """The bounded queue of batches to the trainer (``multiprocessing`` or ``ray.util.queue``); ``None`` asks the
    trainer to stop, ``trainer_worker.FINISH`` to write its last version and stop."""

    def put(self, item: Any, /, block: bool = True, timeout: float | None = None) -> None: ...

    def put_nowait(self, item: Any, /) -> None: ...


class ResultQueue(Protocol):
    """The trainer's messages to the loop: one dict each (a step, a checkpoint, the final version, an error)."""

    def get(self, block: bool = True, timeout: float | None = None) -> dict[str, Any]: ...

    def get_nowait(self) -> dict[str, Any]: ...


class TrainerProcess(Protocol):
    """The trainer as the loop sees it: a process (``multiprocessing``) or an actor (``ray_backend.TrainerHandle``)."""

    @property
    def pid(self) -> int | None: ...

    @property
    def exitcode(self) -> int | None: ...

    def is_alive(self) -> bool: ...

    def join(self, timeout: float | None = None) -> None: ...

    def kill(self) -> None: ...


class Launcher(Protocol):
    """Every member the loop uses of where a run's parts live."""

    name: str

    def queues(self, maxsize: int) -> tuple[BatchQueue, ResultQueue]:
        """The batch queue (bounded by ``maxsize``) to the trainer and its result queue."""
        ...

    def start_trainer(self, args: tuple[Any, ...]) -> TrainerProcess:
        """Start ``trainer_worker.trainer_main(*args)``."""
        ...

    def rollouts(self, agent: AgentLoop, cfg: RunConfig, counts: Counter[str]) -> Rollouts:
        """Where the loop's attempts run (``agent``'s, ``counts`` gathers their infrastructure errors)."""
        ...

    def pids(self) -> dict[str, int]:
        """Processes (actors) it started, for ``run/pids.json``."""
        ...


class ThreadRollouts:
    """Attempts on threads of this process (the sandboxes run on this machine)."""

    def __init__(self, agent: AgentLoop, workers: int, retries: int, counts: Counter[str]) -> None:
        self.agent, self.retries, self.counts = agent, retries, counts
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="rollout")

    def submit(self, spec: AttemptSpec) -> Future[Trajectory]:
        return self.pool.submit(run_with_retries, self.agent, spec, self.retries, self.counts)

    def shutdown(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


class LocalLauncher:
    """The trainer in a spawned process (which starts its own FSDP ranks), rollouts on threads here."""

    name = "local"

    def pids(self) -> dict[str, int]:
        return {}  # the loop records the trainer's pid itself

    def queues(self, maxsize: int) -> tuple[BatchQueue, ResultQueue]:
        ctx = mp.get_context("spawn")
        return ctx.Queue(maxsize=maxsize), ctx.Queue()

    def start_trainer(self, args: tuple[Any, ...]) -> TrainerProcess:
        proc = mp.get_context("spawn").Process(target=trainer_main, daemon=True, name="albatross-trainer",
                                               args=args)
        proc.start()
        return proc

    def rollouts(self, agent: AgentLoop, cfg: RunConfig, counts: Counter[str]) -> ThreadRollouts:
        return ThreadRollouts(agent, cfg.orchestrator.rollout_workers, cfg.sandbox.max_infra_retries, counts)

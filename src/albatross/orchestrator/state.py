"""A run's resumable state: what the orchestrator must remember to continue after a stop or a crash.

Written atomically once a trainer checkpoint is on disk (checkpoints are written in the background: the state
is the one of the step the checkpoint was taken at). The JSONL logs are cut back
to the line counts recorded here on resume, so no attempt or step is ever counted twice; attempts that
were in flight (or finished but not yet trained) are simply run again.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

STATE_FILE = "state.json"


@dataclass
class RunState:
    version: int = 0  # policy version the trainer checkpoint holds
    step: int = 0  # trainer steps done in this run
    group_seq: int = 0
    counts: dict[str, int] = field(default_factory=dict)  # attempts, solved, infra errors, stale tokens
    batch_counts: dict[str, int] = field(default_factory=dict)  # groups seen and dropped, by reason
    max_staleness_seen: int = 0
    sampler: dict[str, Any] = field(default_factory=dict)
    lines: dict[str, int] = field(default_factory=dict)  # JSONL line counts at this state
    trainer_checkpoint: str = ""
    elapsed_s: float = 0.0

    def save(self, run_dir: Path) -> None:
        tmp = run_dir / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1))
        with tmp.open("rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, run_dir / STATE_FILE)

    @classmethod
    def load(cls, run_dir: Path) -> RunState | None:
        path = run_dir / STATE_FILE
        if not path.is_file():
            return None
        return cls(**json.loads(path.read_text()))


class TaskSampler:
    """Cycles through tasks in a seeded shuffled order; its position is part of the run's state."""

    def __init__(self, n_tasks: int, seed: int) -> None:
        self.n, self.rng, self.pos = n_tasks, random.Random(seed), 0
        self.order: list[int] = []

    def next(self) -> int:
        if self.pos >= len(self.order):
            self.order = list(range(self.n))
            self.rng.shuffle(self.order)
            self.pos = 0
        self.pos += 1
        return self.order[self.pos - 1]

    def state(self) -> dict[str, Any]:
        version, internal, gauss = self.rng.getstate()
        return {"order": self.order, "pos": self.pos, "rng": [version, list(internal), gauss]}

    def restore(self, state: dict[str, Any]) -> None:
        if not state:
            return
        self.order, self.pos = list(state["order"]), int(state["pos"])
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))


class MixSampler:
    """Draws from several sources of tasks in proportion to their weights (``tasks.mix``): smooth weighted round
    robin picks the source (each pick adds every source's weight to its credit, takes the source with the most
    credit and charges it the total), so any run of draws holds each source within one draw of its share; the
    source's own ``TaskSampler`` (seeded per source) picks the task. ``groups[i]``: the task indices of source i.
    Its state (credits and every source's sampler) is part of the run's state, so a resumed run draws on exactly
    as the stopped one would have."""

    def __init__(self, groups: list[list[int]], weights: list[float], seed: int) -> None:
        if len(groups) != len(weights) or not groups or any(not g for g in groups) or min(weights) <= 0:
            raise ValueError("MixSampler needs one non-empty group of tasks per positive weight")
        self.groups, self.weights = groups, [float(w) for w in weights]
        self.credit = [0.0] * len(groups)
        self.samplers = [TaskSampler(len(g), seed + 7919 * i) for i, g in enumerate(groups)]

    def next_source(self) -> int:
        total = sum(self.weights)
        for i, w in enumerate(self.weights):
            self.credit[i] += w
        pick = max(range(len(self.groups)), key=lambda i: (self.credit[i], -i))
        self.credit[pick] -= total
        return pick

    def next(self) -> int:
        source = self.next_source()
        return self.groups[source][self.samplers[source].next()]

    def state(self) -> dict[str, Any]:
        return {"credit": list(self.credit), "sources": [s.state() for s in self.samplers]}

    def restore(self, state: dict[str, Any]) -> None:
        if not state:
            return
        if "sources" not in state or len(state["sources"]) != len(self.samplers):
            raise ValueError("the saved task sampler does not match tasks.mix (its sources changed)")
        self.credit = [float(c) for c in state["credit"]]
        for sampler, saved in zip(self.samplers, state["sources"], strict=True):
            sampler.restore(saved)


def prune_before(run_dir: Path, version: int, keep_weights: int) -> None:
    """Delete trainer checkpoints older than ``version`` and exported weights older than the newest
    ``keep_weights`` up to it. Only the orchestrator prunes checkpoints, after state.json names ``version``: the
    trainer may run ahead of the saved state, and a resume needs exactly that version's checkpoint."""
    for ckpt in (run_dir / "checkpoints").glob("trainer-v*"):
        number = ckpt.name.split("-v")[1].removesuffix(".pt")
        if number.isdigit() and int(number) < version:
            if ckpt.is_dir():
                shutil.rmtree(ckpt, ignore_errors=True)
            else:
                ckpt.unlink(missing_ok=True)
    prune_weights(run_dir, version, keep_weights)


def prune_weights(run_dir: Path, version: int, keep_weights: int) -> None:
    """Delete exported weight (and LoRA adapter) versions older than the newest ``keep_weights`` up to ``version``
    (run after every step: a resume does not need them, the trainer sends its checkpoint's weights)."""
    for wdir in [*(run_dir / "weights").glob("v*"), *(run_dir / "adapters").glob("v*")]:
        if wdir.is_dir() and wdir.name[1:].isdigit() and int(wdir.name[1:]) <= version - keep_weights:
            shutil.rmtree(wdir, ignore_errors=True)


def count_lines(path: Path) -> int:
    if not path.is_file():
        return 0
    with path.open("rb") as f:
        return sum(1 for _ in f)


def truncate_lines(path: Path, keep: int) -> None:
    """Cut a JSONL file back to its first ``keep`` lines (drops what a crashed run wrote later)."""
    if not path.is_file():
        return
    with path.open("rb") as f:
        lines = f.readlines()[:keep]
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_bytes(b"".join(line if line.endswith(b"\n") else line + b"\n" for line in lines))
    os.replace(tmp, path)

"""A task mix (``[tasks] mix = { "<source>" = weight, ... }``): training tasks from several sources in set proportions.

A source is a directory of task directories (Terminal-Bench tasks, repository tasks of ``tasks swe`` or ``tasks
import swebench``, tasks of your own) or the name of a built-in family (generated into the run directory). A
directory with ``train/`` (and ``heldout/``) subdirectories, as ``tasks new`` and ``tasks swe --heldout`` write
them, trains on ``train/`` and evaluates on ``heldout/``; any other directory trains on all its tasks. Generated
families get ``tasks.n_train`` / ``n_heldout`` tasks between them, as ``tasks.families`` does. Each source has a
short ``name`` (the family, or the directory's name; ``train`` names its parent) used in metrics and reports;
``tasks.heldout`` tasks belong to the source whose directory holds them, else to ``heldout``.

Which source each new group draws from is decided by ``MixSampler`` (``orchestrator/state.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from albatross.errors import UserError
from albatross.tasks.format import Task, load_tasks

HELDOUT = "heldout"


@dataclass
class Source:
    key: str  # as written in tasks.mix
    name: str  # short label for metrics and reports
    weight: float
    train: list[Task] = field(default_factory=list)
    heldout: list[Task] = field(default_factory=list)
    directory: Path | None = None  # None: generated families


def is_family(key: str) -> bool:
    """A mix key names a built-in family (and no directory of that name exists)."""
    from albatross.tasks.builtin import FAMILIES

    return key in FAMILIES and not Path(key).is_dir()


def load_mix(mix: dict[str, float], generate: Callable[[list[str]], dict[str, list[Task]]],
             heldout_dirs: list[str] | None = None) -> list[Source]:
    """The sources of ``mix`` with their tasks. ``generate(families)`` writes the generated families' tasks and
    returns {split: tasks}; ``heldout_dirs``: ``tasks.heldout``, each task given to the source that holds it."""
    sources: list[Source] = []
    families = [k for k in mix if is_family(k)]
    for key, weight in mix.items():
        if key in families:
            sources.append(Source(key, key, float(weight)))
            continue
        path = Path(key).expanduser()
        if not path.is_dir():
            raise UserError(f"tasks.mix: {key!r} is neither a directory nor a built-in family "
                            "(`albatross tasks families` lists them)")
        split = (path / "train").is_dir()
        train = load_tasks(path / "train" if split else path)
        heldout = load_tasks(path / HELDOUT) if split and (path / HELDOUT).is_dir() else []
        name = path.resolve().name
        name = path.resolve().parent.name if name in ("train", "tasks") else name
        sources.append(Source(key, name, float(weight), train, heldout, path.resolve()))
    if families:
        made = generate(families)
        for source in sources:
            if source.key in families:
                source.train = [t for t in made.get("train", []) if t.metadata.get("family") == source.key]
                source.heldout = [t for t in made.get(HELDOUT, []) if t.metadata.get("family") == source.key]
    _unique_names(sources)
    _attach_heldout(sources, heldout_dirs or [])
    _check(sources)
    return sources


def _unique_names(sources: list[Source]) -> None:
    seen: dict[str, int] = {}
    for s in sources:
        base = "".join(c if c.isalnum() or c in "._-" else "_" for c in s.name) or "source"
        seen[base] = seen.get(base, 0) + 1
        s.name = base if seen[base] == 1 else f"{base}-{seen[base]}"


def _attach_heldout(sources: list[Source], heldout_dirs: list[str]) -> None:
    if not heldout_dirs:
        return
    extra = Source(HELDOUT, HELDOUT, 0.0)
    for task in load_tasks(heldout_dirs):
        where = (task.source_path or task.path).resolve()
        owner = next((s for s in sources if s.directory is not None and s.directory in where.parents), extra)
        if task.id not in {t.id for t in owner.heldout}:  # a source's own heldout/ named again
            owner.heldout.append(task)
    if extra.heldout:
        sources.append(extra)


def _check(sources: list[Source]) -> None:
    seen: dict[str, str] = {}
    for s in sources:
        if s.weight > 0 and not s.train:
            raise UserError(f"tasks.mix: {s.key!r} has no training task")
        for task in s.train + s.heldout:
            if seen.setdefault(task.id, s.key) != s.key:
                raise UserError(f"tasks.mix: task id {task.id!r} is in both {seen[task.id]!r} and {s.key!r}; "
                                "task ids must be unique across sources")


def source_of(sources: list[Source]) -> dict[str, str]:
    """Task id -> source name, for every training and held-out task."""
    return {t.id: s.name for s in sources for t in s.train + s.heldout}


def describe(sources: list[Source]) -> str:
    return ", ".join(f"{s.name} ({len(s.train)} train, {len(s.heldout)} held-out, weight {s.weight:g})"
                     for s in sources)

"""Built-in generated task families (the CPU demo's tasks) and the generator that writes them.

``generate_tasks(out_dir, n_train=..., n_heldout=..., seed=...)`` writes ``out_dir/train/<id>`` and
``out_dir/heldout/<id>`` in the Harbor layout. Held-out tasks are drawn first from their own stream,
so the held-out set for a seed does not change with ``n_train``; no instance (family + key
parameters) is in both splits. Families alternate evenly within each split.
"""

from __future__ import annotations

import hashlib
import random
import shutil
from pathlib import Path

from albatross.tasks.builtin.families import (
    DIFFICULTIES,
    FAMILIES,
    WORDS,
    CountLines,
    Family,
    FollowPointer,
    GrepWord,
    Instance,
)
from albatross.tasks.format import write_task

__all__ = [
    "DIFFICULTIES",
    "FAMILIES",
    "SPLITS",
    "WORDS",
    "CountLines",
    "Family",
    "FollowPointer",
    "GrepWord",
    "Instance",
    "corpus_strings",
    "generate_tasks",
    "instance_seed",
    "list_families",
    "write_instance",
]

SPLITS = ("train", "heldout")
DOCKERFILE = "FROM debian:bookworm-slim\nWORKDIR /app\nCOPY app/ /app/\n"
_MAX_TRIES_PER_TASK = 1000


def list_families() -> list[str]:
    return list(FAMILIES)


def corpus_strings() -> list[str]:
    """Every instruction template, demo command pattern and word: the text a small tokenizer needs."""
    out: list[str] = []
    for family in FAMILIES.values():
        out.append(family.instruction_template)
        out.extend(family.demo_templates)
    out.extend(WORDS)
    return list(dict.fromkeys(out))


def instance_seed(seed: int, split: str, index: int, retry: int) -> int:
    """A stable 63-bit seed for one instance (recorded in task.toml [metadata] seed)."""
    digest = hashlib.sha256(f"{seed}/{split}/{index}/{retry}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def write_instance(instance: Instance, task_dir: Path, *, split: str, seed: int) -> Path:
    """Write one instance as a Harbor task directory."""
    family = FAMILIES[instance.family]
    task_toml = {
        "version": "1.0",
        "metadata": {
            "family": instance.family,
            "category": family.category,
            "difficulty": instance.difficulty,
            "split": split,
            "seed": seed,
            "tags": ["albatross-builtin", instance.family],
        },
        "agent": {"timeout_sec": 60.0},
        "verifier": {"timeout_sec": 30.0},
        "environment": {"cpus": 1, "memory_mb": 512, "storage_mb": 256, "allow_internet": False},
    }
    return write_task(
        task_dir,
        instruction=instance.instruction + "\n",
        task_toml=task_toml,
        env_files={f"app/{name}": content for name, content in instance.files.items()},
        dockerfile=DOCKERFILE,
        solve_sh=instance.solve_sh,
        test_sh=instance.test_sh,
        demo_steps=instance.demo_steps,
    )


def generate_tasks(
    out_dir: str | Path,
    *,
    families: list[str] | None = None,
    n_train: int,
    n_heldout: int,
    seed: int,
    difficulty: str = "easy",
    overwrite: bool = False,
) -> dict[str, list[Path]]:
    """Write ``n_train`` + ``n_heldout`` tasks under ``out_dir``; returns {split: [task dirs]}.

    Deterministic for a seed. Refuses to write into a non-empty split directory unless ``overwrite``
    (which deletes ``out_dir/train`` and ``out_dir/heldout`` only).
    """
    chosen = [_family(name) for name in (families or list_families())]
    out_dir = Path(out_dir)
    _prepare(out_dir, overwrite)
    seen: set[tuple[object, ...]] = set()
    written: dict[str, list[Path]] = {}
    for split, n in (("heldout", n_heldout), ("train", n_train)):
        written[split] = []
        for index in range(n):
            family = chosen[index % len(chosen)]
            instance, inst_seed = _draw(family, difficulty, seed, split, index, seen)
            task_dir = out_dir / split / f"{split}-{index:04d}-{family.name}"
            written[split].append(write_instance(instance, task_dir, split=split, seed=inst_seed))
    return {split: written[split] for split in SPLITS}


def _family(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"unknown task family {name!r}; known: {', '.join(FAMILIES)}")
    return FAMILIES[name]


def _prepare(out_dir: Path, overwrite: bool) -> None:
    for split in SPLITS:
        split_dir = out_dir / split
        if split_dir.exists() and any(split_dir.iterdir()):
            if not overwrite:
                raise FileExistsError(
                    f"{split_dir}: already holds tasks; pass overwrite=True or a new directory"
                )
            shutil.rmtree(split_dir)


def _draw(
    family: Family, difficulty: str, seed: int, split: str, index: int, seen: set[tuple[object, ...]]
) -> tuple[Instance, int]:
    """Draw an instance whose key is not in ``seen`` (and add it)."""
    for retry in range(_MAX_TRIES_PER_TASK):
        inst_seed = instance_seed(seed, split, index, retry)
        instance = family.generate(random.Random(inst_seed), difficulty)
        if instance.key not in seen:
            seen.add(instance.key)
            return instance, inst_seed
    raise ValueError(f"{family.name}: could not draw a new distinct instance for {split} task {index}")

"""Built-in generated task families and the generator that writes them.

``generate_tasks(out_dir, n_train=..., n_heldout=..., seed=...)`` writes ``out_dir/train/<id>``,
``out_dir/heldout/<id>`` and (``n_validation``) ``out_dir/validation/<id>`` in the Harbor layout. Held-out
tasks are drawn first from their own stream, then validation tasks, so neither changes with ``n_train``;
no instance (family + key parameters) is in two splits. Families alternate evenly within each split.

Held-out tasks are unseen, not just new instances: each family sets aside its own 5 held-out and 3
validation words (``split_words_of``; the blocks rotate through WORDS, so a word one family sets aside is
named by training instructions of others), and an instruction may only name words of its split's list, so
no held-out or validation instruction, nor an oracle command built from its words, equals or is contained
in a training one. A family whose
instruction names no word (fs_surgery, log_errors, find_key) uses a paraphrased instruction per split
(``Family.split_templates``); its oracle stays the same, so for a strict test hold such a family out
whole. ``heldout_families`` does that for any family: it appears only in the held-out split (validation
and training use the other families).

``DEMO_FAMILIES`` (count_lines, grep_word, follow_pointer) are the CPU demo's families, sized for a tiny
model, and what ``generate_tasks`` writes when no family is named; ``FAMILIES`` holds every family,
each available by name (``"all"`` names them all). Each family has a seeded generator with difficulty
``easy`` / ``medium`` / ``hard``, an oracle, and a verifier with several named tests (partial credit).
"""

from __future__ import annotations

import hashlib
import random
import re
import shutil
from collections.abc import Iterable
from pathlib import Path

from albatross.tasks.builtin.code import GitRepair, PyFix
from albatross.tasks.builtin.compose import COMPOSED
from albatross.tasks.builtin.data import CsvToJson, LogErrors
from albatross.tasks.builtin.families import (
    DIFFICULTIES,
    WORDS,
    CountLines,
    Family,
    FollowPointer,
    GrepWord,
    Instance,
    split_words,
)
from albatross.tasks.builtin.families import FAMILIES as _DEMO
from albatross.tasks.builtin.files import FsSurgery, SortUnique
from albatross.tasks.builtin.system import FindKey, JobControl
from albatross.tasks.builtin.variants import VARIANTS
from albatross.tasks.format import write_task

__all__ = [
    "DEMO_FAMILIES",
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
    "instruction_words",
    "list_families",
    "split_words_of",
    "write_instance",
]

SPLITS = ("train", "validation", "heldout")
DOCKERFILE = "FROM python:3.11-slim-bookworm\nWORKDIR /app\nCOPY app/ /app/\n"
SETUP = "COPY setup.sh /albatross-setup.sh\nRUN bash /albatross-setup.sh && rm -f /albatross-setup.sh\n"
DEMO_FAMILIES: tuple[str, ...] = tuple(_DEMO)
FAMILIES: dict[str, Family] = {
    **_DEMO,
    **{f.name: f for f in (SortUnique(), FsSurgery(), LogErrors(), CsvToJson(), PyFix(), GitRepair(),
                           JobControl(), FindKey())},
    **{f.name: f for f in COMPOSED},
    **{f.name: f for f in VARIANTS},
}
_MAX_TRIES_PER_TASK = 5000  # a split's words are a few of WORDS: most draws are rejected


def list_families() -> list[str]:
    """Every family, by name (the demo's three first)."""
    return list(FAMILIES)


def corpus_strings(families: Iterable[str] | None = None) -> list[str]:
    """Every instruction template, demo command pattern and word of ``families`` (default: all): the
    text a small tokenizer needs. ``corpus_strings(DEMO_FAMILIES)`` is the demo's original corpus.

    The demo families' strings and WORDS come first, in their old order; the other families' follow."""
    names = [_family(n).name for n in (list_families() if families is None else families)]
    out: list[str] = []
    for family in [FAMILIES[n] for n in DEMO_FAMILIES if n in names]:
        out.append(family.instruction_template)
        out.extend(family.demo_templates)
    out.extend(WORDS)
    for family in [FAMILIES[n] for n in names if n not in DEMO_FAMILIES]:
        out.append(family.instruction_template)
        out.extend(family.split_templates.values())
        out.extend(family.demo_templates)
        out.extend(family.vocabulary)
    return list(dict.fromkeys(out))


def split_words_of(family: str, split: str) -> tuple[str, ...]:
    """The words an instruction of ``family`` may name in ``split`` (see ``families.split_words``; a
    family's block of held-out and validation words follows from its place in ``FAMILIES``)."""
    return split_words(list(FAMILIES).index(_family(family).name), split)


def instruction_words(instruction: str) -> set[str]:
    """The words of ``WORDS`` an instruction names (as whole words: ``test_kiwi.py`` names kiwi)."""
    return set(re.findall(r"[a-z]+", instruction)) & set(WORDS)


def instance_seed(seed: int, split: str, index: int, retry: int) -> int:
    """A stable 63-bit seed for one instance (recorded in task.toml [metadata] seed)."""
    digest = hashlib.sha256(f"{seed}/{split}/{index}/{retry}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def write_instance(instance: Instance, task_dir: Path, *, split: str, seed: int) -> Path:
    """Write one instance as a Harbor task directory."""
    task_dir = Path(task_dir)
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
        "verifier": {"timeout_sec": 30.0, "keep_agent_processes": family.keep_agent_processes},
        "environment": {"cpus": 1, "memory_mb": 512, "storage_mb": 256, "allow_internet": False},
    }
    env_files: dict[str, str | bytes] = {f"app/{name}": content for name, content in instance.files.items()}
    if instance.setup_sh:
        env_files["setup.sh"] = instance.setup_sh
    write_task(
        task_dir,
        instruction=instance.instruction + "\n",
        task_toml=task_toml,
        env_files=env_files,
        dockerfile=DOCKERFILE + (SETUP if instance.setup_sh else ""),
        solve_sh=instance.solve_sh,
        test_sh=instance.test_sh,
        test_files=instance.test_files,
        demo_steps=instance.demo_steps,
    )
    for name in instance.files:
        if name.endswith(".sh"):
            (task_dir / "environment" / "app" / name).chmod(0o755)
    return task_dir


def generate_tasks(
    out_dir: str | Path,
    *,
    families: list[str] | None = None,
    n_train: int,
    n_heldout: int,
    seed: int,
    difficulty: str = "easy",
    overwrite: bool = False,
    n_validation: int = 0,
    heldout_families: list[str] | None = None,
) -> dict[str, list[Path]]:
    """Write ``n_train`` + ``n_validation`` + ``n_heldout`` tasks under ``out_dir``; returns {split: [task dirs]}
    for ``SPLITS`` (validation empty unless asked for).

    ``families``: names (``"all"`` for every family); None or empty: ``DEMO_FAMILIES``. ``heldout_families``:
    families (of ``families`` or more) that appear only in the held-out split. Deterministic for a seed.
    Refuses to write into a non-empty split directory unless ``overwrite`` (which deletes the split
    directories only).
    """
    names = list(families or DEMO_FAMILIES)
    if "all" in names:
        names = list_families()
    unseen = [_family(n).name for n in heldout_families or []]
    seen_by_training = [_family(n) for n in names if n not in unseen]
    if not seen_by_training and (n_train or n_validation):
        raise ValueError("heldout_families leaves no family to train on")
    by_split = {"heldout": [_family(n) for n in dict.fromkeys(names + unseen)], "validation": seen_by_training,
                "train": seen_by_training}
    out_dir = Path(out_dir)
    _prepare(out_dir, overwrite)
    taken: set[tuple[object, ...]] = set()
    written: dict[str, list[Path]] = {}
    for split, n in (("heldout", n_heldout), ("validation", n_validation), ("train", n_train)):
        written[split] = []
        for index in range(n):
            family = by_split[split][index % len(by_split[split])]
            instance, inst_seed = _draw(family, difficulty, seed, split, index, taken)
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
    """Draw an instance whose key is not in ``seen`` (and add it) and whose instruction names only words of
    the split's list (with the split's paraphrased instruction where the family has one)."""
    allowed = set(split_words_of(family.name, split))
    for retry in range(_MAX_TRIES_PER_TASK):
        inst_seed = instance_seed(seed, split, index, retry)
        instance = family.generate(random.Random(inst_seed), difficulty)
        instance.instruction = family.split_templates.get(split, instance.instruction)
        if instance.key not in seen and instruction_words(instance.instruction) <= allowed:
            seen.add(instance.key)
            return instance, inst_seed
    raise ValueError(f"{family.name}: could not draw a new distinct instance for {split} task {index}")

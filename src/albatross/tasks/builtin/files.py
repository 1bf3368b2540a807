"""Families: text processing (sort_unique) and file-system surgery (fs_surgery)."""

from __future__ import annotations

import random

from albatross.tasks.builtin.checks import new_instance
from albatross.tasks.builtin.families import WORDS, Family, Instance, extra_files, text, word_lines


class SortUnique(Family):
    """/app/{a}.txt holds lines (1 word, or 2 from medium on) with duplicates; distractor files by
    difficulty. Tests: the output exists, has exactly the distinct lines, has no duplicate, is sorted."""

    name = "sort_unique"
    category = "text-processing"
    instruction_template = "Write the distinct lines of {a}.txt, sorted, to sorted.txt."
    demo_templates = ("sort -u {a}.txt > sorted.txt", "submit")

    def generate(self, rng: random.Random, difficulty: str = "easy") -> Instance:
        level = extra_files(difficulty)
        names = rng.sample(WORDS, 2 + level)
        a = names[0]
        per_line = 1 if level == 0 else 2
        distinct = sorted({" ".join(rng.sample(WORDS, per_line)) for _ in range(4 + 3 * level)})
        lines = distinct + rng.choices(distinct, k=rng.randint(2, 4 + level))
        rng.shuffle(lines)
        files = {f"{a}.txt": text(lines)}
        files.update({f"{n}.txt": text(word_lines(rng, rng.randint(3, 6), per_line)) for n in names[1:]})
        command = self.demo_templates[0].format(a=a)
        return new_instance(self, (a, tuple(lines)), difficulty, self.instruction_template.format(a=a), files,
                            [command], SORT_CHECKS, distinct)


SORT_CHECKS = '''
def got():
    return lines("sorted.txt")


@check("sorted_exists")
def _():
    return bool(got())


@check("sorted_complete")
def _():
    return set(got()) == set(EXPECTED)


@check("sorted_unique")
def _():
    return set(got()) == set(EXPECTED) and len(got()) == len(set(got()))


@check("sorted_order")
def _():
    return set(got()) == set(EXPECTED) and got() == sorted(got())
'''


class FsSurgery(Family):
    """/app/data is a tree (depth 1-3 by difficulty) of .log, .tmp and .txt files with distinct names.
    Tests: every .log moved into archive/ with its content, none left under data/, every .tmp deleted,
    the .txt files untouched (the last passes untouched; the two removal tests count only when the
    .txt files survive)."""

    name = "fs_surgery"
    category = "file-operations"
    instruction_template = ("Move every .log file under data/ into archive/ (keep the file names), "
                            "delete every .tmp file under data/, and leave all other files where they are.")
    split_templates = {
        "heldout": ("Under data/ there are .log, .tmp and other files. Put the .log files in archive/ under "
                    "their own names, remove the .tmp files, and do not touch anything else."),
        "validation": ("Clean up data/: each .log file goes to archive/ with the same name, each .tmp file is "
                       "removed, every other file stays as it is."),
    }
    demo_templates = (
        "mkdir -p archive",
        "find data -name '*.log' -exec mv {{}} archive/ ';'",
        "find data -name '*.tmp' -delete",
        "submit",
    )

    def generate(self, rng: random.Random, difficulty: str = "easy") -> Instance:
        level = extra_files(difficulty)
        words = rng.sample(WORDS, 5 + 3 * level + 1 + level)
        dirs = self._dirs(rng, words[5 + 3 * level:], level + 1)
        stems = words[: 5 + 3 * level]
        exts = ["log", "tmp", "txt"] + [rng.choice(["log", "tmp", "txt"]) for _ in stems[3:]]
        files = {f"data/{rng.choice(dirs)}/{stem}.{ext}".replace("//", "/"): text(word_lines(rng, 2, 3))
                 for stem, ext in zip(stems, exts, strict=True)}
        expected = {
            "logs": {p.rsplit("/", 1)[1]: c for p, c in files.items() if p.endswith(".log")},
            "kept": {p: c for p, c in files.items() if p.endswith(".txt")},
            "tmp": [p for p in files if p.endswith(".tmp")],
        }
        commands = [t.format() for t in self.demo_templates[:-1]]
        return new_instance(self, (tuple(sorted(files.items())),), difficulty, self.instruction_template, files,
                            commands, FS_CHECKS, expected)

    @staticmethod
    def _dirs(rng: random.Random, names: list[str], depth: int) -> list[str]:
        """Directory paths under data/ ("" is data/ itself), nested up to ``depth`` levels."""
        out, current = [""], ""
        for name in names[:depth]:
            current = f"{current}/{name}" if current else name
            out.append(current)
        for name in names[depth:]:
            out.append(f"{rng.choice(out[1:])}/{name}" if len(out) > 1 else name)
        return out


FS_CHECKS = '''
def kept():
    return all(os.path.isfile(os.path.join(APP, p)) and read(p) == c for p, c in EXPECTED["kept"].items())


def under_data(suffix):
    return [os.path.join(r, f) for r, _, fs in os.walk(os.path.join(APP, "data")) for f in fs if f.endswith(suffix)]


@check("logs_archived")
def _():
    return all(read("archive/" + name) == c for name, c in EXPECTED["logs"].items())


@check("logs_gone_from_data")
def _():
    return kept() and not under_data(".log")


@check("tmp_deleted")
def _():
    return kept() and not under_data(".tmp")


@check("other_files_kept")
def _():
    return kept()
'''

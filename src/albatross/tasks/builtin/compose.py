"""Families composed of the demo families' skills, for learning from the reward alone.

Each of these tasks is solved by commands of the kinds the demo's warm-started families teach (``cat`` a
pointer file, ``wc -l <``, ``grep``), put together in a way no demonstration shows: the demo trains on them
with their verifiers only (``tasks.reward_only_families``), never with their oracle steps. A warm-started
model solves some of them by chance, which gives GRPO groups with signal, and RL has to find the rest.
"""

from __future__ import annotations

import random

from albatross.tasks.builtin.families import (
    WORDS,
    Family,
    FollowPointer,
    GrepWord,
    Instance,
    extra_files,
    make_test_sh,
    text,
    word_lines,
)


class CountPointer(Family):
    """Multi-step. /app holds {a}.txt whose content is "{b}.txt", {b}.txt with 2-9 lines, and files with other
    line counts. The answer is the line count of {b}.txt (never 1, the pointer file's own count)."""

    name = "count_pointer"
    category = "file-operations"
    instruction_template = ("The file {a}.txt names another file. Count the lines in that file and write the "
                            "number to answer.txt.")
    demo_templates = ("cat {a}.txt", "wc -l < {b}.txt > answer.txt", "submit")
    solve_template = 'wc -l < "$(cat {a}.txt)" > answer.txt'

    def generate(self, rng: random.Random, difficulty: str = "easy") -> Instance:
        names = rng.sample(WORDS, 3 + extra_files(difficulty))
        a, b, others = names[0], names[1], names[2:]
        counts = rng.sample(range(2, 10), 1 + len(others))
        files = {f"{a}.txt": f"{b}.txt\n"}
        files.update({f"{n}.txt": text(word_lines(rng, c)) for n, c in zip([b, *others], counts, strict=True)})
        test = make_test_sh(self.name, [("answer_exists", "answer_correct", "answer.txt")], str(counts[0]))
        key = (a, b, tuple(others), tuple(counts))
        return self._instance(key, difficulty, files, test, self.solve_template, a=a, b=b)


class GrepPointer(Family):
    """Multi-step. /app holds {a}.txt whose content is "{b}.log", and logs {b}.log and others (4-8 lines of 3
    words); {w} is in 1-3 lines of each log."""

    name = "grep_pointer"
    category = "text-processing"
    instruction_template = ("The file {a}.txt names a log file. Write the lines of that log that contain {w} "
                            "to out.txt.")
    demo_templates = ("cat {a}.txt", "grep {w} {b}.log > out.txt", "submit")
    solve_template = 'grep {w} "$(cat {a}.txt)" > out.txt'

    def generate(self, rng: random.Random, difficulty: str = "easy") -> Instance:
        words = rng.sample(WORDS, 4 + extra_files(difficulty))
        w, a, logs = words[0], words[1], words[2:]
        contents = [GrepWord._log(rng, w, hits=rng.randint(1, 3)) for _ in logs]
        files = {f"{a}.txt": f"{logs[0]}.log\n"}
        files.update({f"{n}.log": text(lines) for n, lines in zip(logs, contents, strict=True)})
        expected = text([line for line in contents[0] if w in line.split()])
        test = make_test_sh(self.name, [("out_exists", "out_correct", "out.txt")], expected)
        key = (w, a, tuple(logs), tuple(files[f"{n}.log"] for n in logs))
        return self._instance(key, difficulty, files, test, self.solve_template, a=a, b=logs[0], w=w)


class CopyFile(Family):
    """Single step. /app holds {a}.txt and two other files with distinct contents; copy {a}.txt to
    result.txt (follow_pointer's second step, asked for directly)."""

    name = "copy_file"
    category = "file-operations"
    instruction_template = "Copy {a}.txt to result.txt."
    demo_templates = ("cp {a}.txt result.txt", "submit")

    def generate(self, rng: random.Random, difficulty: str = "easy") -> Instance:
        names = rng.sample(WORDS, 3 + extra_files(difficulty))
        contents = FollowPointer._distinct_contents(rng, len(names))
        files = {f"{n}.txt": c for n, c in zip(names, contents, strict=True)}
        test = make_test_sh(self.name, [("result_exists", "result_correct", "result.txt")], contents[0])
        key = (tuple(names), tuple(contents))
        return self._instance(key, difficulty, files, test, self.demo_templates[0], a=names[0])


class CountGrep(Family):
    """Two steps named in the instruction: grep_word's, then count_lines' on its output. /app holds {a}.log and
    another log (4-8 lines of 3 words); {w} is in 1-3 lines of {a}.log."""

    name = "count_grep"
    category = "text-processing"
    instruction_template = ("Write the lines of {a}.log that contain {w} to out.txt, then count the lines in "
                            "out.txt and write the number to answer.txt.")
    demo_templates = ("grep {w} {a}.log > out.txt", "wc -l < out.txt > answer.txt", "submit")

    def generate(self, rng: random.Random, difficulty: str = "easy") -> Instance:
        words = rng.sample(WORDS, 3 + extra_files(difficulty))
        w, names = words[0], words[1:]
        logs = [GrepWord._log(rng, w, hits=rng.randint(1, 3)) for _ in names]
        files = {f"{n}.log": text(lines) for n, lines in zip(names, logs, strict=True)}
        hits = sum(1 for line in logs[0] if w in line.split())
        test = make_test_sh(self.name, [("answer_exists", "answer_correct", "answer.txt")], str(hits))
        key = (w, tuple(names), tuple(files[f"{n}.log"] for n in names))
        solve = "\n".join(self.demo_templates[:2])
        return self._instance(key, difficulty, files, test, solve, a=names[0], w=w)


COMPOSED: tuple[Family, ...] = (CountPointer(), GrepPointer(), CopyFile(), CountGrep())

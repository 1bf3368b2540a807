"""Variants of the demo families that the warm start never demonstrates, for learning from the reward alone.

Each variant keeps its parent family's instruction and command and changes one thing the demonstrations never
vary: the kind of file it reads (``.log`` for ``.txt``) or the file it writes (a named file for ``answer.txt``,
``out.txt`` or ``result.txt``). A warm-started model gets some of them right by copying what the instruction
(or a ``cat``) shows, and RL has to make that reliable.
"""

from __future__ import annotations

import random
from typing import cast

from albatross.tasks.builtin.families import (
    WORDS,
    CountLines,
    Family,
    FollowPointer,
    GrepWord,
    Instance,
    extra_files,
    make_test_sh,
    text,
)


class CountLog(CountLines):
    """count_lines on .log files: /app holds {a}.log {b}.log {c}.log with distinct line counts in 1..9."""

    name = "count_log"
    instruction_template = "Count the lines in {a}.log and write the number to answer.txt."
    demo_templates = ("wc -l < {a}.log > answer.txt", "submit")
    ext = "log"


class GrepTxt(GrepWord):
    """grep_word on .txt files: /app holds {a}.txt and {b}.txt (4-8 lines of 3 words); {w} is in 1-3 lines."""

    name = "grep_txt"
    instruction_template = "Write the lines of {a}.txt that contain {w} to out.txt."
    demo_templates = ("grep {w} {a}.txt > out.txt", "submit")
    ext = "txt"


class PointerLog(Family):
    """follow_pointer whose pointer names a .log file: /app holds {a}.txt ("{b}.log"), {b}.log and two others."""

    name = "pointer_log"
    category = "file-operations"
    instruction_template = FollowPointer.instruction_template
    demo_templates = ("cat {a}.txt", "cp {b}.log result.txt", "submit")
    solve_template = FollowPointer.solve_template

    def generate(self, rng: random.Random, difficulty: str = "easy") -> Instance:
        names = rng.sample(WORDS, 4 + extra_files(difficulty))
        a, b, others = names[0], names[1], names[2:]
        contents = FollowPointer._distinct_contents(rng, 1 + len(others))
        files = {f"{a}.txt": f"{b}.log\n", f"{b}.log": contents[0]}
        files.update({f"{n}.log": c for n, c in zip(others, contents[1:], strict=True)})
        test = make_test_sh(self.name, [("result_exists", "result_correct", "result.txt")], contents[0])
        key = (a, b, tuple(others), tuple(contents))
        return self._instance(key, difficulty, files, test, self.solve_template, a=a, b=b)


class CountTo(Family):
    """count_lines writing to a named file: the number goes to {o}.txt, a word not among the input files."""

    name = "count_to"
    category = "text-processing"
    instruction_template = "Count the lines in {a}.txt and write the number to {o}.txt."
    demo_templates = ("wc -l < {a}.txt > {o}.txt", "submit")

    def generate(self, rng: random.Random, difficulty: str = "easy") -> Instance:
        base = CountLines().generate(rng, difficulty)
        names = sorted(n[: -len(".txt")] for n in base.files)
        o = rng.choice([w for w in WORDS if w not in names])
        a = base.instruction.split(" in ")[1].split(".txt")[0]
        expected = str(len(base.files[f"{a}.txt"].splitlines()))
        test = make_test_sh(self.name, [("out_exists", "out_correct", f"{o}.txt")], expected)
        return self._instance((*base.key[1:], o), difficulty, base.files, test, self.demo_templates[0], a=a, o=o)


class GrepTo(Family):
    """grep_word writing to a named file, on .log or .txt files: the lines of {a}.{e} that contain {w} go to
    {o}.txt."""

    name = "grep_to"
    category = "text-processing"
    instruction_template = "Write the lines of {a}.{e} that contain {w} to {o}.txt."
    demo_templates = ("grep {w} {a}.{e} > {o}.txt", "submit")

    def generate(self, rng: random.Random, difficulty: str = "easy") -> Instance:
        base = GrepWord().generate(rng, difficulty)
        w, e = str(base.key[1]), rng.choice(("log", "txt"))
        a = str(cast("tuple[str, ...]", base.key[2])[0])  # GrepWord's key: (name, word, its file names, ...)
        files = {f"{name[: -len('.log')]}.{e}": content for name, content in base.files.items()}
        o = rng.choice([x for x in WORDS if x != w and f"{x}.{e}" not in files])
        expected = text([line for line in files[f"{a}.{e}"].splitlines() if w in line.split()])
        test = make_test_sh(self.name, [("out_exists", "out_correct", f"{o}.txt")], expected)
        return self._instance((*base.key[1:], e, o), difficulty, files, test, self.demo_templates[0], a=a, w=w,
                              e=e, o=o)


class PointerTo(Family):
    """follow_pointer writing to a named file: the named file is copied to {o}.txt."""

    name = "pointer_to"
    category = "file-operations"
    instruction_template = "The file {a}.txt names another file. Copy that file to {o}.txt."
    demo_templates = ("cat {a}.txt", "cp {b}.txt {o}.txt", "submit")
    solve_template = 'cp "$(cat {a}.txt)" {o}.txt'

    def generate(self, rng: random.Random, difficulty: str = "easy") -> Instance:
        base = FollowPointer().generate(rng, difficulty)
        a, b = str(base.key[1]), str(base.key[2])
        o = rng.choice([w for w in WORDS if f"{w}.txt" not in base.files])
        expected = base.files[f"{b}.txt"]
        test = make_test_sh(self.name, [("out_exists", "out_correct", f"{o}.txt")], expected)
        return self._instance((*base.key[1:], o), difficulty, base.files, test, self.solve_template, a=a, b=b, o=o)


class CopyTo(Family):
    """Single step. /app holds {a}.{e} and two other files of the same kind (``.log`` or ``.txt``) with distinct
    contents; copy {a}.{e} to {o}.txt."""

    name = "copy_to"
    category = "file-operations"
    instruction_template = "Copy {a}.{e} to {o}.txt."
    demo_templates = ("cp {a}.{e} {o}.txt", "submit")

    def generate(self, rng: random.Random, difficulty: str = "easy") -> Instance:
        e = rng.choice(("log", "txt"))
        names = rng.sample(WORDS, 4 + extra_files(difficulty))
        o, inputs = names[0], names[1:]
        contents = FollowPointer._distinct_contents(rng, len(inputs))
        files = {f"{n}.{e}": c for n, c in zip(inputs, contents, strict=True)}
        test = make_test_sh(self.name, [("out_exists", "out_correct", f"{o}.txt")], contents[0])
        key = (e, o, tuple(inputs), tuple(contents))
        return self._instance(key, difficulty, files, test, self.demo_templates[0], a=inputs[0], e=e, o=o)


class _Paraphrase(Family):
    """A demo family's tasks under another instruction: same files, oracle and verifier."""

    parent: Family

    def generate(self, rng: random.Random, difficulty: str = "easy") -> Instance:
        inst = self.parent.generate(rng, difficulty)
        fields = _fields(self.parent, inst)
        inst.family, inst.key = self.name, (self.name, *inst.key[1:])
        inst.instruction = self.instruction_template.format(**fields)
        return inst


def _fields(parent: Family, inst: Instance) -> dict[str, str]:
    """The template fields of a parent instance, read back from its demo steps."""
    import re

    pattern = re.escape(" \n ".join(parent.demo_templates))
    for name in ("a", "b", "w"):
        pattern = pattern.replace(re.escape("{" + name + "}"), f"(?P<{name}>[a-z]+)", 1)
        pattern = pattern.replace(re.escape("{" + name + "}"), f"(?P={name})")
    match = re.fullmatch(pattern, " \n ".join(inst.demo_steps))
    assert match is not None, (parent.name, inst.demo_steps)
    return match.groupdict()


class LinesPara(_Paraphrase):
    name = "lines_para"
    category = "text-processing"
    parent = CountLines()
    instruction_template = "How many lines does {a}.txt have? Write the count to answer.txt."
    demo_templates = CountLines.demo_templates


class GrepPara(_Paraphrase):
    name = "grep_para"
    category = "text-processing"
    parent = GrepWord()
    instruction_template = "Find the lines in {a}.log with {w} and save them to out.txt."
    demo_templates = GrepWord.demo_templates


class PointerPara(_Paraphrase):
    name = "pointer_para"
    category = "file-operations"
    parent = FollowPointer()
    instruction_template = "{a}.txt holds the name of a file. Put a copy of that file in result.txt."
    demo_templates = FollowPointer.demo_templates


VARIANTS: tuple[Family, ...] = (CountLog(), GrepTxt(), PointerLog(), CountTo(), GrepTo(), PointerTo(), CopyTo(),
                                LinesPara(), GrepPara(), PointerPara())

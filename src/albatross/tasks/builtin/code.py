"""Families: a small Python fix with a failing test (py_fix) and git repository repair (git_repair)."""

from __future__ import annotations

import random
import shlex
from collections.abc import Sequence

from albatross.tasks.builtin.checks import new_instance
from albatross.tasks.builtin.families import WORDS, Family, Instance, extra_files, text, word_lines

# name, arguments, correct return expression, buggy one, visible cases, hidden cases ((args), result)
Case = tuple[tuple[object, ...], object]  # (arguments, expected result)
FunctionSpec = tuple[str, str, str, str, list[Case], list[Case]]  # name, args, right, buggy, visible, hidden
FUNCTIONS: tuple[FunctionSpec, ...] = (
    ("add", "a, b", "a + b", "a - b", [((2, 3), 5)], [((2, 3), 5), ((-1, 1), 0), ((10, 5), 15)]),
    ("is_even", "n", "n % 2 == 0", "n % 2 == 1", [((4,), True)], [((4,), True), ((7,), False), ((0,), True)]),
    ("square", "x", "x * x", "x * 2", [((3,), 9)], [((3,), 9), ((5,), 25), ((-4,), 16)]),
    ("clamp", "x, lo, hi", "max(lo, min(x, hi))", "min(lo, max(x, hi))", [((5, 0, 3), 3)],
     [((5, 0, 3), 3), ((-2, 0, 3), 0), ((2, 0, 3), 2)]),
    ("last", "xs", "xs[-1]", "xs[0]", [(([1, 2, 3],), 3)], [(([1, 2, 3],), 3), (([7],), 7), (([4, 9],), 9)]),
    ("count_vowels", "s", "sum(c in 'aeiou' for c in s)", "sum(c in 'aeio' for c in s)",
     [(("tuna",), 2)], [(("tuna",), 2), (("queue",), 4), (("sky",), 0)]),
    ("mean", "xs", "sum(xs) / len(xs)", "sum(xs) / (len(xs) + 1)", [(([2, 4],), 3.0)],
     [(([2, 4],), 3.0), (([5],), 5.0), (([1, 2, 3, 6],), 3.0)]),
    ("reverse_words", "s", "' '.join(s.split()[::-1])", "' '.join(s.split())", [(("a b",), "b a")],
     [(("a b",), "b a"), (("one two three",), "three two one"), (("x",), "x")]),
    ("largest", "xs", "max(xs)", "min(xs)", [(([3, 8, 1],), 8)], [(([3, 8, 1],), 8), (([5],), 5), (([-2, -9],), -2)]),
)


def _sed_pattern(text_: str) -> str:
    return "".join("\\" + c if c in "\\.*[]^$|" else c for c in text_)


def _sed_replacement(text_: str) -> str:
    return "".join("\\" + c if c in "\\&|" else c for c in text_)


class PyFix(Family):
    """/app/{a}.py defines 2-4 small functions (by difficulty); one (hard: two) has a one-line bug that
    test_{a}.py (unittest) catches. Tests (hidden, more cases): one per function, the test file is
    unchanged, and the visible tests pass. Tests of the correct functions pass untouched."""

    name = "py_fix"
    category = "software-engineering"
    instruction_template = ("The tests in test_{a}.py fail. Fix the bug in {a}.py so that python3 -m unittest "
                            "test_{a} passes, without changing the tests.")
    demo_templates = ("python3 -m unittest test_{a}", "sed -i {script} {a}.py", "submit")
    vocabulary = tuple(f[0] for f in FUNCTIONS)

    def generate(self, rng: random.Random, difficulty: str = "easy") -> Instance:
        level = extra_files(difficulty)
        a = rng.choice(WORDS)
        chosen = rng.sample(FUNCTIONS, 2 + level)
        buggy = {f[0] for f in rng.sample(chosen, 2 if level == 2 else 1)}
        module = "".join(f"def {n}({args}):\n    return {bad if n in buggy else good}\n\n\n"
                         for n, args, good, bad, _, _ in chosen).rstrip() + "\n"
        tests = self._unittest(a, chosen)
        commands = [self.demo_templates[0].format(a=a)] + [
            self.demo_templates[1].format(a=a, script=shlex.quote(
                f"s|{_sed_pattern(f'return {bad}')}|{_sed_replacement(f'return {good}')}|"))
            for n, _, good, bad, _, _ in chosen if n in buggy]
        expected = {"module": a, "test_file": tests,
                    "cases": {n: [[list(args), out] for args, out in hidden] for n, _, _, _, _, hidden in chosen}}
        return new_instance(self, (a, tuple(f[0] for f in chosen), tuple(sorted(buggy))), difficulty,
                            self.instruction_template.format(a=a), {f"{a}.py": module, f"test_{a}.py": tests},
                            commands, PY_CHECKS, expected, solve=commands[1:])

    @staticmethod
    def _unittest(a: str, chosen: Sequence[FunctionSpec]) -> str:
        body = [f"import unittest\n\nimport {a}\n\n\nclass Test{a.capitalize()}(unittest.TestCase):"]
        for name, _, _, _, visible, _ in chosen:
            asserts = "".join(f"        self.assertEqual({a}.{name}({', '.join(map(repr, args))}), {out!r})\n"
                              for args, out in visible)
            body.append(f"    def test_{name}(self):\n{asserts}")
        return "\n".join(body) + "\n\nif __name__ == \"__main__\":\n    unittest.main()\n"


PY_CHECKS = '''
sys.path.insert(0, APP)
sys.dont_write_bytecode = True


def unchanged():
    return read("test_" + EXPECTED["module"] + ".py") == EXPECTED["test_file"]


def load():
    import importlib
    return importlib.import_module(EXPECTED["module"])


for _name, _cases in EXPECTED["cases"].items():
    @check("test_" + _name)
    def _(name=_name, cases=_cases):
        fn = getattr(load(), name)
        return all(fn(*args) == out for args, out in cases)


@check("tests_unchanged")
def _():
    return unchanged()


@check("unittest_passes")
def _():
    run = subprocess.run([sys.executable, "-B", "-m", "unittest", "test_" + EXPECTED["module"]], cwd=APP,
                         capture_output=True, timeout=60)
    return unchanged() and run.returncode == 0
'''


class GitRepair(Family):
    """/app/repo is a git repository (built by setup.sh) in which a commit deleted {a}.txt; medium adds
    commits after the deletion, hard also has two versions of the file before it. Tests: the file is
    back with its last content, committed, the tree is clean, and the old history is kept (the last
    two pass untouched)."""

    name = "git_repair"
    category = "version-control"
    instruction_template = ("A commit in repo/ deleted {a}.txt by mistake. Restore the file with its last "
                            "content and commit it, keeping the history.")
    demo_templates = (
        "git -C repo log --oneline --stat",
        "git -C repo checkout $(git -C repo rev-list -n 1 HEAD -- {a}.txt)^ -- {a}.txt",
        "git -C repo commit -q -m 'restore {a}.txt'",
        "submit",
    )
    vocabulary = ("git", "repo", "commit", "restore")

    def generate(self, rng: random.Random, difficulty: str = "easy") -> Instance:
        level = extra_files(difficulty)
        names = rng.sample(WORDS, 3 + level)
        a = names[0]
        steps: list[tuple[str, str, str]] = []  # (message, file, content or "" to delete)
        versions = [text(word_lines(rng, rng.randint(2, 4), 3)) for _ in range(1 + (level == 2))]
        steps += [(f"add {n}.txt", f"{n}.txt", text(word_lines(rng, 2, 3))) for n in names[1:]]
        steps += [(f"add {a}.txt" if i == 0 else f"update {a}.txt", f"{a}.txt", v) for i, v in enumerate(versions)]
        steps.append((f"remove {a}.txt", f"{a}.txt", ""))
        steps += [(f"update {n}.txt", f"{n}.txt", text(word_lines(rng, 3, 3))) for n in names[1 : 1 + level]]
        expected = {"file": f"{a}.txt", "content": versions[-1], "messages": [s[0] for s in steps]}
        commands = [t.format(a=a) for t in self.demo_templates[:-1]]
        files = {"README.txt": "The project repository is in repo/.\n"}
        return new_instance(self, (a, tuple(steps)), difficulty, self.instruction_template.format(a=a), files,
                            commands, GIT_CHECKS, expected, setup_sh=_git_setup(steps))


def _git_setup(steps: list[tuple[str, str, str]]) -> str:
    lines = ["#!/bin/bash", "set -e",
             # the python image has no git: install it at build time (the build may use the Debian archive)
             "command -v git >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install "
             "-y -qq --no-install-recommends git >/dev/null && rm -rf /var/lib/apt/lists/*; }",
             "mkdir -p /app/repo && cd /app/repo", "git init -q -b main",
             "git config user.name developer", "git config user.email developer@example.com"]
    for i, (message, name, content) in enumerate(steps):
        stamp = f"2024-01-{1 + i:02d}T10:00:00+00:00"
        lines.append(f"export GIT_AUTHOR_DATE={stamp} GIT_COMMITTER_DATE={stamp}")
        if content:
            lines.append(f"printf '%s' {shlex.quote(content)} > {name} && git add {name}")
        else:
            lines.append(f"git rm -q {name}")
        lines.append(f"git commit -q -m {shlex.quote(message)}")
    return "\n".join(lines) + "\n"


GIT_CHECKS = '''
def git(*args):
    return subprocess.run(["git", "-C", os.path.join(APP, "repo"), *args], capture_output=True, text=True)


@check("file_restored")
def _():
    return read("repo/" + EXPECTED["file"]) == EXPECTED["content"]


@check("restore_committed")
def _():
    return git("show", "HEAD:" + EXPECTED["file"]).stdout == EXPECTED["content"]


@check("tree_clean")
def _():
    run = git("status", "--porcelain")
    return run.returncode == 0 and run.stdout.strip() == ""


@check("history_kept")
def _():
    messages = git("log", "--reverse", "--format=%s").stdout.splitlines()
    return messages[: len(EXPECTED["messages"])] == EXPECTED["messages"]
'''

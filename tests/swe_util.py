"""A tiny Python project made by the tests (no download): a package with a few functions and a pytest suite, as an
sdist directory (for `tasks swe --sdist`) or as a git repository with a bug, its fix and a test that shows it
(for `tasks import swebench`)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

PYPROJECT = """\
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "tinycalc"
version = "1.0"

[tool.setuptools]
packages = ["tinycalc"]

[tool.pytest.ini_options]
testpaths = ["tests"]
"""

LIBRARY = '''\
"""Small functions with tests."""


def clamp(x, low, high):
    if x < low:
        return low
    if x > high:
        return high
    return x


def mean(values, default=0.0):
    if not values:
        return default
    return sum(values) / len(values)


def window(seq, n=2):
    out = []
    for i in range(len(seq) - n + 1):
        out.append(tuple(seq[i:i + n]))
    return out


def scale(values, factor):
    return [v * factor for v in values]
'''

TESTS = '''\
from tinycalc import clamp, mean, scale, window


def test_clamp_inside():
    assert clamp(5, 0, 10) == 5


def test_clamp_low():
    assert clamp(-3, 0, 10) == 0


def test_clamp_high():
    assert clamp(30, 0, 10) == 10


def test_clamp_edges():
    assert clamp(0, 0, 10) == 0 and clamp(10, 0, 10) == 10


def test_mean():
    assert mean([1, 2, 3]) == 2


def test_mean_empty():
    assert mean([]) == 0.0


def test_window():
    assert window([1, 2, 3]) == [(1, 2), (2, 3)]


def test_window_three():
    assert window([1, 2, 3, 4], 3) == [(1, 2, 3), (2, 3, 4)]


def test_scale():
    assert scale([1, 2], 3) == [3, 6]
'''


def write_project(root: Path) -> Path:
    """The project's source tree (what its sdist unpacks to)."""
    (root / "tinycalc").mkdir(parents=True)
    (root / "tests").mkdir()
    (root / "pyproject.toml").write_text(PYPROJECT)
    (root / "tinycalc" / "__init__.py").write_text(LIBRARY)
    (root / "tests" / "test_calc.py").write_text(TESTS)
    return root


def _git(repo: Path, *args: str) -> str:
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t",
           "HOME": str(repo), "PATH": "/usr/bin:/bin"}
    return subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True, text=True).stdout


def swebench_repo(root: Path) -> tuple[Path, dict]:
    """``root/acme__tinycalc``: a git repository whose base commit has a bug in ``window`` (it drops the last
    window), and the SWE-bench instance of that bug (its fix, a test patch with a test that fails before it)."""
    repo = write_project(root / "acme__tinycalc")
    buggy = (repo / "tinycalc" / "__init__.py").read_text().replace("len(seq) - n + 1", "len(seq) - n")
    (repo / "tinycalc" / "__init__.py").write_text(buggy)
    tests = (repo / "tests" / "test_calc.py").read_text().replace(
        "def test_window():\n    assert window([1, 2, 3]) == [(1, 2), (2, 3)]\n\n\n", "")
    (repo / "tests" / "test_calc.py").write_text(tests)
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "base")
    base = _git(repo, "rev-parse", "HEAD").strip()
    (repo / "tests" / "test_calc.py").write_text(tests + "\n\ndef test_window():\n    assert window([1, 2, 3]) == "
                                                 "[(1, 2), (2, 3)]\n")
    test_patch = _git(repo, "diff")
    _git(repo, "checkout", "-q", "--", ".")
    (repo / "tinycalc" / "__init__.py").write_text(LIBRARY)
    patch = _git(repo, "diff")
    _git(repo, "commit", "-qam", "fix window")  # the fix is in the clone's history, never in the task's image
    passing = ["tests/test_calc.py::test_clamp_inside", "tests/test_calc.py::test_mean",
               "tests/test_calc.py::test_window_three", "tests/test_calc.py::test_scale"]
    instance = {"instance_id": "acme__tinycalc-1", "repo": "acme/tinycalc", "base_commit": base, "patch": patch,
                "test_patch": test_patch, "problem_statement": "window() drops the last window of a sequence.",
                "FAIL_TO_PASS": json.dumps(["tests/test_calc.py::test_window"]),
                "PASS_TO_PASS": json.dumps(passing), "version": "1.0", "created_at": "2026-01-01T00:00:00Z",
                "pip_packages": ["setuptools"]}
    return repo, instance

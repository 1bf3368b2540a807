"""A repository task as a Harbor directory, for generated bugs (``tasks swe``) and imported SWE-bench instances.

::

    instruction.md             the issue report
    task.toml                  [metadata] (project, difficulty, counts), timeouts, limits
    environment/Dockerfile     FROM the project image (generated) or a full build (imported), the repository at
                               /repo as a fresh one-commit git repository, WORKDIR /repo
    environment/files/...      the files of the repository that differ from the image (the bug)
    solution/fix.patch         the fix; solve.sh applies it with git apply; demo.json does the same in one turn
    tests/test.sh              runs albatross_swe_run.py verify config.json
    tests/config.json          FAIL_TO_PASS, PASS_TO_PASS, the test files to run, the pytest configuration
    tests/pristine.tar         the tests and pytest configuration as they were, put back before the run
    tests/albatross_swe_run.py, tests/albatross_swe.py   the runner and its pytest plugin

The reward (``reward.json``) has one entry per FAIL_TO_PASS test and a zero entry per broken PASS_TO_PASS test,
so partial credit is the share of FAIL_TO_PASS tests fixed (less any test broken), success all of them with
nothing broken, and the untouched repository scores 0.
"""

from __future__ import annotations

import difflib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from albatross.tasks.format import write_task
from albatross.tasks.swe.project import EMPTY_CONFIG

REPO = "/repo"
_HERE = Path(__file__).parent
RUNNER, PLUGIN = "albatross_swe_run.py", "albatross_swe.py"
GIT_DATE = "2000-01-01T00:00:00+0000"
TEST_SH = """#!/bin/bash
# The verifier of a repository task: puts the tests back as they were, runs FAIL_TO_PASS and PASS_TO_PASS, and
# writes /logs/verifier/reward.json (see albatross_swe_run.py).
mkdir -p /logs/verifier
cd /tests && exec python3 -s /tests/albatross_swe_run.py verify /tests/config.json
"""
SOLVE_SH = f"""#!/bin/bash
set -e
cd {REPO}
git apply --whitespace=nowarn /solution/fix.patch
"""


@dataclass
class RepoTask:
    """Everything a repository task directory holds (see the module docstring)."""

    task_id: str
    instruction: str
    dockerfile: str
    env_files: dict[str, str | bytes]  # relative to environment/
    fix_patch: str
    fail_to_pass: list[str]
    pass_to_pass: list[str]
    test_files: list[str]  # what the verifier runs (test modules of the repository)
    pristine: bytes  # tar of the files put back before the run
    config_file: str | None  # the repository's pytest configuration file, or None (an empty one is shipped)
    verifier_timeout_s: float
    metadata: dict[str, Any] = field(default_factory=dict)
    agent_timeout_s: float = 1800.0
    memory_mb: int = 2048
    extra_tests: dict[str, str | bytes] = field(default_factory=dict)  # more files of tests/
    pytest_args: list[str] = field(default_factory=list)  # more pytest options of the verifier's run


def git_commit_script(message: str) -> str:
    """Shell lines (a RUN step) that make ``/repo`` a fresh one-commit git repository with fixed dates."""
    q = json.dumps(message)
    return (f"cd {REPO} && rm -rf .git && git init -q -b main && "
            "printf '*.egg-info/\\n__pycache__/\\n.pytest_cache/\\n*.pyc\\n' > .git/info/exclude && git add -A && "
            f"GIT_AUTHOR_DATE={GIT_DATE} GIT_COMMITTER_DATE={GIT_DATE} git -c user.name=albatross "
            f"-c user.email=albatross@localhost -c commit.gpgsign=false commit -q -m {q}")


def unified_patch(changes: dict[str, tuple[str, str]]) -> str:
    """A git-style unified diff turning each file's first text into its second (``rel -> (old, new)``)."""
    out = []
    for rel, (old, new) in sorted(changes.items()):
        if old == new:
            continue
        out.append(f"diff --git a/{rel} b/{rel}\n")
        lines = difflib.unified_diff(old.splitlines(keepends=True), new.splitlines(keepends=True),
                                     f"a/{rel}", f"b/{rel}", n=3)
        for line in lines:
            out.append(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
    return "".join(out)


def write_repo_task(out: Path, task: RepoTask) -> Path:
    """Write ``task`` as ``out/task.task_id`` (see the module docstring)."""
    config = {"repo": REPO, "tests": task.test_files, "fail_to_pass": task.fail_to_pass,
              "pass_to_pass": task.pass_to_pass, "pristine": "pristine.tar", "test_dirs": pristine_dirs(task.pristine),
              "config_file": f"{REPO}/{task.config_file}" if task.config_file else EMPTY_CONFIG,
              "pytest_args": task.pytest_args,
              "timeout": round(max(30.0, task.verifier_timeout_s - 15.0), 1)}
    tests = {"config.json": json.dumps(config, indent=1) + "\n", "pristine.tar": task.pristine,
             RUNNER: (_HERE / "runner.py").read_text(), PLUGIN: (_HERE / "plugin.py").read_text(),
             **task.extra_tests}
    if not task.config_file:
        tests[EMPTY_CONFIG] = "[pytest]\n"
    demo = [f"cd {REPO} && git apply --whitespace=nowarn <<'ALBATROSS_PATCH'\n{task.fix_patch}ALBATROSS_PATCH",
            "submit"]
    toml = {"version": "1.0", "metadata": task.metadata,
            "agent": {"timeout_sec": task.agent_timeout_s},
            "verifier": {"timeout_sec": round(task.verifier_timeout_s, 1)},
            "environment": {"cpus": 1, "memory_mb": task.memory_mb, "storage_mb": 2048, "build_timeout_sec": 600,
                            "allow_internet": False}}
    path = write_task(out / task.task_id, instruction=task.instruction, task_toml=toml, env_files=task.env_files,
                      dockerfile=task.dockerfile, solve_sh=SOLVE_SH, test_sh=TEST_SH, test_files=tests,
                      demo_steps=demo)
    (path / "solution" / "fix.patch").write_text(task.fix_patch)
    return path


def pristine_dirs(pristine: bytes) -> list[str]:
    """The test directories of a pristine tar (``tests/``, ``pkg/tests/``, ...: the first directory on each file's
    path named as a test directory), which the verifier keeps exactly as the tar has them."""
    import io
    import tarfile
    from pathlib import PurePosixPath

    from albatross.tasks.swe.project import TEST_DIRS

    found = set()
    with tarfile.open(fileobj=io.BytesIO(pristine)) as tar:
        for name in tar.getnames():
            parts = PurePosixPath(name).parts[:-1]
            for i, part in enumerate(parts):
                if part in TEST_DIRS:
                    found.add("/".join(parts[: i + 1]))
                    break
    return sorted(found)


def link_or_copy(src: Path, dest: Path) -> None:
    """A hard link where possible (tasks of one project share their pristine.tar), else a copy."""
    dest.unlink(missing_ok=True)
    try:
        os.link(src, dest)
    except OSError:
        dest.write_bytes(src.read_bytes())

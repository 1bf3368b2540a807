"""Shared pieces of the security probes: a task whose answer the "agent" never gives, and helpers that
run probes inside an attempt (the oracle of a hostile agent: plain commands through the attempt)."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from albatross.sandbox import local_available
from albatross.sandbox.base import Attempt, ExecResult
from albatross.tasks import load_task, write_task
from albatross.tasks.format import Task

needs_local = pytest.mark.skipif(not local_available(), reason="the local sandbox needs root, cgroup v1 "
                                 "memory/pids controllers, namespaces and overlayfs")

ANSWER = "forty-two"
DOCKERFILE = "FROM python:3.11-slim-bookworm\nWORKDIR /app\nCOPY app/ /app/\n"
# Passes (reward 1) only when /app/answer.txt holds the answer; the hostile agent never writes it.
TEST_SH = f"""#!/bin/bash
cd /app || exit 1
mkdir -p /logs/verifier
if [ "$(cat /app/answer.txt 2>/dev/null)" = "{ANSWER}" ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
"""
PYTHON = "/usr/bin/python3"


# The same check made by the image's python3 (toolchain probes replace or hook the interpreter).
PY_TEST_SH = f"""#!/bin/bash
mkdir -p /logs/verifier
if python3 -c "import sys; sys.exit(0 if open('/app/answer.txt').read().strip() == '{ANSWER}' else 1)"; then
  echo 1; else echo 0; fi > /logs/verifier/reward.txt
"""


def make_task(root: Path, name: str = "probe", test_sh: str = TEST_SH, test_files: dict[str, str] | None = None,
              toml: dict[str, dict[str, object]] | None = None, solve_sh: str | None = None,
              env_files: dict[str, str | bytes] | None = None, dockerfile: str = DOCKERFILE) -> Task:
    """The probe task; ``toml`` tables are merged into its task.toml ({"verifier": {...}} adds keys)."""
    tables: dict[str, dict[str, object]] = {
        "agent": {"timeout_sec": 30}, "verifier": {"timeout_sec": 30},
        "environment": {"memory_mb": 512, "storage_mb": 256, "allow_internet": False}}
    for section, values in (toml or {}).items():
        tables.setdefault(section, {}).update(values)
    task_dir = write_task(root / name, instruction=f"Write {ANSWER} to /app/answer.txt.\n", task_toml=tables,
                          env_files=env_files or {"app/readme.txt": "hello\n"}, dockerfile=dockerfile,
                          solve_sh=solve_sh or f"#!/bin/bash\necho {ANSWER} > /app/answer.txt\n",
                          test_sh=test_sh, test_files=test_files)
    return load_task(task_dir)


def py(attempt: Attempt, code: str, timeout_s: float = 20) -> ExecResult:
    """Run Python code in the attempt (the system python of the base root)."""
    return attempt.exec(f"{PYTHON} -c {shlex.quote(code)}", timeout_s=timeout_s)


# ctypes prologue for syscall probes: ``sc(nr, *args)`` returns (result, errno)
SYSCALL = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def sc(nr, *args):
    r = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) if isinstance(a, int) else a for a in args])
    return r, ctypes.get_errno()
"""

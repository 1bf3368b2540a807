"""Helpers shared by the sandbox tests: a task environment from a Dockerfile, and a command that must succeed."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def task_env(tmp: Path, dockerfile: str, files: dict[str, str] | None = None) -> Path:
    """``tmp/task/environment`` holding ``dockerfile`` and ``files`` (name -> text)."""
    root = tmp / "task" / "environment"
    root.mkdir(parents=True)
    (root / "Dockerfile").write_text(dockerfile)
    for name, text in (files or {}).items():
        (root / name).write_text(text)
    return root


def ok_output(attempt: Any, command: str, timeout_s: float = 60) -> str:
    """The stripped output of ``command`` in ``attempt``, which must exit 0."""
    result = attempt.exec(command, timeout_s=timeout_s)
    assert result.exit_code == 0, result.output
    return result.output.strip()

"""Sandbox protocol: a task's prepared environment (parent) and attempts forked from it.

An attempt is one isolated, copy-on-write view of its task's prepared environment with a persistent
shell state (working directory and exported environment persist between ``exec`` calls). Backends are
siblings: ``local.py`` (Linux namespaces + overlayfs) and ``process.py`` (no isolation, dev only).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


class SandboxError(RuntimeError):
    """An infrastructure failure (fork failed, sandbox died). Never scored; retried."""


@dataclass
class ExecResult:
    output: str  # stdout and stderr interleaved, decoded as UTF-8 with replacement
    exit_code: int  # -1 if the command was killed for its timeout
    timed_out: bool = False
    seconds: float = 0.0
    truncated_bytes: int = 0  # bytes dropped because output exceeded max_output_bytes


@dataclass
class Limits:
    memory_mb: int = 512
    pids: int = 256
    disk_mb: int = 256
    command_timeout_s: float = 10.0
    max_output_bytes: int = 1 << 20


class Attempt(Protocol):
    """One forked attempt. Every process, mount and file of it is gone after ``close``."""

    def exec(self, command: str, timeout_s: float | None = None) -> ExecResult: ...

    def put_dir(self, host_dir: Path, sandbox_path: str) -> None:
        """Copy a host directory into the attempt (used to add tests/ before verification)."""
        ...

    def read_file(self, sandbox_path: str) -> bytes | None: ...

    def close(self) -> None: ...


class Backend(Protocol):
    name: str
    isolated: bool

    def fork(self, env_dir: Path | None, workdir: str = "/app", limits: Limits | None = None) -> Attempt:
        """Fork an attempt from the prepared environment built from ``env_dir``.

        ``env_dir`` is a task's ``environment/`` directory (Dockerfile and files). The parent is built
        once per distinct environment and cached; attempts are copy-on-write views of it.
        """
        ...

    def close(self) -> None:
        """Release every cached parent."""
        ...

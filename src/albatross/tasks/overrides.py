"""Per-task overrides of task.toml values, kept on albatross's side: for task sets you must not edit.

Some public tasks need a setting their task.toml cannot say, because the format they were written for
has no such field: Terminal-Bench 2.0 tests that check a tool the agent installed under ``/usr/local``
or a file it wrote in ``/etc`` need ``[verifier] toolchain = "attempt"`` (docs/sandbox.md, "Threat
model"), which weakens what the verifier trusts and so is never the default. An overrides file names
each such task, the value, and why::

    [build-pmars]
    reason = "the tests run /usr/local/bin/pmars, which the agent builds and installs"
    verifier.toolchain = "attempt"

``--overrides PATH`` (``tasks validate``, ``tasks probe``, ``eval``) applies one, or ``--overrides
NAME`` a set albatross ships (``BUILTIN``: ``terminal-bench-2``). Only the keys of ``KEYS`` may be
overridden; every entry needs a ``reason``; anything else is a ``TaskFormatError`` naming the file and
entry. A task the file does not name keeps its own values.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from albatross.sandbox.base import TOOLCHAINS
from albatross.tasks.format import MEMORY_RANGE, Task, TaskFormatError

# a task's memory raised for albatross's accounting (its writable layer is a tmpfs counted in its memory), in MiB
MEMORY_MB = range(int(MEMORY_RANGE[0]), int(MEMORY_RANGE[1]) + 1)
KEYS: dict[str, tuple[str, Any]] = {  # "table.key" -> (Task field, allowed values or type)
    "verifier.toolchain": ("toolchain", TOOLCHAINS),
    "verifier.keep_agent_processes": ("keep_agent_processes", bool),
    "environment.memory_mb": ("memory_mb", MEMORY_MB),
}

_ATTEMPT = {"verifier": {"toolchain": "attempt"}}
_SERVER = {"verifier": {"toolchain": "attempt", "keep_agent_processes": True}}
_KEEP = {"verifier": {"keep_agent_processes": True}}
BUILTIN: dict[str, dict[str, dict[str, Any]]] = {
    # Terminal-Bench 2.0 tasks whose tests check what the agent installed or configured in system paths,
    # or a server the agent left running (Terminal-Bench runs the tests in the agent's live container).
    "terminal-bench-2": {
        "build-pmars": {"reason": "the tests run /usr/local/bin/pmars, which the agent builds and installs",
                        **_ATTEMPT},
        "build-pov-ray": {"reason": "the tests run /usr/local/bin/povray, which the agent builds and installs",
                          **_ATTEMPT},
        "nginx-request-logging": {"reason": "the tests fetch pages from the nginx the agent installs, configures "
                                            "under /etc/nginx and leaves running on port 8080", **_SERVER},
        "mailman": {"reason": "the tests send mail through the mail server the agent configures under /etc "
                              "(postfix, mailman3) and leaves running", **_SERVER},
        "adaptive-rejection-sampler": {"reason": "the tests run Rscript, which the agent installs (r-base)",
                                       **_ATTEMPT},
        "dna-assembly": {"reason": "the tests run oligotm (primer3), which the agent installs", **_ATTEMPT},
        "dna-insert": {"reason": "the tests run oligotm (primer3), which the agent installs", **_ATTEMPT},
        "merge-diff-arc-agi-task": {"reason": "the tests run git, which the agent installs, on the repository "
                                              "it merged", **_ATTEMPT},
        "configure-git-webserver": {"reason": "the tests push over ssh to the git server and fetch the page from "
                                              "the nginx the agent installs and leaves running", **_SERVER},
        "git-multibranch": {"reason": "the tests push over ssh to the git server and fetch both branches from "
                                      "the nginx the agent installs and leaves running", **_SERVER},
        "kv-store-grpc": {"reason": "the tests call the gRPC server the agent leaves running, with the grpcio it "
                                    "installs system-wide", **_SERVER},
        "pypi-server": {"reason": "the tests pip-install from the package server the agent leaves running on "
                                  "port 8080", **_KEEP},
        "hf-model-inference": {"reason": "the tests call the Flask API the agent leaves running on port 5000",
                               **_KEEP},
        "qemu-startup": {"reason": "the tests log in over telnet to the VM the agent leaves running", **_KEEP},
        "qemu-alpine-ssh": {"reason": "the tests log in over ssh to the VM the agent leaves running", **_KEEP},
        "install-windows-3.11": {"reason": "the tests check the VM the agent leaves running (QEMU, VNC)", **_KEEP},
        "gcode-to-text": {"reason": "the solution installs 1.7 GB of packages (opencv, matplotlib, tesseract) and "
                                    "then renders: albatross counts an attempt's written files in its memory, "
                                    "Docker does not, so the 2 GiB it declares for its processes become 4 GiB",
                          "environment": {"memory_mb": 4096}},
    },
}


@dataclasses.dataclass(frozen=True)
class Override:
    values: dict[str, Any]  # Task field -> value
    reason: str


def load_overrides(spec: str | Path | None) -> dict[str, Override]:
    """Task id -> its override, from a TOML file or a built-in set's name (``BUILTIN``); {} for none."""
    if not spec:
        return {}
    name = str(spec)
    if name in BUILTIN:
        return _parse(BUILTIN[name], f"built-in overrides {name}")
    path = Path(name)
    if not path.is_file():
        raise TaskFormatError(f"{path}: no overrides file (or a built-in set: {', '.join(sorted(BUILTIN))})")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise TaskFormatError(f"{path}: invalid TOML: {err}") from None
    return _parse(data, str(path))


def _parse(data: dict[str, Any], where: str) -> dict[str, Override]:
    found = {}
    for task_id, entry in data.items():
        if not isinstance(entry, dict):
            raise TaskFormatError(f"{where}: [{task_id}] must be a table")
        reason = entry.get("reason")
        if not isinstance(reason, str) or not reason.strip():
            raise TaskFormatError(f"{where}: [{task_id}] needs a reason (why the task needs the override)")
        values = {}
        for table, inner in entry.items():
            if table == "reason":
                continue
            for key, value in (inner.items() if isinstance(inner, dict) else [("", inner)]):
                dotted = f"{table}.{key}" if key else table
                if dotted not in KEYS:
                    raise TaskFormatError(f"{where}: [{task_id}] {dotted} cannot be overridden (only "
                                          f"{', '.join(KEYS)})")
                field, allowed = KEYS[dotted]
                if not _allowed(value, allowed):
                    raise TaskFormatError(f"{where}: [{task_id}] {dotted} must be {_describe(allowed)}, "
                                          f"got {value!r}")
                values[field] = value
        found[str(task_id)] = Override(values, reason.strip())
    return found


def _allowed(value: Any, allowed: Any) -> bool:
    if isinstance(allowed, type):
        return isinstance(value, allowed)
    if isinstance(allowed, range):  # a whole number (not a bool, not a float) within the range
        return isinstance(value, int) and not isinstance(value, bool) and value in allowed
    return value in allowed


def _describe(allowed: Any) -> str:
    if isinstance(allowed, type):
        return allowed.__name__
    if isinstance(allowed, range):
        return f"a whole number from {allowed.start} to {allowed.stop - 1}"
    return " or ".join(allowed)


def apply_overrides(task: Task, overrides: dict[str, Override]) -> Task:
    """``task`` with its override's values (itself when none names it)."""
    override = overrides.get(task.id)
    return task if override is None else dataclasses.replace(task, **override.values)

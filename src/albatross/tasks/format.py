"""Harbor / Terminal-Bench 2 task directories: load, validate, write.

A task directory holds::

    instruction.md           what the agent is told
    task.toml                [metadata], [agent] timeout_sec, [verifier] timeout_sec, [environment]
    environment/Dockerfile   the environment (its last WORKDIR is where the agent starts) and its files
    solution/solve.sh        the oracle (optional); solution/demo.json is an albatross extension
    tests/test.sh            the verifier; writes /logs/verifier/reward.txt or reward.json

``solution/demo.json`` (``{"steps": ["cmd", ..., "submit"]}``) is the oracle as one shell command per
agent turn, used for supervised warm starts. A malformed directory raises ``TaskFormatError`` whose
message is one line naming the file and the field.

Terminal-Bench 0.2 directories (``task.yaml``, ``run-tests.sh``, ``solution.sh``, ``tests/``) load too:
they are converted to this layout first (``legacy.py``). An environment whose Dockerfile needs the
network (apt-get, pip, curl, ...) or starts from a python image is built from an adapted copy that
carries the offline toolkit (``offline.py``): ``Task.env_dir`` is that copy, ``Task.source_env_dir`` the
task's own ``environment/``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import posixpath
import re
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from albatross.cache import cache_root
from albatross.sandbox.base import NETWORK_POLICIES, TOOLCHAINS, Limits
from albatross.tasks.errors import (
    TaskFormatError as TaskFormatError,  # re-exported: importers name the format
)
from albatross.tasks.legacy import convert_legacy, is_legacy_task
from albatross.tasks.offline import OfflineEnv, adapt_environment
from albatross.tasks.tomlwrite import dumps_toml

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DEFAULT_TIMEOUT_S = 600.0  # Harbor's default for [agent] and [verifier] timeout_sec
DEFAULT_BUILD_TIMEOUT_S = 600.0  # Harbor's default for [environment] build_timeout_sec
DEFAULT_MEMORY_MB = 2048
DEFAULT_STORAGE_MB = 10240
DEFAULT_WORKDIR = "/app"
SUBMIT = "submit"

MAX_INSTRUCTION_BYTES = 1 << 20  # a longer instruction.md is refused before it is read
# (lowest, highest, unit) of what task.toml may ask for; the run's own limits are a ceiling on top
MEMORY_RANGE = (64.0, float(1 << 20), "MiB")  # below 64 MiB not even the sandbox's holder fits
STORAGE_RANGE = (16.0, float(1 << 22), "MiB")
CPUS_RANGE = (0.01, 1024.0, "CPUs")
TIMEOUT_RANGE = (0.1, 7 * 86400.0, "seconds")
# task.toml keys albatross reads, or knows from Harbor and ignores; any other is warned about once
KNOWN_KEYS: dict[str, frozenset[str]] = {
    "": frozenset({"version", "schema_version", "metadata", "task", "agent", "verifier", "environment", "solution",
                   "source", "steps"}),
    "agent": frozenset({"timeout_sec", "setup_timeout_sec", "user"}),
    "verifier": frozenset({"timeout_sec", "env", "user", "environment", "keep_agent_processes", "toolchain"}),
    "environment": frozenset({"build_timeout_sec", "docker_image", "cpus", "memory", "memory_mb", "storage",
                              "storage_mb", "gpus", "gpu_types", "tpu", "allow_internet", "network", "os",
                              "skip_image_build"}),
    "solution": frozenset({"env"}),
}
_warned: set[str] = set()
_warned_lock = threading.Lock()
log = logging.getLogger(__name__)
_UNITS_MB = {"": 1.0, "K": 1 / 1024, "M": 1.0, "G": 1024.0, "T": 1024.0 * 1024.0}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)


@dataclass
class Task:
    id: str  # the directory name
    path: Path
    instruction: str
    agent_timeout_s: float
    verifier_timeout_s: float
    env_dir: Path
    tests_dir: Path
    solution_dir: Path
    workdir: str = DEFAULT_WORKDIR
    memory_mb: int = DEFAULT_MEMORY_MB
    cpus: float = 1.0
    storage_mb: int = DEFAULT_STORAGE_MB
    allow_internet: bool = False
    metadata: dict[str, Any] = field(default_factory=dict)
    demo_steps: list[str] | None = None
    build_timeout_s: float = DEFAULT_BUILD_TIMEOUT_S
    source_env_dir: Path | None = None  # the task's own environment/ (env_dir may be an adapted copy)
    source_path: Path | None = None  # the directory the task was loaded from (differs when converted)
    offline: OfflineEnv | None = None  # set when env_dir is an adapted copy (offline.py)
    network: str | None = None  # the network policy the task asks for (None: the run's); it may only narrow it
    keep_agent_processes: bool = False  # [verifier]: the agent's processes live on while test.sh runs
    toolchain: str = "image"  # [verifier]: test.sh's tools from the pristine "image" or the "attempt" itself

    @property
    def dockerfile(self) -> Path:
        """The task's own Dockerfile (not the adapted copy's)."""
        return (self.source_env_dir or self.env_dir) / "Dockerfile"


BUILTIN_ID = re.compile(r"^(?:train|validation|heldout)-\d+-(?P<family>\w+)$")
"""The directory name of a generated built-in task (``heldout-0003-count_lines``) and its family."""
UNCATEGORIZED = "uncategorized"


def family_of(task: Task) -> str:
    """A task's family: ``[metadata] family`` in its task.toml, else the family a built-in task's directory name
    carries, else ``uncategorized``."""
    family = task.metadata.get("family")
    if isinstance(family, str) and family:
        return family
    return family_of_id(task.id)


def family_of_id(task_id: str) -> str:
    """The family a built-in task's directory name carries (``heldout-0003-count_lines``), else ``uncategorized``."""
    match = BUILTIN_ID.match(task_id)
    return match.group("family") if match else UNCATEGORIZED


# ----------------------------------------------------------------------------------------------- load


def load_task(path: str | Path) -> Task:
    """Load and validate one task directory. Raises ``TaskFormatError``."""
    source = Path(path)
    if not source.is_dir():
        raise TaskFormatError(f"{source}: not a task directory")
    path = _harbor_dir(source)
    toml_path = path / "task.toml"
    cfg = _read_toml(toml_path)
    _warn_unknown(cfg, toml_path)
    env = _table(cfg, "environment", toml_path)
    verifier = _table(cfg, "verifier", toml_path)
    task = Task(
        id=source.name,
        path=path,
        instruction=_read_instruction(path / "instruction.md"),
        agent_timeout_s=_timeout(cfg, "agent", toml_path),
        verifier_timeout_s=_timeout(cfg, "verifier", toml_path),
        env_dir=path / "environment",
        tests_dir=_require_file(path / "tests" / "test.sh").parent,
        solution_dir=path / "solution",
        workdir=dockerfile_workdir(_require_file(path / "environment" / "Dockerfile")),
        memory_mb=_size_mb(env, "memory", toml_path, DEFAULT_MEMORY_MB, MEMORY_RANGE),
        cpus=_ranged(env, "cpus", "[environment]", toml_path, 1.0, CPUS_RANGE),
        storage_mb=_size_mb(env, "storage", toml_path, DEFAULT_STORAGE_MB, STORAGE_RANGE),
        allow_internet=_bool(env, "allow_internet", toml_path),
        metadata=dict(_table(cfg, "metadata", toml_path)),
        demo_steps=_read_demo(path / "solution" / "demo.json"),
        build_timeout_s=_ranged(env, "build_timeout_sec", "[environment]", toml_path, DEFAULT_BUILD_TIMEOUT_S,
                                TIMEOUT_RANGE),
        source_env_dir=path / "environment",
        source_path=source,
        network=_network(env, toml_path),
        keep_agent_processes=_bool(verifier, "keep_agent_processes", toml_path, "[verifier]"),
        toolchain=_choice(verifier, "toolchain", toml_path, "[verifier]", TOOLCHAINS),
    )
    return _with_offline_env(task)


def _harbor_dir(source: Path) -> Path:
    """``source``, or its converted copy when it is a Terminal-Bench 0.2 task."""
    if not is_legacy_task(source):
        return source
    try:
        return convert_legacy(source, cache_root())
    except OSError as e:
        raise TaskFormatError(f"{source}: cannot convert the Terminal-Bench 0.2 task: {e}") from None


def _with_offline_env(task: Task) -> Task:
    try:
        adapted = adapt_environment(task.env_dir)
    except OSError as e:
        raise TaskFormatError(f"{task.env_dir}: cannot write the offline copy of the environment: {e}") from None
    if adapted is not None:
        task.env_dir, task.offline = adapted.env_dir, adapted
    return task


def load_tasks(paths: Sequence[str | Path] | str | Path) -> list[Task]:
    """Load tasks from task directories and from directories that hold task directories.

    A path with a ``task.toml`` is one task; any other directory is searched (recursively, not
    descending into tasks) and its tasks are loaded in sorted path order. Task ids must be unique.
    """
    if isinstance(paths, (str, Path)):
        paths = [paths]
    tasks: list[Task] = []
    seen: dict[str, Path] = {}
    for root in map(Path, paths):
        for task_dir in _task_dirs(root):
            task = load_task(task_dir)
            if task.id in seen:
                raise TaskFormatError(f"{task_dir}: duplicate task id {task.id!r} (also {seen[task.id]})")
            seen[task.id] = task_dir
            tasks.append(task)
    return tasks


def find_task_dirs(paths: Sequence[str | Path] | str | Path) -> list[Path]:
    """The task directories in ``paths`` (each a task directory or a folder of them), in order.

    Raises ``TaskFormatError`` for a path that does not exist or holds no task directory."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    return [d for root in map(Path, paths) for d in _task_dirs(root)]


def _task_dirs(root: Path) -> list[Path]:
    if not root.is_dir():
        raise TaskFormatError(f"{root}: no such directory")
    if _is_task_dir(root):
        return [root]
    found: list[Path] = []
    for child in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        if _is_task_dir(child):
            found.append(child)
        else:
            found.extend(_task_dirs_below(child))
    if not found:
        raise TaskFormatError(f"{root}: no task directories (with a task.toml or task.yaml) found")
    return found


def _is_task_dir(path: Path) -> bool:
    return (path / "task.toml").is_file() or (path / "task.yaml").is_file()


def _task_dirs_below(root: Path) -> list[Path]:
    try:
        return _task_dirs(root)
    except TaskFormatError:
        return []


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            data: dict[str, Any] = tomllib.load(f)
            return data
    except FileNotFoundError:
        raise TaskFormatError(f"{path}: missing") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise TaskFormatError(f"{path}: invalid TOML: {e}") from None


def _read_instruction(path: Path) -> str:
    try:
        with path.open("rb") as f:
            data = f.read(MAX_INSTRUCTION_BYTES + 1)
    except FileNotFoundError:
        raise TaskFormatError(f"{path}: missing") from None
    if len(data) > MAX_INSTRUCTION_BYTES:
        raise TaskFormatError(f"{path}: larger than {MAX_INSTRUCTION_BYTES >> 10} KiB (an instruction is read whole "
                              "into the agent's context)")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise TaskFormatError(f"{path}: not UTF-8 text") from None
    if not text.strip():
        raise TaskFormatError(f"{path}: is empty")
    return text


def _require_file(path: Path) -> Path:
    if not path.is_file():
        raise TaskFormatError(f"{path}: missing")
    return path


def _table(cfg: dict[str, Any], name: str, path: Path) -> dict[str, Any]:
    value = cfg.get(name, {})
    if not isinstance(value, dict):
        raise TaskFormatError(f"{path}: [{name}] must be a table")
    return value


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _positive(table: dict[str, Any], key: str, where: str, path: Path, default: float) -> float:
    value = table.get(key, default)
    if not _is_number(value):
        raise TaskFormatError(f"{path}: {where} {key} must be a number")
    if not math.isfinite(value) or value <= 0:
        raise TaskFormatError(f"{path}: {where} {key} must be positive")
    return float(value)


def _ranged(table: dict[str, Any], key: str, where: str, path: Path, default: float,
            limits: tuple[float, float, str]) -> float:
    """A positive number within ``limits`` (lowest, highest, unit); the error names the range."""
    value = _positive(table, key, where, path, default)
    lowest, highest, unit = limits
    if not lowest <= value <= highest:
        raise TaskFormatError(f"{path}: {where} {key} must be between {lowest:g} and {highest:g} ({unit}), "
                              f"got {value:g}")
    return value


def _timeout(cfg: dict[str, Any], section: str, path: Path) -> float:
    return _ranged(_table(cfg, section, path), "timeout_sec", f"[{section}]", path, DEFAULT_TIMEOUT_S, TIMEOUT_RANGE)


def _size_mb(env: dict[str, Any], name: str, path: Path, default: int, limits: tuple[float, float, str]) -> int:
    """``<name>_mb`` (a number of MiB) or the older ``<name> = "2G"`` / ``"512M"``, within ``limits``."""
    if f"{name}_mb" in env:
        return int(_ranged(env, f"{name}_mb", "[environment]", path, default, limits))
    if name not in env:
        return default
    value = env[name]
    if _is_number(value):
        return int(_ranged(env, name, "[environment]", path, default, limits))
    match = _SIZE_RE.match(value) if isinstance(value, str) else None
    if match is None or float(match.group(1)) <= 0:
        raise TaskFormatError(f'{path}: [environment] {name} must be a size like "512M" or "2G"')
    mb = float(match.group(1)) * _UNITS_MB[match.group(2).upper()]
    return int(_ranged({name: mb}, name, "[environment]", path, default, limits))


def _bool(table: dict[str, Any], key: str, path: Path, where: str = "[environment]") -> bool:
    value = table.get(key, False)
    if not isinstance(value, bool):
        raise TaskFormatError(f"{path}: {where} {key} must be true or false")
    return value


def _choice(table: dict[str, Any], key: str, path: Path, where: str, choices: tuple[str, ...]) -> str:
    value = table.get(key, choices[0])
    if value not in choices:
        raise TaskFormatError(f"{path}: {where} {key} must be one of {', '.join(choices)}")
    return str(value)


def _network(env: dict[str, Any], path: Path) -> str | None:
    """The network policy the task asks for: ``network``, else ``allow_internet`` (true: ``open``, false:
    ``none``), else None (whatever the run allows)."""
    if "network" in env:
        return _choice(env, "network", path, "[environment]", NETWORK_POLICIES)
    if "allow_internet" in env:
        return "open" if _bool(env, "allow_internet", path) else "none"
    return None


def _warn_unknown(cfg: dict[str, Any], path: Path) -> None:
    """Warn (once per key, whatever the task) about task.toml keys albatross neither reads nor knows."""
    unknown = [k for k in cfg if k not in KNOWN_KEYS[""]]
    for section in ("agent", "verifier", "environment", "solution"):
        table = cfg.get(section)
        if isinstance(table, dict):
            unknown += [f"{section}.{k}" for k in table if k not in KNOWN_KEYS[section]]
    for key in unknown:
        with _warned_lock:
            if key in _warned:
                continue
            _warned.add(key)
        log.warning("%s: unknown key %s (ignored; warned once for every task)", path, key)


def attempt_limits(task: Task, run: Limits) -> Limits:
    """The limits of an attempt at ``task`` in a run whose limits are ``run``: the task's memory, storage,
    CPUs, network policy and build time, never beyond the run's (a ceiling the task cannot raise); a run
    without a CPU limit leaves CPUs unlimited."""
    from albatross.sandbox.egress import narrowest

    return dataclasses.replace(
        run, memory_mb=min(run.memory_mb, task.memory_mb), disk_mb=min(run.disk_mb, task.storage_mb),
        cpus=min(run.cpus, task.cpus) if run.cpus > 0 else run.cpus,
        network=narrowest(run.network, task.network or run.network),
        build_timeout_s=min(task.build_timeout_s, run.build_timeout_s or task.build_timeout_s))


def _read_demo(path: Path) -> list[str] | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TaskFormatError(f"{path}: invalid JSON: {e}") from None
    steps = data.get("steps") if isinstance(data, dict) else None
    if not isinstance(steps, list) or not steps or not all(isinstance(s, str) and s for s in steps):
        raise TaskFormatError(f"{path}: steps must be a non-empty list of non-empty strings")
    if steps[-1] != SUBMIT:
        raise TaskFormatError(f'{path}: steps must end with "{SUBMIT}"')
    return steps


def dockerfile_workdir(dockerfile: Path) -> str:
    """The working directory after the Dockerfile's last ``WORKDIR`` (relative ones are joined)."""
    workdir = "/"
    found = False
    for line in dockerfile.read_text(encoding="utf-8", errors="replace").splitlines():
        parts = line.strip().split(None, 1)
        if len(parts) == 2 and parts[0].upper() == "WORKDIR":
            arg = parts[1].strip().strip("\"'")
            workdir = posixpath.normpath(posixpath.join(workdir, arg))
            found = True
    return workdir if found else DEFAULT_WORKDIR


# ---------------------------------------------------------------------------------------------- write


def write_task(
    task_dir: str | Path,
    *,
    instruction: str,
    task_toml: dict[str, Any],
    env_files: Mapping[str, str | bytes],
    dockerfile: str,
    solve_sh: str,
    test_sh: str,
    test_files: Mapping[str, str | bytes] | None = None,
    demo_steps: list[str] | None = None,
) -> Path:
    """Write a task directory in the Harbor layout; ``env_files`` paths are relative to environment/."""
    task_dir = Path(task_dir)
    _write(task_dir / "instruction.md", instruction)
    _write(task_dir / "task.toml", dumps_toml(task_toml))
    _write(task_dir / "environment" / "Dockerfile", dockerfile)
    for rel, content in env_files.items():
        _write(_under(task_dir / "environment", rel), content)
    _write(task_dir / "solution" / "solve.sh", solve_sh, executable=True)
    if demo_steps is not None:
        _write(task_dir / "solution" / "demo.json", json.dumps({"steps": list(demo_steps)}, indent=2) + "\n")
    _write(task_dir / "tests" / "test.sh", test_sh, executable=True)
    for rel, content in (test_files or {}).items():
        _write(_under(task_dir / "tests", rel), content)
    return task_dir


def _under(root: Path, rel: str) -> Path:
    parts = Path(rel).parts
    if not parts or Path(rel).is_absolute() or ".." in parts:
        raise ValueError(f"{rel!r}: must be a relative path inside {root}")
    return root / rel


def _write(path: Path, content: str | bytes, executable: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    if executable:
        path.chmod(0o755)

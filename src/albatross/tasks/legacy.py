"""Terminal-Bench 0.2 task directories, converted to the Harbor layout as Harbor's mapper converts them.

A Terminal-Bench 0.2 task holds ``task.yaml`` (the instruction and settings), ``Dockerfile`` and
``docker-compose.yaml`` at its root, ``solution.sh`` (or ``solution.yaml``, a list of commands),
``run-tests.sh`` and ``tests/``. The conversion:

- ``task.yaml`` -> ``instruction.md`` and ``task.toml`` ([metadata] author, difficulty, category, tags;
  [agent] timeout_sec = max_agent_timeout_sec (default 360); [verifier] timeout_sec =
  max_test_timeout_sec (default 60; Harbor's mapper reuses the agent timeout here));
- ``solution.sh`` -> ``solution/solve.sh``; ``solution.yaml`` -> a solve.sh running its commands;
- ``run-tests.sh`` -> ``tests/test.sh`` with ``$TEST_DIR`` replaced by ``/tests`` and the reward lines
  appended (1 to /logs/verifier/reward.txt when the script exits 0, else 0); ``tests/`` is kept;
- every other file -> ``environment/``; Terminal-Bench base images are replaced by their public
  equivalents followed by ``WORKDIR /app``; the compose service's ``environment`` and ``working_dir``
  become ``ENV`` and ``WORKDIR`` lines. A compose file with more than one service is refused.

The converted copy is written under the cache directory, keyed by the content of the source.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from albatross.tasks.errors import TaskFormatError
from albatross.tasks.tomlwrite import dumps_toml

HANDLED = {"task.yaml", "solution.yaml", "solution.sh", "run-tests.sh", "tests", "docker-compose.yaml",
           "docker-compose.yml"}
IMAGE_REPLACEMENTS = {
    "ghcr.io/laude-institute/t-bench/python-3-13:20250620": "python:3.13-slim-bookworm",
    "ghcr.io/laude-institute/t-bench/python-3-13:latest": "python:3.13-slim-bookworm",
    "ghcr.io/laude-institute/t-bench/ubuntu-24-04:20250624": "ubuntu:24.04",
    "ghcr.io/laude-institute/t-bench/ubuntu-24-04:latest": "ubuntu:24.04",
}
REWARD_LINES = """

if [ $? -eq 0 ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
"""


def is_legacy_task(path: Path) -> bool:
    return (path / "task.yaml").is_file() and not (path / "task.toml").is_file()


def convert_legacy(source: Path, cache_root: Path) -> Path:
    """The Harbor-layout copy of a Terminal-Bench 0.2 task (written once, under ``cache_root``)."""
    digest = hashlib.sha256(b"albatross-tb-legacy-v1")
    for path in sorted(source.rglob("*")):
        digest.update(f"{path.relative_to(source)}\0".encode())
        if path.is_file():
            digest.update(hashlib.sha256(path.read_bytes()).digest())
    final = cache_root / "tb-legacy" / digest.hexdigest()[:16] / source.name
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    holder = Path(tempfile.mkdtemp(prefix=".build-", dir=final.parent))
    try:
        write_converted(source, holder / source.name)
        try:
            os.rename(holder / source.name, final)
        except OSError:
            if not final.is_dir():  # another process may have won the race
                raise
    finally:
        shutil.rmtree(holder, ignore_errors=True)
    return final


def write_converted(source: Path, target: Path) -> None:
    """Write the Harbor layout of the Terminal-Bench 0.2 task ``source`` into ``target``."""
    config = _read_yaml(source / "task.yaml")
    instruction = config.get("instruction")
    if not isinstance(instruction, str) or not instruction.strip():
        raise TaskFormatError(f"{source / 'task.yaml'}: instruction must be a non-empty string")
    env = target / "environment"
    env.mkdir(parents=True)
    _copy_environment(source, env)
    _write_dockerfile(source, env)
    (target / "instruction.md").write_text(instruction if instruction.endswith("\n") else instruction + "\n")
    (target / "task.toml").write_text(dumps_toml(_task_toml(config, source)))
    _write_solution(source, target / "solution")
    _write_tests(source, target / "tests")


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        import yaml
    except ImportError:  # pragma: no cover - transformers brings PyYAML
        raise TaskFormatError(f"{path}: reading Terminal-Bench 0.2 tasks needs PyYAML") from None
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise TaskFormatError(f"{path}: invalid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise TaskFormatError(f"{path}: must be a mapping")
    return data


def _number(config: dict[str, Any], key: str, default: float, path: Path) -> float:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise TaskFormatError(f"{path}: {key} must be a positive number")
    return float(value)


def _task_toml(config: dict[str, Any], source: Path) -> dict[str, Any]:
    path = source / "task.yaml"
    metadata = {
        "author_name": str(config.get("author_name", "unknown")),
        "author_email": str(config.get("author_email", "unknown")),
        "difficulty": str(config.get("difficulty", "unknown")),
        "category": str(config.get("category", "software_engineering")),
        "tags": [str(t) for t in config.get("tags") or []],
        "converted_from": "terminal-bench-0.2",
    }
    return {
        "version": "1.0",
        "metadata": metadata,
        "verifier": {"timeout_sec": _number(config, "max_test_timeout_sec", 60.0, path)},
        "agent": {"timeout_sec": _number(config, "max_agent_timeout_sec", 360.0, path)},
    }


def _copy_environment(source: Path, env: Path) -> None:
    for item in sorted(source.iterdir()):
        if item.name in HANDLED:
            continue
        if item.is_dir():
            shutil.copytree(item, env / item.name, symlinks=True)
        else:
            shutil.copy2(item, env / item.name)


def _write_dockerfile(source: Path, env: Path) -> None:
    dockerfile = env / "Dockerfile"
    if not dockerfile.is_file():
        raise TaskFormatError(f"{source / 'Dockerfile'}: missing")
    lines = []
    for line in dockerfile.read_text(encoding="utf-8").splitlines():
        words = line.split()
        if words and words[0].upper() == "FROM":
            index = next((i for i, w in enumerate(words) if i > 0 and not w.startswith("--")), len(words))
            if index < len(words) and words[index] in IMAGE_REPLACEMENTS:
                words[index] = IMAGE_REPLACEMENTS[words[index]]
                lines += [" ".join(words), "WORKDIR /app"]
                continue
        lines.append(line)
    lines += _compose_lines(source)
    dockerfile.write_text("\n".join(lines) + "\n")


def _compose_lines(source: Path) -> list[str]:
    compose = next((source / n for n in ("docker-compose.yaml", "docker-compose.yml") if (source / n).is_file()),
                   None)
    if compose is None:
        return []
    services = _read_yaml(compose).get("services") or {}
    if not isinstance(services, dict):
        raise TaskFormatError(f"{compose}: services must be a mapping")
    if len(services) > 1:
        raise TaskFormatError(f"{compose}: services: {len(services)} services; only one container is supported")
    service: dict[str, Any] = next(iter(services.values()), {}) or {}
    lines = []
    env = service.get("environment") or []
    pairs = env.items() if isinstance(env, dict) else (str(e).partition("=")[::2] for e in env)
    for key, value in pairs:
        if key != "TEST_DIR" and "${" not in str(value):
            lines.append(f"ENV {key}={value}")
    workdir = service.get("working_dir")
    if isinstance(workdir, str) and "${" not in workdir:
        lines.append(f"WORKDIR {workdir}")
    return ["", "# Fields moved from docker-compose.yaml", *lines] if lines else []


def _write_solution(source: Path, solution: Path) -> None:
    solution.mkdir()
    if (source / "solution.sh").is_file():
        shutil.copy2(source / "solution.sh", solution / "solve.sh")
    elif (source / "solution.yaml").is_file():
        steps = _read_yaml_list(source / "solution.yaml")
        (solution / "solve.sh").write_text("#!/bin/bash\n\n" + "\n".join(steps) + "\n")
    else:
        return
    (solution / "solve.sh").chmod(0o755)


def _read_yaml_list(path: Path) -> list[str]:
    import yaml

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise TaskFormatError(f"{path}: invalid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(data, list) or not all(isinstance(d, dict) and isinstance(d.get("command"), str)
                                             for d in data):
        raise TaskFormatError(f"{path}: must be a list of entries with a command")
    return [d["command"] for d in data]


def _write_tests(source: Path, tests: Path) -> None:
    if (source / "tests").is_dir():
        shutil.copytree(source / "tests", tests, symlinks=True)
    else:
        tests.mkdir()
    run_tests = source / "run-tests.sh"
    if not run_tests.is_file():
        raise TaskFormatError(f"{run_tests}: missing")
    text = run_tests.read_text(encoding="utf-8")
    text = (text if text.endswith("\n") else text + "\n") + REWARD_LINES
    (tests / "test.sh").write_text(re.sub(r"\$\{?TEST_DIR\}?", "/tests", text))
    (tests / "test.sh").chmod(0o755)

"""What the generator knows of a repository from its files (read on the host, never run there): which files
are tests, which are library code, the pytest configuration file, and the pristine set a verifier puts back.
"""

from __future__ import annotations

import configparser
import io
import os
import re
import sys
import tarfile
from pathlib import Path, PurePosixPath

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

TEST_DIRS = {"tests", "test", "testing"}
CONFIG_FILES = ("pytest.ini", ".pytest.ini", "pyproject.toml", "tox.ini", "setup.cfg")
SKIP_DIRS = {"docs", "doc", "examples", "example", "benchmarks", "benchmark", "bench", "build", "dist", "scripts",
             ".git", "__pycache__", ".tox", ".nox", ".eggs", "tools", "ci"}
EMPTY_CONFIG = "pytest.ini"  # shipped in a task's tests/ when the project has no pytest configuration


def walk_files(root: Path) -> list[Path]:
    """Every regular file under ``root`` (no symbolic link followed or listed), sorted."""
    out = []
    for top, _dirs, files in os.walk(root):
        out += [Path(top) / f for f in files if (Path(top) / f).is_file() and not (Path(top) / f).is_symlink()]
    return sorted(out)


def is_test_path(rel: str) -> bool:
    """A test module or a file of a test directory (``tests/``, ``test/``, ``testing/``, ``test_*.py``,
    ``*_test.py``, ``conftest.py``)."""
    path = PurePosixPath(rel)
    name = path.name
    return (any(p in TEST_DIRS for p in path.parts[:-1]) or name == "conftest.py"
            or (name.endswith(".py") and (name.startswith("test_") or name.endswith("_test.py"))))


def test_file_of(nodeid: str) -> str | None:
    """The test file of a pytest node id, when it is a test module (not a doctest of a library module)."""
    file = nodeid.split("::", 1)[0]
    return file if file.endswith(".py") and is_test_path(file) and "::" in nodeid else None


def library_files(repo: Path) -> list[str]:
    """Python files that are library code: not tests, not set-up, docs, examples or tools."""
    out = []
    for path in walk_files(repo):
        rel = path.relative_to(repo).as_posix()
        if not rel.endswith(".py"):
            continue
        parts = PurePosixPath(rel).parts
        if any(p in SKIP_DIRS or p.startswith(".") for p in parts[:-1]) or is_test_path(rel):
            continue
        if len(parts) == 1 and parts[0] in ("setup.py", "conftest.py", "noxfile.py", "fabfile.py"):
            continue
        out.append(rel)
    return out


def config_file(repo: Path) -> str | None:
    """The file pytest would read its configuration from in ``repo`` (its rules, first match), or None."""
    for name in CONFIG_FILES:
        path = repo / name
        if not path.is_file():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if name in ("pytest.ini", ".pytest.ini"):
            return name
        if name == "pyproject.toml":
            try:
                tool = tomllib.loads(text).get("tool", {})
            except tomllib.TOMLDecodeError:
                continue
            if isinstance(tool, dict) and isinstance(tool.get("pytest"), dict) \
                    and ("ini_options" in tool["pytest"] or tool["pytest"]):
                return name
        else:
            section = "pytest" if name == "tox.ini" else "tool:pytest"
            cfg = configparser.ConfigParser(interpolation=None)
            try:
                cfg.read_string(text)
            except configparser.Error:
                continue
            if cfg.has_section(section):
                return name
    return None


def pristine_files(repo: Path) -> list[str]:
    """What a verifier puts back before it runs the tests: every file of a test directory, every test module,
    every ``conftest.py``, and the pytest configuration files at the root."""
    out = []
    for path in walk_files(repo):
        rel = path.relative_to(repo).as_posix()
        parts = PurePosixPath(rel).parts
        if any(p in (".git", "__pycache__", ".pytest_cache") for p in parts):
            continue
        if is_test_path(rel) or (len(parts) == 1 and parts[0] in CONFIG_FILES):
            out.append(rel)
    return out


def pristine_tar(repo: Path, files: list[str], overrides: dict[str, bytes] | None = None) -> bytes:
    """A deterministic tar of ``files`` (their contents in ``repo``, or ``overrides``): same input, same bytes."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for rel in sorted(set(files) | set(overrides or {})):
            data = (overrides or {}).get(rel)
            if data is None:
                data = (repo / rel).read_bytes()
            info = tarfile.TarInfo(rel)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def module_name(rel: str) -> str:
    """``src/pkg/mod.py`` -> ``pkg.mod``; ``pkg/__init__.py`` -> ``pkg``."""
    parts = list(PurePosixPath(rel).with_suffix("").parts)
    if parts and parts[0] in ("src", "lib"):
        parts = parts[1:]
    if parts and parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def safe_id(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-.") or "task"

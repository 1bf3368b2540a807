"""Building a parent: applying a task's Dockerfile to a layer, through a builder that runs the steps.

Shared by both backends: ``env_key`` (which environments are the same), ``copy_tar`` (what COPY/ADD
put where), and ``apply_dockerfile`` (ARG, ENV, WORKDIR, COPY, RUN in order, against a ``Builder``).
"""

from __future__ import annotations

import hashlib
import io
import os
import shlex
import sys
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from albatross.sandbox.base import ExecResult, SandboxError
from albatross.sandbox.dockerfile import Arg, Copy, Env, From, Instruction, Run, Workdir

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class EnvBuildError(SandboxError):
    """A Dockerfile instruction failed while building an environment (e.g. RUN exited non-zero)."""


@dataclass
class Parent:
    key: str
    layer: str
    env: dict[str, str] = field(default_factory=dict)
    workdir: str | None = None
    image: str | None = None


class Builder(Protocol):
    def mkdirs(self, sandbox_path: str) -> None: ...

    def put_tar(self, data: bytes) -> None: ...

    def run_argv(
        self, argv: list[str], env: dict[str, str], cwd: str, timeout_s: float | None = None
    ) -> ExecResult: ...


def env_key(env_dir: Path | None, salt: str = "") -> str:
    """A hash of every file (path, mode, content or link target) of an environment directory."""
    if env_dir is None:
        return "empty"
    digest = hashlib.sha256(b"albatross-env-v2\0" + salt.encode())
    for path in sorted(Path(env_dir).rglob("*")):
        st = path.lstat()
        digest.update(f"{path.relative_to(env_dir)}\0{st.st_mode:o}\0".encode())
        if path.is_symlink():
            digest.update(os.readlink(path).encode())
        elif path.is_file():
            digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()[:24]


class EnvKeys:
    """``env_key`` cached per directory, recomputed only when a file's size, mode or mtime changed."""

    def __init__(self) -> None:
        self._cache: dict[tuple[str, str], tuple[tuple[object, ...], str]] = {}

    def get(self, env_dir: Path | None, salt: str = "") -> str:
        if env_dir is None:
            return env_key(None, salt)
        stats = [(str(p), p.lstat()) for p in sorted(Path(env_dir).rglob("*"))]
        stamp = tuple((name, st.st_mtime_ns, st.st_size, st.st_mode) for name, st in stats)
        cached = self._cache.get((str(env_dir), salt))
        if cached is not None and cached[0] == stamp:
            return cached[1]
        key = env_key(env_dir, salt)
        self._cache[(str(env_dir), salt)] = (stamp, key)
        return key


SOURCE_MARKER = ".albatross-task-dir"  # in an adapted copy of an environment: the task directory it came from


def task_dir_of(env_dir: Path) -> Path:
    """The task directory an environment belongs to: its parent, or the one an adapted copy names."""
    env_dir = Path(env_dir).resolve()
    try:
        named = (env_dir / SOURCE_MARKER).read_text(encoding="utf-8").strip()
    except OSError:
        named = ""
    return Path(named) if named else env_dir.parent


def task_allows_internet(env_dir: Path | None) -> bool:
    """``[environment] allow_internet`` of the task.toml next to ``env_dir`` (False if absent)."""
    if env_dir is None:
        return False
    try:
        with open(Path(env_dir).parent / "task.toml", "rb") as f:
            value = tomllib.load(f).get("environment", {}).get("allow_internet", False)
    except (OSError, tomllib.TOMLDecodeError, AttributeError):
        return False
    return value is True


def state_script(env: dict[str, str], workdir: str) -> str:
    """The shell state an attempt starts from: exported variables and the working directory."""
    lines = [f"export {k}={shlex.quote(v)}" for k, v in env.items()]
    return "\n".join([*lines, f"cd -- {shlex.quote(workdir)}", ""])


def needs_builder(instructions: list[Instruction]) -> bool:
    return any(isinstance(i, (Copy, Run, Workdir)) for i in instructions)


def apply_dockerfile(
    instructions: list[Instruction], parent: Parent, builder: Builder | None, env_dir: Path, timeout_s: float
) -> None:
    """Apply the Dockerfile to the parent layer through the builder attempt."""
    args: dict[str, str] = {}
    for ins in instructions:
        cwd = parent.workdir or "/"
        if isinstance(ins, Arg):
            args[ins.name] = ins.default or args.get(ins.name, "")
        elif isinstance(ins, Env):
            parent.env.update(ins.pairs)
        elif isinstance(ins, From):
            parent.image = ins.image
        elif builder is None:
            raise EnvBuildError(f"{env_dir / 'Dockerfile'}:{ins.line}: no builder for {type(ins).__name__}")
        elif isinstance(ins, Workdir):
            parent.workdir = os.path.normpath(os.path.join(cwd, ins.path))
            builder.mkdirs(parent.workdir)
        elif isinstance(ins, Copy):
            builder.put_tar(copy_tar(ins, env_dir, cwd))
        elif isinstance(ins, Run):
            _run(ins, parent, builder, args, env_dir, timeout_s)


def _run(ins: Run, parent: Parent, builder: Builder, args: dict[str, str], env_dir: Path, timeout_s: float) -> None:
    env = {"PATH": DEFAULT_PATH, "HOME": "/root", **args, **parent.env}
    argv = ["/bin/bash", "-c", ins.command] if isinstance(ins.command, str) else list(ins.command)
    result = builder.run_argv(argv, env, parent.workdir or "/", timeout_s)
    if result.exit_code != 0:
        what = "timed out" if result.timed_out else f"exited with {result.exit_code}"
        raise EnvBuildError(f"{env_dir / 'Dockerfile'}:{ins.line}: RUN {what}: {result.output[-2000:]}")


def tar_add(tar: tarfile.TarFile, source: Path, dest: str) -> None:
    """Add ``source`` (a file, or a directory's contents) to the tar as ``dest`` (absolute)."""
    arc = dest.strip("/")
    if source.is_dir() and not source.is_symlink():
        if arc:
            tar.addfile(tar.gettarinfo(str(source), arcname=arc))
        for child in sorted(source.iterdir()):
            tar.add(str(child), arcname=f"{arc}/{child.name}" if arc else child.name)
    else:
        tar.add(str(source), arcname=arc)


def dir_tar(host_dir: Path, sandbox_path: str) -> bytes:
    """An uncompressed tar putting the contents of ``host_dir`` at ``sandbox_path``."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar_add(tar, host_dir, sandbox_path)
    return buf.getvalue()


def copy_tar(ins: Copy, env_dir: Path, cwd: str) -> bytes:
    """A tar (names relative to /) holding what COPY/ADD ``ins`` puts into the image."""
    sources = _copy_sources(ins, env_dir)
    dest = os.path.join(cwd, ins.dest)
    into_dir = ins.dest.endswith("/") or ins.dest in (".", "") or len(sources) > 1
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for src in sources:
            if src.is_dir():
                tar_add(tar, src, dest)
            else:
                tar_add(tar, src, os.path.join(dest, src.name) if into_dir else dest)
    return buf.getvalue()


def _copy_sources(ins: Copy, env_dir: Path) -> list[Path]:
    root = env_dir.resolve()
    where = f"{env_dir / 'Dockerfile'}:{ins.line}"
    sources: list[Path] = []
    for pattern in ins.sources:
        matches = sorted(root.glob(pattern)) if any(c in pattern for c in "*?[") else [root / pattern]
        for path in matches:
            if not path.resolve().is_relative_to(root):
                raise EnvBuildError(f"{where}: {pattern} is outside {env_dir}")
            if not path.exists():
                raise EnvBuildError(f"{where}: {ins.keyword} source {pattern} not found in {env_dir}")
            sources.append(path)
    if not sources:
        raise EnvBuildError(f"{where}: nothing matches {list(ins.sources)}")
    return sources

"""Building a parent: applying a task's Dockerfile to a layer, through a builder that runs the steps.

Shared by the backends: ``env_key`` (which environments are the same), ``copy_tar`` (what COPY/ADD
put where, with Docker's rules for directories, globs, existing-directory destinations, ``--chown``,
``--chmod`` and ADD's archive extraction), and ``apply_dockerfile`` (one stage's instructions in order,
against a ``Builder``; earlier stages of a multi-stage build come in as host directories, ``stages``).
"""

from __future__ import annotations

import copy as _copy
import dataclasses
import hashlib
import io
import os
import posixpath
import re
import shlex
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Protocol
from urllib.parse import urlparse

from albatross.sandbox.base import ExecResult, SandboxError
from albatross.sandbox.dockerfile import (
    DEFAULT_PATH,
    URL,
    Arg,
    Command,
    Copy,
    Env,
    From,
    Instruction,
    Run,
    User,
    Workdir,
)

__all__ = ["DEFAULT_PATH", "EnvBuildError", "Parent", "UserIds", "apply_dockerfile", "copy_tar", "resolve_user"]


Fetch = Callable[[str, "IO[bytes]", str], None]  # (url, out, where): ADD <url> under the build's network policy


class EnvBuildError(SandboxError):
    """A Dockerfile instruction failed while building an environment (e.g. RUN exited non-zero)."""


@dataclass(frozen=True)
class UserIds:
    uid: int
    gid: int
    groups: tuple[int, ...]  # supplementary groups (from /etc/group)
    home: str

    @property
    def root(self) -> bool:
        return (self.uid, self.gid, self.groups) == (0, 0, ())


@dataclass
class Parent:
    key: str
    layer: str
    env: dict[str, str] = field(default_factory=dict)
    workdir: str | None = None
    image: str | None = None
    user: str | None = None  # the last USER ("name", "uid", "name:group"); None: root, Docker's default
    entrypoint: list[str] | None = None  # ENTRYPOINT / CMD as Docker records them (argv; recorded only)
    cmd: list[str] | None = None
    ids: UserIds | None = None  # ``user`` resolved in the built image: what every attempt command runs as
    build_s: float = 0.0  # how long its build took (all stages)
    cached: bool = False  # loaded from the layer store (built by an earlier run), not built now

    def attempt_env(self) -> dict[str, str]:
        """The environment attempts start with: PATH, HOME (the USER's, as ``docker exec`` sets it, unless
        ENV sets one), then the image's ENV."""
        home = self.ids.home if self.ids is not None else "/root"
        return {"PATH": DEFAULT_PATH, "HOME": home, **self.env}


class Builder(Protocol):
    def mkdirs(self, sandbox_path: str) -> None: ...

    def put_tar(self, data: bytes) -> None: ...

    def put_stream(self, write: Callable[[IO[bytes]], None]) -> None:
        """Extract the tar that ``write(out)`` writes to ``out`` (a stream: never held whole)."""
        ...

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
    """``env_key`` cached per directory (thread-safe). A directory's files are looked at again (their size, mode
    and mtime) at most every ``RECHECK_S`` seconds, and hashed again only when one changed: the attempts of a group
    fork at once, and each fork needs the key of its task's environment."""

    RECHECK_S = 2.0

    def __init__(self) -> None:
        self._cache: dict[tuple[str, str], tuple[tuple[object, ...], str, float]] = {}
        self._lock = threading.Lock()
        self._locks: dict[tuple[str, str], threading.Lock] = {}

    def get(self, env_dir: Path | None, salt: str = "") -> str:
        if env_dir is None:
            return env_key(None, salt)
        name = (str(env_dir), salt)
        with self._lock:
            lock = self._locks.setdefault(name, threading.Lock())
        with lock:  # one thread hashes a new directory; the others wait for its key
            cached = self._cache.get(name)
            now = time.monotonic()
            if cached is not None and now - cached[2] < self.RECHECK_S:
                return cached[1]
            stamp = _stamp(Path(env_dir))
            key = cached[1] if cached is not None and cached[0] == stamp else env_key(env_dir, salt)
            self._cache[name] = (stamp, key, now)
            return key


def _stamp(root: Path) -> tuple[object, ...]:
    """(path, mtime, size, mode) of every entry under ``root``, in a fixed order (links not followed)."""
    out: list[tuple[object, ...]] = []
    stack = [str(root)]
    while stack:
        with os.scandir(stack.pop()) as entries:
            for entry in entries:
                st = entry.stat(follow_symlinks=False)
                out.append((entry.path, st.st_mtime_ns, st.st_size, st.st_mode))
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
    return tuple(sorted(out))


SOURCE_MARKER = ".albatross-task-dir"  # in an adapted copy of an environment: the task directory it came from
# In an adapted environment: the offline toolkit as one archive, ADDed right after FROM. The local backend builds
# that step once per base image, as a layer every such environment stacks on (as Docker's build cache shares it).
SHARED_ARCHIVE = ".albatross-offline.tar"


def task_dir_of(env_dir: Path) -> Path:
    """The task directory an environment belongs to: its parent, or the one an adapted copy names."""
    env_dir = Path(env_dir).resolve()
    try:
        named = (env_dir / SOURCE_MARKER).read_text(encoding="utf-8").strip()
    except OSError:
        named = ""
    return Path(named) if named else env_dir.parent


def state_script(env: dict[str, str], workdir: str) -> str:
    """The shell state an attempt starts from: exported variables and the working directory."""
    lines = [f"export {k}={shlex.quote(v)}" for k, v in env.items()]
    return "\n".join([*lines, f"cd -- {shlex.quote(workdir)}", ""])


def needs_builder(instructions: list[Instruction]) -> bool:
    return any(isinstance(i, (Copy, Run, Workdir)) for i in instructions)


def apply_dockerfile(
    instructions: list[Instruction],
    parent: Parent,
    builder: Builder | None,
    env_dir: Path,
    timeout_s: float,
    stages: dict[str, Path] | None = None,
    fetch: Fetch | None = None,
    copy_budget: int | None = None,
) -> None:
    """Apply one stage's instructions (or a whole single-stage Dockerfile) to the parent layer through
    the builder attempt, as Docker would.

    ``stages``: for ``COPY --from=<ref>``, the host directory holding the root of each earlier stage
    or image, keyed by stage name, stage index ("0", "1", ...) or image reference (build them first:
    ``dockerfile.split_stages`` and ``required_stages``). ``fetch(url, out, where)``: downloads ``ADD
    <url>`` under the build's network policy (None: the build has no network, and ADD of a URL is an
    ``EnvBuildError`` "needs <host>"). ``copy_budget``: bytes one COPY or ADD may put (a bomb is refused)."""
    froms = [i for i in instructions if isinstance(i, From)]
    if len(froms) > 1:
        raise EnvBuildError(f"{env_dir / 'Dockerfile'}:{froms[1].line}: a multi-stage build: apply each stage "
                            "of dockerfile.split_stages() on its own, passing the earlier ones as `stages`")
    _Applier(parent, builder, env_dir, timeout_s, stages or {}, fetch, copy_budget).apply(instructions)


def _table(text: str) -> list[list[str]]:
    return [row.split(":") for row in text.splitlines() if row.strip() and not row.startswith("#")]


def _find(rows: list[list[str]], key: str, column: int) -> list[str] | None:
    return next((r for r in rows if len(r) > column and r[column] == key), None)


def _group_id(group: str, groups: list[list[str]], what: str) -> int:
    if group.isdigit():
        return int(group)
    row = _find(groups, group, 0)
    if row is None or len(row) < 3 or not row[2].isdigit():
        raise EnvBuildError(f"{what}: no group {group!r} in the image's /etc/group")
    return int(row[2])


def resolve_user(spec: str, passwd: str, group: str) -> UserIds:
    """Docker's ``USER`` lookup in the image's /etc/passwd and /etc/group: a name must exist; a numeric
    uid need not (then gid 0, home /); ``user:group`` sets the primary group; supplementary groups are
    those that list the user."""
    name, _, grp = spec.partition(":")
    users, groups = _table(passwd), _table(group)
    row = _find(users, name, 2 if name.isdigit() else 0)
    if row is None and not name.isdigit():
        raise EnvBuildError(f"USER {spec}: no user {name!r} in the image's /etc/passwd")
    uid = int(name) if name.isdigit() or row is None else int(row[2])  # row is None only for a number
    gid = int(row[3]) if row is not None and len(row) > 3 and row[3].isdigit() else 0
    home = row[5] if row is not None and len(row) > 5 and row[5] else "/"
    if grp:
        gid = _group_id(grp, groups, f"USER {spec}")
    member_of = row[0] if row is not None else name
    extra = tuple(sorted({int(g[2]) for g in groups if len(g) > 3 and g[2].isdigit()
                          and member_of in g[3].split(",") and int(g[2]) != gid}))
    return UserIds(uid, gid, extra, home)


def resolve_chown(spec: str, passwd: str, group: str) -> tuple[int, int]:
    """Docker's ``--chown=user[:group]``: names from the image's files; without a group the gid is the
    uid's number (Docker's rule), not the user's primary group."""
    name, _, grp = spec.partition(":")
    if name.isdigit():
        uid = int(name)
    else:
        row = _find(_table(passwd), name, 0)
        if row is None or len(row) < 3 or not row[2].isdigit():
            raise EnvBuildError(f"--chown={spec}: no user {name!r} in the image's /etc/passwd")
        uid = int(row[2])
    gid = _group_id(grp, _table(group), f"--chown={spec}") if grp else uid
    return uid, gid


_KIND_SCRIPT = 'if [ -d "$1" ]; then echo dir; elif [ -e "$1" ] || [ -L "$1" ]; then echo file; else echo missing; fi'


class _Applier:
    """The state of one stage's build: ARGs in scope, the image's users, whether CMD was set."""

    def __init__(self, parent: Parent, builder: Builder | None, env_dir: Path, timeout_s: float,
                 stages: dict[str, Path], fetch: Fetch | None, copy_budget: int | None) -> None:
        self.parent, self.builder, self.env_dir = parent, builder, Path(env_dir)
        self.timeout_s, self.stages, self.fetch, self.copy_budget = timeout_s, stages, fetch, copy_budget
        self.args: dict[str, str] = {}
        self.cmd_set = False
        self.accounts: tuple[str, str] | None = None  # the image's /etc/passwd and /etc/group (until a RUN)

    def where(self, line: int) -> str:
        return f"{self.env_dir / 'Dockerfile'}:{line}"

    def _builder(self) -> Builder:
        """The builder (``apply`` refuses WORKDIR, COPY and RUN, which need one, when there is none)."""
        if self.builder is None:
            raise EnvBuildError(f"{self.env_dir / 'Dockerfile'}: no builder")
        return self.builder

    def apply(self, instructions: list[Instruction]) -> None:
        for ins in instructions:
            if isinstance(ins, From):
                self.parent.image, self.args = ins.image, {}  # ARGs before FROM are not in the stage
            elif isinstance(ins, Arg):
                if ins.default is not None:
                    self.args[ins.name] = ins.default
            elif isinstance(ins, Env):
                self.parent.env.update(ins.pairs)
            elif isinstance(ins, User):
                self.parent.user = ins.user
            elif isinstance(ins, Command):
                self.command(ins)
            elif isinstance(ins, (Workdir, Copy, Run)):
                if self.builder is None:
                    raise EnvBuildError(f"{self.where(ins.line)}: no builder for {type(ins).__name__}")
                if isinstance(ins, Workdir):
                    self.workdir(ins)
                elif isinstance(ins, Copy):
                    self.copy(ins)
                else:
                    self.run(ins)

    def command(self, ins: Command) -> None:
        if ins.keyword == "CMD":
            self.parent.cmd, self.cmd_set = list(ins.argv), True
        else:  # Docker: ENTRYPOINT drops a CMD this stage did not set itself
            self.parent.entrypoint = list(ins.argv)
            if not self.cmd_set:
                self.parent.cmd = None

    # ---- the image, through the builder --------------------------------------------------------
    def _sh(self, script: str, *args: str) -> ExecResult:
        return self._builder().run_argv(["/bin/sh", "-c", script, "sh", *args], {"PATH": DEFAULT_PATH}, "/", 120)

    def kind(self, path: str) -> str | None:
        """"dir", "file" or "missing" for ``path`` in the image (None if the builder cannot tell)."""
        out = self._sh(_KIND_SCRIPT, path).output.strip()
        return out if out in ("dir", "file", "missing") else None

    def _accounts(self) -> tuple[str, str]:
        if self.accounts is None:
            read = self._sh("cat /etc/passwd; echo '#albatross-group'; cat /etc/group 2>/dev/null")
            passwd, _, group = read.output.partition("#albatross-group\n")
            self.accounts = (passwd, group)
        return self.accounts

    def user_ids(self, line: int) -> UserIds | None:
        """The ids RUN steps run as (None: root, no switch needed)."""
        if not self.parent.user:
            return None
        try:
            ids = resolve_user(self.parent.user, *self._accounts())
        except EnvBuildError as err:
            raise EnvBuildError(f"{self.where(line)}: {err}") from None
        return None if ids.root else ids

    # ---- instructions -----------------------------------------------------------------------------
    def workdir(self, ins: Workdir) -> None:
        path = posixpath.normpath(posixpath.join(self.parent.workdir or "/", ins.path))
        self.parent.workdir = path
        ids = self.user_ids(ins.line)
        if ids is not None and self.kind(path) == "missing":  # BuildKit makes it as the USER
            result = self._sh('mkdir -p "$1" && chown "$2" "$1"', path, f"{ids.uid}:{ids.gid}")
            if result.exit_code != 0:
                raise EnvBuildError(f"{self.where(ins.line)}: WORKDIR {path}: {result.output[-500:]}")
        else:
            self._builder().mkdirs(path)

    def copy(self, ins: Copy) -> None:
        cwd = self.parent.workdir or "/"
        owner = None
        if ins.chown:
            try:
                owner = resolve_chown(ins.chown, *self._accounts())
            except EnvBuildError as err:
                raise EnvBuildError(f"{self.where(ins.line)}: {ins.keyword} {err}") from None
        urls = [s for s in ins.sources if URL.match(s)]
        dest = posixpath.normpath(posixpath.join(cwd, ins.dest))
        kind = self.kind(dest)
        for url in urls:
            self.add_url(ins, url, dest, kind, owner)
        if len(urls) == len(ins.sources) and not ins.inline:
            return
        local = dataclasses.replace(ins, sources=tuple(s for s in ins.sources if not URL.match(s)))
        root = None
        if ins.from_ is not None:
            root = self.stages.get(ins.from_) or self.stages.get(ins.from_.lower())
            if root is None:
                raise EnvBuildError(f"{self.where(ins.line)}: {ins.keyword} --from={ins.from_}: no stage or "
                                    "image of that name was built for this step")
        multi = len(ins.sources) + len(ins.inline) > 1
        self._builder().put_stream(lambda out: write_copy_tar(out, local, self.env_dir, cwd, dest_kind=kind,
                                                           source_root=root, owner=owner, into_dir=multi or None,
                                                           budget=self.copy_budget))

    def add_url(self, ins: Copy, url: str, dest: str, kind: str | None, owner: tuple[int, int] | None) -> None:
        """ADD of a URL: downloaded (as Docker's daemon does, not by a tool of the image) into ``dest``
        or, when that is a directory, under the URL's file name; mode 600 unless --chmod."""
        host = urlparse(url).hostname or url.partition("@")[2].partition(":")[0] or url
        if self.fetch is None:
            raise EnvBuildError(f"{self.where(ins.line)}: ADD {url}: needs {host} (the build has no network)")
        with tempfile.TemporaryFile() as body:  # on disk, not in memory
            self.fetch(url, body, self.where(ins.line))
            size = body.tell()
            if self.copy_budget is not None and size > self.copy_budget:
                raise EnvBuildError(f"{self.where(ins.line)}: ADD {url}: expands past the build's disk limit")
            body.seek(0)
            into = ins.dest.endswith("/") or kind == "dir" or len(ins.sources) + len(ins.inline) > 1
            target = posixpath.join(dest, posixpath.basename(urlparse(url).path) or "index.html") if into else dest
            info = tarfile.TarInfo(target.lstrip("/"))
            info.size, info.mode = size, ins.chmod if ins.chmod is not None else 0o600
            info.uid, info.gid = owner or (0, 0)

            def write(out: IO[bytes]) -> None:
                with tarfile.open(fileobj=out, mode="w|") as tar:
                    tar.addfile(info, body)

            self._builder().put_stream(write)

    def run(self, ins: Run) -> None:
        ids = self.user_ids(ins.line)
        home = ids.home if ids is not None else "/root"
        env = {"PATH": DEFAULT_PATH, "HOME": home, **self.args, **self.parent.env}
        argv = [*ins.shell, ins.command] if isinstance(ins.command, str) else list(ins.command)
        if ids is not None:
            groups = f"--groups={','.join(map(str, ids.groups))}" if ids.groups else "--clear-groups"
            argv = ["setpriv", f"--reuid={ids.uid}", f"--regid={ids.gid}", groups, "--", *argv]
        result = self._builder().run_argv(argv, env, self.parent.workdir or "/", self.timeout_s)
        self.accounts = None  # the step may have added users
        if result.exit_code != 0:
            what = "timed out" if result.timed_out else f"exited with {result.exit_code}"
            if ids is not None and result.exit_code == 127 and "setpriv" in result.output:
                what = f"cannot run as USER {self.parent.user}: the image has no setpriv (util-linux)"
            raise EnvBuildError(f"{self.where(ins.line)}: RUN {what}: {result.output[-2000:]}")


# ------------------------------------------------------------------------------------------ COPY / ADD


def tar_add(tar: tarfile.TarFile, source: Path, dest: str) -> None:
    """Add ``source`` (a file, or a directory's contents) to the tar as ``dest`` (absolute)."""
    _TarWriter(tar, None, None, keep_owner=True).add(source, dest, top=True)


def write_dir_tar(out: IO[bytes], host_dir: Path, sandbox_path: str) -> None:
    """Write an uncompressed tar putting the contents of ``host_dir`` at ``sandbox_path`` to ``out``
    (a stream: nothing is held in memory)."""
    with tarfile.open(fileobj=out, mode="w|") as tar:
        tar_add(tar, host_dir, sandbox_path)


def dir_tar(host_dir: Path, sandbox_path: str) -> bytes:
    """An uncompressed tar putting the contents of ``host_dir`` at ``sandbox_path``."""
    buf = io.BytesIO()
    write_dir_tar(buf, host_dir, sandbox_path)
    return buf.getvalue()


class _TarWriter:
    """Adds host files to a tar with COPY's metadata: owner 0:0 unless ``--chown`` (``owner``), the
    source's mode unless ``--chmod``."""

    def __init__(self, tar: tarfile.TarFile, owner: tuple[int, int] | None, chmod: int | None,
                 keep_owner: bool = False, ignored: DockerIgnore | None = None, budget: int | None = None,
                 where: str = "") -> None:
        self.tar, self.owner, self.chmod, self.keep_owner = tar, owner, chmod, keep_owner
        self.ignored = ignored  # the context's .dockerignore: matching files are not in the context
        self.budget, self.where = budget, where  # bytes of files this COPY/ADD may put, at most (None: any)

    def spend(self, size: int) -> None:
        if self.budget is None:
            return
        self.budget -= size
        if self.budget < 0:
            raise EnvBuildError(f"{self.where}: expands past the build's disk limit")

    def _meta(self, info: tarfile.TarInfo, from_archive: bool = False) -> tarfile.TarInfo:
        if self.owner is not None or not (self.keep_owner or from_archive):
            info.uid, info.gid = self.owner or (0, 0)
            info.uname = info.gname = ""
        if self.chmod is not None and (info.isreg() or info.isdir()):
            info.mode = self.chmod
        return info

    def entry(self, host: Path, arc: str) -> None:
        info = self.tar.gettarinfo(str(host), arcname=arc.strip("/"))
        if info is None:  # a socket: Docker skips it too
            return
        self._meta(info)
        if info.isreg():
            self.spend(info.size)
            with open(host, "rb") as f:
                self.tar.addfile(info, f)
        else:
            self.tar.addfile(info)

    def add(self, source: Path, dest: str, top: bool) -> None:
        """A file as ``dest``, or a directory's contents under ``dest`` (with an entry for ``dest``
        itself when ``top``: Docker creates it with the source directory's mode)."""
        if not (source.is_dir() and not source.is_symlink()):
            self.entry(source, dest)
            return
        if top and dest.strip("/"):
            self.entry(source, dest)
        for dirpath, dirnames, filenames in os.walk(source):
            dirnames.sort()
            rel = os.path.relpath(dirpath, source)
            base = dest if rel == "." else posixpath.join(dest, rel)
            for name in sorted([*dirnames, *filenames]):
                if self.ignored is None or not self.ignored.excludes(Path(dirpath) / name):
                    self.entry(Path(dirpath) / name, posixpath.join(base, name))
                elif name in dirnames and not self.ignored.exceptions:  # nothing inside can come back
                    dirnames.remove(name)

    def inline(self, content: str, dest: str) -> None:
        data = content.encode()
        info = tarfile.TarInfo(dest.strip("/"))
        info.size, info.mode = len(data), 0o644
        self.spend(info.size)
        self.tar.addfile(self._meta(info), io.BytesIO(data))

    def archive(self, source: Path, dest: str) -> None:
        """ADD of a local tar (plain, gzip, bzip2 or xz): its members under ``dest``, owners kept; read
        as a stream, member by member, within the budget (a bomb is refused, never held in memory);
        device nodes are left out (the sandbox would not make them anyway)."""
        with tarfile.open(source, "r|*") as arch:
            for member in arch:
                name = posixpath.normpath(member.name.lstrip("/"))
                if name == "." or name.startswith("..") or member.ischr() or member.isblk():
                    continue
                info = _copy.copy(member)
                info.name = posixpath.join(dest, name).lstrip("/")
                if member.islnk():
                    info.linkname = posixpath.join(dest, posixpath.normpath(member.linkname.lstrip("/"))).lstrip("/")
                self._meta(info, from_archive=True)
                if member.isreg():
                    self.spend(member.size)
                self.tar.addfile(info, arch.extractfile(member) if member.isreg() else None)


def is_archive(path: Path) -> bool:
    """True for a tar archive, plain or compressed with gzip, bzip2 or xz (what ADD extracts)."""
    try:
        return path.is_file() and path.stat().st_size > 0 and tarfile.is_tarfile(path)
    except (OSError, tarfile.TarError, EOFError):
        return False


def copy_tar(ins: Copy, env_dir: Path, cwd: str, dest_kind: str | None = None, source_root: Path | None = None,
             owner: tuple[int, int] | None = None, into_dir: bool | None = None) -> bytes:
    """``write_copy_tar`` into memory (small contexts: the process backend, the leakage gate)."""
    buf = io.BytesIO()
    write_copy_tar(buf, ins, env_dir, cwd, dest_kind, source_root, owner, into_dir)
    return buf.getvalue()


def write_copy_tar(out: IO[bytes], ins: Copy, env_dir: Path, cwd: str, dest_kind: str | None = None,
                   source_root: Path | None = None, owner: tuple[int, int] | None = None,
                   into_dir: bool | None = None, budget: int | None = None) -> None:
    """Write to the stream ``out`` a tar (names relative to /) holding what COPY/ADD ``ins`` puts into the
    image, by Docker's rules: a directory source gives its contents; a file goes inside ``dest`` when
    ``dest`` ends in "/", is an existing directory (``dest_kind`` "dir") or there are several sources,
    else it becomes ``dest``; ADD extracts a local tar archive into ``dest``. Sources are read from
    ``source_root`` (an earlier stage's root, for --from) or ``env_dir``; ``dest_kind`` None: unknown
    (treated as missing). ``budget``: bytes of files it may hold (``EnvBuildError`` past it)."""
    where = f"{env_dir / 'Dockerfile'}:{ins.line}"
    if ins.from_ is not None and source_root is None:
        raise EnvBuildError(f"{where}: {ins.keyword} --from={ins.from_}: the stage or image is not built here")
    urls = [s for s in ins.sources if URL.match(s)]
    if urls:
        raise EnvBuildError(f"{where}: ADD {urls[0]}: needs {urlparse(urls[0]).hostname or urls[0]}")
    ignored = DockerIgnore.of(env_dir) if source_root is None else None
    sources = _copy_sources(ins, source_root or env_dir, where, ignored)
    dest = posixpath.normpath(posixpath.join(cwd, ins.dest))
    many = len(sources) + len(ins.inline) > 1
    into = into_dir or many or ins.dest.endswith(("/", "/.")) or ins.dest == "." or dest_kind == "dir"
    with tarfile.open(fileobj=out, mode="w|") as tar:
        writer = _TarWriter(tar, owner, ins.chmod, keep_owner=False, ignored=ignored, budget=budget,
                            where=f"{where}: {ins.keyword}")
        for name, content in ins.inline:
            writer.inline(content, posixpath.join(dest, name) if into else dest)
        for name, path in sources:
            if path.is_dir():
                writer.add(path, dest, top=dest_kind != "dir")
            elif ins.keyword == "ADD" and ins.from_ is None and is_archive(path):
                writer.archive(path, dest)
            else:
                writer.add(path, posixpath.join(dest, name) if into else dest, top=False)


def resolve_in_root(root: Path, path: str, where: str = "") -> Path:
    """``path`` (absolute or relative) inside ``root`` as the image would resolve it: ``..`` stops at
    the root and symbolic links are followed with ``root`` as "/", so nothing outside is ever read."""
    parts = [p for p in path.split("/") if p not in ("", ".")]
    resolved: list[str] = []
    hops = 0
    while parts:
        part = parts.pop(0)
        if part == "..":
            resolved = resolved[:-1]
            continue
        candidate = root.joinpath(*resolved, part)
        if candidate.is_symlink():
            hops += 1
            if hops > 40:
                raise EnvBuildError(f"{where}: too many levels of symbolic links in {path}")
            target = os.readlink(candidate)
            resolved = [] if target.startswith("/") else resolved
            parts = [p for p in target.split("/") if p not in ("", ".")] + parts
            continue
        resolved.append(part)
    return root.joinpath(*resolved)


def _copy_sources(ins: Copy, root: Path, where: str, ignored: DockerIgnore | None = None) -> list[tuple[str, Path]]:
    """(name, host path) of every source: globs expanded (Docker's ``*``, ``?``, ``[...]``), each path
    resolved inside ``root``; what .dockerignore excludes is not there."""
    root = Path(root).resolve()
    sources: list[tuple[str, Path]] = []
    for pattern in ins.sources:
        if any(c in pattern for c in "*?["):
            matches = [str(m.relative_to(root)) for m in sorted(root.glob(pattern.lstrip("/")))
                       if ignored is None or not ignored.excludes(m)]
            if not matches:
                raise EnvBuildError(f"{where}: {ins.keyword} {pattern}: no source files were specified "
                                    f"(nothing matches in {root})")
        else:
            matches = [pattern]
        for rel in matches:
            path = resolve_in_root(root, rel, where)
            if not path.exists() or (ignored is not None and ignored.excludes(path) and path != root):
                raise EnvBuildError(f"{where}: {ins.keyword} source {rel} not found in {root}")
            sources.append((posixpath.basename(posixpath.normpath("/" + rel)) or path.name, path))
    return sources


class DockerIgnore:
    """A build context's ``.dockerignore``, with Docker's rules: one pattern a line (``#`` comments),
    ``*``, ``?``, ``[...]`` within a path element and ``**`` across them, ``!`` re-includes; the last
    matching pattern decides, and a pattern that matches a directory excludes what is inside it."""

    def __init__(self, root: Path, patterns: list[tuple[bool, re.Pattern[str]]]) -> None:
        self.root, self.patterns = Path(root).resolve(), patterns

    @classmethod
    def of(cls, context: Path) -> DockerIgnore | None:
        try:
            text = (Path(context) / ".dockerignore").read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            return None
        patterns = []
        for raw in text.splitlines():
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            negate = line.startswith("!")
            cleaned = posixpath.normpath(line[1:].strip() if negate else line).lstrip("/")
            if cleaned and cleaned != ".":
                patterns.append((negate, re.compile(_glob_regex(cleaned))))
        return cls(context, patterns) if patterns else None

    @property
    def exceptions(self) -> bool:
        """Some ``!`` pattern may bring back a file inside an excluded directory."""
        return any(negate for negate, _ in self.patterns)

    def excludes(self, path: Path) -> bool:
        """Whether the context file ``path`` (a host path under the context) is left out."""
        try:
            rel = Path(path).relative_to(self.root).as_posix()
        except ValueError:
            return False
        parts = rel.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        excluded = False
        for negate, pattern in self.patterns:
            if any(pattern.fullmatch(p) for p in prefixes):
                excluded = not negate
        return excluded


def _glob_regex(pattern: str) -> str:
    """Docker's (Go filepath.Match plus ``**``) pattern as a regular expression."""
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**", i):
            i += 2
            if pattern.startswith("/", i):
                out.append("(?:.*/)?")
                i += 1
            else:
                out.append(".*")
            continue
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            end = pattern.find("]", i + 1)
            if end < 0:
                out.append(re.escape(c))
            else:
                body = pattern[i + 1 : end]
                out.append("[" + ("^" + body[1:] if body.startswith("^") else body) + "]")
                i = end
        elif c == "\\" and i + 1 < len(pattern):
            i += 1
            out.append(re.escape(pattern[i]))
        else:
            out.append(re.escape(c))
        i += 1
    return "".join(out)

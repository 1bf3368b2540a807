"""Directories as values, for Ray clusters without a shared filesystem.

A model directory, a weight version, a checkpoint or a task's directories travel between Ray nodes as a
:class:`Tree` (its regular files, their executable bit and content) through Ray's object store, and are written
into a node-local directory on the node that receives them (:func:`node_root`). Nothing here imports Ray: the
Ray backend puts and gets the values.

- :func:`pack_tree` reads a directory (regular files only; symlinks, devices, fifos and sockets are skipped,
  never followed);
- :func:`write_tree` writes one where a reader never sees it half-written (a temporary sibling, then a rename),
  refusing any path that would leave the destination;
- :func:`materialize` writes it once per content into a cache (``<cache>/<digest>``), whoever else writes the
  same content at the same time;
- :func:`task_roots` and :func:`localize_task` name the directories a task refers to and rewrite its paths to
  their local copies.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import os
import re
import secrets
import shutil
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from albatross.cache import cache_root
from albatross.tasks.format import Task

EXECUTABLE = 0o755
PLAIN = 0o644
NODE_DIR_ENV = "ALBATROSS_NODE_DIR"
_DIGEST = re.compile(r"[0-9a-f]{16,64}")
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # NONBLOCK: a fifo swapped in never hangs
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_TAKEN = (errno.EEXIST, errno.ENOTEMPTY)  # rename onto a directory that holds files
_REPLACE_TRIES = 8


# ----------------------------------------------------------------------------------------------- trees


def tree_digest(files: tuple[tuple[str, int, bytes], ...]) -> str:
    """sha256 (hex) over the (path, mode, sha256 of content) entries sorted by path: equal files, equal digest."""
    total = hashlib.sha256(b"albatross-tree-1\0")
    for path, mode, content in sorted(files, key=lambda f: f[0]):
        total.update(path.encode("utf-8", "surrogateescape") + b"\0" + f"{mode:o}".encode() + b"\0")
        total.update(hashlib.sha256(content).digest())
    return total.hexdigest()


@dataclass(frozen=True)
class Tree:
    """The regular files of a directory as one value: (relative POSIX path, mode 0o755 or 0o644, content),
    kept sorted by path. ``digest`` is computed from them (:func:`tree_digest`), never given: equal trees have
    equal files."""

    files: tuple[tuple[str, int, bytes], ...]
    digest: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "files", tuple(sorted(self.files, key=lambda f: f[0])))
        object.__setattr__(self, "digest", tree_digest(self.files))


def tree_bytes(tree: Tree) -> int:
    """The total size of the tree's file contents."""
    return sum(len(content) for _, _, content in tree.files)


def pack_tree(root: Path, only: Callable[[str], bool] | None = None) -> Tree:
    """The regular files under ``root`` (those whose relative POSIX path ``only`` accepts, when given). Symlinks,
    devices, fifos and sockets are skipped and never followed; a file keeps 0o755 when any execute bit is set,
    else 0o644. A symlinked ``root`` or one that is no directory raises ValueError."""
    try:
        fd = os.open(root, _DIR_FLAGS)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise ValueError(f"{root}: not a directory (a symlinked root is refused)") from None
        raise
    try:
        files = list(_walk(fd, "", only or _everything))
    finally:
        os.close(fd)
    return Tree(tuple(files))


def _everything(path: str) -> bool:
    return True


def _walk(dir_fd: int, prefix: str, only: Callable[[str], bool]) -> Iterator[tuple[str, int, bytes]]:
    """The regular files below the open directory ``dir_fd``, opened relative to it (never through a link)."""
    with os.scandir(dir_fd) as it:
        entries = sorted(it, key=lambda e: e.name)
    for entry in entries:
        rel = prefix + entry.name
        if entry.is_dir(follow_symlinks=False):
            sub = _open_below(entry.name, _DIR_FLAGS, dir_fd)
            if sub is not None:
                try:
                    yield from _walk(sub, rel + "/", only)
                finally:
                    os.close(sub)
        elif entry.is_file(follow_symlinks=False) and only(rel):
            read = _read_regular(entry.name, dir_fd)
            if read is not None:
                yield rel, read[0], read[1]


def _open_below(name: str, flags: int, dir_fd: int) -> int | None:
    """``name`` opened in ``dir_fd``, or None when it turned into a link (or vanished) since it was listed."""
    try:
        return os.open(name, flags, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENOENT, errno.ENXIO):
            return None
        raise


def _read_regular(name: str, dir_fd: int) -> tuple[int, bytes] | None:
    fd = _open_below(name, _READ_FLAGS, dir_fd)
    if fd is None:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # swapped for a fifo or device after it was listed
            return None
        with os.fdopen(os.dup(fd), "rb") as f:
            content = f.read()
    finally:
        os.close(fd)
    return (EXECUTABLE if st.st_mode & 0o111 else PLAIN), content


# ----------------------------------------------------------------------------------------------- write


def check_paths(tree: Tree) -> None:
    """Raise ValueError naming the first path of ``tree`` that could leave its destination (absolute, ``..``,
    an empty or ``.`` part, a NUL), the first mode that is neither 0o755 nor 0o644, or a path given twice or
    both as a file and as a directory."""
    files: set[str] = set()
    dirs: set[str] = set()
    for path, mode, _ in tree.files:
        parts = path.split("/")
        if not path or "\0" in path or path.startswith("/") or any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"{path!r}: not a safe relative path (absolute, '..', an empty or '.' part, or NUL)")
        if mode not in (EXECUTABLE, PLAIN):
            raise ValueError(f"{path!r}: mode {mode:#o} is neither 0o755 nor 0o644")
        if path in files:
            raise ValueError(f"{path!r}: given twice")
        files.add(path)
        dirs.update("/".join(parts[:i]) for i in range(1, len(parts)))
    clash = files & dirs
    if clash:
        raise ValueError(f"{min(clash)!r}: both a file and a directory")


def write_tree(tree: Tree, dest: Path) -> Path:
    """Write ``tree`` at ``dest`` (replacing what is there) so that a reader sees the old directory, none, or
    the complete new one, never a half-written one. Raises ValueError for an unsafe path, before writing."""
    dest = Path(dest)
    tmp = _write_temporary(tree, dest)
    try:
        _rename_replacing(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def materialize(tree: Tree, cache: Path) -> Path:
    """``<cache>/<tree.digest>`` holding ``tree``: written once, then reused as it is. Concurrent callers (threads
    or processes) with the same tree all get the one complete directory."""
    if not _DIGEST.fullmatch(tree.digest):
        raise ValueError(f"{tree.digest!r}: not a tree digest")
    final = Path(cache) / tree.digest
    try:
        if stat.S_ISDIR(os.lstat(final).st_mode):
            return final  # renamed in whole by an earlier write
        return write_tree(tree, final)  # something else squats on the name
    except FileNotFoundError:
        pass
    tmp = _write_temporary(tree, final)
    try:
        os.rename(tmp, final)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if e.errno not in _TAKEN:  # taken: another writer won the race with the same content, theirs is complete
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _write_temporary(tree: Tree, dest: Path) -> Path:
    """``tree`` written into a fresh hidden sibling of ``dest``; every file created anew, never through a link."""
    check_paths(tree)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}-{secrets.token_hex(6)}"
    os.mkdir(tmp, 0o755)
    try:
        made: set[str] = set()
        for path, mode, content in tree.files:
            parts = path.split("/")
            for i in range(1, len(parts)):
                sub = "/".join(parts[:i])
                if sub not in made:
                    os.mkdir(tmp / sub, 0o755)
                    made.add(sub)
            fd = os.open(tmp / path, _CREATE_FLAGS, mode)
            try:
                with os.fdopen(os.dup(fd), "wb") as f:
                    f.write(content)
                os.fchmod(fd, mode)  # the umask narrowed the creation mode
            finally:
                os.close(fd)
        os.chmod(tmp, 0o755)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp


def _rename_replacing(tmp: Path, dest: Path) -> None:
    """Rename ``tmp`` onto ``dest``; an existing ``dest`` is renamed aside first and removed after."""
    for _ in range(_REPLACE_TRIES):
        try:
            os.rename(tmp, dest)
            return
        except OSError as e:
            if e.errno not in (*_TAKEN, errno.ENOTDIR):
                raise
        old = dest.parent / f".{dest.name}.old-{os.getpid()}-{secrets.token_hex(6)}"
        try:
            os.rename(dest, old)
        except FileNotFoundError:
            continue  # another writer moved it aside first
        try:
            os.rename(tmp, dest)
        except OSError as e:
            if e.errno not in (*_TAKEN, errno.ENOTDIR):
                os.rename(old, dest)  # put the old one back
                raise
            _remove(old)  # another writer put theirs in meanwhile: try again, replacing theirs
            continue
        _remove(old)
        return
    raise OSError(errno.EBUSY, f"{dest}: could not replace it ({_REPLACE_TRIES} writers raced)")


def _remove(path: Path) -> None:
    if stat.S_ISDIR(os.lstat(path).st_mode):
        shutil.rmtree(path)
    else:
        path.unlink()


# ----------------------------------------------------------------------------------------------- nodes


def node_root() -> Path:
    """Where this node keeps what was shipped to it: ``$ALBATROSS_NODE_DIR``, else ``<cache>/ray-node``. Tests
    give each Ray node its own value so that nothing is shared between the nodes' workers, as on machines
    without a shared filesystem."""
    value = os.environ.get(NODE_DIR_ENV)
    return Path(value) if value else cache_root() / "ray-node"


# ----------------------------------------------------------------------------------------------- tasks


def _task_paths(task: Task) -> dict[str, Path]:
    """Every directory field of ``task`` (``offline.<name>`` for the adapted environment's), by name."""
    paths: dict[str, Path] = {"path": task.path, "env_dir": task.env_dir, "tests_dir": task.tests_dir,
                              "solution_dir": task.solution_dir}
    if task.source_env_dir is not None:
        paths["source_env_dir"] = task.source_env_dir
    if task.source_path is not None:
        paths["source_path"] = task.source_path
    if task.offline is not None:
        paths["offline.env_dir"] = task.offline.env_dir
        paths["offline.source_dir"] = task.offline.source_dir
    return paths


def _where(path: Path) -> Path:
    """``path`` resolved when it exists here, else made absolute and normalized by its text alone (on a node that
    received a task, its paths name another machine's files)."""
    if path.exists():
        return path.resolve()
    return Path(os.path.normpath(os.path.abspath(path)))


def task_roots(task: Task) -> list[Path]:
    """The fewest directories (resolved) that hold every directory the task refers to: its own ``path``, and an
    adapted environment copy or a converted task's source outside it. In the order the task names them."""
    seen = list(dict.fromkeys(p.resolve() for p in _task_paths(task).values()))
    return [p for p in seen if not any(p != q and p.is_relative_to(q) for q in seen)]


def localize_task(task: Task, trees: dict[str, Path]) -> Task:
    """A copy of ``task`` whose directory fields point into local copies: ``trees`` maps each root (``str`` of a
    :func:`task_roots` entry) to the local directory that holds its files. A field is placed by its root (the
    deepest that holds it); one that no root holds raises ValueError naming it.

    Where the task's files exist, its paths are resolved first; on a node that received the task they are taken
    as written. To ship a task, ship ``resolve_task(task)`` (absolute, resolved paths), so that the receiving node
    places every field exactly as the sending one would."""
    roots = sorted(((Path(k), Path(v)) for k, v in trees.items()), key=lambda kv: len(kv[0].parts), reverse=True)

    def at(name: str, path: Path) -> Path:
        here = _where(path)
        for root, dest in roots:
            if here.is_relative_to(root):
                return dest / here.relative_to(root)
        raise ValueError(f"task {task.id}: {name} {path} is under none of {sorted(trees)}")

    path, env_dir = at("path", task.path), at("env_dir", task.env_dir)
    tests_dir, solution_dir = at("tests_dir", task.tests_dir), at("solution_dir", task.solution_dir)
    source_env_dir = None if task.source_env_dir is None else at("source_env_dir", task.source_env_dir)
    source_path = None if task.source_path is None else at("source_path", task.source_path)
    offline = task.offline
    if offline is not None:
        offline = dataclasses.replace(offline, env_dir=at("offline.env_dir", offline.env_dir),
                                      source_dir=at("offline.source_dir", offline.source_dir))
    return dataclasses.replace(task, path=path, env_dir=env_dir, tests_dir=tests_dir, solution_dir=solution_dir,
                               source_env_dir=source_env_dir, source_path=source_path, offline=offline)


def resolve_task(task: Task) -> Task:
    """``task`` with every directory field absolute and resolved (where it was loaded): what to ship to a node."""
    return localize_task(task, {str(root): root for root in task_roots(task)})

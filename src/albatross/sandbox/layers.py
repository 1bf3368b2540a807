"""Where built parents live: on the host's disk, as Docker keeps its layers, cached by content hash.

A parent (a task environment's built layer over its base image) is a directory of this store:
``<root>/<key>/s<N>/layer`` for each stage N the last one builds on, and ``parent.json`` (the image's
env, workdir, USER and its ids, CMD/ENTRYPOINT, and the stack of lower directories under the last
layer: earlier stages' layers and the base image, by key and path). ``key`` is the environment's
content hash (every file of its directory, the bases' recipe keys, hidden paths, the build's network
policy, the user-namespace mapping): the same environment is built once and reused by every later run
(``LocalBackend(layer_cache=True)``, the command line's default, ``[sandbox] layer_cache``), or once per
backend (a directory of its own, removed when it closes).

A build fills ``<key>.tmp-<pid>-<n>`` and is renamed into place with its record written last, under a
lock file (``<key>.lock``) that makes concurrent processes build it once; a failed build leaves
nothing. A process using a parent holds a shared lock on ``<key>.use`` (``hold``) until it closes; the
record's modification time is when a process last loaded it. ``prune`` removes parents no process holds,
least recently used first, and a persistent store with ``max_bytes`` prunes itself (in the background, to
``LOW_WATER`` of that size) when a build takes it over (``[sandbox] layer_cache_max_gb``). The directory is root's (mode 700): its files belong to the
sandbox's uids, set-id bits included. Builds use the host's disk as Docker's do; ``min_free_mb`` is the free space a build must leave
(a RUN step that goes below it is stopped: ``DiskGuard``).
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import logging
import os
import re
import shutil
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from albatross.cache import images_root

_log = logging.getLogger(__name__)

FORMAT = "1"
RECORD = "parent.json"
USE = ".use"  # <key>.use: held shared by every process using the parent, exclusively by prune
_TMP = re.compile(r"^(?:.+\.tmp|run)-(\d+)-")


def store_root() -> Path:
    """``$ALBATROSS_IMAGES/layers`` (default ``~/.cache/albatross/layers``)."""
    return images_root() / "layers"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class LayerStore:
    """Built parents on disk: persistent (``persistent=True``: shared by every run on this machine) or
    private to one backend (removed by ``close``)."""

    def __init__(self, persistent: bool, root: Path | None = None, max_bytes: int = 0) -> None:
        self.persistent, self.max_bytes = persistent, max_bytes
        base = Path(root) if root is not None else store_root()
        base.mkdir(parents=True, exist_ok=True)
        os.chmod(base, 0o700)
        self._remove_stale(base)
        self.root = base if persistent else base / f"run-{os.getpid()}-{os.urandom(3).hex()}"
        self.root.mkdir(mode=0o700, exist_ok=True)
        self._count = itertools.count()
        self._lock = threading.Lock()
        self._held: dict[str, int] = {}  # key -> descriptor of <key>.use, locked shared until close

    @staticmethod
    def _remove_stale(base: Path) -> None:
        """Half-built layers and private stores of processes that are gone."""
        with contextlib.suppress(OSError):
            for entry in base.iterdir():
                match = _TMP.match(entry.name)
                if match and not _pid_alive(int(match.group(1))):
                    shutil.rmtree(entry, ignore_errors=True)

    def path(self, key: str) -> Path:
        return self.root / key

    @contextlib.contextmanager
    def locked(self, key: str) -> Iterator[None]:
        """Hold ``key``'s lock file: another process building it is waited for."""
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)  # a private store comes back after close
        fd = lock_file(self.root / f"{key}.lock", fcntl.LOCK_EX)
        try:
            yield
        finally:
            os.close(fd)

    def hold(self, key: str) -> None:
        """Mark ``key`` in use by this process until ``close`` (a shared lock on ``<key>.use``): ``prune`` leaves
        it alone. Waits while a prune is removing it (then it is gone, and is built again)."""
        with self._lock:
            if key in self._held:
                return
            self._held[key] = lock_file(self.root / f"{key}{USE}", fcntl.LOCK_SH)

    def load(self, key: str) -> dict[str, Any] | None:
        """The record of a built parent ``key`` (None when there is none, or it is unreadable); marks it used
        now (the record's modification time orders ``prune``)."""
        path = self.path(key) / RECORD
        record = read_record(path)
        if record is not None:
            with contextlib.suppress(OSError):
                os.utime(path)
        return record

    def new_build(self, key: str) -> Path:
        """A fresh directory to build ``key`` in (``commit`` or ``discard`` it)."""
        path = self.root / f"{key}.tmp-{os.getpid()}-{next(self._count)}"
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(mode=0o700)
        return path

    def commit(self, build: Path, key: str, record: dict[str, Any]) -> Path:
        """Write the record into ``build`` and rename it into place as ``key``; returns its path."""
        os.sync()  # builds write without an fsync per file (dpkg's unsafe-io): durable before it counts as built
        record = {**record, "format": FORMAT, "bytes": tree_bytes(build)}
        (build / RECORD).write_text(json.dumps(record) + "\n")
        final = self.path(key)
        if final.exists():  # an older, unreadable one: replaced
            old = self.root / f"{key}.tmp-{os.getpid()}-old{next(self._count)}"
            final.rename(old)
            shutil.rmtree(old, ignore_errors=True)
        build.rename(final)
        if self.persistent and self.max_bytes:
            self.hold(key)  # the parent just built is about to be used: never pruned for the cap
            _keep_under(self.root, self.max_bytes, record["bytes"])
        return final

    @staticmethod
    def discard(build: Path) -> None:
        shutil.rmtree(build, ignore_errors=True)

    def close(self) -> None:
        """Parents held are released; a private store is removed, a persistent one stays."""
        with self._lock:
            held, self._held = self._held, {}
        for fd in held.values():
            os.close(fd)
        if not self.persistent:
            shutil.rmtree(self.root, ignore_errors=True)


def free_mb(path: Path) -> int:
    """Free space (MiB) of the file system holding ``path``, for root."""
    st = os.statvfs(path)
    return (st.f_bavail * st.f_frsize) >> 20


def lock_file(path: Path, op: int) -> int:
    """A descriptor of ``path`` (created if missing) locked with ``flock(op)``, once the lock is on the file that
    is at ``path`` now (``prune`` unlinks the lock files of what it removes)."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, op)
            with contextlib.suppress(FileNotFoundError):
                if os.stat(path).st_ino == os.fstat(fd).st_ino:
                    return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


def read_record(path: Path) -> dict[str, Any] | None:
    """A parent's record (None when missing, unreadable or of another format)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("format") == FORMAT else None


def tree_bytes(root: Path) -> int:
    """Disk space of the files under ``root`` (allocated blocks; a file with several links counted once;
    links never followed)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for top, dirs, files in os.walk(root):
        for name in (*dirs, *files):
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(top, name))
                if st.st_nlink > 1 and not stat.S_ISDIR(st.st_mode):
                    if (st.st_dev, st.st_ino) in seen:
                        continue
                    seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


def parents(root: Path | None = None) -> list[dict[str, Any]]:
    """The persistent store's built parents, least recently used first: ``key``, ``path``, ``bytes`` and
    ``used`` (when a process last loaded it, epoch seconds). A record without its size (an older store) gets it
    now, written back."""
    root = Path(root) if root is not None else store_root()
    found = []
    for entry in root.iterdir() if root.is_dir() else []:
        path = entry / RECORD
        record = read_record(path) if "." not in entry.name else None
        if record is None:
            continue
        size = record.get("bytes")
        if not isinstance(size, int):
            size = tree_bytes(entry)
            with contextlib.suppress(OSError):
                used = path.stat().st_mtime
                tmp = entry / f"{RECORD}.tmp-{os.getpid()}"
                tmp.write_text(json.dumps({**record, "bytes": size}) + "\n")
                os.replace(tmp, path)
                os.utime(path, (used, used))
        with contextlib.suppress(OSError):
            found.append({"key": entry.name, "path": str(entry), "bytes": size, "used": path.stat().st_mtime})
    return sorted(found, key=lambda p: (p["used"], p["key"]))


def disk_usage(root: Path | None = None) -> dict[str, Any]:
    """The persistent store's parents and their sizes (``albatross sandbox image list``)."""
    root = Path(root) if root is not None else store_root()
    return {"root": str(root), "parents": [{**p, "mb": round(p["bytes"] / (1 << 20), 1)} for p in parents(root)]}


def prune(root: Path | None = None, *, max_bytes: int | None = None, unused_s: float | None = None,
          everything: bool = False, dry_run: bool = False,
          log: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Remove built parents that no process holds (``LayerStore.hold``), least recently used first: all of them
    (``everything``), those not loaded for ``unused_s`` seconds, and then more until the store holds at most
    ``max_bytes``. ``dry_run``: say what would go. Returns ``removed`` (keys), ``freed_bytes``, ``kept``,
    ``kept_bytes`` and ``in_use`` (parents held, which were due to go)."""
    import time

    root = Path(root) if root is not None else store_root()
    found = parents(root)
    total = sum(p["bytes"] for p in found)
    now = time.time()
    removed: list[str] = []
    freed, in_use = 0, 0
    for parent in found:
        due = (everything or (unused_s is not None and now - parent["used"] >= unused_s)
               or (max_bytes is not None and total - freed > max_bytes))
        if not due:
            continue
        if not _remove_unheld(root, parent["key"], dry_run):
            in_use += 1
            continue
        removed.append(parent["key"])
        freed += parent["bytes"]
    if removed:
        log(f"layer cache {root}: {'would remove' if dry_run else 'removed'} {len(removed)} built environments "
            f"({freed / (1 << 30):.2f} GiB); {len(found) - len(removed)} kept ({(total - freed) / (1 << 30):.2f} GiB)")
    return {"root": str(root), "removed": removed, "freed_bytes": freed, "kept": len(found) - len(removed),
            "kept_bytes": total - freed, "in_use": in_use}


_RESCAN_S = 600.0
LOW_WATER = 0.9  # a store over its cap is pruned to this share of it, so the next builds do not prune again
_estimates: dict[Path, tuple[int, float]] = {}  # store -> (its size as last scanned plus what this process added, when)
_pruning: dict[Path, threading.Thread] = {}
_estimates_lock = threading.Lock()


def _keep_under(root: Path, max_bytes: int, added: int) -> None:
    """After a build of ``added`` bytes: prune the store when it may be over ``max_bytes``, in the background (a
    build, and the forks waiting for it, never wait for a prune). The store is scanned (a record read per parent)
    when this process has not in ``_RESCAN_S`` or its estimate passes the cap, so most builds cost nothing."""
    import time

    with _estimates_lock:
        size, when = _estimates.get(root, (0, float("-inf")))  # never scanned here: scan now
        now = time.monotonic()
        size += added
        running = _pruning.get(root)
        if (now - when < _RESCAN_S and size <= max_bytes) or (running is not None and running.is_alive()):
            _estimates[root] = (size, when)
            return
        _estimates[root] = (size, now)
        thread = threading.Thread(target=_prune_to, args=(root, max_bytes), name="albatross-layer-prune",
                                  daemon=True)  # cut short at exit: the next store removes the rest
        _pruning[root] = thread
        thread.start()


def _prune_to(root: Path, max_bytes: int) -> None:
    """Scan the store; over ``max_bytes``, prune it to ``LOW_WATER`` of that."""
    import time

    try:
        total = sum(p["bytes"] for p in parents(root))
        kept = prune(root, max_bytes=int(max_bytes * LOW_WATER), log=_log.info)["kept_bytes"] if total > max_bytes \
            else total
    except OSError as err:
        _log.warning("layer cache %s: prune failed: %s", root, err)
        return
    with _estimates_lock:
        _estimates[root] = (kept, time.monotonic())


def wait_pruned(root: Path, timeout_s: float | None = None) -> None:
    """Wait for this process's background prune of ``root`` (if any) to end."""
    with _estimates_lock:
        thread = _pruning.get(Path(root))
    if thread is not None:
        thread.join(timeout_s)


def _remove_unheld(root: Path, key: str, dry_run: bool) -> bool:
    """Remove parent ``key`` and its lock files unless a process holds or builds it (its ``.use`` or ``.lock``
    lock); False when it does."""
    held: list[int] = []
    try:
        for name in (f"{key}{USE}", f"{key}.lock"):
            try:
                held.append(lock_file(root / name, fcntl.LOCK_EX | fcntl.LOCK_NB))
            except BlockingIOError:
                return False
        if not dry_run:  # renamed away first: a reader never sees half a parent
            gone = root / f"{key}.tmp-{os.getpid()}-prune{os.urandom(3).hex()}"
            with contextlib.suppress(FileNotFoundError):
                (root / key).rename(gone)
                shutil.rmtree(gone, ignore_errors=True)
            for name in (f"{key}{USE}", f"{key}.lock"):  # a waiter finds it unlinked and opens the new one
                with contextlib.suppress(FileNotFoundError):
                    (root / name).unlink()
        return True
    finally:
        for fd in held:
            os.close(fd)


class DiskGuard:
    """Keeps a build from filling the host's disk: a RUN step is refused when less than ``min_free_mb``
    is free where the layers are, and stopped (its processes killed) when it gets there."""

    def __init__(self, path: Path, min_free_mb: int, poll_s: float = 1.0) -> None:
        self.path, self.min_free_mb, self.poll_s = Path(path), min_free_mb, poll_s

    def problem(self) -> str:
        free = free_mb(self.path)
        if free >= self.min_free_mb:
            return ""
        return (f"the build filled the disk: {free} MiB free where the layers are built ({self.path}), under the "
                f"{self.min_free_mb} MiB a build must leave ([sandbox] build_min_free_mb)")

    @contextlib.contextmanager
    def watching(self, stop: Callable[[], None]) -> Iterator[list[str]]:
        """While the body runs, check the free space every ``poll_s``; below the minimum, call ``stop()``
        once. Yields a list that then holds the reason."""
        hit: list[str] = []
        done = threading.Event()

        def watch() -> None:
            while not done.wait(self.poll_s):
                why = self.problem()
                if why:
                    hit.append(why)
                    stop()
                    return

        thread = threading.Thread(target=watch, name="albatross-disk-guard", daemon=True)
        thread.start()
        try:
            yield hit
        finally:
            done.set()
            thread.join()

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
nothing. The directory is root's (mode 700): its files belong to the sandbox's uids, set-id bits
included. Builds use the host's disk as Docker's do; ``min_free_mb`` is the free space a build must leave
(a RUN step that goes below it is stopped: ``DiskGuard``).
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import os
import re
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from albatross.cache import images_root

FORMAT = "1"
RECORD = "parent.json"
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

    def __init__(self, persistent: bool, root: Path | None = None) -> None:
        self.persistent = persistent
        base = Path(root) if root is not None else store_root()
        base.mkdir(parents=True, exist_ok=True)
        os.chmod(base, 0o700)
        self._remove_stale(base)
        self.root = base if persistent else base / f"run-{os.getpid()}-{os.urandom(3).hex()}"
        self.root.mkdir(mode=0o700, exist_ok=True)
        self._count = itertools.count()
        self._lock = threading.Lock()

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
        with open(self.root / f"{key}.lock", "w") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            yield

    def load(self, key: str) -> dict[str, Any] | None:
        """The record of a built parent ``key`` (None when there is none, or it is unreadable)."""
        try:
            record = json.loads((self.path(key) / RECORD).read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(record, dict) or record.get("format") != FORMAT:
            return None
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
        (build / RECORD).write_text(json.dumps({**record, "format": FORMAT}) + "\n")
        final = self.path(key)
        if final.exists():  # an older, unreadable one: replaced
            old = self.root / f"{key}.tmp-{os.getpid()}-old{next(self._count)}"
            final.rename(old)
            shutil.rmtree(old, ignore_errors=True)
        build.rename(final)
        return final

    @staticmethod
    def discard(build: Path) -> None:
        shutil.rmtree(build, ignore_errors=True)

    def close(self) -> None:
        """A private store is removed; a persistent one stays."""
        if not self.persistent:
            shutil.rmtree(self.root, ignore_errors=True)


def free_mb(path: Path) -> int:
    """Free space (MiB) of the file system holding ``path``, for root."""
    st = os.statvfs(path)
    return (st.f_bavail * st.f_frsize) >> 20


def disk_usage(root: Path | None = None) -> dict[str, Any]:
    """The persistent store's parents and their sizes (``albatross sandbox image list``)."""
    root = Path(root) if root is not None else store_root()
    found = []
    for entry in sorted(root.glob("*")) if root.is_dir() else []:
        if (entry / RECORD).is_file():
            size = sum(f.lstat().st_size for f in entry.rglob("*") if f.is_file() and not f.is_symlink())
            found.append({"key": entry.name, "path": str(entry), "mb": round(size / (1 << 20), 1)})
    return {"root": str(root), "parents": found}


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

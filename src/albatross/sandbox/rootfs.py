"""Base root file systems of the isolated backend, and building one once (``build_once``).

``image`` (default): the root the Dockerfile's ``FROM`` names, built by ``images.resolve_base``.

``host`` (explicit opt-in only): the host's ``/``, read-only under every overlay; instant, but NOT
isolated from the host's files: tasks see the host's programs, ``/etc`` (``/etc/shadow`` included) and
installed software, and cannot rely on a distribution's package manager working as in a container.

``debian``: a Debian root built once with ``debootstrap --variant=minbase`` from the Debian package
registry into ``$ALBATROSS_IMAGES/rootfs/debian-<suite>`` (default ``~/.cache/albatross``), then used
read-only like the host root. Tasks whose Dockerfile installs packages (``RUN apt-get install ...``,
with ``allow_internet = true``) work without touching the host. The build is atomic (a temporary
directory renamed into place) and guarded by a lock file, so concurrent processes build it once.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from albatross.cache import images_root
from albatross.sandbox.base import SandboxError

BASES = ("image", "host", "debian")
DEFAULT_SUITE = "bookworm"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
MARKER = ".albatross-base.json"


class BaseUnavailable(SandboxError):
    """The requested base root file system is not built and cannot be built here."""


def cache_dir() -> Path:
    """``$ALBATROSS_IMAGES`` or ``~/.cache/albatross`` (machine-wide: see ``albatross.cache.images_root``)."""
    return images_root()


def debian_path(suite: str = DEFAULT_SUITE) -> Path:
    return cache_dir() / "rootfs" / f"debian-{suite}"


def is_built(path: Path) -> bool:
    """A complete root: its marker (written last) and a shell, or a marker saying it has none (an image
    built ``FROM scratch``, such as uv's)."""
    if not (path / MARKER).is_file():
        return False
    if (path / "bin" / "sh").exists():
        return True
    try:
        return bool(json.loads((path / MARKER).read_text()).get("scratch"))
    except (OSError, ValueError, AttributeError):
        return False


def base_root(base: str, build: bool = True) -> str:
    """The directory used as the bottom layer for ``base`` ("host" or "debian"; "image" bases come from
    ``images.resolve_base``, per Dockerfile); builds Debian once."""
    if base == "host":
        return "/"
    if base == "debian":
        path = debian_path()
        if not is_built(path):
            if not build:
                raise BaseUnavailable("the debian base is not built; run `albatross sandbox base build`")
            build_debian()
        return str(path)
    raise ValueError(f"unknown sandbox base {base!r}; choose one of {list(BASES)}")


def debootstrap_missing() -> str:
    """Why debootstrap cannot run here ("" when it can)."""
    if os.geteuid() != 0:
        return "building the debian base needs root"
    if shutil.which("debootstrap") is None:
        return "debootstrap is not installed (apt-get install debootstrap)"
    return ""


def build_debian(
    suite: str = DEFAULT_SUITE,
    mirror: str = DEFAULT_MIRROR,
    force: bool = False,
    log: Callable[[str], None] | None = None,
) -> Path:
    """Build (once) the Debian base with debootstrap; returns its directory."""
    path = debian_path(suite)
    why = debootstrap_missing()
    if why and not is_built(path):
        raise BaseUnavailable(why)
    return build_once(path, lambda tmp: _debootstrap(tmp, suite, mirror, log or (lambda line: None)), force)


def build_once(path: Path, make: Callable[[Path], dict[str, Any]], force: bool = False) -> Path:
    """Build the root file system ``path`` once: ``make(tmp)`` fills a temporary directory next to it and
    returns what to record in its marker; the directory is then renamed into place. A lock file makes
    concurrent processes build it once (the others wait and use it); a failed build leaves nothing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f"{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building it: wait for it
        if is_built(path) and not force:
            return path
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            info = make(tmp)
            (tmp / MARKER).write_text(json.dumps(info) + "\n")
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        old = path.with_name(f"{path.name}.old-{os.getpid()}")
        if path.exists():
            path.rename(old)
        tmp.rename(path)
        with contextlib.suppress(OSError):
            shutil.rmtree(old)
    return path


def _debootstrap(tmp: Path, suite: str, mirror: str, log: Callable[[str], None]) -> dict[str, Any]:
    start = time.monotonic()
    log(f"debootstrap --variant=minbase {suite} {tmp} {mirror} (a few minutes, once)")
    argv = ["debootstrap", "--variant=minbase", suite, str(tmp), mirror]
    proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = " | ".join((proc.stdout + proc.stderr).strip().splitlines()[-3:])
        raise BaseUnavailable(f"debootstrap {suite} from {mirror} failed (exit {proc.returncode}): {tail}")
    info = {"suite": suite, "mirror": mirror, "built": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "seconds": round(time.monotonic() - start, 1)}
    log(f"debian base ready in {info['seconds']} s")
    return info

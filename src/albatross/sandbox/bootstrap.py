"""Bootstrapping a base root: the host's apt mirrors, the bootstrap tool (mmdebstrap, else debootstrap), its run in
a mount namespace of its own, and what a container image has that a bootstrap leaves out. Shared by the Debian
bases (``images``) and the Ubuntu ones (``ubuntu``); imports neither."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

from albatross.cache import images_root
from albatross.sandbox import rootfs


def images_dir() -> Path:
    """Where built bases live (``images_root()/images``)."""
    return images_root() / "images"


def host_mirror() -> str:
    """The Debian mirror this machine's apt uses (/etc/apt/sources.list(.d)), else deb.debian.org."""
    for path in [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]:
        with contextlib.suppress(OSError):
            for url in source_urls(path.read_text(encoding="utf-8", errors="replace"), path.suffix):
                if "/debian" in url and "security" not in url:
                    return url.rstrip("/")
    return rootfs.DEFAULT_MIRROR


def source_urls(text: str, suffix: str) -> Iterator[str]:
    """The archive URLs of an apt sources file's text (one-line ``.list`` or deb822 ``.sources``)."""
    for line in text.splitlines():
        words = line.split("#", 1)[0].split()
        if suffix == ".sources" and words[:1] == ["URIs:"]:
            yield from words[1:]
        elif words[:1] == ["deb"]:
            yield next((w for w in words[1:] if not w.startswith("[")), "")


def bootstrap_tool() -> str:
    """mmdebstrap (installed with apt-get if missing and possible), else debootstrap, else ""."""
    if shutil.which("mmdebstrap") is None and os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run(["apt-get", "install", "-y", "-q", "mmdebstrap"], capture_output=True,
                       env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"}, check=False, timeout=600)
    return next((tool for tool in ("mmdebstrap", "debootstrap") if shutil.which(tool)), "")


MMDEBSTRAP_MINBASE = ("mmdebstrap", "--variant=minbase", "--mode=root", "--format=directory",
                      "--dpkgopt=path-exclude=/usr/share/man/*", "--dpkgopt=path-exclude=/usr/share/doc/*",
                      "--dpkgopt=path-include=/usr/share/doc/*/copyright",
                      "--dpkgopt=path-exclude=/usr/share/locale/*")


def run_bootstrapper(argv: list[str], what: str, log: Callable[[str], None]) -> None:
    """Run a bootstrapper (``mmdebstrap`` / ``debootstrap`` ``argv``) in its own mount namespace where ``unshare``
    exists, so its mounts (/proc, /dev of the new root) stay out of the host's table; a failure is
    ``BaseUnavailable`` naming ``what`` with the tail of its output."""
    if shutil.which("unshare"):
        argv = ["unshare", "--mount", "--propagation", "private", *argv]
    log(f"{' '.join(argv)} (a minute or two, once per base)")
    proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = " | ".join((proc.stdout + proc.stderr).strip().splitlines()[-3:])
        raise rootfs.BaseUnavailable(f"{what} failed (exit {proc.returncode}): {tail}")


def finish_root(root: Path, python: bool) -> None:
    """What a container image has that a bootstrap leaves out: its own hostname, hosts and no resolv.conf;
    for python images a pip that is not externally managed and ``python``/``pip`` on PATH."""
    etc = root / "etc"
    (etc / "hostname").write_text("sandbox\n")
    (etc / "hosts").write_text("127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"
                               "127.0.1.1\tsandbox\n")
    resolv = etc / "resolv.conf"
    if resolv.is_symlink() or resolv.exists():
        resolv.unlink()
    resolv.write_text("")
    for cache in ("var/cache/apt/archives", "var/lib/apt/lists"):  # as Docker's debian images ship them
        for entry in (root / cache).glob("*"):
            if entry.is_file() and entry.name not in ("lock",):
                entry.unlink()
    if python:
        for marker in root.glob("usr/lib/python3*/EXTERNALLY-MANAGED"):
            marker.unlink()
        bindir = root / "usr/local/bin"
        bindir.mkdir(parents=True, exist_ok=True)
        for name, target in (("python", "/usr/bin/python3"), ("pip", "/usr/bin/pip3"), ("pip3", "/usr/bin/pip3")):
            if not (bindir / name).exists() and (root / target.lstrip("/")).exists():
                (bindir / name).symlink_to(target)

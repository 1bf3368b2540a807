"""Ubuntu bases (``ubuntu:24.04`` and the other releases), built as Ubuntu's own image is: from the
Ubuntu archive.

Docker's ``ubuntu`` images are a minimal bootstrap of the release from the Ubuntu archive (main,
restricted, universe, multiverse; the release, ``-updates`` and ``-security`` suites) with a default
``ubuntu`` user (uid 1000, since 23.04). Here ``mmdebstrap --variant=minbase`` bootstraps the same suites
from the archive this machine reaches (its apt sources' Ubuntu mirror, else ``archive.ubuntu.com``), and
the image's apt keeps using them (through the egress proxy, whose default registries list the archive's
hosts). The archive's signing keys come from the ``ubuntu-keyring`` package, downloaded once and checked
against a sha256 pinned here, so a mirror or proxy cannot change what apt trusts. Like the other bases,
the image also gets ``python3`` (the offline verifier's pytest runs on it) and the notes say so.
"""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from albatross.sandbox.bootstrap import (
    MMDEBSTRAP_MINBASE,
    bootstrap_tool,
    finish_root,
    images_dir,
    run_bootstrapper,
    source_urls,
)
from albatross.sandbox.rootfs import BaseUnavailable

DEFAULT_MIRROR = "http://archive.ubuntu.com/ubuntu"
SECURITY_MIRROR = "http://security.ubuntu.com/ubuntu"
COMPONENTS = "main restricted universe multiverse"
KEYRING_DEB = "pool/main/u/ubuntu-keyring/ubuntu-keyring_2023.11.28.1_all.deb"
KEYRING_DEB_SHA256 = "36de43b15853ccae0028e9a767613770c704833f82586f28eb262f0311adb8a8"
KEYRING_FILE = "usr/share/keyrings/ubuntu-archive-keyring.gpg"
KEYRING_SHA256 = "80a36b0a6de2f69f49d2df75ef473ccde121e9e190b9ea01d20a4f63778d5c31"
USER_SINCE = ("noble",)  # releases whose image has the ``ubuntu`` user (uid 1000)


def ubuntu_mirror() -> str:
    """The Ubuntu mirror of this machine's apt sources, else the Ubuntu archive."""
    for path in [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]:
        with contextlib.suppress(OSError):
            for url in source_urls(path.read_text(encoding="utf-8", errors="replace"), path.suffix):
                if url.rstrip("/").endswith("/ubuntu") and "security" not in url:
                    return url.rstrip("/")
    return DEFAULT_MIRROR


def keyring(mirror: str, cache: Path) -> Path:
    """The Ubuntu archive keyring (``ubuntu-archive-keyring.gpg``), from the ``ubuntu-keyring`` package of
    ``mirror``, both checked against the pinned sha256; cached in ``cache``."""
    path = cache / "ubuntu-archive-keyring.gpg"
    if path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == KEYRING_SHA256:
        return path
    url = f"{mirror.rstrip('/')}/{KEYRING_DEB}"
    try:
        with urllib.request.urlopen(url, timeout=120) as response:
            data = response.read(1 << 20)
    except OSError as err:
        raise BaseUnavailable(f"{url}: {err}") from None
    if hashlib.sha256(data).hexdigest() != KEYRING_DEB_SHA256:
        raise BaseUnavailable(f"{url}: not the ubuntu-keyring package albatross pins (sha256 differs)")
    with tempfile.TemporaryDirectory(prefix="albatross-keyring-") as tmp:
        deb = Path(tmp) / "keyring.deb"
        deb.write_bytes(data)
        proc = subprocess.run(["dpkg-deb", "-x", str(deb), f"{tmp}/x"], capture_output=True, text=True)
        found = Path(tmp) / "x" / KEYRING_FILE
        if proc.returncode != 0 or not found.is_file():
            raise BaseUnavailable(f"{url}: cannot unpack {KEYRING_FILE} ({proc.stderr.strip()[-200:]})")
        if hashlib.sha256(found.read_bytes()).hexdigest() != KEYRING_SHA256:
            raise BaseUnavailable(f"{url}: {KEYRING_FILE} is not the keyring albatross pins")
        cache.mkdir(parents=True, exist_ok=True)
        tmp_path = cache / f".keyring-{time.monotonic_ns()}"
        shutil.copyfile(found, tmp_path)
        tmp_path.rename(path)
    return path


def sources(release: str, mirror: str) -> list[str]:
    """The apt sources of Ubuntu's image of ``release``: the release, -updates and -security."""
    security = SECURITY_MIRROR if mirror == DEFAULT_MIRROR else mirror
    return [f"deb {mirror} {release} {COMPONENTS}", f"deb {mirror} {release}-updates {COMPONENTS}",
            f"deb {security} {release}-security {COMPONENTS}"]


def bootstrap_ubuntu(recipe: Any, tmp: Path, log: Callable[[str], None]) -> dict[str, Any]:
    """Build the Ubuntu base of ``recipe`` (an ``images.Recipe`` with ``distro="ubuntu"``) into ``tmp``."""
    if bootstrap_tool() != "mmdebstrap":
        raise BaseUnavailable("Ubuntu bases need mmdebstrap (apt-get install mmdebstrap)")
    keys = keyring(recipe.mirror, images_dir() / "keyrings")
    include = ",".join(recipe.packages)
    argv = [*MMDEBSTRAP_MINBASE, f"--keyring={keys}", *([f"--include={include}"] if include else []),
            recipe.release, str(tmp), *sources(recipe.release, recipe.mirror)]
    start = time.monotonic()
    run_bootstrapper(argv, f"mmdebstrap Ubuntu {recipe.release} from {recipe.mirror}", log)
    finish_root(tmp, recipe.python)
    if recipe.release in USER_SINCE:
        add_default_user(tmp)
    seconds = round(time.monotonic() - start, 1)
    log(f"base Ubuntu {recipe.release} {include} built in {seconds} s")
    return {"recipe": {"distro": "ubuntu", "release": recipe.release, "packages": list(recipe.packages),
                       "mirror": recipe.mirror}, "tool": "mmdebstrap", "seconds": seconds,
            "built": time.strftime("%Y-%m-%dT%H:%M:%S"), "env": recipe.env}


def add_default_user(root: Path) -> None:
    """The ``ubuntu`` user and group (uid and gid 1000, home /home/ubuntu) of Ubuntu's image."""
    etc = root / "etc"
    for name, line in (("passwd", "ubuntu:x:1000:1000:Ubuntu:/home/ubuntu:/bin/bash"),
                       ("group", "ubuntu:x:1000:"), ("shadow", "ubuntu:!:19000:0:99999:7:::"),
                       ("gshadow", "ubuntu:!::")):
        path = etc / name
        text = path.read_text() if path.is_file() else ""
        if not any(row.startswith("ubuntu:") for row in text.splitlines()):
            path.write_text(text + ("" if text.endswith("\n") or not text else "\n") + line + "\n")
    home = root / "home" / "ubuntu"
    home.mkdir(parents=True, exist_ok=True)
    for skel in (root / "etc" / "skel").glob(".*"):
        if skel.is_file():
            shutil.copy2(skel, home / skel.name)
    for path in [home, *home.iterdir()]:
        shutil.chown(path, 1000, 1000)
    home.chmod(0o750)

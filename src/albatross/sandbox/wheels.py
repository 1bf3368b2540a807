"""Images built from a wheel of the package index: uv's (``ghcr.io/astral-sh/uv:<version>``).

uv's published image is ``FROM scratch`` with two static binaries, ``/uv`` and ``/uvx``: the same
binaries its wheel on PyPI carries (``uv-<version>.data/scripts/``). Where the container registry is
out of reach and the package index is not, the image is rebuilt from that recipe: the wheel for this
machine's architecture is found through the index's JSON simple API (PEP 691), downloaded, checked
against the sha256 the index gives, and its two binaries become the root's ``/uv`` and ``/uvx``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
import urllib.request
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urljoin

from albatross.sandbox.rootfs import BaseUnavailable

MAX_WHEEL_BYTES = 256 << 20
_ARCH = {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}


def pick_wheel(files: list[dict[str, Any]], name: str, version: str, machine: str) -> dict[str, Any]:
    """The manylinux wheel of ``name`` ``version`` for ``machine`` among an index page's files."""
    arch = _ARCH.get(machine, machine)
    prefix = f"{name}-{version}-"
    for entry in files:
        filename = str(entry.get("filename", ""))
        if filename.startswith(prefix) and filename.endswith(".whl") and "manylinux" in filename \
                and filename.rsplit(".", 1)[0].endswith(arch):
            return entry
    raise BaseUnavailable(f"the package index has no manylinux {arch} wheel of {name} {version}")


def _get(url: str, accept: str, limit: int, timeout_s: float = 120.0) -> bytes:
    request = urllib.request.Request(url, headers={"Accept": accept, "User-Agent": "albatross"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            data: bytes = response.read(limit + 1)
    except OSError as err:
        raise BaseUnavailable(f"{url}: {err}") from None
    if len(data) > limit:
        raise BaseUnavailable(f"{url}: larger than {limit >> 20} MiB")
    return data


def fetch_wheel(index: str, name: str, version: str, out: Path) -> Path:
    """Download the wheel of ``name`` ``version`` for this machine from ``index`` into ``out``, its sha256
    checked against the index's."""
    page_url = f"{index.rstrip('/')}/{name}/"
    try:
        page = json.loads(_get(page_url, "application/vnd.pypi.simple.v1+json", 64 << 20))
        entry = pick_wheel(page["files"], name, version, os.uname().machine)
        want = entry["hashes"]["sha256"]
    except (ValueError, KeyError, TypeError) as err:
        raise BaseUnavailable(f"{page_url}: not a PEP 691 JSON index page ({err})") from None
    data = _get(urljoin(page_url, entry["url"]), "*/*", MAX_WHEEL_BYTES)
    if hashlib.sha256(data).hexdigest() != want:
        raise BaseUnavailable(f"{entry['filename']}: sha256 differs from the index's")
    path = out / str(entry["filename"]).replace("/", "_")
    path.write_bytes(data)
    return path


def build_uv_root(version: str, index: str, root: Path, log: Callable[[str], None] | None = None
                  ) -> dict[str, Any]:
    """uv's image: ``root`` holding only ``/uv`` and ``/uvx`` (mode 755), from the uv wheel."""
    start = time.monotonic()
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="albatross-wheel-") as tmp:
        wheel = fetch_wheel(index, "uv", version, Path(tmp))
        with zipfile.ZipFile(wheel) as archive:
            for tool in ("uv", "uvx"):
                member = f"uv-{version}.data/scripts/{tool}"
                try:
                    with archive.open(member) as src, open(root / tool, "wb") as dst:
                        shutil.copyfileobj(src, dst)
                except KeyError:
                    raise BaseUnavailable(f"{wheel.name}: no {member}") from None
                os.chmod(root / tool, 0o755)
    seconds = round(time.monotonic() - start, 1)
    if log:
        log(f"uv {version} image built from {wheel.name} in {seconds} s")
    return {"recipe": {"uv": version, "index": index}, "scratch": True, "seconds": seconds,
            "built": time.strftime("%Y-%m-%dT%H:%M:%S"), "env": {}}

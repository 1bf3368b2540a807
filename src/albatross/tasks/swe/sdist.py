"""A project's source distribution: which version, where to get it, unpacked safely.

``fetch_sdist("toolz==1.0.0")`` asks the package index (PEP 691 JSON, the simple API pip uses; ``PIP_INDEX_URL``
or https://pypi.org/simple) for the project's files, picks the sdist of the version asked for (none asked: the
newest final release that has one), downloads it once into ``$ALBATROSS_CACHE/swe/sdists`` and checks its sha256.
Nothing of it runs on the host: ``unpack`` extracts with the tar "data" filter (no links out, no devices, no
absolute paths, no setuid bits) and strips the top-level directory. A local archive or directory (``--sdist``)
takes the place of the download.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tarfile
import urllib.parse
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from albatross.errors import UserError

INDEX_URL = "https://pypi.org/simple"
_ACCEPT = "application/vnd.pypi.simple.v1+json"
_SDIST = re.compile(r"^(?P<name>.+?)-(?P<version>[^-]+?)\.(?:tar\.gz|tgz|zip|tar\.bz2)$")
MAX_SDIST_BYTES = 64 << 20
MAX_UNPACKED_BYTES = 512 << 20


@dataclass(frozen=True)
class Sdist:
    """An sdist on disk: the project's normalised ``name``, its ``version``, the archive and its sha256."""

    name: str
    version: str
    path: Path
    sha256: str


def normalise(name: str) -> str:
    """PEP 503 name: lower case, runs of ``-_.`` as one ``-``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_requirement(spec: str) -> tuple[str, str | None]:
    """``NAME`` or ``NAME==VERSION`` -> (normalised name, version or None); anything else is a ``UserError``."""
    match = re.fullmatch(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:==\s*([A-Za-z0-9.+!_-]+))?\s*", spec)
    if match is None:
        raise UserError(f"--package {spec!r}: expected NAME or NAME==VERSION")
    return normalise(match.group(1)), match.group(2)


def index_url() -> str:
    return os.environ.get("PIP_INDEX_URL", INDEX_URL).rstrip("/")


def fetch_sdist(spec: str, cache: Path, timeout_s: float = 60.0) -> Sdist:
    """The sdist of ``spec`` (``NAME`` or ``NAME==VERSION``), downloaded once into ``cache`` and checked."""
    name, version = parse_requirement(spec)
    files = _index_files(name, timeout_s)
    chosen = _pick(files, name, version, spec)
    digest = chosen.get("hashes", {}).get("sha256", "")
    dest = cache / name / chosen["filename"]
    if not (dest.is_file() and _sha256(dest) == digest):
        _download(urllib.parse.urljoin(f"{index_url()}/{name}/", chosen["url"]), dest, digest, timeout_s)
    match = _SDIST.match(chosen["filename"])
    return Sdist(name, match.group("version") if match else str(version), dest, _sha256(dest))


def local_sdist(path: Path, spec: str) -> Sdist:
    """A local archive or source directory standing in for the download (``--sdist``)."""
    name, version = parse_requirement(spec)
    if not path.exists():
        raise UserError(f"--sdist {path}: no such file or directory")
    digest = _tree_sha256(path) if path.is_dir() else _sha256(path)
    return Sdist(name, version or "0", path, digest)


def _index_files(name: str, timeout_s: float) -> list[dict[str, Any]]:
    url = f"{index_url()}/{name}/"
    request = urllib.request.Request(url, headers={"Accept": _ACCEPT})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as r:
            data = json.loads(r.read(8 << 20))
    except urllib.error.HTTPError as e:
        raise UserError(f"--package {name}: the index answered {e.code} for {url}") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise UserError(f"--package {name}: cannot read {url}: {e}") from None
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(files, list):
        raise UserError(f"--package {name}: {url} is not a PEP 691 JSON project page")
    return [f for f in files if isinstance(f, dict) and isinstance(f.get("filename"), str)]


def _pick(files: list[dict[str, Any]], name: str, version: str | None, spec: str) -> dict[str, Any]:
    from packaging.version import InvalidVersion, Version

    sdists = []
    for f in files:
        match = _SDIST.match(f["filename"])
        if match is None or normalise(match.group("name")) != name or f.get("yanked"):
            continue
        try:
            sdists.append((Version(match.group("version")), f))
        except InvalidVersion:
            continue
    if version is not None:
        found = [f for v, f in sdists if v == Version(version)]
        if not found:
            raise UserError(f"--package {spec}: the index has no source distribution of version {version}")
        return found[0]
    final = sorted(((v, f) for v, f in sdists if not v.is_prerelease), key=lambda vf: vf[0])
    if not final:
        raise UserError(f"--package {spec}: the index has no source distribution of a final release")
    return final[-1][1]


def _download(url: str, dest: Path, digest: str, timeout_s: float) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + f".part-{os.getpid()}")
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r, tmp.open("wb") as out:
            copied = 0
            while chunk := r.read(1 << 20):
                copied += len(chunk)
                if copied > MAX_SDIST_BYTES:
                    raise UserError(f"{url}: larger than {MAX_SDIST_BYTES >> 20} MiB")
                out.write(chunk)
    except (urllib.error.URLError, OSError) as e:
        tmp.unlink(missing_ok=True)
        raise UserError(f"cannot download {url}: {e}") from None
    if digest and _sha256(tmp) != digest:
        tmp.unlink(missing_ok=True)
        raise UserError(f"{url}: sha256 differs from the index's")
    tmp.replace(dest)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _tree_sha256(root: Path) -> str:
    h = hashlib.sha256()
    from albatross.tasks.swe.project import walk_files

    for path in (p for p in walk_files(root) if not _skipped(p.relative_to(root))):
        h.update(str(path.relative_to(root)).encode() + b"\0" + _sha256(path).encode())
    return h.hexdigest()


def _skipped(rel: Path) -> bool:
    return any(part in (".git", "__pycache__", ".pytest_cache") for part in rel.parts)


def unpack(sdist: Sdist, dest: Path) -> Path:
    """Extract (or copy, for a directory) the sdist into ``dest`` with its top-level directory stripped; returns
    ``dest``. Links out of the tree, devices, absolute paths and more than ``MAX_UNPACKED_BYTES`` are refused."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    if sdist.path.is_dir():
        shutil.copytree(sdist.path, dest, dirs_exist_ok=True, symlinks=True,
                        ignore=shutil.ignore_patterns(".git", "__pycache__", ".pytest_cache", "*.pyc"))
        return dest
    staging = dest.with_name(dest.name + ".unpack")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        _extract(sdist.path, staging)
        entries = list(staging.iterdir())
        top = entries[0] if len(entries) == 1 and entries[0].is_dir() else staging
        for child in top.iterdir():
            child.rename(dest / child.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return dest


def _extract(archive: Path, dest: Path) -> None:
    try:
        if zipfile.is_zipfile(archive):
            _extract_zip(archive, dest)
            return
        with tarfile.open(archive) as tar:
            total = sum(m.size for m in tar.getmembers() if m.isfile())
            if total > MAX_UNPACKED_BYTES:
                raise UserError(f"{archive}: unpacks to more than {MAX_UNPACKED_BYTES >> 20} MiB")
            tar.extractall(dest, filter="data")
    except (tarfile.TarError, zipfile.BadZipFile, OSError) as e:
        raise UserError(f"{archive}: cannot unpack the source distribution: {e}") from None


def _extract_zip(archive: Path, dest: Path) -> None:
    with zipfile.ZipFile(archive) as z:
        infos = z.infolist()
        if sum(i.file_size for i in infos) > MAX_UNPACKED_BYTES:
            raise UserError(f"{archive}: unpacks to more than {MAX_UNPACKED_BYTES >> 20} MiB")
        root = dest.resolve()
        for info in infos:
            target = (dest / info.filename).resolve()
            if not str(target).startswith(str(root) + os.sep):
                raise UserError(f"{archive}: entry {info.filename!r} climbs out of the archive")
        z.extractall(dest)

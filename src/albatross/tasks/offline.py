"""Running real tasks offline: the toolkit of shims, the adapted environment, and network evidence.

Terminal-Bench 2 tasks expect the internet: Dockerfiles run ``apt-get update && apt-get install``,
verifiers install uv with ``curl ... | sh`` and run ``uvx -w pytest==8.4.1 pytest ...``. Offline, the
*toolkit* (``/usr/local/lib/albatross-offline`` inside a sandbox) serves those requests from what the
machine already has:

- ``bin/``: shims for apt-get/apt (install succeeds when the package is installed on the local base),
  pip/pip3, uv, uvx (pytest from the toolkit, run by the environment's python), curl/wget (the uv
  installer is served locally) and pytest; ``pybin/python`` is ``python3``;
- ``site/``: pytest and its dependencies, copied from the Python that runs albatross, and the
  ``albatross_pytest`` plugin (per-test results, ``--ctrf``).

A request that only the network could satisfy fails with one line ``albatross-offline: needs the
network: ...``; :func:`network_evidence` finds it (and the usual resolver errors) in command output.

Environments whose Dockerfile ``RUN`` steps call those tools, or that start ``FROM`` a python image,
are *adapted* (:func:`adapt_environment`): a copy of ``environment/`` with the toolkit in it as one archive (a
hard link to :func:`toolkit_archive`) and two lines after ``FROM`` that ``ADD`` it into the image and put it first
on ``PATH``. The verifier and oracle get a
fresh copy of the toolkit before they run (``verify.py``), so an agent cannot tamper with it.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tarfile
import tempfile
import threading
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from albatross.cache import cache_root
from albatross.sandbox.build import SHARED_ARCHIVE, SOURCE_MARKER
from albatross.tasks import shims
from albatross.tasks.shims import NEEDS_NETWORK, PIP_ZIP, TOOLKIT_PATH

TOOLKIT_BIN = f"{TOOLKIT_PATH}/bin"
TOOLKIT_PYBIN = f"{TOOLKIT_PATH}/pybin"
TEST_RESULTS = "/logs/verifier/albatross-tests.json"
_TOOLKIT_FORMAT = "3"
_ADAPTED_FORMAT = "2"  # the toolkit ADDed as one archive
_DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_SKIPPED_DISTS = {"colorama"}  # Windows only (pygments stays: pytest >= 8.4 imports it unconditionally)
_TOOLS = re.compile(r"(?<![\w./-])(apt-get|apt|pip3?|uvx?|curl|wget|pytest|py\.test)(?![\w.-])")
_NETWORK_ERRORS = (
    NEEDS_NETWORK,
    "Could not resolve host",
    "Temporary failure in name resolution",
    "Temporary failure resolving",
    "Name or service not known",
    "No address associated with hostname",
    "Network is unreachable",
    "Failed to establish a new connection",
    "getaddrinfo failed",
    "unable to resolve host address",
    "not allowed by the network policy",  # a build step the egress proxy refused (sandbox/buildnet.py)
    "Blocked by network policy",  # the egress proxy's answer, as pip, wget and python print it
    "CONNECT tunnel failed, response 403",  # curl's words for it
    "Received HTTP code 403 from proxy after CONNECT",
)
_lock = threading.Lock()
_toolkits: dict[Path, Path] = {}  # cache root -> built toolkit
_pruned: list[int] = []  # adapted environments removed by this process's one pruning pass


# ------------------------------------------------------------------------------------------- evidence


def uses_toolkit(script: str) -> bool:
    """Whether a shell script calls a tool the toolkit stands in for (apt-get, pip, uv, curl, ...)."""
    return bool(_TOOLS.search(script))


def network_evidence(output: str) -> str | None:
    """The first output line showing that the network was needed, or None."""
    for line in output.splitlines():
        if any(marker in line for marker in _NETWORK_ERRORS):
            return line.strip()[:300]
    return None


def is_python_image(image: str) -> bool:
    name = image.split("/")[-1]
    return name.startswith("python") or name.startswith("python-3")


# -------------------------------------------------------------------------------------------- toolkit


def toolkit_dir() -> Path:
    """The toolkit on this host (built once per content version under the cache directory)."""
    root = cache_root()
    with _lock:
        if root not in _toolkits or not _toolkits[root].is_dir():
            _toolkits[root] = _build_toolkit(root)
        return _toolkits[root]


def toolkit_archive() -> Path:
    """The toolkit as one uncompressed tar (built once beside it): an adapted environment holds a link to it and
    ``ADD``s it, instead of a copy of its thousand files per task."""
    toolkit = toolkit_dir()
    final = toolkit.with_name(toolkit.name + ".tar")
    with _lock:
        if not final.is_file():
            fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".tar", dir=toolkit.parent)
            try:
                with os.fdopen(fd, "wb") as out, tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
                    tar.add(toolkit, arcname=".", filter=_as_root)  # members in sorted order
                os.rename(tmp, final)
            except OSError:
                Path(tmp).unlink(missing_ok=True)
                if not final.is_file():
                    raise
    return final


def _as_root(info: tarfile.TarInfo) -> tarfile.TarInfo:
    """Members owned by root, as COPY makes them."""
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    return info


def _toolkit_digest(dists: list[metadata.Distribution]) -> str:
    digest = hashlib.sha256(_TOOLKIT_FORMAT.encode())
    for group in (shims.BIN, shims.LIB, shims.PYBIN):
        for name, text in sorted(group.items()):
            digest.update(f"{name}\0{text}\0".encode())
    digest.update(Path(__file__).with_name("pytest_results.py").read_bytes())
    for dist in dists:
        digest.update(f"{dist.metadata['Name']}={dist.version}\0".encode())
    return digest.hexdigest()[:16]


def _build_toolkit(root: Path) -> Path:
    dists = _pytest_dists()
    pip = _dist("pip")
    if pip is not None:
        dists = [*dists, pip]
    final = root / "offline-toolkit" / _toolkit_digest(dists)
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=final.parent))
    try:
        _write_scripts(tmp / "bin", shims.BIN)
        _write_scripts(tmp / "lib", shims.LIB)
        _write_scripts(tmp / "pybin", shims.PYBIN)
        site = tmp / "site"
        site.mkdir()
        shutil.copyfile(Path(__file__).with_name("pytest_results.py"), site / "albatross_pytest.py")
        for dist in dists:
            if dist is pip:
                _zip_dist(dist, tmp / "lib" / PIP_ZIP)
            else:
                _copy_dist(dist, site)
        os.rename(tmp, final)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not final.is_dir():  # another process may have won the race
            raise
    return final


def _write_scripts(directory: Path, scripts: dict[str, str]) -> None:
    directory.mkdir(parents=True)
    for name, text in scripts.items():
        path = directory / name
        path.write_text(text)
        path.chmod(0o755)


def _dist(name: str) -> metadata.Distribution | None:
    try:
        return metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return None


def _pytest_dists() -> list[metadata.Distribution]:
    """pytest and the distributions it needs at run time, as installed here (empty without pytest)."""
    found: dict[str, metadata.Distribution] = {}
    todo = ["pytest"]
    while todo:
        name = _canonical(todo.pop())
        if name in found or name in _SKIPPED_DISTS:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # e.g. tomli or exceptiongroup, which only older pythons need
        found[name] = dist
        for req in dist.requires or []:
            spec, _, marker = req.partition(";")
            if "extra" not in marker and "win32" not in marker:
                todo.append(re.split(r"[\s\[<>=!~(]", spec.strip(), maxsplit=1)[0])
    return [found[n] for n in sorted(found)]


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _zip_dist(dist: metadata.Distribution, target: Path) -> None:
    """``dist``'s modules as one zip file that python imports from (pip runs so, as get-pip runs it): one
    file where the tree has a thousand, linked into every adapted environment, and kept off the
    environment's own import path (``link_toolkit_site`` adds ``site/``, never this)."""
    import zipfile

    with zipfile.ZipFile(target, "w", zipfile.ZIP_STORED) as out:  # stored: read fast, linked, not copied
        for rel in sorted(dist.files or [], key=str):
            source = Path(str(dist.locate_file(rel)))
            keep = rel.parts and rel.parts[0] != ".." and not rel.parts[0].endswith(".dist-info")  # metadata:
            if keep and source.suffix != ".pyc" and source.is_file():  # pip would list the zip as an egg
                info = zipfile.ZipInfo("/".join(rel.parts), date_time=(1980, 1, 1, 0, 0, 0))
                info.external_attr = 0o644 << 16
                out.writestr(info, source.read_bytes())


def _copy_dist(dist: metadata.Distribution, site: Path) -> None:
    for rel in dist.files or []:
        if rel.parts and rel.parts[0] == "..":
            continue  # console scripts outside site-packages
        source = Path(str(dist.locate_file(rel)))
        if source.is_file():
            target = site / Path(*rel.parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


# ---------------------------------------------------------------------------- adapted environments


@dataclass(frozen=True)
class OfflineEnv:
    """An adapted copy of a task's environment directory."""

    env_dir: Path  # the adapted copy (what the sandbox builds)
    source_dir: Path  # the task's own environment/
    after_line: int  # the toolkit lines were inserted after this line of the original Dockerfile
    inserted: int  # how many lines were inserted

    def source_line(self, line: int) -> int:
        """The original Dockerfile's line number for a line of the adapted one."""
        return line - self.inserted if line > self.after_line + self.inserted else min(line, self.after_line)

    def map_message(self, message: str) -> str:
        """Rewrite ``<adapted Dockerfile>:N`` in an error message to the original file and line."""
        adapted = re.escape(str(self.env_dir / "Dockerfile"))
        original = str(self.source_dir / "Dockerfile")
        return re.sub(adapted + r":(\d+)", lambda m: f"{original}:{self.source_line(int(m.group(1)))}", message)


def needs_adapting(env_dir: Path) -> bool:
    """True when the Dockerfile runs a tool that needs the network, or starts from a python image."""
    from albatross.sandbox.dockerfile import DockerfileError, From, Run, parse_dockerfile

    try:
        instructions = parse_dockerfile(env_dir / "Dockerfile")
    except DockerfileError:
        return False  # the build gate reports it
    for ins in instructions:
        if isinstance(ins, From) and is_python_image(ins.image):
            return True
        if isinstance(ins, Run):
            text = ins.command if isinstance(ins.command, str) else " ".join(ins.command)
            if uses_toolkit(text):
                return True
    return False


def adapt_environment(env_dir: Path) -> OfflineEnv | None:
    """The adapted copy of ``env_dir`` (cached by content), or None when it needs no adapting."""
    env_dir = Path(env_dir)
    if not needs_adapting(env_dir):
        return None
    toolkit = toolkit_archive()
    if not _pruned:
        _pruned.append(prune_adapted())
    # the source path is part of the key: the copy names its task directory for the sandbox to hide
    digest = hashlib.sha256(f"{_ADAPTED_FORMAT}\0{toolkit.name}\0{env_dir.resolve()}\0".encode())
    for path in sorted(env_dir.rglob("*")):
        digest.update(f"{path.relative_to(env_dir)}\0".encode())
        if path.is_file():
            digest.update(hashlib.sha256(path.read_bytes()).digest())
    final = cache_root() / "offline-env" / f"{env_dir.parent.name}-{digest.hexdigest()[:16]}"
    text = (env_dir / "Dockerfile").read_text(encoding="utf-8")
    after, lines = _insertion(text)
    if not final.is_dir():
        _write_adapted(env_dir, final, toolkit, text, after, lines)
    return OfflineEnv(final, env_dir, after, len(lines))


def _insertion(dockerfile: str) -> tuple[int, list[str]]:
    """(line after which to insert, the lines): after the FROM instruction (and its continuations)."""
    rows = dockerfile.splitlines()
    after, python_image = 0, False
    for i, row in enumerate(rows):
        words = row.strip().split()
        if words and words[0].upper() == "FROM":
            j = i
            while rows[j].rstrip().endswith("\\") and j + 1 < len(rows):
                j += 1
            after = j + 1
            image = next((w for w in words[1:] if not w.startswith("--")), "")
            python_image = is_python_image(image)
            break
    dirs = [TOOLKIT_BIN] + ([TOOLKIT_PYBIN] if python_image else [])
    return after, [f"ADD {SHARED_ARCHIVE} {TOOLKIT_PATH}/", f"ENV PATH={':'.join(dirs)}:{_DEFAULT_PATH}"]


def _write_adapted(env_dir: Path, final: Path, toolkit: Path, text: str, after: int, lines: list[str]) -> None:
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=final.parent))
    try:
        shutil.copytree(env_dir, tmp, symlinks=True, dirs_exist_ok=True)
        _make_writable(tmp)  # a read-only task directory gives read-only copies
        _link_or_copy(toolkit, tmp / SHARED_ARCHIVE)
        rows = text.splitlines()
        (tmp / "Dockerfile").write_text("\n".join(rows[:after] + lines + rows[after:]) + "\n")
        (tmp / SOURCE_MARKER).write_text(f"{env_dir.resolve().parent}\n")
        os.rename(tmp, final)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not final.is_dir():
            raise


def _link_or_copy(source: Path, dest: Path) -> None:
    """``dest`` a hard link to ``source`` (read-only, shared by every adapted environment), a copy across
    devices."""
    try:
        os.link(source, dest)
    except OSError:
        shutil.copy2(source, dest)


def prune_adapted(root: Path | None = None) -> int:
    """Delete adapted environments whose task directory is gone (run directories, temporary task sets);
    returns how many. Runs at most once per process, from :func:`adapt_environment`."""
    base = (root or cache_root()) / "offline-env"
    removed = 0
    for entry in base.glob("*"):
        try:
            source = Path((entry / SOURCE_MARKER).read_text(encoding="utf-8").strip())
        except OSError:
            continue  # being written, or not ours
        if source and not source.exists():
            shutil.rmtree(entry, ignore_errors=True)
            removed += 1
    return removed


def _make_writable(root: Path) -> None:
    for path in [root, *root.rglob("*")]:
        if not path.is_symlink():
            path.chmod(path.stat().st_mode | 0o200)

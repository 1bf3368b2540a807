"""Base images of the isolated sandbox: the root file system a Dockerfile's ``FROM`` names, built here.

No image is pulled from a container registry (none is reachable here). A ``FROM`` reference maps to a
*recipe* (a Debian release, the packages of the image's runtime, the Debian mirror this machine uses),
and the recipe is built once with ``mmdebstrap`` (``debootstrap`` where mmdebstrap is missing) into
``images_root()/images/<sha>`` (``$ALBATROSS_IMAGES``), the sha being that of the recipe: content-addressed, built atomically
under a lock file (``rootfs.build_once``), read-only afterwards. Images a user has (an OCI image layout
or a ``docker save`` archive) are imported with ``import_image`` (``albatross sandbox image import PATH
--tag REF``, or every one found in ``[sandbox] images``); a ``FROM`` naming an imported tag uses it.

Mapping (anything else is refused with ``EnvBuildError("no base for <ref>")``):

========================================  ===========================================================
``debian:<release>[-slim]``, ``debian:N``  that release, minbase
``python:3.X[-slim][-<release>]``         the release (without one: the Debian release whose python3
                                          is closest to 3.X) + python3, pip, venv; pip is not
                                          "externally managed"; ``python`` and ``pip`` on PATH
``ubuntu:<ver>``                          that Ubuntu release (24.04 noble, 22.04 jammy, 20.04 focal)
                                          from the Ubuntu archive, as its image is (``ubuntu.py``: the
                                          archive's keyring pinned by hash), + python3
``node``/``rust``/``golang``/``gcc``/...  the closest Debian release + that runtime's Debian packages
``ghcr.io/astral-sh/uv:<version>``         uv's own recipe (``FROM scratch``, ``/uv`` and ``/uvx``), its
                                          binaries taken from the ``uv`` wheel of that version on the
                                          package index (sha256 checked against the index's)
========================================  ===========================================================

Every difference from what was asked (Python 3.11 for ``python:3.13``, Debian for Ubuntu, ...) is a
line of ``Base.notes``, which the build report shows. ``resolve_base`` is the stable entry point (the
isolated backend and the container-engine backend both call it).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import posixpath
import re
import stat
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from albatross.sandbox import extract, rootfs
from albatross.sandbox.bootstrap import (
    MMDEBSTRAP_MINBASE,
    bootstrap_tool,
    finish_root,
    host_mirror,
    images_dir,
    run_bootstrapper,
)
from albatross.sandbox.build import EnvBuildError

DEFAULT_REF = "python:3.11-slim-bookworm"  # the base of an environment without a Dockerfile
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
RECIPE_FORMAT = "1"
RELEASES = {"bullseye": 11, "bookworm": 12, "trixie": 13}  # what deb.debian.org serves
DEBIAN_NUMBERS = {v: k for k, v in RELEASES.items()}
OLDER = {"buster": "bullseye", "stretch": "bullseye", "jessie": "bullseye"}  # archived: the oldest served
NEWEST = "trixie"
PYTHON3 = {"bullseye": (3, 9), "bookworm": (3, 11), "trixie": (3, 13)}  # the release's python3
UBUNTU = {"20.04": "focal", "focal": "focal", "22.04": "jammy", "jammy": "jammy", "24.04": "noble",
          "noble": "noble", "latest": "noble", "rolling": "noble"}  # the Ubuntu suite of an ubuntu: tag
# Other runtimes: their Debian packages.
RUNTIMES: dict[str, tuple[str, ...]] = {
    "node": ("nodejs", "npm", "ca-certificates"),
    "rust": ("rustc", "cargo", "gcc", "libc6-dev", "ca-certificates"),
    "golang": ("golang-go", "gcc", "libc6-dev", "git", "ca-certificates"),
    "gcc": ("gcc", "g++", "make", "libc6-dev", "ca-certificates"),
    "openjdk": ("default-jdk-headless", "ca-certificates"),
    "eclipse-temurin": ("default-jdk-headless", "ca-certificates"),
    "maven": ("maven", "default-jdk-headless", "ca-certificates"),
    "ruby": ("ruby", "ruby-dev", "ca-certificates"),
    "php": ("php-cli", "ca-certificates"),
    "perl": ("perl", "ca-certificates"),
    "r-base": ("r-base-core", "ca-certificates"),
    "buildpack-deps": ("ca-certificates", "curl", "wget", "gnupg", "git", "build-essential", "procps",
                        "xz-utils", "bzip2", "unzip"),
}
# The python images' runtime with its C headers (the images have Python.h: a C extension builds with gcc
# alone), plus procps (ps, pgrep, kill: agents and task scripts expect them; the python slim images lack
# them, a deviation stated in docs/sandbox.md).
PYTHON_PACKAGES = ("python3", "python3-pip", "python3-venv", "python-is-python3", "libpython3-dev",
                   "ca-certificates", "netbase", "tzdata", "procps")
# Ubuntu's image has apt and the archive's keyring (Priority important there: minbase leaves them out), and
# python3 is added for the offline verifier's pytest (noted).
UBUNTU_PACKAGES = ("apt", "ubuntu-keyring", "ca-certificates", "python3")
_UV = re.compile(r"^ghcr\.io/astral-sh/uv:(\d+\.\d+\.\d+)$")  # uv's distroless image: /uv, /uvx
_TBENCH = re.compile(r"^ghcr\.io/laude-institute/t-bench/(python-3-(\d+)|ubuntu-(\d+)-(\d+))(:.*)?$")
MARKER = rootfs.MARKER
MAX_IMAGE_BYTES = 64 << 30  # files of an imported image, all layers together
MAX_JSON_BYTES = 16 << 20  # an index, manifest or config of an image archive


@dataclass(frozen=True)
class Base:
    """A built base image: ``root`` (a read-only directory, the bottom layer of every parent built
    on it), the image's ``env`` (PATH, LANG, PYTHON_VERSION, ...), ``notes`` naming each difference
    from what ``ref`` asked for, ``key`` (the cache entry's name, stable per recipe), and the ``user``
    and ``workdir`` a stage ``FROM`` it starts with (an imported image's config ``User`` and
    ``WorkingDir``, as Docker applies them; None: root and the task's workdir)."""

    ref: str
    root: Path
    env: dict[str, str]
    notes: tuple[str, ...]
    key: str
    user: str | None = None
    workdir: str | None = None


@dataclass(frozen=True)
class Recipe:
    """What a base is built from; its hash names the cache entry."""

    release: str
    packages: tuple[str, ...] = ()
    mirror: str = rootfs.DEFAULT_MIRROR
    python: bool = False  # pip not externally managed, python/pip on PATH
    env: dict[str, str] = field(default_factory=dict)
    uv: str = ""  # a uv image (``FROM scratch`` + /uv, /uvx) of this version, from the uv wheel: no Debian
    distro: str = "debian"  # "ubuntu": an Ubuntu suite from the Ubuntu archive (``ubuntu.py``)

    def key(self) -> str:
        parts = [RECIPE_FORMAT, self.release, sorted(self.packages), self.mirror, self.python,
                 sorted(self.env.items())]
        if self.uv:
            parts.append({"uv": self.uv, "index": self.mirror})
        if self.distro != "debian":
            parts.append({"distro": self.distro, "format": 1})
        return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:20]


# ---- resolving a FROM reference ------------------------------------------------------------------------


def resolve_base(image_ref: str | None, log: Callable[[str], None] | None = None,
                 search: Path | None = None) -> Base:
    """The base for ``FROM image_ref`` (``None``: ``DEFAULT_REF``), built once and cached.

    Stable API (used by the local and the container-engine backends). An imported image tagged
    ``image_ref`` wins (``import_image``; ``search``: a directory of OCI layouts / ``docker save``
    archives imported on first use, ``[sandbox] images``); otherwise the reference maps to a Debian
    recipe (module docstring) built with mmdebstrap from this machine's Debian mirror. Raises
    ``EnvBuildError`` for a reference with no base, ``rootfs.BaseUnavailable`` when the build cannot run."""
    ref = (image_ref or DEFAULT_REF).strip()
    imported = _imported(ref, search, log)
    if imported is not None:
        return imported
    recipe, notes = recipe_for(ref)
    root = build_recipe(recipe, log)
    return Base(ref, root, _image_env(recipe, root), tuple(notes), recipe.key())


def base_problem(ref: str, search: Path | None = None) -> str | None:
    """Why ``FROM ref`` has no base here (no recipe maps it and no image is imported under it), or None.
    Cheap: builds nothing."""
    if _tag_file(ref).is_file():
        return None
    if search is not None and Path(search).is_dir():
        for candidate in sorted(Path(search).iterdir()):
            with contextlib.suppress(EnvBuildError, OSError, tarfile.TarError):
                if normalise_ref(ref) in [normalise_ref(t) for t in image_tags(candidate)]:
                    return None
    try:
        recipe_for(ref)
    except EnvBuildError as err:
        return f"FROM {ref}: cannot be built here: {err}"
    return None


def base_notes(ref: str) -> list[str]:
    """How the base for ``FROM ref`` differs from that image (builds nothing; [] when it has none)."""
    if _tag_file(ref).is_file():
        return [f"{ref}: an imported image"]
    try:
        return recipe_for(ref)[1]
    except EnvBuildError:
        return []


def normalise_ref(ref: str) -> tuple[str, str]:
    """(name, tag) of an image reference: registry ``docker.io/library/`` and any digest dropped."""
    ref = ref.split("@", 1)[0]
    for prefix in ("docker.io/", "index.docker.io/", "registry-1.docker.io/"):
        if ref.startswith(prefix):
            ref = ref[len(prefix):]
    ref = ref.removeprefix("library/")
    name, _, tag = ref.rpartition(":") if ":" in ref.rsplit("/", 1)[-1] else (ref, "", "latest")
    return name, tag or "latest"


def recipe_for(ref: str) -> tuple[Recipe, list[str]]:
    """The recipe standing in for ``ref`` and the notes naming how it differs."""
    uv = _UV.match(ref.split("@", 1)[0])
    if uv:
        return Recipe("scratch", (), uv_index(), uv=uv.group(1)), \
            [f"{ref}: uv's image recipe (FROM scratch + /uv, /uvx), the binaries from the uv {uv.group(1)} "
             "wheel of the package index"]
    mirror = host_mirror()
    tbench = _TBENCH.match(ref)
    if tbench:  # Terminal-Bench's own base images: a python or ubuntu image with tmux
        inner = f"python:3.{tbench.group(2)}-slim" if tbench.group(2) else f"ubuntu:{tbench.group(3)}.{tbench.group(4)}"
        recipe, notes = recipe_for(inner)
        return Recipe(recipe.release, (*recipe.packages, "tmux"), mirror, recipe.python, recipe.env), \
            [f"{ref}: built as {inner} + tmux", *notes]
    name, tag = normalise_ref(ref)
    if name == "debian":
        release, notes = _debian_release(tag, ref)
        return Recipe(release, (), mirror), notes
    if name == "python":
        return _python_recipe(tag, ref, mirror)
    if name == "ubuntu":
        from albatross.sandbox.ubuntu import ubuntu_mirror

        ubuntu = UBUNTU.get(tag.split("-")[0])
        if ubuntu is None:
            raise EnvBuildError(f"no base for {ref}: unknown Ubuntu version {tag!r}")
        return Recipe(ubuntu, UBUNTU_PACKAGES, ubuntu_mirror(), distro="ubuntu"), \
            [f"{ref}: Ubuntu {ubuntu} from the Ubuntu archive (minbase), with python3, which the offline "
             "verifier's pytest runs on (uv would download a Python)"]
    if name in RUNTIMES:
        release, notes = _release_in_tag(tag, ref)
        packages = RUNTIMES[name]
        return Recipe(release, packages, mirror), \
            [*notes, f"{ref}: Debian {release} with {' '.join(packages[:2])} from Debian (its version, not "
                     f"necessarily {tag})"]
    raise EnvBuildError(f"no base for {ref}: only debian, python, ubuntu, {', '.join(sorted(RUNTIMES))} images "
                        "map to a Debian-built base here (or import the image: albatross sandbox image import)")


def _debian_release(tag: str, ref: str) -> tuple[str, list[str]]:
    word = tag.removesuffix("-slim").split("-")[0].split(".")[0]
    if word in ("latest", "stable", "slim"):
        word = "bookworm" if word == "stable" else NEWEST
    if word.isdigit():
        word = DEBIAN_NUMBERS.get(int(word), "")
    if word in RELEASES:
        return word, []
    if word in OLDER:
        return OLDER[word], [f"{ref}: Debian {word} is archived; built as {OLDER[word]}"]
    raise EnvBuildError(f"no base for {ref}: unknown Debian release {tag!r}")


def _release_in_tag(tag: str, ref: str) -> tuple[str, list[str]]:
    """The Debian release a tag names (``...-bookworm``, ``...-slim-trixie``), else the newest."""
    for part in reversed(tag.split("-")):
        if part in RELEASES:
            return part, []
        if part in OLDER:
            return OLDER[part], [f"{ref}: Debian {part} is archived; built on {OLDER[part]}"]
    return NEWEST, []


def _python_recipe(tag: str, ref: str, mirror: str) -> tuple[Recipe, list[str]]:
    """A python image's base: the Debian release the tag names (its packages are what the Dockerfile's
    apt-get and tools expect: openssl's output format, library versions), else the release whose
    python3 is closest to the version asked for, else the newest. A python3 other than 3.X is noted."""
    match = re.match(r"^(\d+)\.(\d+)", tag)
    want = (int(match.group(1)), int(match.group(2))) if match else None
    if any(p in RELEASES or p in OLDER for p in tag.split("-")):
        release, notes = _release_in_tag(tag, ref)
    elif want is not None:
        release = min(PYTHON3, key=lambda r: (abs(PYTHON3[r][1] - want[1]), -RELEASES[r]))
        notes = []
    else:
        release, notes = NEWEST, []
    have = PYTHON3[release]
    if want is not None and want != have:
        notes.append(f"{ref}: Python {have[0]}.{have[1]} (Debian {release}'s python3) stands in for "
                     f"Python {want[0]}.{want[1]}")
    env = {"LANG": "C.UTF-8", "PYTHON_VERSION": f"{have[0]}.{have[1]}"}
    return Recipe(release, PYTHON_PACKAGES, mirror, True, env), notes


# ---- building a recipe ---------------------------------------------------------------------------------


def build_recipe(recipe: Recipe, log: Callable[[str], None] | None = None, force: bool = False) -> Path:
    """The root directory of ``recipe``, built once (mmdebstrap, else debootstrap; a uv image from the uv
    wheel) and cached."""
    path = images_dir() / recipe.key()
    if recipe.uv:
        from albatross.sandbox.wheels import build_uv_root

        return rootfs.build_once(path, lambda tmp: build_uv_root(recipe.uv, recipe.mirror, tmp, log), force)
    if recipe.distro == "ubuntu":
        from albatross.sandbox.ubuntu import bootstrap_ubuntu

        return rootfs.build_once(path, lambda tmp: bootstrap_ubuntu(recipe, tmp, log or (lambda _: None)), force)
    return rootfs.build_once(path, lambda tmp: _bootstrap(recipe, tmp, log or (lambda _: None)), force)


def uv_index() -> str:
    """The package index uv images are built from: the host's pip index (http(s)), else PyPI's."""
    from albatross.sandbox.buildnet import host_package_indexes

    return host_package_indexes().get("PIP_INDEX_URL", "").split(" ")[0] or "https://pypi.org/simple"


def _bootstrap(recipe: Recipe, tmp: Path, log: Callable[[str], None]) -> dict[str, Any]:
    if os.geteuid() != 0:
        raise rootfs.BaseUnavailable("building a base image needs root")
    tool = bootstrap_tool()
    if not tool:
        raise rootfs.BaseUnavailable("neither mmdebstrap nor debootstrap is installed (apt-get install mmdebstrap)")
    include = ",".join(recipe.packages)
    head = list(MMDEBSTRAP_MINBASE) if tool == "mmdebstrap" else ["debootstrap", "--variant=minbase"]
    argv = [*head, *([f"--include={include}"] if include else []), recipe.release, str(tmp), recipe.mirror]
    start = time.monotonic()
    run_bootstrapper(argv, f"{tool} {recipe.release} from {recipe.mirror}", log)
    finish_root(tmp, recipe.python)
    seconds = round(time.monotonic() - start, 1)
    log(f"base {recipe.release} {include} built in {seconds} s")
    return {"recipe": {"release": recipe.release, "packages": list(recipe.packages), "mirror": recipe.mirror,
                       "python": recipe.python}, "tool": tool, "seconds": seconds,
            "built": time.strftime("%Y-%m-%dT%H:%M:%S"), "env": recipe.env}


def _image_env(recipe: Recipe, root: Path) -> dict[str, str]:
    env = {"PATH": DEFAULT_PATH, **recipe.env}
    with contextlib.suppress(OSError, ValueError):
        env.update(json.loads((root / MARKER).read_text()).get("env", {}))
    return env


# ---- imported images (OCI image layouts, docker save archives) -----------------------------------------


def tags_dir() -> Path:
    return images_dir() / "tags"


def _tag_file(ref: str) -> Path:
    name, tag = normalise_ref(ref)
    return tags_dir() / (hashlib.sha256(f"{name}:{tag}".encode()).hexdigest()[:24] + ".json")


def _imported(ref: str, search: Path | None, log: Callable[[str], None] | None) -> Base | None:
    path = _tag_file(ref)
    if not path.is_file() and search is not None and Path(search).is_dir():
        for candidate in sorted(Path(search).iterdir()):
            with contextlib.suppress(EnvBuildError):
                if normalise_ref(ref) in [normalise_ref(t) for t in image_tags(candidate)]:
                    import_image(candidate, ref, log)
                    break
    if not path.is_file():
        return None
    entry = json.loads(path.read_text())
    root = images_dir() / entry["key"]
    if not rootfs.is_built(root):
        return None
    source = entry.get("source", "?")
    if "user" not in entry:  # tagged before User/WorkingDir were recorded: read them from the source
        entry.update(_config_of(Path(source), entry["key"]))
    env = {"PATH": DEFAULT_PATH, **entry.get("env", {})}
    user, workdir = entry.get("user"), entry.get("workdir")
    return Base(ref, root, env, _import_notes(ref, source, user, workdir), entry["key"], user, workdir)


def _import_notes(ref: str, source: object, user: str | None, workdir: str | None) -> tuple[str, ...]:
    """The note of an imported base: where it came from, and the config's User and WorkingDir if set."""
    said = [f"{name} {value}" for name, value in (("User", user), ("WorkingDir", workdir)) if value]
    config = f" (its config's {' and '.join(said)}: a stage FROM it starts with them, as in Docker)" if said else ""
    return (f"{ref}: imported from {source}{config}",)


def _config_of(source: Path, key: str) -> dict[str, str | None]:
    """``user`` and ``workdir`` of the image at ``source`` if it is still the one imported as ``key``
    (an entry tagged before they were recorded), else {}."""
    with contextlib.suppress(EnvBuildError, OSError, tarfile.TarError):
        archive = _Archive(source)
        try:
            config, _layers, _tags, image_id = _read_image(archive)
        finally:
            archive.close()
        if _imported_key(image_id) == key:
            user, workdir = _user_and_workdir(config)
            return {"user": user, "workdir": workdir}
    return {}


def _imported_key(image_id: str) -> str:
    return "imported-" + hashlib.sha256(image_id.encode()).hexdigest()[:20]


def _user_and_workdir(config: dict[str, Any]) -> tuple[str | None, str | None]:
    """The image config's ``User`` and ``WorkingDir`` (absolute, normalised); None where unset."""
    inner = config.get("config") or {}
    user = str(inner.get("User") or "").strip() or None
    workdir = str(inner.get("WorkingDir") or "").strip()
    return user, posixpath.normpath(posixpath.join("/", workdir)) if workdir else None


class _Archive:
    """Read files of an OCI layout or a docker save archive, as a directory or a tar file. A name the
    manifest gives must be a file inside the archive: no absolute path, no ``..``, no symbolic link."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.tar = None if self.path.is_dir() else tarfile.open(self.path, "r:*")

    def read(self, name: str) -> bytes:
        """A small file of the archive (an index, a manifest, a config), whole."""
        with self.open(name) as f:
            data = f.read(MAX_JSON_BYTES + 1)
        if len(data) > MAX_JSON_BYTES:
            raise EnvBuildError(f"{self.path}: {name} is larger than {MAX_JSON_BYTES >> 20} MiB")
        return data

    def exists(self, name: str) -> bool:
        try:
            self.open(name).close()
        except (EnvBuildError, OSError, KeyError):
            return False
        return True

    def open(self, name: str) -> IO[bytes]:
        """A stream of the file ``name`` of the archive (not read into memory)."""
        parts = [p for p in name.split("/") if p not in ("", ".")]
        if name.startswith("/") or ".." in parts or not parts:
            raise EnvBuildError(f"{self.path}: the manifest names {name!r}, outside the archive")
        if self.tar is not None:
            member = self.tar.extractfile("/".join(parts))
            if member is None:
                raise EnvBuildError(f"{self.path}: {name} is not a file")
            return member
        fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for part in parts[:-1]:
                child = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                os.close(fd)
                fd = child
            leaf = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
        except OSError as err:  # missing, or a link: not a file of the archive
            raise OSError(err.errno, f"{name}: not a file inside the archive ({err.strerror})") from None
        finally:
            os.close(fd)
        if not stat.S_ISREG(os.fstat(leaf).st_mode):
            os.close(leaf)
            raise EnvBuildError(f"{self.path}: {name} is not a regular file inside the archive")
        return os.fdopen(leaf, "rb")

    def close(self) -> None:
        if self.tar is not None:
            self.tar.close()


def _blob(digest: str) -> str:
    algo, _, hexd = digest.partition(":")
    return f"blobs/{algo}/{hexd}"


def _read_image(archive: _Archive) -> tuple[dict[str, Any], list[str], list[str], str]:
    """(config, layer member names, tags, id) of the image in an OCI layout or docker save archive."""
    try:
        if archive.exists("manifest.json"):  # docker save (also written next to index.json by newer dockers)
            entry = json.loads(archive.read("manifest.json"))[0]
            config = json.loads(archive.read(entry["Config"]))
            return config, list(entry["Layers"]), list(entry.get("RepoTags") or []), entry["Config"]
        index = json.loads(archive.read("index.json"))
        manifest, tags = _pick_manifest(archive, index)
        config = json.loads(archive.read(_blob(manifest["config"]["digest"])))
        layers = [_blob(layer["digest"]) for layer in manifest["layers"]]
        return config, layers, tags, manifest["config"]["digest"]
    except (KeyError, IndexError, ValueError, OSError) as err:
        raise EnvBuildError(f"{archive.path}: not an OCI image layout or docker save archive ({err})") from err


def _pick_manifest(archive: _Archive, index: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    entries = index.get("manifests", [])
    for entry in entries:
        doc = json.loads(archive.read(_blob(entry["digest"])))
        tags = [t for t in [entry.get("annotations", {}).get("org.opencontainers.image.ref.name", "")] if t]
        if "manifests" in doc:  # an image index: the linux/amd64 (or first) manifest in it
            inner = doc["manifests"]
            arch = os.uname().machine.replace("x86_64", "amd64").replace("aarch64", "arm64")
            chosen = next((m for m in inner if m.get("platform", {}).get("architecture") == arch), inner[0])
            return json.loads(archive.read(_blob(chosen["digest"]))), tags
        return doc, tags
    raise KeyError("index.json lists no manifest")


def image_tags(path: Path) -> list[str]:
    """The tags an OCI layout (``org.opencontainers.image.ref.name``) or docker save archive names."""
    archive = _Archive(path)
    try:
        return _read_image(archive)[2]
    finally:
        archive.close()


def import_image(path: Path, tag: str, log: Callable[[str], None] | None = None,
                 max_bytes: int = MAX_IMAGE_BYTES) -> Base:
    """Unpack the image at ``path`` (OCI layout directory or tar, or docker save archive) into the cache
    and tag it ``tag``: layers in order, streamed (never whole in memory), whiteouts honoured, nothing
    written outside the root (``extract``), no device node made, at most ``max_bytes`` of files in all;
    env from the image config; its ``User`` and ``WorkingDir`` are recorded with the tag (the WorkingDir
    is made, root's, if no layer has it, as Docker makes it when a container starts). The key is the
    config's digest, which covers all three."""
    archive = _Archive(Path(path))
    try:
        config, layers, _tags, image_id = _read_image(archive)
        key = _imported_key(image_id)
        env = dict(e.split("=", 1) for e in (config.get("config") or {}).get("Env") or [] if "=" in e)
        user, workdir = _user_and_workdir(config)

        def unpack(tmp: Path) -> dict[str, Any]:
            tmp.mkdir(parents=True, exist_ok=True)
            left = max_bytes
            for name in layers:
                with archive.open(name) as stream:
                    left -= apply_layer(tmp, stream, extract.Bounds(max_bytes=left)).bytes
            if workdir is not None:
                extract.make_dirs(tmp, workdir)
            return {"source": str(path), "env": env, "image": image_id, "user": user, "workdir": workdir}

        root = rootfs.build_once(images_dir() / key, unpack)
    finally:
        archive.close()
    tags_dir().mkdir(parents=True, exist_ok=True)
    entry = {"ref": tag, "key": key, "source": str(path), "env": env, "user": user, "workdir": workdir}
    tmp = _tag_file(tag).with_suffix(f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(entry) + "\n")
    tmp.rename(_tag_file(tag))
    if log:
        log(f"imported {path} as {tag}: {root}")
    return Base(tag, root, {"PATH": DEFAULT_PATH, **env}, _import_notes(tag, path, user, workdir), key, user,
                workdir)


def apply_layer(root: Path, stream: IO[bytes], bounds: extract.Bounds | None = None) -> extract.Unpacked:
    """Apply one layer tar (plain, gzip or xz; streamed) to ``root``: ``.wh.NAME`` deletes NAME,
    ``.wh..wh..opq`` empties the directory of what lower layers put there, every path resolved inside
    ``root`` without following a link out of it, no device node made (``extract.unpack``)."""
    try:
        return extract.unpack(stream, str(root), whiteouts=True, bounds=bounds or extract.Bounds())
    except extract.UnsafeArchive as err:
        raise EnvBuildError(f"image layer: {err}") from None


# ---- the cache -----------------------------------------------------------------------------------------


def list_images() -> list[dict[str, Any]]:
    """Every built base in the cache: its key, path and what it was built from (its marker)."""
    found = []
    for path in sorted(images_dir().glob("*")):
        if rootfs.is_built(path):
            with contextlib.suppress(OSError, ValueError):
                found.append({"key": path.name, "path": str(path), **json.loads((path / MARKER).read_text())})
    return found

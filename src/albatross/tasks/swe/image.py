"""One base image per project version: the repository and its test dependencies, built once and shared by every
task of that project.

The image is built from a build context (``context``): ``FROM python:3.X-slim``, git from the Debian archive, the
unpacked sdist at ``/repo``, and ``install.py`` (an editable install with the test extras and pytest, run as a
``RUN`` step, so it reaches the package registries the way any build step does, under the build's network policy).
The sandbox builds it like any task environment; its root is then written out of an attempt of it (a tar, read
back in pieces), stored as an OCI image layout under ``$ALBATROSS_CACHE/swe/images/<key>`` and imported under the
tag ``albatross-swe/<name>:<version>-<key>``, where ``key`` hashes everything the build reads (the sdist's
sha256, the Python, the Dockerfile, ``install.py``): content-addressed, built once per machine. Each task's
Dockerfile is then ``FROM`` that tag plus its mutated files and a fresh one-commit git repository: a small layer
over a base every task shares (on disk, read-only), instead of a full install per task.

The repository in the image has no ``.git`` (each task makes its own, so no object of the original code is in
any task's history) and no ``__pycache__``. Elsewhere, import the layout with ``albatross sandbox image import
<layout> --tag <tag>`` or rebuild it with the same ``albatross tasks swe`` command.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from albatross.errors import UserError
from albatross.sandbox.base import Attempt, Backend
from albatross.tasks.swe.sdist import Sdist, unpack

FORMAT = "1"
REPO = "/repo"
_INSTALL = Path(__file__).with_name("install.py")
_PART_BYTES = 40 << 20  # pieces read back from the attempt (under the sandbox's 64 MiB read limit)
_ENV_SKIP = {"PWD", "OLDPWD", "SHLVL", "_", "HOSTNAME", "HOME", "TERM", "SANDBOX_ROOT"}
_EXPORT_DIR = "/tmp/.albatross-export"


@dataclass(frozen=True)
class ProjectImage:
    """A project's base image: its ``tag`` (what task Dockerfiles name in FROM), the build ``context`` (with the
    unpacked repository in ``context/repo``), the OCI ``layout`` it was imported from, and ``env_dir``: an
    environment ``FROM tag`` with ``WORKDIR /repo`` that the generator forks attempts from."""

    tag: str
    key: str
    context: Path
    layout: Path
    env_dir: Path
    python: str

    @property
    def repo(self) -> Path:
        return self.context / "repo"


def python_ref(python: str) -> str:
    """The FROM reference of a Python version (``3.11`` -> ``python:3.11-slim``)."""
    if not python.replace(".", "").isdigit():
        raise UserError(f"--python {python!r}: expected a version such as 3.11")
    return f"python:{python}-slim"


def dockerfile(python: str) -> str:
    return (f"FROM {python_ref(python)}\n"
            "ENV PYTHONDONTWRITEBYTECODE=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1\n"
            "RUN apt-get update && apt-get install -y --no-install-recommends git && rm -rf /var/lib/apt/lists/*\n"
            f"COPY repo/ {REPO}/\n"
            "COPY install.py /tmp/albatross-install.py\n"
            f"RUN python3 /tmp/albatross-install.py {REPO} && rm -f /tmp/albatross-install.py\n"
            f"WORKDIR {REPO}\n")


def image_key(sdist: Sdist, python: str) -> str:
    text = json.dumps([FORMAT, sdist.name, sdist.version, sdist.sha256, dockerfile(python), _INSTALL.read_text()])
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def image_tag(sdist: Sdist, key: str) -> str:
    version = "".join(c if c.isalnum() or c in "._-" else "_" for c in sdist.version)
    return f"albatross-swe/{sdist.name}:{version}-{key}"


def project_image(sdist: Sdist, python: str, root: Path, make_backend: Callable[[], Backend],
                  log: Callable[[str], None] = print) -> ProjectImage:
    """The project's base image, built and imported once (content-addressed; see the module docstring).
    ``make_backend()`` gives a sandbox backend for the build (closed afterwards)."""
    from albatross.sandbox.images import base_problem

    key = image_key(sdist, python)
    tag = image_tag(sdist, key)
    base = root / key
    context, layout, env_dir = base / "context", base / "layout", base / "env"
    image = ProjectImage(tag, key, context, layout, env_dir, python)
    if not (context / "repo").is_dir():
        _write_context(sdist, python, context)
    env_dir.mkdir(parents=True, exist_ok=True)
    (env_dir / "Dockerfile").write_text(f"FROM {tag}\nWORKDIR {REPO}\n")
    if base_problem(tag) is None:
        return image
    if not (layout / "index.json").is_file():
        _build_layout(image, make_backend, log)
    from albatross.sandbox.images import import_image

    import_image(layout, tag, log=log)
    return image


def _write_context(sdist: Sdist, python: str, context: Path) -> None:
    tmp = context.with_name(context.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    unpack(sdist, tmp / "repo")
    shutil.copyfile(_INSTALL, tmp / "install.py")
    (tmp / "Dockerfile").write_text(dockerfile(python))
    shutil.rmtree(context, ignore_errors=True)
    tmp.rename(context)


def _build_layout(image: ProjectImage, make_backend: Callable[[], Backend], log: Callable[[str], None]) -> None:
    """Build the context in a sandbox, read its root back and write it as a one-layer OCI image layout."""
    from albatross.sandbox.base import Limits, SandboxError

    t0 = time.monotonic()
    log(f"[swe] building {image.tag} (the repository and its test dependencies; once)")
    tmp = image.layout.with_name(image.layout.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "blobs" / "sha256").mkdir(parents=True)
    backend = make_backend()
    try:
        backend.prepare(image.context)
        attempt = backend.fork(image.context, REPO, Limits(memory_mb=6144, disk_mb=4096, pids=256,
                                                            command_timeout_s=1200.0))
        try:
            env = _read_root(attempt, tmp / "layer.tar.gz")
        finally:
            attempt.close()
    except (SandboxError, OSError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(f"{image.context / 'Dockerfile'}: the project image does not build: "
                        f"{str(e).strip()[-600:]}") from None
    finally:
        backend.close()
    size = _write_layout(tmp, env, image.tag)
    shutil.rmtree(image.layout, ignore_errors=True)
    tmp.rename(image.layout)
    log(f"[swe] {image.tag}: {size >> 20} MiB compressed, {time.monotonic() - t0:.0f} s")


def _read_root(attempt: Attempt, dest: Path) -> dict[str, str]:
    """Write the attempt's root as a gzip tar to ``dest`` (read back in pieces); returns the image's env."""
    script = (f"rm -rf {_EXPORT_DIR} && mkdir -p {_EXPORT_DIR} && cd / && "
              f"tar --numeric-owner --one-file-system -cpf - --exclude=.{_EXPORT_DIR} --exclude=./proc "
              f"--exclude=./sys --exclude=./dev . | gzip -1 | split -b {_PART_BYTES} -d -a 4 - {_EXPORT_DIR}/part-"
              f" && ls {_EXPORT_DIR}")
    result = attempt.exec(script, 1200.0)
    if result.exit_code != 0:
        raise OSError(f"cannot write the image's root out: {result.output[-400:]}")
    parts = sorted(line.strip() for line in result.output.splitlines() if line.strip().startswith("part-"))
    with dest.open("wb") as out:
        for name in parts:
            data = attempt.read_file(f"{_EXPORT_DIR}/{name}")
            if data is None:
                raise OSError(f"cannot read {_EXPORT_DIR}/{name} back")
            out.write(data)
            attempt.exec(f"rm -f {_EXPORT_DIR}/{name}", 30.0)  # the attempt's disk holds one piece less
    env = attempt.exec_clean("env -0", "/", 30.0)
    pairs = [item.split("=", 1) for item in env.output.split("\0") if "=" in item]
    return {k: v for k, v in pairs if k not in _ENV_SKIP and k.isidentifier()}


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _file_digests(path: Path) -> tuple[str, str, int]:
    """(sha256 of the file, sha256 of its gunzipped content, size), read in chunks."""
    outer, inner = hashlib.sha256(), hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            outer.update(chunk)
    with gzip.open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            inner.update(chunk)
    return "sha256:" + outer.hexdigest(), "sha256:" + inner.hexdigest(), path.stat().st_size


def _write_layout(layout: Path, env: dict[str, str], tag: str) -> int:
    """Make ``layout`` (holding ``layer.tar.gz``) an OCI image layout: the layer as a blob, its config (Env,
    WorkingDir) and a manifest tagged ``tag``; returns the layer's size."""
    blobs = layout / "blobs" / "sha256"
    layer_digest, diff_id, size = _file_digests(layout / "layer.tar.gz")
    (layout / "layer.tar.gz").rename(blobs / layer_digest.split(":")[1])
    config = {"architecture": "amd64", "os": "linux",
              "config": {"Env": [f"{k}={v}" for k, v in sorted(env.items())], "WorkingDir": REPO},
              "rootfs": {"type": "layers", "diff_ids": [diff_id]}}
    config_bytes = json.dumps(config, sort_keys=True).encode()
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                           "digest": _digest(config_bytes), "size": len(config_bytes)},
                "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": layer_digest,
                            "size": size}]}
    manifest_bytes = json.dumps(manifest, sort_keys=True).encode()
    for data in (config_bytes, manifest_bytes):
        (blobs / _digest(data).split(":")[1]).write_bytes(data)
    index = {"schemaVersion": 2, "manifests": [{"mediaType": manifest["mediaType"], "digest": _digest(manifest_bytes),
                                                 "size": len(manifest_bytes),
                                                 "annotations": {"org.opencontainers.image.ref.name": tag}}]}
    (layout / "index.json").write_text(json.dumps(index))
    (layout / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
    return size

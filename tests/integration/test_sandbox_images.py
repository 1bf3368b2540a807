"""Real base images under real sandboxes: a Dockerfile's FROM is the attempt's root, builds reach the
package registries, attempts reach nothing, and nothing of the host shows through.

The first run builds the bases (mmdebstrap, a minute or two each, cached in ``~/.cache/albatross/images``);
later runs take seconds. Needs root, the local sandbox and the Debian archive (and PyPI for the pip test).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from albatross.sandbox import EnvBuildError, LocalBackend, local_available
from albatross.sandbox.images import resolve_base
from sandbox_util import task_env

needs_local = pytest.mark.skipif(not local_available(), reason="the local sandbox needs root, cgroups, namespaces")
pytestmark = needs_local
REPO = Path(__file__).resolve().parents[2]


def test_default_backend_base_is_the_image(backend: LocalBackend) -> None:
    assert backend.base == "image"


def test_bookworm_base_is_the_attempt_root(backend: LocalBackend, tmp_path: Path) -> None:
    base = resolve_base("debian:bookworm-slim")
    with backend.fork(task_env(tmp_path, "FROM debian:bookworm-slim\nWORKDIR /app\n")) as attempt:
        result = attempt.exec(". /etc/os-release; echo $VERSION_CODENAME; command -v python3 || echo no-python")
        assert result.output.split() == ["bookworm", "no-python"]  # minbase: no python, unlike the host
    assert (base.root / "etc/debian_version").read_text().startswith("12.")


def test_attempt_sees_the_image_not_the_host(backend: LocalBackend, tmp_path: Path) -> None:
    image = resolve_base("python:3.11-slim-bookworm")
    with backend.fork(task_env(tmp_path, "FROM python:3.11-slim-bookworm\nWORKDIR /app\n")) as attempt:
        shadow = attempt.read_file("/etc/shadow")
        hostname = attempt.read_file("/etc/hostname")
        assert shadow == (image.root / "etc/shadow").read_bytes()
        assert shadow != Path("/etc/shadow").read_bytes()
        assert hostname == b"sandbox\n" != Path("/etc/hostname").read_bytes()
        # no host path of albatross's own processes: the repository, the host python's prefix
        for path in (str(REPO), sys.prefix, os.path.dirname(sys.executable), "/work", "/farm"):
            probe = attempt.exec(f"test -e {path} && ls -A {path} | head -3")
            assert probe.exit_code != 0 or probe.output.strip() == "", (path, probe.output)
        assert attempt.exec("python --version").output.strip() == "Python 3.11.2"
        # the python images' C headers: a C extension needs only gcc (Terminal-Bench's portfolio-optimization)
        assert attempt.exec("python3 -c \"import sysconfig, os; print(os.path.isfile(os.path.join("
                            "sysconfig.get_paths()['include'], 'Python.h')))\"").output.strip() == "True"
        # nothing of the host is there to hide: the image's own /root and /home stay (Docker's view)
        assert attempt.read_file("/root/.bashrc") == (image.root / "root/.bashrc").read_bytes()


def test_pip_install_in_run_step_and_attempt_has_no_network(backend: LocalBackend, tmp_path: Path) -> None:
    dockerfile = ("FROM python:3.11-slim-bookworm\nWORKDIR /app\n"
                  "RUN pip install --no-deps six==1.16.0\n")
    with backend.fork(task_env(tmp_path, dockerfile)) as attempt:
        assert attempt.exec("python -c 'import six; print(six.__version__)'").output.strip() == "1.16.0"
        offline = attempt.exec("pip download --no-deps -d /tmp/x idna==3.7 --timeout 3 --retries 0 2>&1")
        assert offline.exit_code != 0
        net = attempt.exec("python3 -c \"import socket; socket.create_connection(('151.101.0.223', 443), 3)\"")
        assert net.exit_code != 0 and "unreachable" in net.output.lower()


def test_unreachable_host_is_a_named_build_failure(backend: LocalBackend, tmp_path: Path) -> None:
    dockerfile = "FROM python:3.11-slim-bookworm\nRUN python -c \"import urllib.request as u; u.urlopen('https://github.com/x')\"\n"
    with pytest.raises(EnvBuildError, match=r"Dockerfile:2: RUN needs github\.com"):
        backend.prepare(task_env(tmp_path, dockerfile))


def test_no_dockerfile_forks_default_base(backend: LocalBackend) -> None:
    with backend.fork(None, "/") as attempt:
        assert attempt.exec("python3 -c 'print(1+1)'").output.strip() == "2"


def test_copy_from_uvs_image_built_from_its_wheel(backend: LocalBackend, tmp_path: Path) -> None:
    """`COPY --from=ghcr.io/astral-sh/uv:<version>` (Terminal-Bench's Dockerfiles): uv's distroless image,
    rebuilt from the uv wheel of the package index, gives the real binaries of that version. The second
    stage is built on the first, which the layer store keeps with it."""
    dockerfile = ("FROM debian:bookworm-slim AS build\nCOPY --from=ghcr.io/astral-sh/uv:0.8.14 /uv /uvx /bin/\n"
                  "RUN uv --version > /uv.txt\nFROM build\nWORKDIR /app\n")
    with backend.fork(task_env(tmp_path, dockerfile)) as attempt:
        assert attempt.exec("cat /uv.txt; uvx --version; ls /bin/uv").output.split("\n")[:3] == [
            "uv 0.8.14", "uvx 0.8.14", "/bin/uv"]
    assert sorted(p.name for p in resolve_base("ghcr.io/astral-sh/uv:0.8.14").root.iterdir()) == [
        ".albatross-base.json", "uv", "uvx"]


def test_multi_stage_copy_from_earlier_stage(backend: LocalBackend, tmp_path: Path) -> None:
    dockerfile = ("FROM debian:bookworm-slim AS build\nWORKDIR /src\nRUN echo compiled > out.bin\n"
                  "FROM build AS test\nRUN cat out.bin > checked\n"
                  "FROM python:3.11-slim-bookworm\nWORKDIR /app\nCOPY --from=build /src/out.bin ./\n"
                  "COPY --from=1 /src/checked /app/\n")
    with backend.fork(task_env(tmp_path, dockerfile)) as attempt:
        assert attempt.exec("cat /app/out.bin /app/checked; ls /src 2>&1 | head -1").output.split("\n")[:2] == [
            "compiled", "compiled"]
        assert attempt.exec("test -e /src").exit_code != 0  # the earlier stages are not in the image


def test_adapted_environments_on_one_image_stack_on_one_toolkit_layer(tmp_path: Path) -> None:
    """The offline toolkit an adapted environment ADDs after FROM is built once per image, as a layer the
    environments stack on, not copied into each one's own layer; a shared layer pruned since is built again."""
    from albatross.sandbox.layers import LayerStore, read_record
    from albatross.tasks.offline import TOOLKIT_PATH, adapt_environment

    def adapted(name: str) -> Path:
        env = task_env(tmp_path / name, "FROM python:3.11-slim-bookworm\nWORKDIR /app\nCOPY data.txt /app/\n",
                       {"data.txt": f"{name}\n"})
        found = adapt_environment(env)
        assert found is not None
        return found.env_dir

    envs = [adapted(name) for name in ("one", "two", "three")]
    store = tmp_path / "layers"

    def run_all() -> list[str]:
        b = LocalBackend(warm=0, hide_paths=[tmp_path])
        b.layers = LayerStore(True, store)
        try:
            for env, name in zip(envs, ("one", "two", "three"), strict=True):
                with b.fork(env) as attempt:
                    r = attempt.exec(f"cat /app/data.txt; test -x {TOOLKIT_PATH}/bin/apt-get && echo shims; "
                                     "python -c 'print(6*7)'")
                    assert r.output.split() == [name, "shims", "42"], r.output
        finally:
            b.close()
        return sorted(p.name for p in store.iterdir() if "." not in p.name)

    keys = run_all()
    shared = [k for k in keys if k.startswith("shared-")]
    own = [k for k in keys if not k.startswith("shared-")]
    assert len(shared) == 1 and len(own) == 3, keys
    for key in own:
        record = read_record(store / key / "parent.json")
        assert record is not None and {"shared": shared[0], "path": "s0/layer"} in record["stack"]
        assert not (store / key / record["layer"] / TOOLKIT_PATH.lstrip("/")).exists()  # not a copy of its own
        assert record["bytes"] < 1 << 20
    assert (store / shared[0] / "s0/layer" / TOOLKIT_PATH.lstrip("/") / "bin/apt-get").is_file()
    import shutil

    shutil.rmtree(store / shared[0])  # pruned: the environments that stack on it are built again, with it
    assert run_all() == keys

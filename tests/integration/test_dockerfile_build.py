"""Dockerfile semantics applied by a real local sandbox attempt (the builder a parent build uses):
COPY into a directory WORKDIR made, directory contents, ADD of an archive, --chown/--chmod, heredocs,
SHELL, USER for RUN and WORKDIR, COPY --from a stage root, and ADD of a URL with no network."""

from __future__ import annotations

import os
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from albatross.sandbox import LocalBackend, local_available
from albatross.sandbox.build import EnvBuildError, Parent, apply_dockerfile
from albatross.sandbox.dockerfile import parse_dockerfile, split_stages
from sandbox_util import ok_output

pytestmark = pytest.mark.skipif(
    not local_available(), reason="the local sandbox needs root, cgroup v1 memory+pids, namespaces, overlayfs"
)

DOCKERFILE = """\
FROM debian:bookworm
ARG V=7
WORKDIR /app
COPY f.py /app
COPY data/ /app/data
ADD pkg.tar.gz /opt/
COPY --chown=nobody:nogroup --chmod=640 f.py /app/owned.py
COPY <<EOF /app/conf.txt
v=$V
EOF
SHELL ["/bin/bash", "-c"]
RUN [[ -f /app/f.py ]] && echo "bash $V" > /app/bash.txt
USER nobody
WORKDIR mine
RUN id -u > uid.txt
"""


@pytest.fixture(scope="module")
def attempt() -> Iterator:
    backend = LocalBackend(base="host", warm=0)
    try:
        with backend.fork(None, "/") as att:
            yield att
    finally:
        backend.close()


def make_env(tmp_path: Path, dockerfile: str) -> Path:
    env = tmp_path / "environment"
    (env / "data" / "sub").mkdir(parents=True)
    (env / "data" / "sub" / "b.txt").write_text("b\n")
    (env / "f.py").write_text("print(1)\n")
    (env / "pkg").mkdir()
    (env / "pkg" / "lib.txt").write_text("lib\n")
    with tarfile.open(env / "pkg.tar.gz", "w:gz") as tar:
        tar.add(env / "pkg", arcname="pkg")
    (env / "Dockerfile").write_text(dockerfile)
    return env


def test_instructions_applied_as_docker_does(attempt, tmp_path: Path) -> None:
    env = make_env(tmp_path, DOCKERFILE)
    parent = Parent("test", "unused")
    apply_dockerfile(parse_dockerfile(env / "Dockerfile"), parent, attempt, env, 60)
    assert ok_output(attempt, "cat /app/f.py") == "print(1)"  # into the directory WORKDIR made, not over it
    assert ok_output(attempt, "cat /app/data/sub/b.txt") == "b"  # a directory's contents
    assert ok_output(attempt, "cat /opt/pkg/lib.txt") == "lib"  # ADD extracted the archive
    assert ok_output(attempt, "test ! -e /opt/pkg.tar.gz && echo gone") == "gone"
    assert ok_output(attempt, "stat -c '%U:%G %a' /app/owned.py") == "nobody:nogroup 640"
    assert ok_output(attempt, "stat -c '%u:%g' /app/f.py") == "0:0"
    assert ok_output(attempt, "cat /app/conf.txt") == "v=7"
    assert ok_output(attempt, "cat /app/bash.txt") == "bash 7"  # SHELL bash: [[ ]] works; ARG is in RUN's env
    assert ok_output(attempt, "cat /app/mine/uid.txt") == "65534"  # RUN as USER nobody
    assert ok_output(attempt, "stat -c '%U' /app/mine") == "nobody"  # WORKDIR made as the USER (BuildKit)
    assert (parent.user, parent.workdir) == ("nobody", "/app/mine")  # a relative WORKDIR extends the last


def test_parent_built_by_the_local_backend(tmp_path: Path) -> None:
    """The backend's own build path: `WORKDIR /app` then `COPY f.py /app` gives /app/f.py in every attempt."""
    env = make_env(tmp_path, "FROM debian:12\nWORKDIR /app\nCOPY f.py /app\nRUN test -f /app/f.py\n")
    backend = LocalBackend(base="host", warm=0, hide_paths=[tmp_path])
    try:
        assert backend.prepare(env).workdir == "/app"
        with backend.fork(env, "/app") as att:
            assert ok_output(att, "cat f.py; test -d /app && echo dir") == "print(1)\ndir"
            # on the host's root its private places are hidden (an image base has none of them)
            assert ok_output(att, "ls -A /work /root /home | grep -v '^/.*:$' | grep -v '^$' || true") == ""
    finally:
        backend.close()


def test_copy_from_a_stage_root(attempt, tmp_path: Path) -> None:
    stage = tmp_path / "stage-root"
    (stage / "opt" / "tool").mkdir(parents=True)
    (stage / "opt" / "tool" / "run").write_text("#!/bin/sh\necho tool\n")
    os.chmod(stage / "opt" / "tool" / "run", 0o755)
    (stage / "usr" / "bin").mkdir(parents=True)
    os.symlink("/opt/tool/run", stage / "usr" / "bin" / "tool")  # absolute: inside the stage, not the host
    env = make_env(tmp_path, "FROM debian:12 AS build\nRUN make\nFROM debian:12\n"
                   "COPY --from=build /usr/bin/tool /usr/local/bin/\n")
    last = split_stages(parse_dockerfile(env / "Dockerfile"))[-1]
    apply_dockerfile(last.instructions, Parent("test", "unused"), attempt, env, 60, stages={"build": stage})
    assert ok_output(attempt, "/usr/local/bin/tool") == "tool"


def test_named_build_failures(attempt, tmp_path: Path) -> None:
    env = make_env(tmp_path, "FROM debian:12\nADD https://example.com/x.tgz /opt/\n")
    with pytest.raises(EnvBuildError, match=r"Dockerfile:2: ADD https://example.com/x.tgz: needs example.com"):
        apply_dockerfile(parse_dockerfile(env / "Dockerfile"), Parent("t", "u"), attempt, env, 60)
    (env / "Dockerfile").write_text("FROM debian:12\nUSER ghost\nRUN true\n")
    with pytest.raises(EnvBuildError, match=r"Dockerfile:3: USER ghost: no user 'ghost'"):
        apply_dockerfile(parse_dockerfile(env / "Dockerfile"), Parent("t", "u"), attempt, env, 60)


def test_leak_scan_of_an_untouched_attempt(attempt, tmp_path: Path) -> None:
    """The gate's scan hashes every file of a secret's size in the image: a copy of the expected output
    anywhere is a leak naming both files; the input the instruction names is not."""
    from albatross.tasks import load_task, write_task
    from albatross.tasks.leakage import scan_for_leaks

    expected, given = "the expected output, kept by the tests\n", "the input the agent is asked to compress\n"
    task = load_task(write_task(tmp_path / "t", instruction="Compress /srv/input.txt.\n", task_toml={},
                                env_files={}, dockerfile="FROM debian:12\n", solve_sh="#!/bin/bash\ntrue\n",
                                test_sh="#!/bin/bash\ntrue\n",
                                test_files={"expected.txt": expected, "reference.txt": given}))
    files = tmp_path / "image"
    (files / "var" / "cache" / "x").mkdir(parents=True)
    (files / "var" / "cache" / "x" / "out.txt").write_text(expected)
    (files / "srv").mkdir()
    (files / "srv" / "input.txt").write_text(given)
    from albatross.sandbox.build import dir_tar

    attempt.put_tar(dir_tar(files, "/"))
    assert scan_for_leaks(attempt, task) == ["tests/expected.txt is readable in the image at /var/cache/x/out.txt"]


def test_add_of_a_url_downloads_when_the_build_has_a_network(attempt, tmp_path: Path) -> None:
    """Where ADD puts a download and with which mode (the download itself is the backend's fetcher, which
    checks the build's network policy; a server of the host is refused there: tests/security)."""
    import functools
    import shutil
    import threading
    import urllib.request
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    def fetch(url: str, out, where: str) -> None:
        with urllib.request.urlopen(url, timeout=30) as response:
            shutil.copyfileobj(response, out)

    served = tmp_path / "served"
    served.mkdir()
    (served / "tool.sh").write_text("echo downloaded\n")
    handler = functools.partial(SimpleHTTPRequestHandler, directory=str(served))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/tool.sh"
        env = make_env(tmp_path, f"FROM debian:12\nADD {url} /opt/dl/\nADD {url} /opt/dl/renamed.sh\n")
        apply_dockerfile(parse_dockerfile(env / "Dockerfile"), Parent("t", "u"), attempt, env, 60, fetch=fetch)
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
    assert ok_output(attempt, "cat /opt/dl/tool.sh; stat -c '%a %u' /opt/dl/renamed.sh") == "echo downloaded\n600 0"

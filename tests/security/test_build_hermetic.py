"""Hermetic builds: a Dockerfile's RUN steps run in a network namespace of their own, reach only what the
task's network policy allows (the package registries, through albatross's egress proxy), never a service
of the host (its 127.0.0.1 or any of its own addresses); the download caches are not shared writable
between environments; ``build_timeout_sec`` bounds the whole build."""

from __future__ import annotations

import http.server
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _probes import make_task, needs_local

from albatross.sandbox import LocalBackend
from albatross.tasks.gates import FAIL, gate_task
from sandbox_util import task_env

pytestmark = needs_local
SECRET = "host-secret-7f3a"


class _Secret(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        body = SECRET.encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def host_server() -> Iterator[int]:
    """An HTTP server of the host on every address (0.0.0.0): its port."""
    server = http.server.ThreadingHTTPServer(("0.0.0.0", 0), _Secret)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def host_address() -> str:
    """One of the host's own non-loopback addresses (the source address of its default route)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: no packet is sent for a UDP connect
            return s.getsockname()[0]
        except OSError:
            pytest.skip("the host has no default route")
    return ""


FETCH = {  # how a RUN step tries to read the host's server (writes what it got to /got.txt)
    "urllib": "python3 -c \"import urllib.request; print(urllib.request.urlopen('http://{host}:{port}/s', "
              "timeout=5).read().decode())\"",
    "socket": "python3 -c \"import socket; s = socket.create_connection(('{host}', {port}), 5); "
              "s.sendall(b'GET /s HTTP/1.0\\\\r\\\\n\\\\r\\\\n'); "
              "print(b''.join(iter(lambda: s.recv(4096), b'')).decode())\"",
}


@pytest.mark.parametrize("how", sorted(FETCH))
@pytest.mark.parametrize("where", ["loopback", "host-address"])
def test_run_step_cannot_reach_a_host_service(backend: LocalBackend, host_server: int, tmp_path: Path,
                                              how: str, where: str) -> None:
    host = "127.0.0.1" if where == "loopback" else host_address()
    fetch = FETCH[how].format(host=host, port=host_server)
    env = task_env(tmp_path, f"FROM python:3.11-slim-bookworm\nRUN {fetch} > /got.txt 2>&1 || true\n")
    with backend.fork(env) as attempt:
        got = (attempt.read_file("/got.txt") or b"").decode(errors="replace")
    assert SECRET not in got, got


def test_add_of_a_url_cannot_fetch_a_host_service(backend: LocalBackend, host_server: int, tmp_path: Path) -> None:
    """albatross downloads an ``ADD <url>`` itself (as Docker's daemon does): from the host, so the build's
    policy is checked there too."""
    from albatross.sandbox import EnvBuildError

    env = task_env(tmp_path, f"FROM python:3.11-slim-bookworm\nADD http://127.0.0.1:{host_server}/s /got.txt\n")
    try:
        with backend.fork(env) as attempt:
            got = (attempt.read_file("/got.txt") or b"").decode(errors="replace")
    except EnvBuildError as err:
        got = str(err)
    assert SECRET not in got, got


def test_build_cannot_poison_the_caches_of_another_build(backend: LocalBackend, tmp_path: Path) -> None:
    poison = ("RUN for f in \"$SSL_CERT_FILE\" /var/cache/albatross-ca/ca-certificates.crt; do "
              "[ -n \"$f\" ] && echo POISON >> \"$f\" && echo wrote \"$f\" >> /wrote.txt; done 2>/dev/null; "
              "mkdir -p /var/cache/albatross-pip/http /var/cache/albatross-npm 2>/dev/null; "
              "echo POISON > /var/cache/albatross-pip/http/poison; echo POISON > /var/cache/albatross-npm/poison; "
              "echo POISON > /var/cache/apt/archives/poison_1.0_all.deb; true\n")
    look = ("RUN cat \"$SSL_CERT_FILE\" /var/cache/albatross-pip/http/poison /var/cache/albatross-npm/poison "
            "/var/cache/apt/archives/poison_1.0_all.deb > /seen.txt 2>/dev/null; true\n")
    first = task_env(tmp_path / "a", "FROM python:3.11-slim-bookworm\n" + poison)
    second = task_env(tmp_path / "b", "FROM python:3.11-slim-bookworm\nENV OTHER=1\n" + look)
    with backend.fork(first) as attempt:
        wrote = attempt.read_file("/wrote.txt")
    with backend.fork(second) as attempt:
        seen = attempt.read_file("/seen.txt") or b""
    assert wrote is None, wrote  # the CA bundle a build trusts is read-only to it
    assert b"POISON" not in seen


def test_build_timeout_bounds_the_whole_build(backend: LocalBackend, tmp_path: Path) -> None:
    dockerfile = "FROM python:3.11-slim-bookworm\nRUN sleep 25\n"
    task = make_task(tmp_path, "slow-build", dockerfile=dockerfile, toml={"environment": {"build_timeout_sec": 2}})
    start = time.monotonic()
    report = gate_task(task.path, backend)
    elapsed = time.monotonic() - start
    assert report.gates["build"].status == FAIL, report.gates["build"]
    assert elapsed < 15, f"the build ran {elapsed:.0f} s with build_timeout_sec = 2"

"""Limits of an attempt: each one hit is an outcome the agent sees (ExecResult.limit), the attempt stays
usable, and nothing spills over to the host."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from albatross.sandbox import Limits, LocalBackend, ProcessBackend, local_available
from albatross.sandbox.local import LocalAttempt

pytestmark = pytest.mark.skipif(
    not local_available(), reason="the local sandbox needs root, cgroup v1 memory+pids, namespaces, overlayfs"
)


def fork(backend: LocalBackend, **limits: object) -> LocalAttempt:
    return backend.fork(None, workdir="/app", limits=Limits(**limits))  # type: ignore[arg-type]


def test_memory_hog_is_killed_and_reported_oom(backend: LocalBackend) -> None:
    with fork(backend, memory_mb=64) as attempt:
        hog = "python3 -c \"b = bytearray(200 << 20); b[::4096] = b'x' * len(b[::4096]); print('sur' + 'vived')\""
        result = attempt.exec(hog, timeout_s=60)
        assert result.limit == "oom", result
        assert result.exit_code == 137 and "survived" not in result.output
        assert attempt.exec("echo still-here").output == "still-here\n"  # the holder was not the victim


def test_fork_bomb_is_contained_and_reported(backend: LocalBackend) -> None:
    with fork(backend, pids=48) as attempt:
        start = time.monotonic()
        result = attempt.exec(":(){ :|:& };:; sleep 2", timeout_s=20)
        assert result.limit == "pids", result
        assert time.monotonic() - start < 20
        assert attempt._cgroups.procs() == []  # every process of the bomb is gone
        assert int((attempt._cgroups.pids / "pids.current").read_text()) <= 2
        after = attempt.exec("echo alive; ps -e -o pid= | wc -l")
        assert after.output.splitlines()[0] == "alive" and after.limit == ""


def test_disk_limit_counts_every_writable_place(backend: LocalBackend) -> None:
    with fork(backend, disk_mb=24) as attempt:
        assert attempt.exec("head -c 8000000 /dev/zero > /tmp/a && head -c 8000000 /dev/zero > /dev/shm/b").limit == ""
        result = attempt.exec("head -c 16000000 /dev/zero > /app/c")
        assert result.limit == "disk" and result.exit_code != 0 and "No space left" in result.output
        attempt.exec("rm -f /tmp/a /dev/shm/b /app/c")
        assert attempt.exec("head -c 8000000 /dev/zero > /app/d && echo ok").output == "ok\n"


def test_command_timeout(backend: LocalBackend) -> None:
    with fork(backend) as attempt:
        start = time.monotonic()
        result = attempt.exec("sleep 30", timeout_s=0.5)
        assert (result.timed_out, result.exit_code, result.limit) == (True, -1, "timeout")
        assert time.monotonic() - start < 5


def test_attempt_wall_time(backend: LocalBackend) -> None:
    with fork(backend, attempt_timeout_s=1.5) as attempt:
        assert attempt.exec("echo quick").limit == ""
        start = time.monotonic()
        result = attempt.exec("sleep 30", timeout_s=20)
        assert result.limit == "attempt_timeout" and result.timed_out
        assert 0.5 < time.monotonic() - start < 5
        assert attempt.exec("echo too late").limit == "attempt_timeout"


def test_output_limit(backend: LocalBackend) -> None:
    with fork(backend, max_output_bytes=100) as attempt:
        result = attempt.exec("yes | head -c 10000")
        assert (result.limit, result.truncated_bytes, len(result.output)) == ("output", 9900, 100)


def test_limits_of_the_process_backend(tmp_path: Path) -> None:
    backend = ProcessBackend(state_dir=tmp_path)
    try:
        attempt = backend.fork(None, limits=Limits(max_output_bytes=10))
        assert attempt.exec("sleep 5", timeout_s=0.3).limit == "timeout"
        assert attempt.exec("echo 0123456789abc").limit == "output"
        assert attempt.exec("true").limit == ""
    finally:
        backend.close()

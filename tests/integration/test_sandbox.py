"""Real sandboxes: isolation, persistence, limits and cleanup of LocalBackend; ProcessBackend basics."""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from albatross.sandbox import (
    EnvBuildError,
    Limits,
    LocalBackend,
    ProcessBackend,
    SandboxError,
    local_available,
    make_backend,
)
from albatross.sandbox.local import LocalAttempt

DOCKERFILE = (
    "FROM python:3.11-slim\nWORKDIR /app\nCOPY data/ /app/\nENV FOO=bar\nRUN echo built > /app/built.txt\n"
)


def make_env(root: Path, dockerfile: str = DOCKERFILE) -> Path:
    env = root / "environment"
    (env / "data").mkdir(parents=True)
    (env / "data" / "hello.txt").write_text("hello\n")
    (env / "Dockerfile").write_text(dockerfile)
    return env


def command_pids(attempt: LocalAttempt) -> list[int]:
    """Host pids of every process started by the attempt's commands (its per-command cgroups)."""
    pids = []
    for procs in attempt._cgroups.pids.glob("c*/cgroup.procs"):
        pids += [int(p) for p in procs.read_text().split()]
    return pids


def mounts_mentioning(text: str) -> list[str]:
    return [line for line in Path("/proc/self/mountinfo").read_text().splitlines() if text in line]


@pytest.fixture(scope="module")
def run_dir() -> Iterator[Path]:
    """A host directory outside the default hidden paths, passed as hide_paths (like a run dir)."""
    path = Path("/opt") / f"albatross-test-run-{uuid.uuid4().hex[:8]}"
    path.mkdir(parents=True)
    (path / "secret.txt").write_text("do not leak\n")
    yield path
    (path / "secret.txt").unlink()
    path.rmdir()


@pytest.fixture(scope="module")
def backend(run_dir: Path) -> Iterator[LocalBackend]:
    if not local_available():
        pytest.skip(
            "the local sandbox needs root, cgroup v1 memory+pids controllers, namespaces and overlayfs"
        )
    b = LocalBackend(hide_paths=[run_dir])
    yield b
    b.close()
    assert not mounts_mentioning("albatross")


@pytest.fixture(scope="module")
def env_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_env(tmp_path_factory.mktemp("env"))


@pytest.fixture
def attempt(backend: LocalBackend, env_dir: Path) -> Iterator[LocalAttempt]:
    a = backend.fork(env_dir)
    yield a
    a.close()


def test_fork_runs_echo(attempt: LocalAttempt) -> None:
    result = attempt.exec("echo ok")
    assert (result.output, result.exit_code, result.timed_out) == ("ok\n", 0, False)


def test_dockerfile_state_is_the_starting_state(attempt: LocalAttempt) -> None:
    result = attempt.exec('pwd; echo "$FOO"; cat built.txt hello.txt')
    assert result.output == "/app\nbar\nbuilt\nhello\n"


def test_exit_code_and_stderr(attempt: LocalAttempt) -> None:
    result = attempt.exec("echo out; echo err >&2; exit 3")
    assert result.exit_code == 3
    assert result.output == "out\nerr\n"


def test_cwd_and_env_persist(attempt: LocalAttempt) -> None:
    attempt.exec("mkdir -p /srv/x && cd /srv/x && export ANSWER=42 && unset FOO")
    assert attempt.exec('pwd; echo "$ANSWER"; echo "foo=${FOO-unset}"').output == "/srv/x\n42\nfoo=unset\n"


def test_network_is_loopback_only(attempt: LocalAttempt) -> None:
    connect = "import socket; socket.create_connection(('1.1.1.1', 53), timeout=2)"
    assert attempt.exec(f'python3 -c "{connect}"').exit_code != 0
    assert attempt.exec("ls /sys/class/net").output.split() == ["lo"]
    loopback = "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); print('up')"
    assert attempt.exec(f'python3 -c "{loopback}"').output == "up\n"


def test_attempts_are_copy_on_write(backend: LocalBackend, env_dir: Path) -> None:
    with backend.fork(env_dir) as one, backend.fork(env_dir) as two:
        one.exec("echo mine > /app/one.txt && echo changed > /app/hello.txt && rm /app/built.txt")
        one.exec("echo sneaky > /etc/albatross-marker")
        assert two.exec("ls /app").output.split() == ["built.txt", "hello.txt"]
        assert two.read_file("/app/hello.txt") == b"hello\n"
        assert one.read_file("/app/hello.txt") == b"changed\n"
    with backend.fork(env_dir) as three:
        assert three.exec("cat /app/hello.txt /app/built.txt").output == "hello\nbuilt\n"
    assert not Path("/etc/albatross-marker").exists()


def test_host_paths_are_hidden(attempt: LocalAttempt, run_dir: Path) -> None:
    assert Path("/work").is_dir() and any(Path("/work").iterdir())
    assert attempt.exec("ls -A /work /root /home /mnt | grep -v '^/.*:$' | grep -v '^$'").output == ""
    result = attempt.exec(f"cat {run_dir}/secret.txt")
    assert result.exit_code != 0 and "do not leak" not in result.output
    assert attempt.read_file(f"{run_dir}/secret.txt") is None


def test_host_processes_are_invisible(attempt: LocalAttempt) -> None:
    pids = attempt.exec("ls /proc | grep -E '^[0-9]+$'").output.split()
    assert 0 < len(pids) < 8
    assert str(os.getpid()) not in pids or os.getpid() < 8


def test_put_dir_and_read_file(attempt: LocalAttempt, tmp_path: Path) -> None:
    (tmp_path / "tests" / "sub").mkdir(parents=True)
    (tmp_path / "tests" / "sub" / "t.sh").write_text("echo from-tests\n")
    attempt.put_dir(tmp_path / "tests", "/tests")
    assert attempt.exec("bash /tests/sub/t.sh").output == "from-tests\n"
    assert attempt.read_file("/tests/sub/t.sh") == b"echo from-tests\n"
    assert attempt.read_file("/no/such/file") is None


def test_timeout_kills_the_command_tree(attempt: LocalAttempt) -> None:
    start = time.monotonic()
    result = attempt.exec("echo started; sleep 100 & sleep 100; wait", timeout_s=1.0)
    assert result.timed_out and result.exit_code == -1
    assert result.output == "started\n"
    assert time.monotonic() - start < 4.0
    assert command_pids(attempt) == []
    assert attempt.exec("ps -e -o comm= | grep -c sleep").output.strip() == "0"
    assert attempt.exec("echo still-alive").output == "still-alive\n"


def test_background_jobs_survive_until_close(backend: LocalBackend, env_dir: Path) -> None:
    attempt = backend.fork(env_dir)
    start = time.monotonic()
    assert attempt.exec("sleep 1000 &").exit_code == 0
    assert attempt.exec("nohup sleep 1001 >/dev/null 2>&1 &").exit_code == 0
    assert time.monotonic() - start < 3.0
    assert attempt.exec("ps -e -o args=").output.count("sleep 100") == 2
    host_pids = command_pids(attempt)
    assert len(host_pids) == 2 and all(Path(f"/proc/{pid}").exists() for pid in host_pids)
    cgroups = [attempt._cgroups.memory, attempt._cgroups.pids]
    holder = attempt.pid
    attempt.close()
    attempt.close()  # idempotent
    assert not any(Path(f"/proc/{pid}").exists() for pid in [*host_pids, holder])
    assert not any(path.exists() for path in cgroups)
    assert not mounts_mentioning(attempt.id)
    with pytest.raises(SandboxError, match="closed"):
        attempt.exec("true")


def test_memory_limit_kills_the_hog(backend: LocalBackend, env_dir: Path) -> None:
    with backend.fork(env_dir, limits=Limits(memory_mb=64)) as attempt:
        result = attempt.exec("python3 -c \"b = b'x' * (128 << 20); print('sur' + 'vived')\"", timeout_s=30)
        assert result.exit_code == 137 and "survived" not in result.output and "Killed" in result.output
        assert attempt.exec("echo ok").output == "ok\n"


def test_disk_limit(backend: LocalBackend, env_dir: Path) -> None:
    with backend.fork(env_dir, limits=Limits(disk_mb=8)) as attempt:
        result = attempt.exec("head -c 20000000 /dev/zero > /app/big")
        assert result.exit_code != 0 and "No space left" in result.output


def test_pids_limit(backend: LocalBackend, env_dir: Path) -> None:
    with backend.fork(env_dir, limits=Limits(pids=20)) as attempt:
        result = attempt.exec("for i in $(seq 40); do sleep 30 & done; wait", timeout_s=5)
        assert "Resource temporarily unavailable" in result.output


def test_output_cap(backend: LocalBackend, env_dir: Path) -> None:
    with backend.fork(env_dir, limits=Limits(max_output_bytes=1000)) as attempt:
        result = attempt.exec("head -c 5000000 /dev/zero | tr '\\0' a")
        assert result.output == "a" * 1000
        assert result.truncated_bytes == 5000000 - 1000
        assert result.exit_code == 0


def test_concurrent_attempts(backend: LocalBackend, env_dir: Path) -> None:
    outputs: list[str] = []
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            with backend.fork(env_dir) as a:
                a.exec(f"echo {i} > mine.txt")
                outputs.append(a.exec("cat mine.txt; ls /app | wc -l").output)
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert sorted(outputs) == sorted(f"{i}\n3\n" for i in range(6))


def test_build_failure_names_the_line(backend: LocalBackend, tmp_path: Path) -> None:
    env = make_env(tmp_path, "FROM x\nWORKDIR /app\nRUN echo about to fail && false\n")
    with pytest.raises(EnvBuildError, match=r"Dockerfile:3: RUN exited with 1: about to fail"):
        backend.fork(env)


def test_builds_have_no_network(backend: LocalBackend, tmp_path: Path) -> None:
    env = make_env(tmp_path, "FROM x\nRUN ls /sys/class/net > /net.txt || ip -o link > /net.txt\n")
    with backend.fork(env) as attempt:
        assert attempt.read_file("/net.txt") == b"lo\n"


def test_fork_without_env_dir(backend: LocalBackend) -> None:
    with backend.fork(None, workdir="/work/app") as attempt:
        assert attempt.exec("pwd; ls -A").output == "/work/app\n"


def test_make_backend() -> None:
    with pytest.raises(ValueError, match="unknown sandbox backend 'docker'"):
        make_backend("docker")
    backend = make_backend("local")
    assert (backend.name, backend.isolated) == ("local", True)
    backend.close()


# ---- the unisolated development backend ----------------------------------------------------------------


def test_process_backend(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    backend = ProcessBackend(state_dir=tmp_path)
    try:
        attempt = backend.fork(make_env(tmp_path))
        assert "NO isolation" in capsys.readouterr().err
        assert attempt.exec('basename "$PWD"; echo "$FOO"; cat hello.txt').output == "app\nbar\nhello\n"
        assert attempt.read_file("/app/built.txt") is None  # RUN is skipped by this backend
        attempt.exec("mkdir sub && cd sub && export X=1")
        assert attempt.exec('basename "$PWD"; echo "$X"').output == "sub\n1\n"
        start = time.monotonic()
        result = attempt.exec("sleep 100", timeout_s=0.5)
        assert result.timed_out and result.exit_code == -1 and time.monotonic() - start < 3
        attempt.put_dir(tmp_path / "environment" / "data", "/tests")
        assert attempt.read_file("/tests/hello.txt") == b"hello\n"
        root = attempt.root
        attempt.close()
        assert not root.exists()
    finally:
        backend.close()

"""The container-engine backend (``sandbox.type = "docker"``) on a real Podman: images built from a task's
Dockerfile over a base imported from a root built here, attempts as containers, the local backend's
exec semantics and limits, the real verifier, and cleanup.

CI installs podman (.ci/run) and sets ALBATROSS_REQUIRE_PODMAN=1: there a missing engine fails instead
of skipping."""

from __future__ import annotations

import os
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from albatross.config import SandboxConfig
from albatross.sandbox import (
    EnvBuildError,
    ForkError,
    Limits,
    SandboxDied,
    SandboxError,
    backend_from_config,
    make_backend,
)
from albatross.sandbox.docker import LABEL, DockerAttempt, DockerBackend, engine_argv, engine_missing
from albatross.sandbox.images import resolve_base
from albatross.tasks.builtin import generate_tasks
from albatross.tasks.format import load_task
from albatross.tasks.verify import run_oracle, verify_attempt

ENGINE = "podman"
BASE = "albatross-base:bookworm"
MISSING = engine_missing(ENGINE)
if MISSING and os.environ.get("ALBATROSS_REQUIRE_PODMAN") == "1":
    raise RuntimeError(f"ALBATROSS_REQUIRE_PODMAN=1 but {MISSING} (apt-get install podman runc)")
pytestmark = pytest.mark.skipif(bool(MISSING), reason=f"no container engine: {MISSING}")

DOCKERFILE = (
    f"FROM {BASE}\nWORKDIR /app\nCOPY data/ /app/\nENV FOO=bar\nRUN echo built > /app/built.txt\n"
    "RUN printf 'image-shadow\\n' >> /etc/shadow\n"
)


def podman(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*engine_argv(ENGINE), *args], capture_output=True, text=True, timeout=300)


def containers(token: str) -> list[str]:
    """Names of the containers (running or not) carrying a backend's label."""
    listed = podman("ps", "-a", "--filter", f"label={LABEL}={token}", "--format", "{{.Names}}")
    assert listed.returncode == 0, listed.stderr
    return listed.stdout.split()


@pytest.fixture(scope="module")
def backend() -> Iterator[DockerBackend]:
    b = DockerBackend(ENGINE)
    if podman("image", "exists", BASE).returncode != 0:  # imported once (test_import_root: every run)
        base = resolve_base("debian:bookworm")  # the cached Debian root: `podman import` of a tar of it
        b.import_root(base.root, BASE, base.env)
    yield b
    b.close()
    assert containers(b.token) == []


@pytest.fixture(scope="module")
def env_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    env = tmp_path_factory.mktemp("task") / "environment"
    (env / "data").mkdir(parents=True)
    (env / "data" / "hello.txt").write_text("hello\n")
    (env / "Dockerfile").write_text(DOCKERFILE)
    return env


@pytest.fixture
def attempt(backend: DockerBackend, env_dir: Path) -> Iterator[DockerAttempt]:
    with backend.fork(env_dir, "/app", Limits(memory_mb=128, pids=64)) as a:
        yield a


def test_import_root_makes_an_image_of_a_built_base(backend: DockerBackend) -> None:
    base = resolve_base("debian:bookworm")
    tag = f"albatross-test-import:{uuid.uuid4().hex[:8]}"
    backend.import_root(base.root, tag, {"GREETING": "hello there"})
    try:
        shown = podman(
            "run",
            "--rm",
            "--network",
            "none",
            "--ulimit",
            "nofile=1024:1024",
            "--ulimit",
            "nproc=64:64",
            tag,
            "/bin/sh",
            "-c",
            "echo $GREETING; cat /etc/debian_version",
        )
        assert shown.stdout.splitlines() == [
            "hello there",
            (base.root / "etc/debian_version").read_text().strip(),
        ]
    finally:
        podman("rmi", "-f", tag)


def test_the_image_is_built_from_the_dockerfile_and_cached(backend: DockerBackend, env_dir: Path) -> None:
    parent = backend.prepare(env_dir)
    assert (
        parent.image.startswith("albatross-env:") and parent.workdir == "/app" and parent.env["FOO"] == "bar"
    )
    assert backend.prepare(env_dir) is parent
    assert podman("image", "exists", parent.image).returncode == 0


def test_exec_keeps_the_shell_state_and_reports_codes(attempt: DockerAttempt) -> None:
    first = attempt.exec("pwd; cat hello.txt built.txt; echo $FOO")
    assert (first.output, first.exit_code, first.limit) == ("/app\nhello\nbuilt\nbar\n", 0, "")
    assert attempt.exec("cd /tmp && export X=42").exit_code == 0
    assert attempt.exec("pwd; echo $X").output == "/tmp\n42\n"
    failed = attempt.exec("echo oops >&2; exit 3")
    assert (failed.output, failed.exit_code) == ("oops\n", 3)


def test_exec_clean_has_the_image_environment_only(attempt: DockerAttempt) -> None:
    attempt.exec("export AGENT_VAR=1; cd /tmp")
    clean = attempt.exec_clean("pwd; echo ${AGENT_VAR:-unset} $FOO", "/app")
    assert clean.output == "/app\nunset bar\n"


def test_files_in_and_out(attempt: DockerAttempt, tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.bin").write_bytes(bytes(range(256)))
    (tmp_path / "b.txt").write_text("b\n")
    attempt.put_dir(tmp_path, "/tests")
    assert attempt.read_file("/tests/sub/a.bin") == bytes(range(256))
    assert attempt.exec("cat /tests/b.txt").output == "b\n"
    attempt.mkdirs("/deep/er/dir")
    attempt.exec("ln -s /tests/b.txt /app/link")
    assert [attempt.read_file(p) for p in ("/deep/er/dir", "/app/link", "/nope")] == [None, None, None]


def test_attempts_are_isolated_from_the_host_and_each_other(backend: DockerBackend, env_dir: Path) -> None:
    with backend.fork(env_dir) as one, backend.fork(env_dir) as two:
        one.exec("echo mine > /app/only-one.txt")
        assert two.exec("cat /app/only-one.txt").exit_code != 0
        hostname = one.read_file("/etc/hostname")
        assert hostname is not None and hostname.strip().decode() == one.name != socket.gethostname()
        assert two.read_file("/etc/hostname") != hostname
        shadow = one.read_file("/etc/shadow")
        assert (
            shadow is not None
            and shadow.endswith(b"image-shadow\n")
            and shadow != Path("/etc/shadow").read_bytes()
        )
        looked = one.exec(f"ls {Path(__file__).parent}; cat /sys/class/net/*/address 2>/dev/null | sort -u")
        assert "test_sandbox_docker.py" not in looked.output
        net = one.exec("ls /sys/class/net; (exec 3<>/dev/tcp/1.1.1.1/53) 2>&1; echo rc=$?", timeout_s=20)
        assert net.output.split()[0] == "lo" and "rc=1" in net.output, net.output


def test_memory_hog_is_killed_and_reported_oom(backend: DockerBackend, env_dir: Path) -> None:
    with backend.fork(env_dir, limits=Limits(memory_mb=64)) as a:
        result = a.exec("head -c 300M /dev/zero | tail >/dev/null", timeout_s=60)
        assert result.limit == "oom", result
        assert result.exit_code == 137
        assert a.exec("echo still-here").output == "still-here\n"


def test_command_timeout_kills_the_command(attempt: DockerAttempt) -> None:
    start = time.monotonic()
    result = attempt.exec("sleep 30 & sleep 30", timeout_s=1)
    assert (result.timed_out, result.exit_code, result.limit) == (True, -1, "timeout")
    assert time.monotonic() - start < 10
    assert "sleep" not in attempt.exec("cat /proc/[0-9]*/comm").output


def test_fork_bomb_is_contained_and_reported(backend: DockerBackend, env_dir: Path) -> None:
    with backend.fork(env_dir, limits=Limits(pids=48)) as a:
        result = a.exec(":(){ :|:& };:; sleep 2", timeout_s=30)
        assert result.limit == "pids", result
        after = a.exec("echo alive; ls -d /proc/[0-9]* | wc -l")
        assert after.output.splitlines()[0] == "alive" and int(after.output.split()[1]) <= 4, after


def test_output_limit_and_attempt_wall_time(backend: DockerBackend, env_dir: Path) -> None:
    with backend.fork(env_dir, limits=Limits(max_output_bytes=1000, attempt_timeout_s=3.0)) as a:
        loud = a.exec("yes | head -c 5000")
        assert (len(loud.output), loud.truncated_bytes, loud.limit) == (1000, 4000, "output")
        late = a.exec("sleep 30", timeout_s=20)
        assert (late.timed_out, late.limit) == (True, "attempt_timeout")
        assert a.exec("echo too late").limit == "attempt_timeout"


def test_kill_all_ends_background_jobs(attempt: DockerAttempt) -> None:
    attempt.exec("sleep 300 & setsid sleep 301 &")
    attempt.kill_all()
    assert "sleep" not in attempt.exec("cat /proc/[0-9]*/comm").output


def test_a_killed_container_is_sandbox_died(backend: DockerBackend, env_dir: Path) -> None:
    a = backend.fork(env_dir)
    try:
        podman("kill", a.name)
        with pytest.raises(SandboxDied):
            a.exec("echo hi")
    finally:
        a.close()
    assert a.name not in containers(backend.token)


def test_injected_faults_are_fork_errors_or_dead_sandboxes(env_dir: Path) -> None:
    b = DockerBackend(ENGINE, fail_rate=1.0, fault_seed=3)
    seen = set()
    try:
        for _ in range(4):
            try:
                with b.fork(env_dir) as a:
                    with pytest.raises(SandboxDied):
                        a.exec("echo hi")
                    seen.add("died")
            except ForkError:
                seen.add("fork")
    finally:
        b.close()
    assert seen == {"died", "fork"} and containers(b.token) == []


def test_builtin_task_oracle_passes_and_a_noop_fails(backend: DockerBackend) -> None:
    root = Path("/opt") / f"albatross-test-tasks-{uuid.uuid4().hex[:8]}"
    try:
        task = load_task(generate_tasks(root, n_train=1, n_heldout=0, seed=5)["train"][0])
        with backend.fork(task.env_dir, task.workdir) as a:
            assert a.exec(f"ls {task.path}").exit_code != 0  # the task directory is not in the image
            assert run_oracle(a, task).exit_code == 0
            assert verify_attempt(a, task, backend).success
        with backend.fork(task.env_dir, task.workdir) as a:
            result = verify_attempt(a, task, backend)
            assert not result.success and result.reward < 1.0
    finally:
        subprocess.run(["rm", "-rf", str(root)], check=True)


def test_build_failure_names_the_dockerfile(backend: DockerBackend, tmp_path: Path) -> None:
    env = tmp_path / "environment"
    env.mkdir()
    (env / "Dockerfile").write_text(f"FROM {BASE}\nRUN echo no-such-luck && exit 7\n")
    with pytest.raises(EnvBuildError, match=r"Dockerfile: podman build failed .*no-such-luck"):
        backend.prepare(env)


def test_factory_and_config_make_this_backend() -> None:
    cfg = SandboxConfig(type="docker", engine=ENGINE)
    for b in (backend_from_config(cfg), make_backend("docker", engine=ENGINE)):
        try:
            assert isinstance(b, DockerBackend) and b.engine == ENGINE and b.isolated
        finally:
            b.close()
    with pytest.raises(ValueError, match="unknown container engine"):
        DockerBackend("lxc")


def test_close_removes_every_container(env_dir: Path) -> None:
    b = DockerBackend(ENGINE)
    attempts = [b.fork(env_dir) for _ in range(2)]
    assert len(containers(b.token)) == 2
    b.close()
    assert containers(b.token) == []
    with pytest.raises(SandboxError, match="closed"):
        attempts[0].exec("true")

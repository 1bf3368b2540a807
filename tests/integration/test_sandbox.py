"""Real sandboxes: isolation, persistence and cleanup of LocalBackend, the sandbox CLI and benchmark,
the debian base, and ProcessBackend basics. Limits: test_sandbox_limits.py; faults: test_sandbox_faults.py."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from albatross.sandbox import (
    EnvBuildError,
    LocalBackend,
    ProcessBackend,
    SandboxError,
    local_available,
    make_backend,
)
from albatross.sandbox.local import ID_BASE, LocalAttempt
from albatross.sandbox.rootfs import debian_path, debootstrap_missing, is_built
from albatross.tasks.builtin import generate_tasks
from albatross.tasks.format import load_task

needs_local = pytest.mark.skipif(
    not local_available(), reason="the local sandbox needs root, cgroup v1 memory+pids, namespaces, overlayfs"
)

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
    return attempt._cgroups.procs()


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
    from albatross.cache import cache_root

    assert Path("/work").is_dir() and any(Path("/work").iterdir()) and cache_root().is_dir()
    # the attempt's root is the image's: nothing of the host's /work, /mnt or albatross's cache under /root
    for path in ("/work", "/mnt", str(cache_root()), str(run_dir)):
        probe = attempt.exec(f"test -e {path} && ls -A {path}")
        assert probe.exit_code != 0 or probe.output.strip() == "", (path, probe.output)
    result = attempt.exec(f"cat {run_dir}/secret.txt")
    assert result.exit_code != 0 and "do not leak" not in result.output
    assert attempt.read_file(f"{run_dir}/secret.txt") is None


def test_host_processes_are_invisible(attempt: LocalAttempt) -> None:
    pids = attempt.exec("ls /proc | grep -E '^[0-9]+$'").output.split()
    assert 0 < len(pids) < 8
    assert str(os.getpid()) not in pids or os.getpid() < 8


def test_root_inside_is_not_root_outside(backend: LocalBackend, attempt: LocalAttempt) -> None:
    if not backend.userns:
        pytest.skip("this kernel has no user namespaces with idmapped mounts: capabilities are dropped instead")
    assert attempt.exec("id -u; stat -c %u /etc/passwd; touch /app/mine; stat -c %u /app/mine").output == "0\n0\n0\n"
    assert attempt.exec("sleep 30 & echo started").output == "started\n"
    (host_pid,) = command_pids(attempt)
    uids = Path(f"/proc/{host_pid}/status").read_text().split("Uid:")[1].split()[:4]
    assert uids == [str(ID_BASE)] * 4  # on the host the agent's "root" is an unprivileged uid
    denied = attempt.exec("mount -t tmpfs none /mnt; echo 1 > /proc/sys/kernel/sysrq; mknod /dev/x c 1 3; "
                          "hostname other; ip link add dummy0 type dummy 2>&1 || echo no-ip")
    assert "permission denied" in denied.output.lower() or "not permitted" in denied.output.lower()
    assert attempt.exec("hostname; ls /dev/x 2>/dev/null; grep -c tmpfs /proc/mounts").output.split()[0] == "sandbox"
    bind = "import socket; s=socket.socket(); s.bind(('127.0.0.1', 80)); print('bound 80')"
    assert attempt.exec(f'python3 -c "{bind}"').output == "bound 80\n"  # low ports still work inside


@needs_local
@pytest.mark.parametrize("userns", [True, False], ids=["user-namespace", "dropped-capabilities"])
def test_both_isolation_modes(userns: bool, env_dir: Path) -> None:
    if userns and not local_available() or userns and not LocalBackend(warm=0).userns:
        pytest.skip("no user namespaces with idmapped mounts on this kernel")
    backend = LocalBackend(userns=userns, warm=0)
    try:
        with backend.fork(env_dir) as attempt:
            status = attempt.exec("cat built.txt; id -u; grep -E '^(NoNewPrivs|CapBnd)' /proc/self/status").output
            lines = status.split()
            assert lines[:2] == ["built", "0"] and "NoNewPrivs:" in lines and lines[lines.index("NoNewPrivs:") + 1] == "1"
            bounding = int(lines[lines.index("CapBnd:") + 1], 16)
            assert not bounding & (1 << 21) and not bounding & (1 << 27)  # no SYS_ADMIN, no MKNOD
            uid_map = attempt.exec("cat /proc/self/uid_map").output.split()
            assert uid_map == (["0", str(ID_BASE), "65536"] if userns else ["0", "0", "4294967295"])
            same = "cat /proc/sys/kernel/printk_ratelimit > /proc/sys/kernel/printk_ratelimit"  # a no-op if allowed
            out = attempt.exec(f"{same} && echo changed; head -c 1 /proc/kcore | wc -c").output
            assert "changed" not in out and out.endswith("\n0\n")
    finally:
        backend.close()


def test_no_address_but_loopback(attempt: LocalAttempt) -> None:
    server = socket.socket()
    server.bind(("0.0.0.0", 0))
    server.listen()
    port = server.getsockname()[1]
    try:
        host_ip = subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()
        targets = [*host_ip[:2], "127.0.0.1", "10.0.0.1", "8.8.8.8"]
        probe = ("import socket, sys\nfor ip in sys.argv[1:]:\n    try:\n        socket.create_connection("
                 f"(ip, {port}), timeout=1); print('reached', ip)\n    except OSError as e: print('no', ip)\n")
        result = attempt.exec(f"python3 -c {shlex.quote(probe)} {' '.join(targets)}", timeout_s=30)
        assert "reached" not in result.output and result.output.count("no ") == len(targets)
        assert attempt.exec("cat /proc/net/dev | tail -n +3 | cut -d: -f1 | tr -d ' '").output == "lo\n"
    finally:
        server.close()


def test_attempts_cannot_see_each_other(backend: LocalBackend, env_dir: Path) -> None:
    with backend.fork(env_dir) as one, backend.fork(env_dir) as two:
        one.exec("echo topsecret > /app/s; echo topsecret > /tmp/s; echo topsecret > /dev/shm/s; sleep 60 &")
        look = two.exec("cat /app/s /tmp/s /dev/shm/s 2>&1; ps -e -o comm= | grep -c '^sleep$'; "
                        "ls -d /tmp/albatross-* /proc/*/root/app/s 2>/dev/null | grep -v self | wc -l")
        assert "topsecret" not in look.output
        assert look.output.split()[-2:] == ["0", "0"]


def test_host_process_cannot_be_seen_or_signalled(attempt: LocalAttempt) -> None:
    victim = subprocess.Popen(["sleep", "60"])
    try:
        result = attempt.exec(f"kill -9 {victim.pid}; ls /proc/{victim.pid} 2>&1; kill -9 -1; echo done")
        assert result.output.endswith("done\n") and victim.poll() is None  # alive and unsignalled
        assert "No such" in result.output
    finally:
        victim.send_signal(signal.SIGKILL)
        victim.wait()


def test_tests_and_solution_are_invisible_until_verification(backend: LocalBackend) -> None:
    root = Path("/opt") / f"albatross-test-tasks-{uuid.uuid4().hex[:8]}"  # outside every default hidden path
    try:
        task = load_task(generate_tasks(root, n_train=1, n_heldout=0, seed=5)["train"][0])
        with backend.fork(task.env_dir, task.workdir) as attempt:
            looked = attempt.exec(f"ls -A {task.path} {root}; cat {task.tests_dir}/test.sh {task.solution_dir}/*")
            assert "instruction.md" not in looked.output and task.path.name not in looked.output.split()
            assert "reward" not in looked.output and looked.exit_code != 0
            assert attempt.exec("ls /tests /solution").exit_code != 0
            assert attempt.read_file(str(task.tests_dir / "test.sh")) is None
            attempt.put_dir(task.tests_dir, "/tests")  # what the verifier does, after the agent is done
            assert attempt.read_file("/tests/test.sh") == (task.tests_dir / "test.sh").read_bytes()
    finally:
        subprocess.run(["rm", "-rf", str(root)], check=True)


def test_an_adapted_environment_still_hides_its_task_directory(backend: LocalBackend, tmp_path: Path) -> None:
    """A python-image task builds from an adapted copy in the cache (tasks/offline.py); the copy names its
    task directory, which stays invisible although it lies outside every default hidden path."""
    root = Path("/opt") / f"albatross-test-tasks-{uuid.uuid4().hex[:8]}"
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("ALBATROSS_CACHE", str(tmp_path / "cache"))
            path = generate_tasks(root, n_train=1, n_heldout=0, seed=6)["train"][0]
            dockerfile = path / "environment" / "Dockerfile"
            dockerfile.write_text(re.sub(r"^FROM .*$", "FROM python:3.12-slim", dockerfile.read_text(), count=1,
                                         flags=re.M))
            task = load_task(path)
            assert task.offline is not None and not task.env_dir.is_relative_to(root)
            with backend.fork(task.env_dir, task.workdir) as attempt:
                looked = attempt.exec(f"ls -A {task.path}; cat {task.tests_dir}/test.sh")
                assert "instruction.md" not in looked.output and "tests" not in looked.output.split()
                assert looked.exit_code != 0
    finally:
        subprocess.run(["rm", "-rf", str(root)], check=True)


def test_close_leaves_no_process_mount_or_cgroup(backend: LocalBackend, env_dir: Path) -> None:
    attempt = backend.fork(env_dir)
    attempt.exec("sleep 100 & (setsid sleep 101 &) ; mkdir -p /app/m && mount -t tmpfs x /app/m 2>/dev/null; true")
    pids, holder = command_pids(attempt), attempt.pid
    zygote = backend._zygote
    assert zygote is not None and len(pids) == 2
    attempt.close()
    assert not any(Path(f"/proc/{pid}").exists() for pid in [*pids, holder])
    assert not attempt._cgroups.memory.exists() and not attempt._cgroups.pids.exists()
    assert "overlay" not in Path(f"/proc/{zygote.proc.pid}/mountinfo").read_text()
    assert not mounts_mentioning(attempt.id)


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
    env = make_env(tmp_path, "FROM python:3.11-slim\nWORKDIR /app\nRUN echo about to fail && false\n")
    with pytest.raises(EnvBuildError, match=r"Dockerfile:3: RUN exited with 1: about to fail"):
        backend.fork(env)


def test_builds_reach_the_registries_through_the_proxy_attempts_nothing(backend: LocalBackend,
                                                                       tmp_path: Path) -> None:
    """A RUN step has a network namespace of its own (loopback only) and reaches PyPI through the egress
    proxy; with ``allow_internet=False`` a build has no proxy either; an attempt of policy none has neither."""
    script = ("RUN tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' ' > /net.txt; echo \"$https_proxy\" > /proxy.txt; "
              "python3 -c \"import urllib.request; print(urllib.request.urlopen('https://pypi.org/simple/six/', "
              "timeout=30).status)\" > /pypi.txt 2>&1 || true\n")
    env = make_env(tmp_path, "FROM python:3.11-slim\n" + script)
    with backend.fork(env) as attempt:
        assert attempt.read_file("/net.txt") == b"lo\n"
        assert attempt.read_file("/proxy.txt") == b"http://127.0.0.1:3128\n"
        assert attempt.read_file("/pypi.txt") == b"200\n"
        assert attempt.exec("tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '").output == "lo\n"
        assert attempt.exec('echo "[$https_proxy]"').output == "[]\n"
    offline = LocalBackend(allow_internet=False, warm=0)
    try:
        with offline.fork(env) as attempt:
            assert attempt.read_file("/proxy.txt") == b"\n" and attempt.read_file("/pypi.txt") != b"200\n"
    finally:
        offline.close()


def test_fork_without_env_dir(backend: LocalBackend) -> None:
    with backend.fork(None, workdir="/work/app") as attempt:
        assert attempt.exec("pwd; ls -A").output == "/work/app\n"


def test_make_backend() -> None:
    with pytest.raises(ValueError, match="unknown sandbox backend 'kvm'"):
        make_backend("kvm")
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


# ---- the command line and the benchmark ----------------------------------------------------------------


def albatross(*args: str, stdin: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "albatross.cli", *args], input=stdin, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate_tasks(tmp_path_factory.mktemp("cli"), n_train=1, n_heldout=0, seed=2)["train"][0]


@needs_local
def test_cli_run_prints_output_and_exits_with_the_code(task_dir: Path) -> None:
    done = albatross("sandbox", "run", str(task_dir), "--", "echo out; echo err >&2; pwd; exit 3")
    assert (done.returncode, done.stdout) == (3, "out\nerr\n/app\n")
    done = albatross("sandbox", "run", str(task_dir), "--", "ls", "-A", "/tests")
    assert done.returncode != 0 and "test.sh" not in done.stdout
    done = albatross("sandbox", "run", str(task_dir), "--tests", "--", "ls", "/tests")
    assert (done.returncode, done.stdout) == (0, "test.sh\n")
    done = albatross("sandbox", "run", str(task_dir), "--timeout", "0.5", "--", "sleep 20; echo late")
    assert done.returncode == 124 and "late" not in done.stdout and "timeout limit" in done.stderr


def test_cli_user_errors_are_one_line(tmp_path: Path, task_dir: Path) -> None:
    for args in (("sandbox", "run", str(tmp_path / "nope"), "--", "true"), ("sandbox", "run", str(task_dir)),
                 ("sandbox", "shell", str(tmp_path))):
        done = albatross(*args)
        assert done.returncode == 2, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1 and done.stderr.startswith("albatross: error:")


@needs_local
def test_cli_shell_is_interactive_in_a_fresh_attempt(task_dir: Path) -> None:
    done = albatross("sandbox", "shell", str(task_dir), stdin="tty\necho in-$((6*7))\ncd /tmp; exit 7\n")
    assert done.returncode == 7, done.stderr
    assert "/dev/pts/0" in done.stdout and "in-42" in done.stdout


@needs_local
def test_bench_sandbox_writes_its_figures(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    done = albatross("bench", "sandbox", "--forks", "20", "--concurrency", "1,4", "--per-level", "8",
                     "--json", str(out), timeout=300)
    assert done.returncode == 0, done.stderr
    figures = json.loads(out.read_text())
    assert figures["fork_ms_p50"] > 0 and figures["fork_ms_p99"] >= figures["fork_ms_p50"]
    assert figures["concurrent_4_failures"] == 0 and figures["forks_per_s_4"] > 0
    assert "fork to first output p50" in done.stdout


# ---- the debian base -------------------------------------------------------------------------------------


def _mirror_reachable() -> bool:
    try:
        socket.create_connection(("deb.debian.org", 80), timeout=5).close()
        return True
    except OSError:
        return False


@needs_local
@pytest.mark.slow
def test_debian_base_installs_packages_without_touching_the_host(tmp_path: Path) -> None:
    if not is_built(debian_path()) and debootstrap_missing():
        pytest.skip(f"no debian base and cannot build one: {debootstrap_missing()}")
    if not _mirror_reachable():
        pytest.skip("the Debian mirror deb.debian.org is unreachable from here")
    task = tmp_path / "task"
    env = task / "environment"
    env.mkdir(parents=True)
    (task / "task.toml").write_text("[environment]\nallow_internet = true\n")
    (env / "Dockerfile").write_text("FROM debian:bookworm\nWORKDIR /app\nRUN apt-get update -qq && "
                                    "apt-get install -y -qq --no-install-recommends hello >/dev/null\n")
    backend = LocalBackend(base="debian", warm=0)
    try:
        with backend.fork(None) as bare:
            assert "bookworm" in bare.exec("cat /etc/os-release").output
            assert bare.exec("command -v python3 || echo none").output == "none\n"  # not the host's root
        with backend.fork(env) as attempt:
            assert attempt.exec("hello").output == "Hello, world!\n"
            offline = attempt.exec("cd /tmp && apt-get download hello >/dev/null 2>&1; echo $?", timeout_s=60)
            assert offline.output != "0\n"  # the build had the network; the attempt does not
    finally:
        backend.close()
    assert not Path("/usr/bin/hello").exists() or Path("/usr/bin/hello").stat().st_mtime < time.time() - 600

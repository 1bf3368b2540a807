"""Recovery of LocalBackend from the death of its zygote (SIGKILL by pid): the next fork starts a fresh
one (exactly once per death, also under concurrent forks), the attempts that lived on the dead one raise
SandboxDied (an infrastructure error the harness retries), and nothing of either zygote is left behind."""

from __future__ import annotations

import logging
import os
import select
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from albatross.eval.oracle import OracleAgent
from albatross.harness.agent import AttemptSpec
from albatross.harness.retry import run_with_retries as run_attempt
from albatross.records import STATUS_INFRA_ERROR, Trajectory
from albatross.sandbox import LocalBackend, SandboxDied, SandboxError, local_available
from albatross.sandbox.cgroups import cgroup_root
from albatross.sandbox.local import LocalAttempt
from albatross.tasks.builtin import generate_tasks
from albatross.tasks.format import load_tasks

pytestmark = pytest.mark.skipif(
    not local_available(), reason="the local sandbox needs root, cgroup v1 memory+pids, namespaces, overlayfs"
)

DOCKERFILE = "FROM python:3.11-slim\nWORKDIR /app\nCOPY data/ /app/\nRUN echo built > /app/built.txt\n"


@pytest.fixture
def env_dir(tmp_path: Path) -> Path:
    env = tmp_path / "task" / "environment"
    (env / "data").mkdir(parents=True)
    (env / "data" / "hello.txt").write_text("hello\n")
    (env / "Dockerfile").write_text(DOCKERFILE)
    return env


@pytest.fixture
def backend(tmp_path: Path) -> Iterator[LocalBackend]:
    b = LocalBackend(hide_paths=[tmp_path], warm=2)
    yield b
    b.close()


# ---- helpers -----------------------------------------------------------------------------------------------


def running(pid: int) -> bool:
    """The process exists and has not exited (a zombie waiting for its reaper has)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def wait_until(check, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def kill_zygote(backend: LocalBackend) -> int:
    """SIGKILL the backend's zygote by its pid; return once it has exited (as a test harness would)."""
    pid = backend.zygote_pid
    assert pid is not None
    pidfd = os.pidfd_open(pid)
    try:
        os.kill(pid, signal.SIGKILL)
        assert select.select([pidfd], [], [], 5)[0], "the zygote did not die"
    finally:
        os.close(pidfd)
    return pid


def warm_holders(backend: LocalBackend) -> list[int]:
    with backend._pool._cond:
        return [a.pid for ready in backend._pool._ready.values() for a in ready]


def leftovers(backend: LocalBackend, pids: list[int], roots: list[str]) -> list[str]:
    """What of the backend is still there: mounts, attempt cgroups, running processes, zygote dirs."""
    found = [line for line in Path("/proc/self/mountinfo").read_text().splitlines() if "albatross" in line]
    prefix = f"{os.getpid()}-{backend._token}-"
    found += [str(p) for c in ("memory", "pids") for p in cgroup_root(c).glob(f"{prefix}*")]
    found += [f"process {pid}" for pid in pids if running(pid)]
    found += [root for root in roots if Path(root).exists()]
    return found


def sandbox_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno >= logging.WARNING and r.name.startswith("albatross.sandbox")]


# ---- the zygote dies between forks --------------------------------------------------------------------------


def test_a_killed_zygote_is_restarted_by_the_next_fork(backend: LocalBackend, env_dir: Path,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="albatross.sandbox")
    with backend.fork(env_dir) as attempt:
        assert attempt.exec("cat built.txt hello.txt").output == "built\nhello\n"
    assert wait_until(lambda: len(warm_holders(backend)) == 2)
    old = backend._zygote
    assert old is not None
    holders = warm_holders(backend)
    dead_pid = kill_zygote(backend)
    assert wait_until(lambda: not any(running(pid) for pid in holders)), "holders outlived their zygote"

    with backend.fork(env_dir) as attempt:  # the parent (COPY and RUN) is rebuilt on the fresh zygote
        assert attempt.exec("cat built.txt hello.txt; echo new > hello.txt").output == "built\nhello\n"
        assert attempt.zygote is backend._zygote and backend.zygote_pid != dead_pid
    for _ in range(3):
        with backend.fork(env_dir) as attempt:
            assert attempt.exec("cat hello.txt").output == "hello\n"
    new = backend._zygote
    assert new is not None and backend.restarts == 1
    assert not running(dead_pid) and not Path(old.root).exists()  # reaped, its directory removed
    warnings = sandbox_warnings(caplog)
    assert len(warnings) == 1 and f"zygote {dead_pid} died" in warnings[0]

    pids = [dead_pid, new.pid, *holders, *warm_holders(backend)]
    backend.close()
    assert wait_until(lambda: not leftovers(backend, pids, [old.root, new.root])), \
        leftovers(backend, pids, [old.root, new.root])
    assert backend.restarts == 1 and backend.live_attempts() == 0


def test_a_zygote_killed_during_a_build_is_restarted_and_the_build_redone(backend: LocalBackend,
                                                                          env_dir: Path) -> None:
    (env_dir / "Dockerfile").write_text(DOCKERFILE + "RUN sleep 1.5 && echo slow > /app/slow.txt\n")
    backend.prepare(None)  # the zygote runs
    built: list[object] = []
    thread = threading.Thread(target=lambda: built.append(backend.prepare(env_dir)))
    thread.start()
    assert wait_until(lambda: len(backend._attempts) == 1)  # the builder runs the Dockerfile
    time.sleep(0.5)
    kill_zygote(backend)
    thread.join(30)
    assert len(built) == 1 and backend.restarts == 1  # prepare did not fail: it built again
    with backend.fork(env_dir) as attempt:
        assert attempt.exec("cat built.txt slow.txt").output == "built\nslow\n"
    assert backend.restarts == 1


def test_a_build_cut_short_by_close_is_not_started_again(backend: LocalBackend, env_dir: Path) -> None:
    """Ctrl-C closes the backend under a running build: the build fails at once, on no fresh zygote."""
    (env_dir / "Dockerfile").write_text(DOCKERFILE + "RUN sleep 30 && echo slow > /app/slow.txt\n")
    backend.prepare(None)  # the zygote runs
    outcome: list[BaseException | object] = []

    def build() -> None:
        try:
            outcome.append(backend.prepare(env_dir))
        except BaseException as err:  # noqa: BLE001 - the outcome is what the test looks at
            outcome.append(err)

    thread = threading.Thread(target=build)
    thread.start()
    assert wait_until(lambda: len(backend._attempts) == 1)  # the builder runs the Dockerfile
    first = backend.zygote_pid
    time.sleep(0.5)
    started = time.monotonic()
    backend.close()
    thread.join(20)
    assert not thread.is_alive() and time.monotonic() - started < 15, "the build went on after close"
    assert len(outcome) == 1 and isinstance(outcome[0], SandboxError), outcome
    assert backend.restarts == 0 and backend.zygote_pid is None, "a fresh zygote was started after close"
    assert first is not None and not running(first)


@pytest.mark.parametrize("userns", [True, False], ids=["user-namespace", "dropped-capabilities"])
def test_holders_die_with_their_zygote_in_both_modes(userns: bool, tmp_path: Path) -> None:
    backend = LocalBackend(hide_paths=[tmp_path], userns=userns and None, warm=0)
    if userns and not backend.userns:
        pytest.skip("no user namespaces with idmapped mounts on this kernel")
    try:
        attempt = backend.fork(None, workdir="/w")
        assert attempt.exec("id -u").output == "0\n"
        kill_zygote(backend)
        assert wait_until(lambda: not running(attempt.pid)), "the holder outlived its zygote"
        assert not attempt.alive()
        with pytest.raises(SandboxDied):
            attempt.exec("echo never")
        attempt.close()
        with backend.fork(None, workdir="/w") as fresh:
            assert fresh.exec("echo ok").output == "ok\n"
        assert backend.restarts == 1
    finally:
        backend.close()


def test_concurrent_forks_after_a_death_restart_it_once(backend: LocalBackend, env_dir: Path) -> None:
    with backend.fork(env_dir) as attempt:
        attempt.exec("true")
    kill_zygote(backend)
    outputs: list[str] = []
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def work(i: int) -> None:
        try:
            start.wait()
            with backend.fork(env_dir) as a:
                outputs.append(a.exec(f"echo {i}; cat built.txt").output)
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors  # the forks waited for the restart; none failed
    assert sorted(outputs) == sorted(f"{i}\nbuilt\n" for i in range(8))
    assert backend.restarts == 1


# ---- the zygote dies while attempts run ---------------------------------------------------------------------


def test_attempts_running_when_the_zygote_dies_raise_sandbox_died(backend: LocalBackend, env_dir: Path) -> None:
    results: dict[int, object] = {}
    holders: list[int] = []
    ready = threading.Barrier(5)

    def work(i: int) -> None:
        attempt = backend.fork(env_dir)
        try:
            attempt.exec("true")
            holders.append(attempt.pid)
            ready.wait()
            results[i] = attempt.exec("sleep 30; echo finished", timeout_s=60)
        except SandboxError as err:
            results[i] = err
        finally:
            attempt.close()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    ready.wait()
    time.sleep(0.3)  # the commands are running
    start = time.monotonic()
    kill_zygote(backend)
    for t in threads:
        t.join(30)
    assert time.monotonic() - start < 5  # promptly, not when the commands would have ended
    assert len(results) == 4 and all(isinstance(r, SandboxDied) for r in results.values()), results
    assert not any(running(pid) for pid in holders)
    with backend.fork(env_dir) as attempt:  # the backend recovered
        assert attempt.exec("cat built.txt").output == "built\n"
    assert backend.restarts == 1 and backend.live_attempts() <= backend._pool.size


def test_forks_during_repeated_deaths_finish_or_fail_as_infra_errors(backend: LocalBackend, env_dir: Path) -> None:
    stop = threading.Event()
    outcomes: Counter[str] = Counter()
    unexpected: list[BaseException] = []
    lock = threading.Lock()

    def work() -> None:
        while not stop.is_set():
            try:
                with backend.fork(env_dir) as a:
                    ok = a.exec("cat built.txt").output == "built\n"
                outcome = "ok" if ok else "wrong"
            except SandboxError as err:
                outcome = type(err).__name__
            except BaseException as err:  # noqa: BLE001 - reported below
                unexpected.append(err)
                return
            with lock:
                outcomes[outcome] += 1

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    pids = []
    try:
        for death in range(2):
            time.sleep(1.0)
            pids.append(kill_zygote(backend))
            assert wait_until(lambda n=death + 1: backend.restarts == n, 10)
        time.sleep(1.0)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert not unexpected, unexpected
    assert backend.restarts == 2 and len(set(pids)) == 2
    assert outcomes["ok"] > 0 and outcomes["wrong"] == 0
    assert set(outcomes) <= {"ok", "SandboxDied", "ForkError", "ZygoteDied"}, outcomes
    with backend.fork(env_dir) as attempt:
        assert attempt.exec("cat built.txt").output == "built\n"


# ---- a holder dies ------------------------------------------------------------------------------------------


def test_a_killed_holder_raises_sandbox_died_promptly(backend: LocalBackend, env_dir: Path) -> None:
    attempt: LocalAttempt = backend.fork(env_dir)
    try:
        assert attempt.exec("echo up").output == "up\n"
        threading.Timer(0.5, os.kill, (attempt.pid, signal.SIGKILL)).start()
        start = time.monotonic()
        with pytest.raises(SandboxDied):
            attempt.exec("sleep 30", timeout_s=60)
        assert time.monotonic() - start < 3
        with pytest.raises(SandboxDied):
            attempt.exec("echo again")
        with pytest.raises(SandboxDied):
            attempt.read_file("/app/hello.txt")
    finally:
        attempt.close()
    with backend.fork(env_dir) as other:  # only that attempt is lost: the zygote lives on
        assert other.exec("cat hello.txt").output == "hello\n"
    assert backend.restarts == 0


# ---- through the harness --------------------------------------------------------------------------------------


class _KillOnFirstFork:
    """The backend, except that right after the first fork its zygote is killed (mid-try)."""

    name, isolated = "local", True

    def __init__(self, backend: LocalBackend) -> None:
        self.backend, self.killed = backend, 0

    def fork(self, *args, **kw):
        attempt = self.backend.fork(*args, **kw)
        if not self.killed:
            self.killed = kill_zygote(self.backend)
        return attempt

    def close(self) -> None:
        self.backend.close()


def test_a_try_cut_short_by_the_zygote_death_is_retried_and_scored(tmp_path: Path) -> None:
    task = load_tasks(generate_tasks(tmp_path / "tasks", n_train=1, n_heldout=0, seed=4)["train"])[0]
    backend = LocalBackend(hide_paths=[tmp_path], warm=1)
    proxy = _KillOnFirstFork(backend)
    counts: Counter = Counter()
    tries: list[Trajectory] = []
    try:
        final = run_attempt(OracleAgent(proxy), AttemptSpec(task, "g0", 0), 3, counts, tries.append)
    finally:
        backend.close()
    assert proxy.killed and backend.restarts == 1
    assert tries[0].status == STATUS_INFRA_ERROR and "SandboxDied" in tries[0].error
    assert not tries[0].success and not tries[0].reward.metrics  # never scored
    assert final.status != STATUS_INFRA_ERROR and final.success, final.error
    assert counts["infra_error_attempts"] == len(tries) - 1 >= 1

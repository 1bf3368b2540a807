"""Unisolated sandbox for development on machines without root: NOT a security boundary.

Each attempt is a temporary directory holding a copy of its parent's files; commands run there with
``bash -c`` in a new session, as the calling user, seeing the whole host (file system, network,
processes). From the Dockerfile only COPY, WORKDIR and ENV are honoured; RUN is skipped (with a
warning), so environments that install software with RUN will not work here.

Path mapping (the main limitation): absolute sandbox paths given to ``put_dir``/``read_file``, COPY
destinations and the WORKDIR are rewritten to ``<attempt dir>/<path>``, but paths inside commands are
not: ``cat /app/x`` reads the host's ``/app/x``; use relative paths, or ``$SANDBOX_ROOT/app/x``.
Timeouts kill the command's process group; processes that start their own session escape that kill,
and are only killed at ``close`` (or ``kill_all``, before verification) if they stayed in a process
group this backend started: the verifier here is out of reach of a well-behaved agent only.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import select
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from albatross.sandbox.base import (
    LIMIT_OUTPUT,
    LIMIT_TIMEOUT,
    ExecResult,
    ForkError,
    Limits,
    Output,
    SandboxDied,
    SandboxError,
    VerifierExec,
    VerifierSpec,
    pick_limit,
    verify_in_place,
)
from albatross.sandbox.build import copy_tar, env_key
from albatross.sandbox.dockerfile import Copy, Env, Run, Workdir, parse_dockerfile
from albatross.sandbox.faults import FAULT_DIE, FAULT_FORK, FaultInjector

log = logging.getLogger(__name__)
_FIXED_PATH = os.pathsep.join(p for p in (str(Path(sys.executable).parent), "/usr/local/sbin", "/usr/local/bin",
                                          "/usr/sbin", "/usr/bin", "/sbin", "/bin"))

_NOT_ISOLATED = (
    "albatross: WARNING: sandbox backend 'process' gives NO isolation: attempt {id} runs as {user} "
    "with full access to this machine's files, network and processes. Use the 'local' backend for "
    "training and evaluation."
)


@dataclass
class _Parent:
    root: Path
    key: str  # ``env_key`` of its environment
    env: dict[str, str] = field(default_factory=dict)
    workdir: str | None = None
    build_s: float = 0.0  # nothing is built (RUN is skipped); ``Prepared``
    cached: bool = False


def _state_file(root: Path) -> Path:
    return root / ".albatross" / "state"


def _prologue(root: Path) -> str:
    state = shlex.quote(str(_state_file(root)))
    return (
        f"source {state} 2>/dev/null\n"
        f'trap \'__albatross_rc=$?; {{ export -p; printf "cd -- %q\\n" "$PWD"; }} >{state} '
        "2>/dev/null; exit $__albatross_rc' EXIT\n"
    )


class ProcessAttempt:
    """One attempt: a temporary directory and the process groups of its commands."""

    def __init__(self, attempt_id: str, root: Path, limits: Limits) -> None:
        self.id, self.root, self.limits = attempt_id, root, limits
        self._lock = threading.Lock()
        self._groups: set[int] = set()
        self._closed = False
        self.dead = False  # fault injection: the attempt behaves as if its sandbox had died
        self.first_output_at: float | None = None  # not measured here (``Attempt.first_output_at``)

    def host_path(self, sandbox_path: str) -> Path:
        """Where the sandbox path ``sandbox_path`` lives on the host (inside the attempt directory)."""
        path = Path(os.path.normpath("/" + sandbox_path.lstrip("/")))
        return self.root / path.relative_to("/")

    def exec(self, command: str, timeout_s: float | None = None) -> ExecResult:
        return self._run(["bash", "-c", _prologue(self.root) + command], self.root, timeout_s,
                         os.environ.get("PATH", "/usr/bin:/bin"))

    def exec_clean(self, command: str, cwd: str, timeout_s: float | None = None) -> ExecResult:
        """``bash --noprofile --norc -c command`` with a fixed environment, none of the shell's state."""
        where = self.host_path(cwd)
        return self._run(["bash", "--noprofile", "--norc", "-c", command], where if where.is_dir() else self.root,
                         timeout_s, _FIXED_PATH)

    def verify(self, spec: VerifierSpec) -> VerifierExec:
        """The verifier in the attempt itself (``base.verify_in_place``): this backend cannot give it a view
        of its own, so its tools are the attempt's."""
        return verify_in_place(self, spec)

    def kill_all(self) -> None:
        """Kill the process group of every command this attempt ran (best effort: no isolation)."""
        with self._lock:
            self._check_alive()
            for group in self._groups:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(group, signal.SIGKILL)

    def _run(self, argv: list[str], cwd: Path, timeout_s: float | None, path: str) -> ExecResult:
        timeout = self.limits.command_timeout_s if timeout_s is None else timeout_s
        with self._lock:
            if self._closed:
                raise SandboxError(f"attempt {self.id} is closed")
            if self.dead:
                raise SandboxDied(f"attempt {self.id}: sandbox died")
            start = time.monotonic()
            env = {"PATH": path, "SANDBOX_ROOT": str(self.root)}
            try:
                proc = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    env=env,
                    cwd=cwd,
                )
            except OSError as err:
                raise SandboxError(f"attempt {self.id}: cannot start bash: {err}") from err
            self._groups.add(proc.pid)
            out = Output(self.limits.max_output_bytes)
            timed_out = self._collect(proc, out, start + timeout)
            code = proc.returncode if proc.returncode >= 0 else 128 - proc.returncode
        limit = pick_limit({LIMIT_TIMEOUT: timed_out, LIMIT_OUTPUT: out.dropped > 0})
        return ExecResult(
            out.text(), -1 if timed_out else code, timed_out, time.monotonic() - start, out.dropped, limit
        )

    def _collect(self, proc: subprocess.Popen[bytes], out: Output, deadline: float) -> bool:
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        pidfd = os.pidfd_open(proc.pid)
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        poller.register(pidfd, select.POLLIN)
        timed_out = False
        try:
            while proc.poll() is None:
                wait = max(0.0, deadline - time.monotonic())
                for ready, _event in poller.poll(wait * 1000):
                    if ready == fd:
                        data = os.read(fd, 1 << 16)
                        out.add(data) if data else poller.unregister(fd)
                if time.monotonic() >= deadline and proc.poll() is None:
                    timed_out = True
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            os.set_blocking(fd, False)
            with contextlib.suppress(BlockingIOError):
                while data := os.read(fd, 1 << 16):
                    out.add(data)
        finally:
            os.close(pidfd)
            proc.stdout.close()
        return timed_out

    def _check_alive(self) -> None:
        if self._closed:
            raise SandboxError(f"attempt {self.id} is closed")
        if self.dead:
            raise SandboxDied(f"attempt {self.id}: sandbox died")

    def put_dir(self, host_dir: Path, sandbox_path: str) -> None:
        self._check_alive()
        shutil.copytree(host_dir, self.host_path(sandbox_path), symlinks=True, dirs_exist_ok=True)

    def read_file(self, sandbox_path: str) -> bytes | None:
        """A regular file's bytes; None when missing, not a regular file, or a symbolic link."""
        self._check_alive()
        try:
            fd = os.open(self.host_path(sandbox_path), os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
        except OSError:
            return None
        with os.fdopen(fd, "rb") as f:
            return f.read() if stat.S_ISREG(os.fstat(fd).st_mode) else None

    def refused_hosts(self) -> list[str]:
        return []  # nothing is enforced: its commands have the host's network

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for group in self._groups:  # background jobs that stayed in a group we started
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(group, signal.SIGKILL)
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> ProcessAttempt:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ProcessBackend:
    """Attempts as temporary directories, without isolation (see the module docstring)."""

    name = "process"
    isolated = False
    restarts = 0  # no helper process to restart

    def pids(self) -> dict[str, int]:
        return {}

    def __init__(
        self,
        state_dir: str | Path | None = None,
        hide_paths: object = (),
        fail_rate: float = 0.0,
        fault_seed: int | None = None,
        **ignored: object,
    ) -> None:
        """``hide_paths`` and the isolated backend's options (``base``, ``warm``, ...) are accepted and
        ignored: nothing is hidden here. ``fail_rate``: share of forks made to fail (tests only)."""
        self.faults = FaultInjector(fail_rate, fault_seed)
        self._root = Path(tempfile.mkdtemp(prefix="albatross-process-", dir=state_dir))
        self._lock = threading.Lock()
        self._parents: dict[str, _Parent] = {}
        self._attempts: set[ProcessAttempt] = set()
        self._count = 0

    def prepare(self, env_dir: Path | None, network: str = "none", build_timeout_s: float | None = None) -> _Parent:
        """The parent of ``env_dir`` (RUN is skipped, so neither the network policy nor a build time applies;
        nothing here is isolated: commands have the host's network whatever the policy)."""
        key = env_key(env_dir)
        with self._lock:
            if key not in self._parents:
                self._parents[key] = self._build(env_dir, self._root / "parents" / key)
            return self._parents[key]

    def _build(self, env_dir: Path | None, root: Path) -> _Parent:
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        parent = _Parent(root, root.name)
        if env_dir is None:
            return parent
        for ins in parse_dockerfile(Path(env_dir) / "Dockerfile"):
            cwd = parent.workdir or "/"
            if isinstance(ins, Env):
                parent.env.update(ins.pairs)
            elif isinstance(ins, Workdir):
                parent.workdir = os.path.normpath(os.path.join(cwd, ins.path))
                (root / parent.workdir.lstrip("/")).mkdir(parents=True, exist_ok=True)
            elif isinstance(ins, Copy):
                with tarfile.open(fileobj=io.BytesIO(copy_tar(ins, Path(env_dir), cwd))) as tar:
                    if hasattr(tarfile, "tar_filter"):  # extraction filters: Python 3.12, 3.11.4+, 3.10.12+
                        tar.extractall(root, filter="tar")
                    else:
                        tar.extractall(root)
            elif isinstance(ins, Run):
                log.warning("%s/Dockerfile:%d: RUN skipped by the 'process' backend", env_dir, ins.line)
        return parent

    def fork(
        self, env_dir: Path | None, workdir: str = "/app", limits: Limits | None = None
    ) -> ProcessAttempt:
        fault = self.faults.draw()
        if fault == FAULT_FORK:
            raise ForkError("injected fault: fork failed")
        parent = self.prepare(env_dir)
        with self._lock:
            self._count += 1
            attempt_id = f"p{self._count}"
        root = self._root / "attempts" / attempt_id
        shutil.copytree(parent.root, root, symlinks=True)
        attempt = ProcessAttempt(attempt_id, root, limits or Limits())
        message = _NOT_ISOLATED.format(id=attempt_id, user=_user())
        log.warning(message)
        print(message, file=sys.stderr)
        start = attempt.host_path(parent.workdir or workdir)
        start.mkdir(parents=True, exist_ok=True)
        env = {"HOME": str(root), **parent.env}
        state = [f"export {k}={shlex.quote(v)}" for k, v in env.items()] + [
            f"cd -- {shlex.quote(str(start))}"
        ]
        _state_file(root).parent.mkdir(parents=True, exist_ok=True)
        _state_file(root).write_text("\n".join(state) + "\n")
        with self._lock:
            self._attempts.add(attempt)
        attempt.dead = fault == FAULT_DIE
        return attempt

    def close(self) -> None:
        with self._lock:
            attempts, self._attempts = list(self._attempts), set()
            self._parents.clear()
        for attempt in attempts:
            attempt.close()
        shutil.rmtree(self._root, ignore_errors=True)


def _user() -> str:
    try:
        import pwd

        return pwd.getpwuid(os.getuid()).pw_name
    except (ImportError, KeyError):
        return str(os.getuid())

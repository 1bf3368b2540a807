"""Container-engine sandbox: each task environment an image, each attempt a container (Docker or Podman).

For users with a container engine (``sandbox.type = "docker"``, ``sandbox.engine`` "auto", "docker" or
"podman"; auto: Docker when its daemon answers, else Podman when it is installed). The same harness,
verifier and limits run on it as on ``local.py``; only the isolation comes from the engine.

Images: a task's ``environment/`` is built once with ``<engine> build`` and tagged
``albatross-env:<env_key>`` (reused across runs while the directory's files are the same; ``<engine> rmi``
it to rebuild). Builds use the engine's default network (package installs work); attempts never have
one. A ``FROM`` image the engine does not have is made here when albatross can build it
(``images.resolve_base``: a Debian-family root from this machine's Debian mirror, imported with
``<engine> import`` under the name the Dockerfile uses, with the image's env); any other is left to the
engine (which pulls it, where a registry is reachable). No environment: ``images.DEFAULT_REF``.

Attempts: ``<engine> run -d`` of the image with ``--network none``, its own hostname, ``--memory`` (swap
included), ``--pids-limit``, ``--cpus`` (when ``Limits.cpus`` > 0), ``--shm-size`` of ``disk_mb``, Docker's
default capabilities minus NET_RAW and MKNOD, ``no-new-privileges``, and a bash as process 1 that only
reaps orphans (so ``kill -9 -1`` inside ends everything else). Commands run with ``<engine> exec``
through a small ``sh`` wrapper that reports the command's pid (its session), changes directory and runs
the command with exactly the given environment (``env -i``); ``exec`` keeps cwd and exported variables
in ``/run/albatross/state`` (a tmpfs of the container), as the local backend does. An image with a
``User`` in its config (a Dockerfile ``USER``) has every command run as it (``exec --user``, with the
user's HOME unless ENV sets one, resolved once per image in its /etc/passwd); the container's process 1,
tars, reads and kills run as root, and the shell state and ``/logs`` belong to the user.

Limits are outcomes (``ExecResult.limit``), as with ``local``: a timeout kills the command's process
group inside the container (exit code -1, ``timed_out``); the memory and process limits are read from the
container's cgroup on this host (``oom_kill`` and ``pids.current``; only when the engine runs here and
the container's init is visible in ``/proc``); a fork bomb gets every process of the attempt killed.
The disk limit is ``--storage-opt size=`` where the engine's storage supports it (overlay on xfs with
project quotas, btrfs, zfs), tried once per backend; elsewhere only ``/dev/shm`` is bounded, and a full
disk is not reported as ``disk``. A container that died (killed, crashed, engine gone) raises
``SandboxDied``; ``close`` removes it (``rm -f``). Every container carries the label
``albatross.sandbox=<backend token>``.

Podman without systemd (no ``/run/systemd/system``) gets ``--cgroup-manager=cgroupfs`` and
``--events-backend=file``; on a host with hybrid cgroups (v1 controllers and a v2 mount), where crun
refuses to run, ``--runtime=runc`` when runc is installed. Container rlimits are set to this process's
own (an engine's default may exceed what an unprivileged-resource caller may set).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import re
import resource
import select
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from albatross.errors import UserError
from albatross.sandbox.base import (
    LIMIT_ATTEMPT_TIMEOUT,
    LIMIT_OOM,
    LIMIT_OUTPUT,
    LIMIT_PIDS,
    LIMIT_TIMEOUT,
    ExecResult,
    ForkError,
    Limits,
    Output,
    SandboxDied,
    SandboxError,
    VerifierExec,
    VerifierSpec,
    closed_at_exit,
    pick_limit,
    sandbox_default,
    verify_in_place,
)
from albatross.sandbox.build import (
    DEFAULT_PATH,
    EnvBuildError,
    EnvKeys,
    UserIds,
    dir_tar,
    resolve_user,
    state_script,
)
from albatross.sandbox.faults import FAULT_DIE, FAULT_FORK, FaultInjector

__all__ = [
    "ENGINES",
    "LABEL",
    "DockerAttempt",
    "DockerBackend",
    "EngineUnavailable",
    "engine_missing",
    "find_engine",
]

log = logging.getLogger(__name__)

ENGINES = ("docker", "podman")
LABEL = "albatross.sandbox"  # every container of a backend: LABEL=<its token>
IMAGE_REPO = "albatross-env"
STATE_DIR = "/run/albatross"
STATE_FILE = f"{STATE_DIR}/state"
CAP_DROP = ("NET_RAW", "MKNOD")
ENGINE_TIMEOUT_S = 120.0  # an engine call (run, cp, rm, inspect) that takes longer: the engine is stuck
# Process 1: reaps orphans and never exits on its own; no child of its own, so `kill -9 -1` leaves it alone.
_INIT = (
    f"mkdir -p {STATE_DIR} && mkfifo {STATE_DIR}/idle && exec 3<>{STATE_DIR}/idle && rm -f {STATE_DIR}/idle "
    "|| exit 1; "
    "trap 'exit 0' TERM; while :; do read -r -u 3 _; done"
)
# Every exec: print the pid (a session leader: the engine starts each exec in its own session), cd, run
# argv with exactly the given environment.
_PID_MARK = b"\x1falbatross-pid "
_WRAP = 'printf "\\037albatross-pid %s\\n" "$$"; cd -- "$1" 2>/dev/null || cd /; shift; exec env -i "$@"'
# The persistent shell of `exec`, as local.py keeps it; commands are the OOM killer's first pick.
_PROLOGUE = (
    "echo 1000 >/proc/self/oom_score_adj 2>/dev/null\n"
    f"source {STATE_FILE} 2>/dev/null\n"
    'trap \'__albatross_rc=$?; { export -p; printf "cd -- %q\\n" "$PWD"; } '
    f">{STATE_FILE} 2>/dev/null; exit $__albatross_rc' EXIT\n"
)
_KILL_ALL = (
    "kill -9 -1 2>/dev/null; sleep 0.2; n=0; for d in /proc/[0-9]*; do p=${d#/proc/}; "
    '[ "$p" = 1 ] || [ "$p" = $$ ] || n=$((n+1)); done; echo $n'
)
# The starting directory and the shell state, as root; a non-root USER ($2, "uid:gid") owns the state and
# /logs (the verifier makes /logs/verifier afresh there), as on the local backend.
_START = (
    f'mkdir -p -- "$1" && (umask 077 && cat > {STATE_FILE}) && if [ -n "$2" ]; then '
    f'chown -- "$2" {STATE_DIR} {STATE_FILE} && {{ [ -d /logs ] && [ ! -L /logs ] || '
    '{ rm -f /logs && mkdir /logs; }; } && chown -h -- "$2" /logs; fi'
)
_READ = '[ -f "$1" ] && [ ! -L "$1" ] || exit 3; exec cat -- "$1"'
_FROM = re.compile(r"^\s*FROM\s+(?:--\S+\s+)*(\S+)(?:\s+AS\s+(\S+))?", re.I | re.M)


# ---- the engine --------------------------------------------------------------------------------------------


class EngineUnavailable(SandboxError, UserError):
    """``sandbox.type = "docker"`` on a machine without a usable container engine (a user error: exit 2)."""


def _answers(argv: list[str]) -> bool:
    try:
        return subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=15).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def find_engine(engine: str = "auto") -> str:
    """The engine to use: ``engine`` itself, or for "auto" Docker if its daemon answers, else Podman if
    it is on PATH. Raises ``EngineUnavailable`` naming what is missing."""
    if engine not in ("auto", *ENGINES):
        raise ValueError(f"unknown container engine {engine!r}; choose auto, docker or podman")
    wanted = ENGINES if engine == "auto" else (engine,)
    for name in wanted:
        if shutil.which(name) is None:
            continue
        if name == "podman" or _answers(["docker", "version", "--format", "{{.Server.Version}}"]):
            return name
    if engine == "docker" and shutil.which("docker"):
        raise EngineUnavailable(
            'sandbox "docker", engine "docker": the docker daemon does not answer (`docker version` fails)'
        )
    raise EngineUnavailable(
        f'sandbox "docker": no container engine ({" or ".join(wanted)} is not on '
        "PATH, or its daemon does not answer)"
    )


def engine_missing(engine: str = "auto") -> str:
    """Why no container engine can be used here ("" when one can)."""
    try:
        find_engine(engine)
    except EngineUnavailable as err:
        return str(err)
    return ""


def _hybrid_cgroups() -> bool:
    """cgroup v1 controllers with a v2 hierarchy mounted beside them (crun refuses to run there)."""
    return (
        Path("/sys/fs/cgroup/memory").is_dir() and Path("/sys/fs/cgroup/unified/cgroup.controllers").exists()
    )


def engine_argv(engine: str) -> list[str]:
    """The engine's command with the global flags this host needs (module docstring)."""
    argv = [engine]
    if engine == "podman":
        if not Path("/run/systemd/system").is_dir():
            argv += ["--cgroup-manager=cgroupfs", "--events-backend=file"]
        if _hybrid_cgroups() and shutil.which("runc"):
            argv.append("--runtime=runc")
    return argv


def _tail(text: str | bytes, lines: int = 5) -> str:
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    return " | ".join(text.strip().splitlines()[-lines:])


# ---- the container's cgroup, seen from this host -----------------------------------------------------------


class _HostCgroup:
    """The container's memory and pids cgroups on this host (v1 or v2); ``None`` members when not visible
    (an engine on another machine or in a VM): then OOM kills and the process limit go unreported."""

    def __init__(self, init_pid: int, container_id: str) -> None:
        self.init_pid = init_pid
        self.memory: Path | None = None
        self.pids: Path | None = None
        try:
            lines = Path(f"/proc/{init_pid}/cgroup").read_text().splitlines()
        except OSError:
            return
        paths = {}
        for line in lines:
            _num, controllers, path = line.split(":", 2)
            for name in controllers.split(",") if controllers else ["unified"]:
                paths[name] = path
        if container_id[:12] not in "".join(paths.values()):  # a pid of another machine's namespace
            return
        v2 = "memory" not in paths
        root = Path("/sys/fs/cgroup")
        self.memory = (
            root / paths["unified"].lstrip("/") if v2 else root / "memory" / paths["memory"].lstrip("/")
        )
        self.pids = root / paths["unified"].lstrip("/") if v2 else root / "pids" / paths["pids"].lstrip("/")

    def oom_kills(self) -> int:
        if self.memory is None:
            return 0
        for name in ("memory.events", "memory.oom_control"):
            with contextlib.suppress(OSError):
                for line in (self.memory / name).read_text().splitlines():
                    if line.startswith("oom_kill "):
                        return int(line.split()[1])
        return 0

    def current(self) -> int:
        """Processes in the container, its process 1 included (0 when not visible)."""
        if self.pids is None:
            return 0
        try:
            return int((self.pids / "pids.current").read_text())
        except (OSError, ValueError):
            return 0

    def kill_all(self, settle_s: float = 5.0) -> int:
        """SIGKILL every process of the container but process 1 until none is left; how many are left."""
        if self.pids is None:
            return 0
        deadline = time.monotonic() + settle_s
        while True:
            try:
                procs = [int(p) for p in (self.pids / "cgroup.procs").read_text().split()]
            except (OSError, ValueError):
                return 0
            others = [p for p in procs if p != self.init_pid]
            if not others or time.monotonic() > deadline:
                return len(others)
            for pid in others:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, 9)
            time.sleep(0.02)


# ---- attempts ----------------------------------------------------------------------------------------------


@dataclass
class _Exchange:
    code: int
    timed_out: bool
    out: Output
    started: bool  # the command started in the container (the wrapper reported its pid)
    crowded: bool  # the process table was found full while it ran (and emptied)


class DockerAttempt:
    """One attempt: a running container, driven with ``<engine> exec``."""

    def __init__(self, backend: DockerBackend, name: str, limits: Limits) -> None:
        self.id, self.name, self.limits = name, name, limits
        self._backend, self._engine = backend, backend.engine_argv
        self.first_output_at: float | None = None  # not measured here (``Attempt.first_output_at``)
        self._lock = threading.Lock()
        self._closed = False
        self._cgroup: _HostCgroup | None = None
        self.deadline: float | None = None
        self.image_env: dict[str, str] = {"PATH": DEFAULT_PATH, "HOME": "/root"}  # for exec_clean
        self.user: str | None = None  # the image's User commands run as (``exec --user``); None: root
        self.owner = ""  # "uid:gid" of that user, who owns the shell state and /logs

    # ---- lifecycle ------------------------------------------------------------------------------------
    def start(self, state: str, workdir: str) -> None:
        """Find the container's cgroup, make the starting directory and write the shell's starting state
        (after ``run -d``)."""
        fmt = "{{.State.Pid}} {{.Id}}"
        found = self._engine_call(["inspect", "--format", fmt, self.name]).stdout.split()
        if len(found) == 2 and found[0].isdigit() and int(found[0]) > 0:
            self._cgroup = _HostCgroup(int(found[0]), found[1])
        self._stdin_call(["/bin/sh", "-c", _START, "sh", workdir, self.owner], state.encode())

    def activate(self) -> None:
        """Start the attempt's wall-time budget."""
        if self.limits.attempt_timeout_s is not None:
            self.deadline = time.monotonic() + self.limits.attempt_timeout_s

    def alive(self) -> bool:
        if self._closed:
            return False
        try:
            probe = self._engine_call(["inspect", "--format", "{{.State.Running}}", self.name], check=False)
        except SandboxError:
            return False
        return probe.returncode == 0 and probe.stdout.strip() == "true"

    def kill(self) -> None:
        """Kill the container now, as if it had crashed (fault injection; ``close`` still removes it)."""
        with contextlib.suppress(SandboxError):
            self._engine_call(["kill", self.name], check=False)

    def kill_all(self) -> None:
        """End the agent: SIGKILL every process of the container but its process 1; ``SandboxError`` if
        any survive."""
        with self._lock:
            self._check_open()
            left = self._kill_all()
        if left > 0:
            raise SandboxError(f"attempt {self.id}: {left} processes survived the end of the attempt")

    def _kill_all(self) -> int:
        if self._cgroup is not None and self._cgroup.pids is not None:
            return self._cgroup.kill_all()
        run = self._engine_call(["exec", self.name, "/bin/sh", "-c", _KILL_ALL], check=False)
        if run.returncode != 0:
            raise self._gone(f"cannot kill its processes: {_tail(run.stderr)}")
        return int(run.stdout.split()[-1]) if run.stdout.split() else 0

    def refused_hosts(self) -> list[str]:
        return []  # its attempts have no network at all

    def close(self) -> None:
        """Remove the container (its processes, writable layer and tmpfs go with it)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._backend._remove(self.name)
        self._backend._forget(self)

    def __enter__(self) -> DockerAttempt:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- engine calls ----------------------------------------------------------------------------------
    def _engine_call(self, args: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
        return self._backend._call(args, check=check)

    def _stdin_call(self, argv: list[str], data: bytes) -> None:
        """Run ``argv`` in the container with ``data`` on its stdin; ``SandboxError`` unless it exits 0."""
        self._check_open()
        try:
            run = subprocess.run(
                [*self._engine, "exec", "-i", self.name, *argv],
                input=data,
                capture_output=True,
                timeout=ENGINE_TIMEOUT_S,
                cwd=self._backend.scratch,
            )
        except (OSError, subprocess.TimeoutExpired) as err:
            raise SandboxError(f"attempt {self.id}: {err}") from err
        if run.returncode != 0:
            raise self._gone(_tail(run.stderr or run.stdout))

    def _gone(self, why: str) -> SandboxError:
        """``SandboxDied`` when the container is no longer running, else a plain ``SandboxError``."""
        if not self.alive():
            return SandboxDied(f"attempt {self.id}: container died ({why})")
        return SandboxError(f"attempt {self.id}: {why}")

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxError(f"attempt {self.id} is closed")

    # ---- commands --------------------------------------------------------------------------------------
    def exec(self, command: str, timeout_s: float | None = None) -> ExecResult:
        """Run ``command`` with ``bash -c``; cwd and exported environment persist between calls."""
        return self.run_argv(["/bin/bash", "-c", _PROLOGUE + command], {}, "/", timeout_s)

    def exec_clean(self, command: str, cwd: str, timeout_s: float | None = None) -> ExecResult:
        """Run ``command`` as a fresh ``bash --noprofile --norc -c`` with the image's environment only."""
        return self.run_argv(
            ["/bin/bash", "--noprofile", "--norc", "-c", command], dict(self.image_env), cwd, timeout_s
        )

    def verify(self, spec: VerifierSpec) -> VerifierExec:
        """The verifier in the attempt itself (``base.verify_in_place``): this backend cannot give it a view
        of its own, so its tools are the attempt's."""
        return verify_in_place(self, spec)

    def run_argv(
        self, argv: list[str], env: dict[str, str], cwd: str, timeout_s: float | None = None
    ) -> ExecResult:
        """Run ``argv`` with exactly ``env`` in ``cwd`` (``/`` when it is not a directory)."""
        with self._lock:
            self._check_open()
            start = time.monotonic()
            crowded = self._at_pids_limit()
            if crowded:  # background processes filled the process table: contain them first
                self._kill_all()
            timeout = self.limits.command_timeout_s if timeout_s is None else timeout_s
            budget = None if self.deadline is None else self.deadline - start
            if budget is not None and budget <= 0:
                self._kill_all()
                return ExecResult("", -1, True, 0.0, 0, LIMIT_ATTEMPT_TIMEOUT)
            by_attempt = budget is not None and budget < timeout
            oom_before = self._cgroup.oom_kills() if self._cgroup else 0
            wrapped = ["/bin/sh", "-c", _WRAP, "sh", cwd, *(f"{k}={v}" for k, v in env.items()), *argv]
            ex = self._exchange(wrapped, start + (budget if budget is not None and by_attempt else timeout))
            if not ex.started or (ex.code >= 125 and not self.alive()):
                raise self._gone(f"exec failed with exit code {ex.code}: {_tail(ex.out.text())}")
            pids = crowded or ex.crowded or self._at_pids_limit()
            if pids:
                self._kill_all()
            limit = pick_limit(
                {
                    LIMIT_OOM: self._cgroup is not None and self._cgroup.oom_kills() > oom_before,
                    LIMIT_PIDS: pids,
                    LIMIT_ATTEMPT_TIMEOUT: ex.timed_out and by_attempt,
                    LIMIT_TIMEOUT: ex.timed_out and not by_attempt,
                    LIMIT_OUTPUT: ex.out.dropped > 0,
                }
            )
        code = -1 if ex.timed_out else ex.code
        return ExecResult(ex.out.text(), code, ex.timed_out, time.monotonic() - start, ex.out.dropped, limit)

    def _at_pids_limit(self) -> bool:
        return self._cgroup is not None and self._cgroup.current() >= self.limits.pids

    def _exchange(self, argv: list[str], deadline: float) -> _Exchange:
        try:
            user = ["--user", self.user] if self.user else []
            proc = subprocess.Popen(
                [*self._engine, "exec", *user, self.name, *argv],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                cwd=self._backend.scratch,
            )
        except OSError as err:
            raise SandboxError(f"attempt {self.id}: cannot run {self._engine[0]}: {err}") from err
        assert proc.stdout is not None
        out = Output(self.limits.max_output_bytes)
        reader = _PidReader(out)
        timed_out, crowded = False, False
        give_up, check = 0.0, time.monotonic() + 1.0
        fd = proc.stdout.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        try:
            while True:
                now = time.monotonic()
                events = poller.poll(min(max(0.0, deadline - now), 1.0) * 1000)
                if events:
                    data = os.read(fd, 1 << 16)
                    if not data:
                        break
                    reader.add(data)
                now = time.monotonic()
                if now > check:  # a fork bomb that fills the table is killed now, not at the timeout
                    check = now + 1.0
                    if self._at_pids_limit():
                        crowded = True
                        self._kill_all()
                if now >= deadline:
                    if not timed_out:
                        timed_out, give_up = True, now + 10.0
                    elif now > give_up:
                        proc.kill()
                        proc.wait()
                        raise SandboxDied(f"attempt {self.id}: command did not die after its timeout")
                    self._kill_session(reader.pid, proc)
                    deadline = now + 0.5
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired as err:
            proc.kill()
            proc.wait()
            raise SandboxDied(f"attempt {self.id}: {self._engine[0]} exec did not exit") from err
        finally:
            proc.stdout.close()
        reader.finish()
        code = proc.returncode if proc.returncode >= 0 else 128 - proc.returncode
        return _Exchange(code, timed_out, out, reader.pid is not None, crowded)

    def _kill_session(self, pid: int | None, proc: subprocess.Popen[bytes]) -> None:
        """Kill the timed-out command's process group inside the container (the engine starts each exec
        as a session and group leader; the command alone if not), or the client if it never started."""
        if pid is None:
            proc.kill()
            return
        kill = self._engine_call(
            [
                "exec",
                self.name,
                "/bin/bash",
                "-c",
                'kill -9 -- -"$1" 2>/dev/null || kill -9 "$1"',
                "bash",
                str(pid),
            ],
            check=False,
        )
        if kill.returncode not in (0, 1) and self._cgroup is not None:  # no room to exec (process limit)
            self._cgroup.kill_all()

    # ---- files -----------------------------------------------------------------------------------------
    def put_dir(self, host_dir: Path, sandbox_path: str) -> None:
        """Copy the contents of ``host_dir`` into the attempt at ``sandbox_path``."""
        host_dir = Path(host_dir)
        if not host_dir.is_dir():
            raise FileNotFoundError(f"put_dir: {host_dir} is not a directory")
        self.put_tar(dir_tar(host_dir, sandbox_path))

    def put_tar(self, data: bytes) -> None:
        """Extract an uncompressed tar (member names relative to /) into the attempt (``tar`` inside)."""
        with self._lock:
            self._stdin_call(["tar", "-x", "-p", "-f", "-", "-C", "/"], data)

    def mkdirs(self, sandbox_path: str) -> None:
        with self._lock:
            self._stdin_call(["mkdir", "-p", "--", sandbox_path], b"")

    def read_file(self, sandbox_path: str) -> bytes | None:
        """The bytes of a regular file as the attempt sees it, or None (missing, not regular, a link)."""
        with self._lock:
            self._check_open()
            try:
                run = subprocess.run(
                    [*self._engine, "exec", self.name, "/bin/sh", "-c", _READ, "sh", sandbox_path],
                    stdin=subprocess.DEVNULL,
                    capture_output=True,
                    timeout=ENGINE_TIMEOUT_S,
                    cwd=self._backend.scratch,
                )
            except (OSError, subprocess.TimeoutExpired) as err:
                raise SandboxError(f"attempt {self.id}: {err}") from err
        if run.returncode == 0:
            return run.stdout
        if run.returncode == 3:
            return None
        raise self._gone(f"cannot read {sandbox_path}: {_tail(run.stderr)}")


class _PidReader:
    """Splits the wrapper's pid line off the front of a command's output; the rest goes to ``out``."""

    def __init__(self, out: Output) -> None:
        self.out, self._head = out, b""
        self.pid: int | None = None

    def add(self, data: bytes) -> None:
        if self.pid is not None:
            self.out.add(data)
            return
        self._head += data
        at = self._head.find(_PID_MARK)
        end = self._head.find(b"\n", at) if at >= 0 else -1
        if end >= 0:
            self.pid = int(self._head[at + len(_PID_MARK) : end])
            rest, self._head = self._head[:at] + self._head[end + 1 :], b""
            if rest:
                self.out.add(rest)

    def finish(self) -> None:
        if self._head:  # no pid line: the engine's own error message
            self.out.add(self._head)


# ---- the backend -------------------------------------------------------------------------------------------


@dataclass
class DockerParent:
    """A built environment: its image and what attempts start from."""

    key: str
    image: str
    env: dict[str, str] = field(default_factory=dict)
    workdir: str | None = None
    notes: list[str] = field(default_factory=list)
    user: str | None = None  # the image's User (None: root)
    owner: str = ""  # "uid:gid" of that user ("" for root)
    build_s: float = 0.0  # the engine's build time is not measured here; ``Prepared``
    cached: bool = False


_LIVE = closed_at_exit()  # closed when the interpreter exits


def _no_network_policy(policy: str) -> None:
    """Attempts of this backend have no network; another policy is a user error naming the one that has."""
    if policy != "none":
        raise UserError(f"network policy {policy!r}: the docker sandbox runs attempts with no network; the "
                        "local sandbox (sandbox.type = \"local\") enforces the registries and open policies")


class DockerBackend:
    """Attempts as containers of a Docker or Podman engine (see the module docstring)."""

    name = "docker"
    isolated = True
    restarts = 0  # nothing of ours to restart: the engine runs the containers

    def __init__(
        self,
        engine: str | None = None,
        build_timeout_s: float = 1800.0,
        fail_rate: float = 0.0,
        fault_seed: int | None = None,
        hide_paths: Iterable[str | Path] = (),
        images_dir: str | Path | None = None,
    ) -> None:
        """``engine``: "auto", "docker" or "podman". ``hide_paths`` is accepted for the common backend
        signature: a container sees nothing of the host's files. ``fail_rate``: share of forks made to
        fail at random (fault-injection tests only). ``images_dir``: OCI layouts / ``docker save`` archives
        a ``FROM`` may name (``[sandbox] images``, as for ``local``). ``engine`` left out: ``[sandbox] engine``'s default."""
        del hide_paths
        self.engine = find_engine(sandbox_default("engine") if engine is None else engine)
        self.engine_argv = engine_argv(self.engine)
        # the working directory of every engine command: Podman's conmon writes files (an ``oom`` marker when a
        # container's command is OOM-killed) into the directory it was started from, which is ours, not the caller's
        self.scratch = tempfile.mkdtemp(prefix="albatross-engine-")
        self.build_timeout_s = build_timeout_s
        self.images_dir = Path(images_dir) if images_dir else None
        self.faults = FaultInjector(fail_rate, fault_seed)
        self.token = f"{os.getpid()}-{os.urandom(3).hex()}"
        self._lock = threading.Lock()
        self._keys = EnvKeys()
        self._parents: dict[str, DockerParent] = {}
        self._building: dict[str, threading.Lock] = {}
        self._attempts: set[DockerAttempt] = set()
        self._ids = itertools.count()
        self._storage_opt: bool | None = None  # whether --storage-opt size= works (tried on the first fork)
        _LIVE.add(self)

    def pids(self) -> dict[str, int]:
        """No process of ours: the engine (daemon or conmon) runs the containers."""
        return {}

    # ---- engine calls ---------------------------------------------------------------------------------
    def _call(
        self, args: list[str], check: bool = True, timeout_s: float = ENGINE_TIMEOUT_S
    ) -> subprocess.CompletedProcess[str]:
        try:
            run = subprocess.run(
                [*self.engine_argv, *args],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                errors="replace",
                timeout=timeout_s,
                cwd=self.scratch,
            )
        except (OSError, subprocess.TimeoutExpired) as err:
            raise SandboxError(f"{self.engine} {args[0]}: {err}") from err
        if check and run.returncode != 0:
            raise SandboxError(f"{self.engine} {args[0]} failed (exit {run.returncode}): {_tail(run.stderr)}")
        return run

    def _has_image(self, ref: str) -> bool:
        return self._call(["image", "inspect", "--format", "{{.Id}}", ref], check=False).returncode == 0

    # ---- environments -----------------------------------------------------------------------------------
    def prepare(self, env_dir: Path | None, network: str = "none", build_timeout_s: float | None = None
                ) -> DockerParent:
        """Build (once) the image of ``env_dir``; safe to call from many threads. Builds have the engine's
        network (its own policy, not albatross's); ``build_timeout_s`` is not enforced here (the backend's
        ``build_timeout_s`` bounds ``<engine> build``)."""
        _no_network_policy(network)
        key = self._keys.get(env_dir, self.engine)
        with self._lock:
            parent = self._parents.get(key)
            if parent is not None:
                return parent
            building = self._building.setdefault(key, threading.Lock())
        with building:
            with self._lock:
                parent = self._parents.get(key)
            if parent is None:
                parent = self._build(env_dir, key)
                with self._lock:
                    self._parents[key] = parent
            return parent

    def _build(self, env_dir: Path | None, key: str) -> DockerParent:
        from albatross.sandbox.images import DEFAULT_REF

        notes: list[str] = []
        if env_dir is None:
            notes += self._ensure_base(DEFAULT_REF)
            return self._parent(key, DEFAULT_REF, notes)
        dockerfile = Path(env_dir) / "Dockerfile"
        if not dockerfile.is_file():
            raise EnvBuildError(f"{env_dir}: no Dockerfile")
        stages: set[str] = set()
        for ref, stage in _FROM.findall(dockerfile.read_text(encoding="utf-8", errors="replace")):
            if ref.lower() not in stages and ref != "scratch" and "$" not in ref:
                notes += self._ensure_base(ref)
            if stage:
                stages.add(stage.lower())
        tag = f"{IMAGE_REPO}:{key}"
        if not self._has_image(tag):
            args = ["build", "--force-rm", "-t", tag,  # a failed build leaves no working container
                    "--label", f"{LABEL}.env={key}", "-f", str(dockerfile), str(env_dir)]
            run = self._call(args, check=False, timeout_s=self.build_timeout_s)
            if run.returncode != 0:
                raise EnvBuildError(
                    f"{dockerfile}: {self.engine} build failed (exit {run.returncode}): "
                    f"{_tail(run.stdout + run.stderr, 8)[-2000:]}"
                )
        return self._parent(key, tag, notes)

    def _ensure_base(self, ref: str) -> list[str]:
        """Make the image ``ref`` exist in the engine when it does not and albatross can build it
        (``images.resolve_base``), imported under that name; the notes of the base, if made."""
        from albatross.sandbox import images
        from albatross.sandbox.rootfs import BaseUnavailable

        if self._has_image(ref):
            return []
        try:
            base = images.resolve_base(ref, search=self.images_dir)
        except (EnvBuildError, BaseUnavailable) as err:  # the engine pulls it, where it can
            log.info("%s: no local base for %s (%s); the engine will look for it", self.engine, ref, err)
            return []
        self.import_root(base.root, ref, base.env, base.user, base.workdir)
        return list(base.notes)

    def import_root(self, root: Path, ref: str, env: dict[str, str], user: str | None = None,
                    workdir: str | None = None) -> None:
        """``<engine> import`` a root directory as the image ``ref`` with ``env`` as its ENV (and ``user``,
        ``workdir`` as its USER and WORKDIR: an imported image's config)."""
        changes = [arg for k, v in env.items() for arg in ("--change", f"ENV {k}={json.dumps(v)}")]
        changes += [arg for word, value in (("USER", user), ("WORKDIR", workdir)) if value
                    for arg in ("--change", f"{word} {value}")]
        tar = subprocess.Popen(
            ["tar", "-C", str(root), "--numeric-owner", "-cf", "-", "."],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        try:
            run = subprocess.run(
                [*self.engine_argv, "import", *changes, "-", ref],
                stdin=tar.stdout,
                capture_output=True,
                text=True,
                timeout=self.build_timeout_s,
                cwd=self.scratch,
            )
        finally:
            assert tar.stdout is not None
            tar.stdout.close()
            tar.wait()
        if run.returncode != 0:
            raise EnvBuildError(f"{self.engine} import of {root} as {ref} failed: {_tail(run.stderr)}")

    def _parent(self, key: str, image: str, notes: list[str]) -> DockerParent:
        config = json.loads(
            self._call(["image", "inspect", "--format", "{{json .Config}}", image]).stdout or "{}"
        )
        env = dict(item.split("=", 1) for item in (config.get("Env") or []) if "=" in item)
        user = config.get("User") or None
        ids = self._user_ids(image, user) if user else None
        root = ids is None or ids.root
        return DockerParent(
            key,
            image,
            {"PATH": DEFAULT_PATH, "HOME": "/root" if ids is None else ids.home, **env},
            config.get("WorkingDir") or None,
            notes,
            None if root else user,
            "" if ids is None or root else f"{ids.uid}:{ids.gid}",
        )

    def _user_ids(self, image: str, user: str) -> UserIds:
        """The image's User resolved in its own /etc/passwd and /etc/group (``build.resolve_user``: the
        engine's rules), read once per image by a throwaway container."""
        script = "cat /etc/passwd; echo '#albatross-group'; cat /etc/group 2>/dev/null; true"
        run = self._call(
            [
                "run",
                "--rm",
                *_limit_args(Limits()),
                "--user",
                "0",
                "--entrypoint",
                "/bin/sh",
                image,
                "-c",
                script,
            ]
        )
        passwd, _, group = run.stdout.partition("#albatross-group\n")
        try:
            return resolve_user(user, passwd, group)
        except EnvBuildError as err:
            raise EnvBuildError(f"{image}: {err} (attempts run as the image's User)") from None

    # ---- attempts -----------------------------------------------------------------------------------------
    def fork(
        self, env_dir: Path | None, workdir: str = "/app", limits: Limits | None = None
    ) -> DockerAttempt:
        """A fresh container of the environment's image (no network: ``--network none``)."""
        _no_network_policy((limits or Limits()).network)
        fault = self.faults.draw()
        if fault == FAULT_FORK:
            raise ForkError("injected fault: fork failed")
        parent = self.prepare(env_dir)
        limits = limits or Limits()
        name = f"albatross-{self.token}-{next(self._ids)}"
        attempt = DockerAttempt(self, name, limits)
        with self._lock:
            self._attempts.add(attempt)
        try:
            self._run_container(name, parent.image, limits)
            start = parent.workdir or workdir
            attempt.user, attempt.owner = parent.user, parent.owner
            attempt.start(state_script(parent.env, start), start)
        except BaseException as err:
            attempt.close()
            if isinstance(err, SandboxError) and not isinstance(err, ForkError):
                raise ForkError(f"attempt {name}: {err}") from err
            raise
        attempt.image_env = dict(parent.env)
        attempt.activate()
        if fault == FAULT_DIE:
            attempt.kill()
        return attempt

    def _run_container(self, name: str, image: str, limits: Limits) -> None:
        args = [
            "run",
            "-d",
            "--name",
            name,
            "--hostname",
            name[:63],
            "--label",
            f"{LABEL}={self.token}",
            *_limit_args(limits),
            "--user",
            "0",
            "--entrypoint",
            "/bin/bash",
            image,
            "-c",
            _INIT,
        ]
        if self._storage_opt is not False:
            run = self._call([*args[:1], "--storage-opt", f"size={limits.disk_mb}m", *args[1:]], check=False)
            if run.returncode == 0:
                self._storage_opt = True
                return
            self._remove(name)
            if self._storage_opt or "storage" not in run.stderr.lower():  # failed for another reason
                raise ForkError(f"{self.engine} run failed: {_tail(run.stderr)}")
            self._storage_opt = False
            log.info(
                "%s: no --storage-opt size= here (%s); the disk limit bounds /dev/shm only",
                self.engine,
                _tail(run.stderr, 1),
            )
        self._call(args)

    def _remove(self, name: str) -> None:
        args = ["rm", "-f", *(["-t", "0"] if self.engine == "podman" else []), name]
        run = self._call(args, check=False)
        if run.returncode != 0 and "no such container" not in run.stderr.lower():
            log.warning("%s rm -f %s: %s", self.engine, name, _tail(run.stderr))

    def _forget(self, attempt: DockerAttempt) -> None:
        with self._lock:
            self._attempts.discard(attempt)

    def live_attempts(self) -> int:
        with self._lock:
            return len(self._attempts)

    def close(self) -> None:
        """Remove every container of this backend (images stay: they are the cache). Idempotent."""
        with self._lock:
            attempts, self._attempts = list(self._attempts), set()
            self._parents.clear()
        for attempt in attempts:
            attempt.close()
        shutil.rmtree(self.scratch, ignore_errors=True)
        _LIVE.discard(self)


def _limit_args(limits: Limits) -> list[str]:
    """``<engine> run`` flags for an attempt's limits and isolation."""
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    nofile = min(nofile if nofile != resource.RLIM_INFINITY else 1 << 20, 1 << 20)
    args = [
        "--network",
        "none",
        "--memory",
        f"{limits.memory_mb}m",
        "--memory-swap",
        f"{limits.memory_mb}m",
        "--pids-limit",
        str(limits.pids),
        "--shm-size",
        f"{limits.disk_mb}m",
        "--tmpfs",
        f"{STATE_DIR}:size=1m,mode=700",
        "--security-opt",
        "no-new-privileges",
        "--ulimit",
        f"nofile={nofile}:{nofile}",
        "--ulimit",
        f"nproc={limits.pids}:{limits.pids}",
    ]
    for cap in CAP_DROP:
        args += ["--cap-drop", cap]
    if limits.cpus > 0:
        args += ["--cpus", f"{limits.cpus:g}"]
    return args

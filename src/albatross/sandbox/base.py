"""Sandbox protocol: a task's prepared environment (parent) and attempts forked from it.

An attempt is one isolated, copy-on-write view of its task's prepared environment with a persistent
shell state (working directory and exported environment persist between ``exec`` calls). Backends are
siblings: ``local.py`` (Linux namespaces + overlayfs) and ``process.py`` (no isolation, dev only).

Hitting a limit is an outcome of the command, not an error: ``ExecResult.limit`` names it. An
infrastructure failure raises ``SandboxError`` (``ForkError``, ``SandboxDied``); it is never scored.
"""

from __future__ import annotations

import atexit
import math
import shlex
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from albatross.config import SandboxConfig
    from albatross.sandbox.faults import FaultInjector

# Values of ExecResult.limit, most decisive first (when several are hit, the first one is reported).
LIMIT_OOM = "oom"  # the memory limit was hit: the kernel killed a process of the attempt
LIMIT_PIDS = "pids"  # the process limit was hit: every process the agent started was killed
LIMIT_ATTEMPT_TIMEOUT = "attempt_timeout"  # the attempt's wall-time budget is spent
LIMIT_TIMEOUT = "timeout"  # the command ran past its timeout and was killed
LIMIT_DISK = "disk"  # the attempt's writable layer is full
LIMIT_OUTPUT = "output"  # output beyond max_output_bytes was dropped
LIMITS = (LIMIT_OOM, LIMIT_PIDS, LIMIT_ATTEMPT_TIMEOUT, LIMIT_TIMEOUT, LIMIT_DISK, LIMIT_OUTPUT)
NETWORK_POLICIES = ("none", "registries", "open")  # narrowest first (``egress``: what each allows)


class SandboxError(RuntimeError):
    """An infrastructure failure (fork failed, sandbox died). Never scored; retried."""


class ForkError(SandboxError):
    """An attempt could not be created."""


class SandboxDied(SandboxError):
    """An attempt's sandbox went away while in use."""


class AttemptBroken(SandboxDied):
    """The attempt's sandbox died of the attempt's own doing (its memory limit killed the sandbox's
    process): the attempt failed. ``verify_attempt`` scores that 0 (once the untouched-fork check passes),
    never an infrastructure error."""


@dataclass
class ExecResult:
    output: str  # stdout and stderr interleaved, decoded as UTF-8 with replacement
    exit_code: int  # -1 if the command was killed for its timeout
    timed_out: bool = False
    seconds: float = 0.0
    truncated_bytes: int = 0  # bytes dropped because output exceeded max_output_bytes
    limit: str = ""  # the limit the command hit (one of LIMITS), "" if none


@dataclass(frozen=True)
class Limits:
    """Per-attempt limits; invalid values (sizes under 1 MiB, times that are not finite and positive,
    a negative CPU share) raise ``ValueError`` here, before any sandbox is made from them."""

    memory_mb: int = 512
    pids: int = 256
    disk_mb: int = 256  # MiB the attempt may write (its upper layer, /tmp, /dev/shm together)
    command_timeout_s: float = 10.0
    max_output_bytes: int = 1 << 20
    attempt_timeout_s: float | None = None  # wall time from fork; None: no limit
    cpus: float = 0.0  # CPU time per wall second (1.5 = one and a half CPUs); 0: no limit
    network: str = "none"  # the attempt's network policy: none, registries or open (``egress``)
    build_timeout_s: float | None = None  # wall time of the whole build, if this fork has to build its environment

    def __post_init__(self) -> None:
        sizes = {"memory_mb": self.memory_mb, "disk_mb": self.disk_mb, "pids": self.pids,
                 "max_output_bytes": self.max_output_bytes}
        for name, size in sizes.items():
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"sandbox limit {name} must be a whole number >= 1, got {size!r}")
        times = {"command_timeout_s": self.command_timeout_s, "attempt_timeout_s": self.attempt_timeout_s,
                 "build_timeout_s": self.build_timeout_s}
        for name, seconds in times.items():
            if seconds is not None and not (math.isfinite(seconds) and seconds > 0):
                raise ValueError(f"sandbox limit {name} must be a finite number > 0, got {seconds!r}")
        if not (math.isfinite(self.cpus) and self.cpus >= 0):
            raise ValueError(f"sandbox limit cpus must be a finite number >= 0, got {self.cpus!r}")
        if self.network not in NETWORK_POLICIES:
            raise ValueError(f"sandbox limit network must be one of {', '.join(NETWORK_POLICIES)}, got "
                             f"{self.network!r}")

    @classmethod
    def from_config(cls, sc: SandboxConfig) -> Limits:
        """The limits of a ``[sandbox]`` config section (``SandboxConfig``)."""
        return cls(memory_mb=sc.memory_mb, pids=sc.pids, disk_mb=sc.disk_mb, command_timeout_s=sc.command_timeout_s,
                   attempt_timeout_s=sc.attempt_timeout_s or None, cpus=sc.cpus, network=sc.network)


def sandbox_default(name: str) -> Any:
    """The default of ``[sandbox] name`` (written once, in config.py; imported only when a caller leaves a setting
    out, so the sandbox's own processes never load the config)."""
    from albatross.config import default

    return default("sandbox", name)


def pick_limit(hit: dict[str, bool]) -> str:
    """The most decisive limit among those hit, or ""."""
    return next((name for name in LIMITS if hit.get(name)), "")


class Output:
    """Collects a command's output up to a cap; counts (and discards) the rest."""

    def __init__(self, cap: int) -> None:
        self.cap, self.kept, self.dropped = cap, 0, 0
        self.chunks: list[bytes] = []

    def add(self, data: bytes) -> None:
        room = max(0, self.cap - self.kept)
        if room:
            self.chunks.append(data[:room])
            self.kept += min(room, len(data))
        self.dropped += max(0, len(data) - room)

    def text(self) -> str:
        return b"".join(self.chunks).decode("utf-8", errors="replace")


TOOLCHAINS = ("image", "attempt")  # where the verifier's interpreter and tools come from


@dataclass(frozen=True)
class VerifierSpec:
    """How to run a task's verifier in a finished attempt (``Attempt.verify``).

    ``command`` (a shell command line, run by ``bash --noprofile --norc -c`` in ``cwd`` with the image's
    environment plus ``env``) runs test.sh from ``tests_path``, where the task's ``tests_dir`` is copied;
    ``toolkit`` (host directory, path in the sandbox) is put there read-only; ``reads`` are the files read
    back afterwards (the reward files, in ``reward_dir``, which starts empty). ``toolchain``: "image": the
    interpreter and tools (/usr, /etc, /bin, /lib...) are the task's pristine image's, not the attempt's;
    "attempt": its own (the task's tests must run in the attempt's environment). ``keep_agent_processes``:
    the agent's processes still run (they never reach the verifier's files or processes)."""

    tests_dir: Path
    command: str
    cwd: str
    timeout_s: float
    env: dict[str, str] = field(default_factory=dict)
    toolkit: tuple[Path, str] | None = None
    reads: tuple[str, ...] = ()
    tests_path: str = "/tests"
    reward_dir: str = "/logs/verifier"
    toolchain: str = "image"
    keep_agent_processes: bool = False


@dataclass
class VerifierExec:
    """What a verifier run gave: test.sh's run, the files it read back (None: missing or not a regular
    file), the attempt's changes to system paths (``toolchain = "attempt"``), and ``error``: why the
    verifier could not even start (the attempt's own doing: a full disk, ...), "" when it ran."""

    run: ExecResult
    files: dict[str, bytes | None]
    system_changes: list[str] = field(default_factory=list)
    error: str = ""


class Attempt(Protocol):
    """One forked attempt. Every process, mount and file of it is gone after ``close``."""

    @property
    def first_output_at(self) -> float | None:
        """perf_counter() when the last command first wrote (None: not measured)."""
        ...

    def exec(self, command: str, timeout_s: float | None = None) -> ExecResult: ...

    def put_dir(self, host_dir: Path, sandbox_path: str) -> None:
        """Copy a host directory into the attempt (used to add tests/ before verification)."""
        ...

    def read_file(self, sandbox_path: str) -> bytes | None:
        """A regular file's bytes, or None (missing, not a regular file, or a symbolic link)."""
        ...

    def kill_all(self) -> None:
        """End the agent: kill every process the attempt's commands started (background jobs too).
        Raises ``SandboxError`` if some survive."""
        ...

    def exec_clean(self, command: str, cwd: str, timeout_s: float | None = None) -> ExecResult:
        """Run ``command`` with ``bash --noprofile --norc -c`` as a fresh process: the image's own
        environment (Dockerfile ENV, a fixed PATH) and nothing of the persistent shell's state."""
        ...

    def verify(self, spec: VerifierSpec) -> VerifierExec:
        """Run a verifier (``VerifierSpec``) in this finished attempt. ``SandboxError`` only for faults the
        attempt could not cause."""
        ...

    def refused_hosts(self) -> list[str]:
        """The hosts the network policy refused to this attempt so far, first refused first ([] without a
        network, or where the backend does not enforce a policy)."""
        ...

    def close(self) -> None: ...


_RESET = ("for p in {dirs}; do if [ -L $p ] || {{ [ -e $p ] && [ ! -d $p ]; }}; then rm -f $p; fi; done; "
          "rm -rf {clear} && mkdir -p {reward}")


def verify_in_place(attempt: Attempt, spec: VerifierSpec) -> VerifierExec:
    """``Attempt.verify`` for backends that cannot give the verifier a view of its own (``process``,
    ``docker``): whatever the agent left at the tests path and the reward directory is removed, the tests
    and the toolkit are copied in, the command runs with ``exec_clean``; the tools are the attempt's own.
    A put that fails for want of space is the attempt's doing (``VerifierExec.error``)."""
    dirs = ["logs", spec.reward_dir.lstrip("/"), spec.tests_path.lstrip("/")]  # relative to "/" (process: mapped)
    reset = attempt.exec_clean(_RESET.format(dirs=" ".join(dirs), clear=" ".join(dirs[1:]), reward=dirs[1]), "/",
                               timeout_s=60)
    if reset.exit_code != 0:
        return VerifierExec(reset, {}, error=f"cannot clear {spec.reward_dir} and {spec.tests_path}: "
                                               f"{reset.output[-200:]}")
    try:
        attempt.put_dir(spec.tests_dir, spec.tests_path)
        if spec.toolkit is not None:
            attempt.put_dir(*spec.toolkit)
    except SandboxError as err:
        if "No space left" in str(err) or "Disk quota" in str(err):
            return VerifierExec(ExecResult(str(err), 1), {}, error=f"no space to put the tests: {err}")
        raise
    exports = "".join(f"export {k}={shlex.quote(v)}; " for k, v in spec.env.items())
    run = attempt.exec_clean(exports + spec.command, spec.cwd, timeout_s=spec.timeout_s)
    return VerifierExec(run, {path: attempt.read_file(path) for path in spec.reads})


class Prepared(Protocol):
    """A built environment that attempts fork from (what ``Backend.prepare`` returns), as its callers read it."""

    key: str  # the environment's content key
    build_s: float  # how long its build took (0 where a backend does not measure it)
    cached: bool  # built by an earlier run (loaded from the layer store), not now


class Backend(Protocol):
    """Every member a caller of a sandbox backend uses (``local.py``, ``process.py``)."""

    name: str
    isolated: bool  # False: no isolation at all (``process``), and the harness says so loudly
    restarts: int  # sandbox helpers (zygotes) started again after dying
    faults: FaultInjector  # the forks and attempts it was asked to fail (``fail_rate``), and how many it failed

    def prepare(self, env_dir: Path | None, network: str = "none", build_timeout_s: float | None = None) -> Prepared:
        """Build (once, cached) the parent environment that attempts of ``env_dir`` fork from, for attempts
        of network policy ``network``, the whole build within ``build_timeout_s`` (None: the backend's)."""
        ...

    def pids(self) -> dict[str, int]:
        """Processes this backend started (``run/pids.json``), by name."""
        ...

    def fork(self, env_dir: Path | None, workdir: str = "/app", limits: Limits | None = None) -> Attempt:
        """Fork an attempt from the prepared environment built from ``env_dir``.

        ``env_dir`` is a task's ``environment/`` directory (Dockerfile and files). The parent is built
        once per distinct environment and cached; attempts are copy-on-write views of it.
        """
        ...

    def close(self) -> None:
        """Release every cached parent."""
        ...


def closed_at_exit() -> weakref.WeakSet[Backend]:
    """A set of live backends that are all closed when the interpreter exits, so no holder, mount or
    container of ours outlives the process that started it (backends add themselves when they start)."""
    live: weakref.WeakSet[Backend] = weakref.WeakSet()

    def close_all() -> None:
        for backend in list(live):
            backend.close()

    atexit.register(close_all)
    return live

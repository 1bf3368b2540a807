"""Isolated sandbox: Linux namespaces, a copy-on-write overlay of a frozen parent, cgroup v1 or v2 limits.

Layout of one attempt::

    /            overlay (nodev): lowerdir=<parent layer>:<base root> (read-only), upper+work on a tmpfs of
                 ``limits.disk_mb`` (the disk-write limit, shared with /tmp, /run and /dev/shm; its file
                 table is 256 files per MiB)
    /proc /sys   the attempt's own procfs (pid namespace) and read-only sysfs (net namespace: only lo)
    /dev         null zero full random urandom tty, /dev/pts (new instance), /dev/shm
    hidden       on the host's root (``base="host"``): /work /root /home /tmp /var/tmp /run /mnt /media
                 /srv /old_root /farm, every ``hide_paths`` entry and the task's own directory are empty
                 in every parent layer; an image base has nothing of the host and keeps its own

Processes: ``zygote.py`` forks each attempt's holder (``holder.py``) into new mount, pid, network
(loopback only), ipc and uts namespaces; commands run under it via posix_spawn, each in its own session
and pids sub-cgroup. In user-namespace mode (the default where the kernel allows it) the holder and every
command run as uid 0 of the attempt's own user namespace, which maps to uid ``ID_BASE`` on the host,
owns none of the attempt's other namespaces and is charged to a host uid of its own (per-user kernel
counts such as inotify instances are per attempt): root inside can own files and kill its own
processes, but cannot mount, reconfigure the network, or touch anything on the host as root. Every
command runs under the seccomp filter of ``seccomp.py`` and in a session keyring of its attempt.
Before verification ``kill_all`` ends every process of the attempt and ``verify`` runs the verifier
as a fresh process with the image's environment only, in a mount namespace of its own with the pristine
image's tools (``verifier.py``). When the image has a ``USER`` (the last
stage's, resolved once per environment in the built image's /etc/passwd and /etc/group), every command
of an attempt (agent, oracle, verifier) runs as that user, with its groups and HOME, as ``docker exec``
does; builds, tars and reads stay root. Without user namespaces, commands run
as host root with a reduced capability bounding set and no_new_privs. Either way the capability
bounding set is Docker's default minus MKNOD.

Parents: a parent is built once per distinct environment (files, base, hidden paths): a *builder*
whose overlay upper directory is the parent's layer applies the Dockerfile (COPY through a tar, WORKDIR,
RUN with ``bash -c``); the layer is then frozen and becomes the top lower layer of every attempt forked
from it. The base under it is the image the Dockerfile's ``FROM`` names (``images.resolve_base``; a
multi-stage Dockerfile builds each earlier stage first, for ``COPY --from``). Builds run in a network
namespace of their own and reach the package registries through the egress proxy (``egress.py``,
``buildnet.py``: per-environment download caches, the host's CA bundle read-only); an attempt reaches
what its network policy (``Limits.network``) allows, through the same proxy.

Speed: the zygote keeps network namespaces ready; the backend keeps ``warm`` attempts of each recently
forked (parent, workdir, limits) ready in the background, so a fork usually takes an attempt that is
already set up; the first request to a fresh attempt is pipelined behind its set-up.

Recovery: the zygote is one process; if it dies (SIGKILL, a crash), its holders die with it (their
layers lived in its mount namespace), so their attempts raise ``SandboxDied`` (an infrastructure error,
retried by the harness). The next fork notices (a request finds the socket closed, or the process has
exited), logs one warning, starts a fresh zygote (``restarts`` counts them; exactly one per death, under
the backend lock, while concurrent forks wait), drops the warm attempts and the parents of the dead one,
and rebuilds the parent it needs; a fork interrupted by the death is retried on the fresh zygote.

Limits: hitting one is an outcome (``ExecResult.limit``), never an error; see ``base.LIMITS``.
Limitations: needs root, the memory and pids cgroup controllers (v1 or v2; ``cgroups.py``), overlayfs and tmpfs xattrs. The image
named by FROM is not pulled from a registry: it is built from Debian packages (``images.py``) or imported.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import itertools
import json
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import astuple, dataclass
from functools import lru_cache
from pathlib import Path
from typing import IO, Any, TypeVar

from albatross.cache import cache_root
from albatross.sandbox import buildnet, cgroups, dockerfile, egress, images, rootfs, wire
from albatross.sandbox.base import (
    LIMIT_ATTEMPT_TIMEOUT,
    LIMIT_DISK,
    LIMIT_OOM,
    LIMIT_OUTPUT,
    LIMIT_PIDS,
    LIMIT_TIMEOUT,
    AttemptBroken,
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
)
from albatross.sandbox.build import (
    DEFAULT_PATH,
    SHARED_ARCHIVE,
    EnvBuildError,
    EnvKeys,
    Parent,
    UserIds,
    apply_dockerfile,
    needs_builder,
    resolve_user,
    state_script,
    task_dir_of,
    write_dir_tar,
)
from albatross.sandbox.buildnet import needed_host
from albatross.sandbox.dockerfile import Instruction, parse_dockerfile
from albatross.sandbox.faults import FAULT_DIE, FAULT_FORK, FaultInjector
from albatross.sandbox.holder import STATE_FILE
from albatross.sandbox.layers import DiskGuard, LayerStore, free_mb
from albatross.sandbox.zygote import Zygote, ZygoteDied

__all__ = ["EnvBuildError", "LocalAttempt", "LocalBackend", "local_available", "needed_host", "userns_available"]

log = logging.getLogger(__name__)
T = TypeVar("T")

ID_BASE = 1_000_000_000  # host uid and gid of root inside the sandbox user namespace
HIDDEN_PATHS = ("/work", "/root", "/home", "/tmp", "/var/tmp", "/run", "/mnt", "/media", "/srv",
                "/old_root", "/farm")
# What every RUN step of a build has (the Dockerfile's ENV wins): dpkg without an fsync per file, as
# Docker's Debian and Ubuntu images configure it (their /etc/dpkg/dpkg.cfg.d/docker-apt-speedup); the
# build's layer is written to disk and made durable when it is stored, not file by file.
BUILD_ENV = {"DPKG_FORCE": "unsafe-io"}
LAYER_KEY_FORMAT = "layers-1"  # part of every environment's key: a change of how layers are built or stored
HOST_BASE_LAYERS = Path("/dev/shm/albatross-layers")  # where layers over the host's root are built (a tmpfs)
DISK_FULL_BYTES = 64 << 10  # less free space than this in the writable layer: the disk limit was hit
MAX_POOL_KEYS = 4  # environments kept warm at once, by default (``LocalBackend(warm_envs=...)``)
MAX_FILL_THREADS = 8  # threads that set warm attempts up, when several environments are kept warm
ZYGOTE_TRIES = 3  # a fork or prepare cut short by the zygote's death is tried again on a fresh one
# Restore cwd and exported env, run the command, save them again (also on `exit N`). Commands are
# the memory limit's first victims, not the holder (raising one's own oom_score_adj needs no privilege).
_PROLOGUE = (
    "echo 1000 >/proc/self/oom_score_adj 2>/dev/null\n"
    f"source {STATE_FILE} 2>/dev/null\n"
    'trap \'__albatross_rc=$?; { export -p; printf "cd -- %q\\n" "$PWD"; } '
    f">{STATE_FILE} 2>/dev/null; exit $__albatross_rc' EXIT\n"
)


def _wait_readable(fd: int, timeout_s: float) -> bool:
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(max(0.0, timeout_s) * 1000))


@dataclass
class _Exchange:
    """What came back from one command: exit code, kill by timeout, output, holder's notes."""

    code: int
    timed_out: bool
    out: Output
    reply: dict[str, Any]


class LocalAttempt:
    """One attempt: a holder process in its own namespaces, driven over a Unix socket."""

    def __init__(self, backend: LocalBackend, attempt_id: str, sock: socket.socket, pid: int,
                 groups: cgroups.AttemptCgroups, limits: Limits, zygote: Zygote | None = None) -> None:
        self.id, self.pid, self.limits = attempt_id, pid, limits
        self._backend, self._sock, self._cgroups = backend, sock, groups
        self.zygote = zygote  # the zygote that forked the holder: the holder dies with it
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:
            self._pidfd = None  # it died during set-up; the first reply says why
        self._lock = threading.Lock()
        self._close_lock = threading.Lock()
        self._closed = False
        self._pending_ready = True  # set-up reply not read yet (requests are pipelined behind it)
        self._cgroup = "c0"  # the pids cgroup the next command starts in (each reply names the next)
        self.deadline: float | None = None
        self.first_output_at: float | None = None  # perf_counter() when the last command first wrote
        self.image_env: dict[str, str] = {"PATH": DEFAULT_PATH, "HOME": "/root"}  # for exec_clean
        self.user: UserIds | None = None  # the image's USER every command runs as (None: root)
        self.network = egress.NONE  # its network policy (the egress proxy serves it unless none)
        self.lowers: list[str] = []  # the pristine image under its writable layer (paths in its zygote)
        self.broken = ""  # why the attempt's own doing killed its sandbox (out of memory); "" while it lives

    # ---- lifecycle --------------------------------------------------------------------------------
    def activate(self) -> None:
        """Start the attempt's wall-time budget (at fork, not when a warm attempt was prepared)."""
        if self.limits.attempt_timeout_s is not None:
            self.deadline = time.monotonic() + self.limits.attempt_timeout_s

    def alive(self) -> bool:
        """The holder runs (and its zygote does: a holder of a dead zygote is being killed)."""
        return (not self._closed and self._pidfd is not None and not _wait_readable(self._pidfd, 0)
                and (self.zygote is None or self.zygote.alive()))

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        with self._lock:
            if not _wait_readable(self._sock.fileno(), timeout_s):
                raise ForkError(f"attempt {self.id}: sandbox did not start within {timeout_s:.0f} s")
            self._skip_ready()

    def kill_all(self) -> None:
        """End the agent: SIGKILL every process of every command's cgroup (the whole pid namespace but
        its pid 1, the holder), wait until the holder has reaped them; ``SandboxError`` if any is left."""
        with self._lock:
            self._check_open()
            self._cgroups.kill_all(settle_s=5.0)
            left = self._cgroups.current() - 1
        if left > 0:
            raise SandboxError(f"attempt {self.id}: {left} processes survived the end of the attempt")

    def interrupt(self) -> None:
        """Kill every process of every command now, from any thread (a build that filled the disk)."""
        self._cgroups.kill_all(settle_s=0.0)

    def exec_clean(self, command: str, cwd: str, timeout_s: float | None = None) -> ExecResult:
        """Run ``command`` as a fresh ``bash --noprofile --norc -c`` with the image's environment only."""
        return self.run_argv(["/bin/bash", "--noprofile", "--norc", "-c", command], dict(self.image_env), cwd,
                             timeout_s)

    def verify(self, spec: VerifierSpec) -> VerifierExec:
        """Run the verifier in a mount namespace of its own (``verifier.py``): the pristine image's tools
        (``spec.toolchain``), the attempt's working state, its own /tests, reward directory and toolkit;
        test.sh is a command of the attempt (its namespaces, cgroups, limits, seccomp filter, user)."""
        if self.broken:
            raise AttemptBroken(self.broken)
        try:
            return self._verify(spec)
        except SandboxDied as err:
            if isinstance(err, AttemptBroken) or not self._killed_by_itself():
                raise
            self.broken = self.broken or f"the attempt's sandbox was killed when it ran out of memory ({err})"
            raise AttemptBroken(self.broken) from err

    def _verify(self, spec: VerifierSpec) -> VerifierExec:
        with self._lock:
            self._check_open()
            self._skip_ready()  # the holder's root must be complete before the verifier looks at it
            zygote = self.zygote
            if zygote is None:  # a builder's attempt: no verifier runs there
                raise SandboxError("no zygote to run the verifier in")
            changes = self._system_changes() if spec.toolchain == "attempt" else []
            group = self._cgroups.new_group("cv")
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            read_fd, write_fd = os.pipe()
            user = None if self.user is None else [self.user.uid, self.user.gid, list(self.user.groups)]
            # host paths go to the zygote's child absolute: it works in another directory
            puts = [[str(Path(spec.toolkit[0]).resolve()), spec.toolkit[1], False]] if spec.toolkit is not None else []
            msg = {"op": "verify", "holder": self.pid, "lowers": self.lowers, "toolchain": spec.toolchain,
                   "cgroups": [str(self._cgroups.memory), str(group), str(self._cgroups.cpu or "")],
                   "user": user, "isolate": spec.keep_agent_processes, "env": {**self.image_env, **spec.env},
                   "argv": ["/bin/bash", "--noprofile", "--norc", "-c", spec.command], "cwd": spec.cwd,
                   "tests_dir": str(Path(spec.tests_dir).resolve()), "tests_path": spec.tests_path,
                   "reward_dir": spec.reward_dir,
                   "puts": puts, "reads": list(spec.reads), "disk_mb": self.limits.disk_mb}
            start = time.monotonic()
            try:
                try:
                    pid = zygote.request(msg, fds=[theirs.fileno(), write_fd])["pid"]
                finally:
                    theirs.close()
                    os.close(write_fd)
                reply, payload, out, timed_out = self._verifier_report(ours, read_fd, pid, start + spec.timeout_s)
            finally:
                ours.close()
                os.close(read_fd)
                self._cgroups.kill(group.name)  # what test.sh left running
        if "error" in reply:
            raise self._died(RuntimeError(f"the verifier could not start: {reply['error']}"))
        files, offset = {}, 0
        for path, size in reply.get("files", {}).items():
            files[path] = None if size is None else payload[offset:offset + size]
            offset += size or 0
        code = -1 if timed_out else int(reply.get("exit", -1))
        run = ExecResult(out.text(), code, timed_out, time.monotonic() - start, out.dropped,
                         LIMIT_TIMEOUT if timed_out else "")
        return VerifierExec(run, files, changes)

    def _verifier_report(self, sock: socket.socket, read_fd: int, pid: int, deadline: float
                         ) -> tuple[dict[str, Any], bytes, Output, bool]:
        """The verifier's output and report; past ``deadline`` its processes are killed (timed out)."""
        out = Output(self.limits.max_output_bytes)
        poller = select.poll()
        poller.register(read_fd, select.POLLIN)
        poller.register(sock, select.POLLIN)
        timed_out, give_up = False, 0.0
        while True:
            for fd, _event in poller.poll(max(0.0, min(deadline - time.monotonic(), 1.0)) * 1000):
                if fd == read_fd:
                    data = os.read(read_fd, 1 << 16)
                    out.add(data) if data else poller.unregister(read_fd)
                else:
                    try:
                        reply, payload, _fds = wire.recv(sock)
                    except (EOFError, OSError) as err:
                        raise self._died(err) from err
                    os.set_blocking(read_fd, False)
                    with contextlib.suppress(BlockingIOError):
                        while data := os.read(read_fd, 1 << 16):
                            out.add(data)
                    return reply, payload, out, timed_out
            now = time.monotonic()
            if now >= deadline:
                if not timed_out:
                    timed_out, give_up = True, now + 10.0
                elif now > give_up:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                    raise SandboxDied(f"attempt {self.id}: the verifier did not end after its timeout")
                self._cgroups.kill("cv")
                deadline = now + 0.2

    def _system_changes(self) -> list[str]:
        """The attempt's changes under /usr, /etc, /bin, /lib ... (what it wrote over the image)."""
        self._send({"op": "changes"})
        reply = self._reply()[0]
        return list(reply.get("changes", []))

    def kill(self) -> None:
        """Kill the sandbox now, as if it had crashed (fault injection; ``close`` still cleans up)."""
        if self._pidfd is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)

    def refused_hosts(self) -> list[str]:
        return self._backend.refused_hosts(self)

    def close(self) -> None:
        """Kill the holder (and so the whole pid namespace and its mounts), remove the cgroups."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self.kill()
        if self._pidfd is not None and not _wait_readable(self._pidfd, 10.0):
            log.warning("attempt %s: holder %d did not exit within 10 s", self.id, self.pid)
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        with self._lock:  # a concurrent exec sees EOF and lets go
            self._sock.close()
            if self._pidfd is not None:
                os.close(self._pidfd)
        self._cgroups.remove()
        self._backend._forget(self)

    def __enter__(self) -> LocalAttempt:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- replies ------------------------------------------------------------------------------------
    def _died(self, err: BaseException) -> SandboxDied:
        return SandboxDied(f"attempt {self.id}: sandbox holder died ({err})")

    def _recv(self) -> tuple[dict[str, Any], bytes, list[int]]:
        try:
            return wire.recv(self._sock)
        except (EOFError, OSError) as err:  # killed (a failed set-up says why, and is a ForkError)
            raise self._died(err) from err

    def _skip_ready(self) -> None:
        if self._pending_ready:
            reply = self._recv()[0]
            if "error" in reply:
                raise ForkError(f"attempt {self.id}: {reply['error']}")
            self._pending_ready = False

    def _reply(self) -> tuple[dict[str, Any], bytes, list[int]]:
        self._skip_ready()
        return self._recv()

    def _send(self, msg: dict[str, Any], payload: bytes = b"", fds: Iterable[int] = ()) -> None:
        try:
            wire.send(self._sock, msg, payload, fds)
        except OSError as err:
            raise self._died(err) from err

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxError(f"attempt {self.id} is closed")

    # ---- commands -----------------------------------------------------------------------------------
    def exec(self, command: str, timeout_s: float | None = None) -> ExecResult:
        """Run ``command`` with ``bash -c`` in the attempt; cwd and exported env persist."""
        return self.run_argv(["/bin/bash", "-c", _PROLOGUE + command], {}, "/", timeout_s)

    def run_argv(self, argv: list[str], env: dict[str, str], cwd: str, timeout_s: float | None = None
                 ) -> ExecResult:
        """Run ``argv`` with exactly ``env`` in ``cwd`` (no shell state); used for builds. A sandbox that its
        own commands killed (they ran it out of memory) answers every command so, as a command that was
        killed by the memory limit, instead of failing as an infrastructure error would."""
        try:
            return self._run_argv(argv, env, cwd, timeout_s)
        except SandboxDied as err:
            if not self._killed_by_itself():
                raise
            if not self.broken:
                self.broken = f"the attempt's sandbox was killed when it ran out of memory ({err})"
            return ExecResult(f"albatross: {self.broken}\n", 137, False, 0.0, 0, LIMIT_OOM)

    def _killed_by_itself(self) -> bool:
        """The holder is gone, its zygote lives, and the attempt's memory limit has killed a process."""
        gone = self._pidfd is None or _wait_readable(self._pidfd, 0.5)
        return gone and (self.zygote is None or self.zygote.alive()) and self._cgroups.oom_kills() > 0

    def _run_argv(self, argv: list[str], env: dict[str, str], cwd: str, timeout_s: float | None = None
                  ) -> ExecResult:
        with self._lock:
            self._check_open()
            if self.broken:
                raise SandboxDied(self.broken)
            start = time.monotonic()
            crowded = self._at_pids_limit()
            if crowded:  # background processes filled the process table: contain them first
                self._cgroups.kill_all()
            timeout = self.limits.command_timeout_s if timeout_s is None else timeout_s
            budget = None if self.deadline is None else self.deadline - start
            if budget is not None and budget <= 0:
                self._cgroups.kill_all()
                return ExecResult("", -1, True, 0.0, 0, LIMIT_ATTEMPT_TIMEOUT)
            by_attempt = budget is not None and budget < timeout
            oom_before = self._cgroups.oom_kills()
            ex = self._exchange(argv, env, cwd, start + (budget if budget is not None and by_attempt else timeout))
            limit = self._limit_hit(ex, crowded, oom_before, by_attempt)
        code = -1 if ex.timed_out else ex.code
        return ExecResult(ex.out.text(), code, ex.timed_out, time.monotonic() - start, ex.out.dropped, limit)

    def _limit_hit(self, ex: _Exchange, crowded: bool, oom_before: int, by_attempt: bool) -> str:
        """Which limit the command hit; after a fork bomb, every process of the agent is killed."""
        refused = self._cgroups.new_pid_refusals()  # cgroup v2 counts refused forks on the attempt
        pids = crowded or refused > 0 or bool(ex.reply.get("forkfail")) or ex.reply.get("spawn_error") == errno.EAGAIN
        pids = pids or self._at_pids_limit()
        if pids:
            self._cgroups.kill_all()
        return pick_limit({
            LIMIT_OOM: self._cgroups.oom_kills() > oom_before,
            LIMIT_PIDS: pids,
            LIMIT_ATTEMPT_TIMEOUT: ex.timed_out and by_attempt,
            LIMIT_TIMEOUT: ex.timed_out and not by_attempt,
            LIMIT_DISK: 0 <= ex.reply.get("disk_free", -1) < DISK_FULL_BYTES,
            LIMIT_OUTPUT: ex.out.dropped > 0,
        })

    def _at_pids_limit(self) -> bool:
        return self._cgroups.current() >= self.limits.pids

    def _exchange(self, argv: list[str], env: dict[str, str], cwd: str, deadline: float) -> _Exchange:
        cgroup = self._cgroup
        self.first_output_at = None
        read_fd, write_fd = os.pipe()
        try:
            try:
                self._send({"op": "exec", "argv": argv, "env": env, "cwd": cwd, "cgroup": cgroup},
                           fds=[write_fd])
            finally:
                os.close(write_fd)
            out = Output(self.limits.max_output_bytes)
            reply, timed_out = self._collect(read_fd, out, deadline, cgroup)
            self._cgroup = reply.get("next", self._cgroup)
        finally:
            os.close(read_fd)
        return _Exchange(int(reply.get("exit", -1)), timed_out, out, reply)

    def _collect(self, read_fd: int, out: Output, deadline: float, cgroup: str
                 ) -> tuple[dict[str, Any], bool]:
        poller = select.poll()
        poller.register(read_fd, select.POLLIN)
        poller.register(self._sock, select.POLLIN)
        reply: dict[str, Any] | None = None
        timed_out, give_up, check = False, 0.0, time.monotonic() + 1.0
        while reply is None:
            events = poller.poll(min(max(0.0, deadline - time.monotonic()), 1.0) * 1000)
            if time.monotonic() > check:  # a fork bomb that fills the table is killed now, not at the timeout
                check = time.monotonic() + 1.0
                if self._at_pids_limit():
                    self._cgroups.kill_all()
            for fd, _event in events:
                if fd == read_fd:
                    data = os.read(read_fd, 1 << 16)
                    if data and self.first_output_at is None:
                        self.first_output_at = time.perf_counter()
                    out.add(data) if data else poller.unregister(read_fd)
                elif self._pending_ready:  # the set-up reply of a fresh attempt: keep reading output
                    self._skip_ready()
                else:
                    reply = self._recv()[0]
            now = time.monotonic()
            if reply is None and now >= deadline:
                if not timed_out:
                    timed_out, give_up = True, now + 10.0
                elif now > give_up:
                    raise SandboxDied(f"attempt {self.id}: command did not die after its timeout")
                self._cgroups.kill(cgroup)
                deadline = now + 0.2
        os.set_blocking(read_fd, False)
        with contextlib.suppress(BlockingIOError):
            while data := os.read(read_fd, 1 << 16):  # what was written before the command exited
                out.add(data)
        return reply, timed_out

    # ---- files and terminals ------------------------------------------------------------------------
    def _call(self, msg: dict[str, Any], payload: bytes = b"") -> tuple[dict[str, Any], bytes, list[int]]:
        with self._lock:
            self._check_open()
            self._send(msg, payload)
            reply, data, fds = self._reply()
        if "error" in reply:
            raise SandboxError(f"attempt {self.id}: {reply['error']}")
        return reply, data, fds

    def put_dir(self, host_dir: Path, sandbox_path: str) -> None:
        """Copy the contents of ``host_dir`` into the attempt at ``sandbox_path`` (streamed)."""
        host_dir = Path(host_dir)
        if not host_dir.is_dir():
            raise FileNotFoundError(f"put_dir: {host_dir} is not a directory")
        self.put_stream(lambda out: write_dir_tar(out, host_dir, sandbox_path))

    def put_stream(self, write: Callable[[IO[bytes]], None]) -> None:
        """Extract into the attempt the tar that ``write(out)`` writes to ``out``: a pipe the holder reads
        as it unpacks, so the tar is never held whole on either side. An exception of ``write`` (a COPY
        past its budget) is raised once the holder has let go."""
        with self._lock:
            self._check_open()
            read_fd, write_fd = os.pipe()
            try:
                self._send({"op": "put", "stream": True}, fds=[read_fd])
            finally:
                os.close(read_fd)
            failed: BaseException | None = None
            with os.fdopen(write_fd, "wb", buffering=1 << 16) as out:
                try:
                    write(out)
                except BrokenPipeError:
                    pass  # the holder stopped reading: its reply says why
                except BaseException as err:  # noqa: BLE001 - re-raised below, after the reply
                    failed = err
            reply = self._reply()[0]
        if failed is not None:
            raise failed
        if "error" in reply:
            raise SandboxError(f"attempt {self.id}: {reply['error']}")

    def put_tar(self, data: bytes) -> None:
        """Extract an uncompressed tar (member names relative to /) into the attempt."""
        self._call({"op": "put"}, data)

    def mkdirs(self, sandbox_path: str) -> None:
        self._call({"op": "mkdirs", "path": sandbox_path})

    def read_file(self, sandbox_path: str) -> bytes | None:
        """The bytes of a regular file as the attempt sees it, or None if there is none."""
        reply, data, _fds = self._call({"op": "read", "path": sandbox_path})
        return None if reply.get("missing") else data

    def terminal(self, argv: list[str], relay: Callable[[int], None]) -> int:
        """Run ``argv`` on a new terminal of the attempt; ``relay(master_fd)`` drives it until the
        command closes it. Returns the command's exit code."""
        home = self.image_env.get("HOME", "/root")
        env = {"TERM": os.environ.get("TERM", "xterm"), "PATH": DEFAULT_PATH, "HOME": home}
        with self._lock:
            self._check_open()
            self._send({"op": "pty", "argv": argv, "env": env, "cwd": "/"})
            reply, _data, fds = self._reply()
            if "error" in reply or not fds:
                raise SandboxError(f"attempt {self.id}: {reply.get('error', 'no terminal')}")
            try:
                relay(fds[0])
            finally:
                os.close(fds[0])
            reply = self._reply()[0]
            self._cgroup = reply.get("next", self._cgroup)
            return int(reply.get("exit", -1))


# ---- the warm pool ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Spec:
    """What an attempt is forked as: the parent, the starting directory and the limits."""

    parent_key: str
    workdir: str
    limits: Limits

    @property
    def key(self) -> tuple[Any, ...]:
        return (self.parent_key, self.workdir, astuple(self.limits))


class WarmPool:
    """Keeps up to ``size`` set-up attempts ready for each of the last few specs forked, refilled by a
    background thread, so a fork is taking one (the set-up of the next overlaps the use of this one)."""

    def __init__(self, make: Callable[[_Spec], LocalAttempt], size: int, keys: int = MAX_POOL_KEYS) -> None:
        self.make, self.size, self.keys = make, size, keys
        self._ready: OrderedDict[tuple[Any, ...], list[LocalAttempt]] = OrderedDict()
        self._specs: dict[tuple[Any, ...], _Spec] = {}
        self._cond = threading.Condition()
        self._closed = False
        self._threads: list[threading.Thread] = []
        self._making: Counter[tuple[Any, ...]] = Counter()  # attempts being set up, per spec
        self._waiting = 0  # forks waiting for one of them

    def take(self, spec: _Spec, wait_s: float = 5.0) -> LocalAttempt | None:
        """A ready attempt of ``spec``; if none is ready but one is being set up, wait for that one
        (it has a head start on a fresh fork). None when there is neither."""
        deadline = time.monotonic() + wait_s
        while True:
            with self._cond:
                ready = self._ready.get(spec.key)
                while not ready and self._making[spec.key] and time.monotonic() < deadline:
                    self._waiting += 1
                    self._cond.wait(max(0.0, deadline - time.monotonic()))
                    self._waiting -= 1
                    ready = self._ready.get(spec.key)
                if not ready:
                    return None
                attempt = ready.pop(0)
            if attempt.alive():
                return attempt
            attempt.close()  # died while waiting (killed from outside): never hand it out

    def want(self, spec: _Spec) -> None:
        """Keep ``size`` attempts of ``spec`` ready (evicting the least recently wanted spec)."""
        if self.size <= 0:
            return
        evicted: list[LocalAttempt] = []
        with self._cond:
            if self._closed:
                return
            self._specs[spec.key] = spec
            self._ready.setdefault(spec.key, [])
            self._ready.move_to_end(spec.key)
            while len(self._ready) > self.keys:
                key, attempts = self._ready.popitem(last=False)
                self._specs.pop(key, None)
                evicted += attempts
            # set-ups mostly wait for the kernel: run them in parallel, more of them for more environments
            while len(self._threads) < min(self.size * len(self._ready), max(self.size, MAX_FILL_THREADS)):
                thread = threading.Thread(target=self._fill, name="albatross-warm-pool", daemon=True)
                self._threads.append(thread)
                thread.start()
            self._cond.notify_all()
        for attempt in evicted:
            attempt.close()

    def _next(self) -> _Spec | None:
        """Claim the set-up of one attempt for the most recently wanted spec that lacks one (waits)."""
        with self._cond:
            while not self._closed:
                for key in reversed(self._ready):
                    if len(self._ready[key]) + self._making[key] < self.size:
                        self._making[key] += 1
                        return self._specs[key]
                self._cond.wait()
            return None

    def _fill(self) -> None:
        while (spec := self._next()) is not None:
            try:
                self._add(spec, self.make(spec))
            except ZygoteDied as err:  # the backend restarts it and clears the pool; forks want again
                log.debug("warm pool: %s", err)
                time.sleep(0.05)
            except Exception as err:  # noqa: BLE001 - a failed refill is retried; forks never wait long
                log.warning("warm pool: %s", err)
                time.sleep(0.5)
            finally:
                with self._cond:
                    self._making[spec.key] -= 1
                    self._cond.notify_all()

    def _add(self, spec: _Spec, attempt: LocalAttempt) -> None:
        """Wait for its set-up, warm it up with a first command (for a faster first command) unless a
        fork is waiting for it, and keep it."""
        try:
            attempt.wait_ready()
            if not self._waiting:
                attempt.run_argv(["/bin/bash", "-c", ":"], {}, "/", 30)
        except SandboxError as err:
            gone = attempt.zygote is not None and attempt.zygote.died_within(0.2)  # the backend says so once
            log.log(logging.DEBUG if gone else logging.WARNING, "warm pool: %s", err)
            attempt.close()
            return
        with self._cond:
            keep = not self._closed and spec.key in self._ready
            if keep:
                self._ready[spec.key].append(attempt)
                self._cond.notify_all()
        if not keep:
            attempt.close()

    def clear(self) -> None:
        """Forget every spec and close every ready attempt (after the zygote that made them died)."""
        with self._cond:
            attempts = [a for ready in self._ready.values() for a in ready]
            self._ready.clear()
            self._specs.clear()
            self._cond.notify_all()
        for attempt in attempts:
            attempt.close()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            attempts = [a for ready in self._ready.values() for a in ready]
            self._ready.clear()
            self._cond.notify_all()
            threads = list(self._threads)
        for thread in threads:
            thread.join(timeout=60)
        for attempt in attempts:
            attempt.close()


# ---- the backend -----------------------------------------------------------------------------------------

_LIVE = closed_at_exit()  # closed when the interpreter exits


class LocalBackend:
    """Attempts isolated with namespaces, overlayfs and cgroups (see the module docstring)."""

    name = "local"
    isolated = True

    def __init__(
        self,
        hide_paths: Iterable[str | Path] = (),
        allow_internet: bool | None = None,
        build_limits: Limits | None = None,
        build_timeout_s: float = 1800.0,
        base: str | None = None,
        userns: bool | None = None,
        warm: int | None = None,
        fail_rate: float = 0.0,
        fault_seed: int | None = None,
        images_dir: str | Path | None = None,
        registries: Iterable[str] | None = None,
        layer_cache: bool = False,
        build_min_free_mb: int | None = None,
        layer_cache_max_gb: float | None = None,
        warm_envs: int = MAX_POOL_KEYS,
    ) -> None:
        """``hide_paths``: extra host paths made empty in every sandbox (e.g. the run directory).
        ``allow_internet``: False builds with no network at all; otherwise RUN steps reach the package
        registries (``registries``; any host when the attempt's policy is ``open``) through the egress
        proxy, in a network namespace of their own. An attempt's network is its ``Limits.network``.
        ``registries``: the hosts of the ``registries`` policy (default: ``[sandbox] registries``; the
        host's Debian mirror and index hosts are added). ``base``: "image" (the Dockerfile's FROM,
        built by ``images.resolve_base``), "debian" (one cached bookworm) or "host" (the host's own root:
        NOT isolated from the host's files; warns). ``images_dir``: OCI layouts / docker save archives
        a FROM may name (``[sandbox] images``).
        ``userns``: run as root of a user namespace (None: wherever the kernel allows it).
        ``warm``: attempts kept ready per recently forked environment, for the last ``warm_envs`` of them.
        ``fail_rate``: share of forks
        made to fail at random (fault-injection tests only), drawn from ``Random(fault_seed)``.
        ``layer_cache``: keep built environments on disk for every later run (``layers.LayerStore``, keyed
        by content hash); False: in a directory of this backend's own, removed by ``close``. Builds use the
        host's disk, as Docker's do, leaving ``build_min_free_mb`` free; a build that takes the cache over
        ``layer_cache_max_gb`` starts a background prune (least recently used first; 0: no cap). ``base``, ``warm``,
        ``registries``, ``build_min_free_mb`` and ``layer_cache_max_gb`` left out (None) are the ``[sandbox]``
        section's defaults."""
        base = sandbox_default("base") if base is None else base
        warm = sandbox_default("warm") if warm is None else warm
        if base not in rootfs.BASES:
            raise ValueError(f"unknown sandbox base {base!r}; choose one of {list(rootfs.BASES)}")
        self.hide_paths = [*HIDDEN_PATHS, *(str(Path(p).resolve()) for p in hide_paths)]
        self.allow_internet, self.base = allow_internet, base
        self.registries = buildnet.registry_hosts(sandbox_default("registries") if registries is None else registries)
        self._egress: egress.EgressProxy | None = None  # started when a sandbox first needs it
        if base == "host":
            log.warning("sandbox base \"host\": every attempt reads the host's own root file system (/etc, "
                        "installed software, /etc/shadow): NOT isolated from the host's files; use base "
                        "\"image\" for training and evaluation")
        self.images_dir = Path(images_dir) if images_dir else None
        self._bases: dict[str | None, images.Base] = {}  # FROM reference -> its base (resolved once)
        self._dockerfiles: dict[str, tuple[tuple[int, int], list[Instruction]]] = {}
        self.build_limits = build_limits or Limits(memory_mb=4096, pids=4096, disk_mb=4096)
        # over the host's own root, a layer on its disk would lie inside the overlay's lower layer (overlayfs
        # refuses that): those layers go to the host's /dev/shm, a tmpfs, and are never cached
        cap_gb = sandbox_default("layer_cache_max_gb") if layer_cache_max_gb is None else layer_cache_max_gb
        self.layers = (LayerStore(layer_cache, None, max_bytes=int(cap_gb * (1 << 30))) if base != "host"
                       else LayerStore(False, HOST_BASE_LAYERS))
        self.build_min_free_mb: int = sandbox_default("build_min_free_mb") if build_min_free_mb is None else build_min_free_mb
        self.build_timeout_s = build_timeout_s
        self.userns = userns_available() if userns is None else userns
        self.faults = FaultInjector(fail_rate, fault_seed)
        self._zygote: Zygote | None = None
        self.restarts = 0  # zygotes started again after the previous one died
        self._closes = 0  # calls of close(): work cut short by one is not retried on a fresh zygote
        self._lock = threading.Lock()
        self._keys = EnvKeys()
        self._building: dict[str, threading.Lock] = {}
        self._digests: dict[tuple[int, int, int, int], str] = {}  # a shared archive's stamps -> its sha256
        self._attempts: set[LocalAttempt] = set()
        self._ids = itertools.count()
        self._token = os.urandom(3).hex()  # pids cgroups may be shared with other pid namespaces
        self._pool = WarmPool(self._make_attempt, warm, warm_envs)
        cgroups.remove_stale()
        _LIVE.add(self)

    @property
    def id_base(self) -> int:
        return ID_BASE if self.userns else 0

    @property
    def zygote_pid(self) -> int | None:
        """The pid of the running zygote (None before the first fork and after ``close``)."""
        zygote = self._zygote
        return None if zygote is None else zygote.pid

    def pids(self) -> dict[str, int]:
        """The helper process this backend started (for a run's pids.json)."""
        pid = self.zygote_pid
        return {} if pid is None else {"sandbox": pid}

    def _zyg(self) -> Zygote:
        """The zygote; if it died, a fresh one. Exactly one restart per death: the first thread to notice
        restarts under the lock, the others wait for it and get the fresh one."""
        with self._lock:
            dead = self._zygote if self._zygote is not None and not self._zygote.alive() else None
            if dead is not None:
                self.restarts += 1
                self._zygote = None
                log.warning("sandbox zygote %d died (exit code %s): starting a fresh one (restart %d); "
                            "its attempts are lost, its environments are rebuilt", dead.pid, dead.proc.poll(),
                            self.restarts)
            if self._zygote is None:
                self._zygote = Zygote(self.id_base, self.layers.root)
            zygote = self._zygote
        if dead is not None:  # outside the lock: closing attempts takes it
            dead.close()  # reap it and remove its directory (its mounts went with its namespace)
            self._pool.clear()  # warm attempts of the dead zygote: their holders died with it
        return zygote

    def _retrying(self, what: Callable[[], T]) -> T:
        """``what()``, again on a fresh zygote if the zygote died under it (a few times at most), unless the
        backend was closed meanwhile (Ctrl-C: a build cut short is not started again)."""
        closes = self._closes
        for tries_left in range(ZYGOTE_TRIES - 1, -1, -1):
            try:
                return what()
            except ZygoteDied as err:
                if not tries_left or self._closes != closes:
                    raise
                log.debug("retrying on a fresh zygote: %s", err)
        raise AssertionError("unreachable")

    # ---- attempts ---------------------------------------------------------------------------------------
    def fork(self, env_dir: Path | None, workdir: str = "/app", limits: Limits | None = None) -> LocalAttempt:
        """Fork a fresh attempt from the (cached) parent built from ``env_dir``."""
        fault = self.faults.draw()
        if fault == FAULT_FORK:
            raise ForkError("injected fault: fork failed")
        attempt, spec = self._retrying(lambda: self._fork_once(env_dir, workdir, limits or Limits()))
        self._pool.want(spec)
        attempt.activate()
        if fault == FAULT_DIE:
            attempt.kill()
        return attempt

    def _fork_once(self, env_dir: Path | None, workdir: str, limits: Limits) -> tuple[LocalAttempt, _Spec]:
        parent = self._prepare(env_dir, limits.network, limits.build_timeout_s)
        spec = _Spec(parent.key, parent.workdir or workdir, limits)
        return self._pool.take(spec) or self._make_attempt(spec), spec

    def _make_attempt(self, spec: _Spec) -> LocalAttempt:
        zygote = self._zyg()
        parent = zygote.parents.get(spec.parent_key)
        if parent is None:  # built by a zygote that has died since: the next fork rebuilds it
            raise ZygoteDied(f"environment {spec.parent_key[:12]} is not built on the fresh sandbox zygote")
        policy = spec.limits.network
        env = {**parent.attempt_env(), **egress.proxy_env(policy)}
        binds: list[list[Any]] = []
        if policy != egress.NONE:  # the host's CA bundle, read-only: TLS may pass a proxy only the host trusts
            trust = buildnet.host_trust()
            env.update({buildnet.NETWORK_VAR: "1", **trust.env})
            binds = [list(b) for b in trust.binds]
        ids = parent.ids
        lower = [parent.layer, *zygote.lowers[spec.parent_key]]
        user = None if ids is None else [ids.uid, ids.gid, list(ids.groups)]
        attempt = self._spawn(zygote, spec.limits, {"lower": lower, "upper": None, "work": None, "new_net": True,
                                                    "workdir": spec.workdir, "user": user, "proxy": policy,
                                                    "binds": binds, "state": state_script(env, spec.workdir)})
        attempt.image_env, attempt.user, attempt.lowers = env, ids, lower
        return attempt

    def _spawn(self, zygote: Zygote, limits: Limits, cfg: dict[str, Any]) -> LocalAttempt:
        attempt_id = f"{os.getpid()}-{self._token}-{next(self._ids)}"
        groups = cgroups.AttemptCgroups(attempt_id, limits, owner=self.id_base)
        cfg = {**cfg, "scratch": f"{zygote.root}/scratch", "disk_mb": limits.disk_mb, **groups.holder_config()}
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            reply, fds = zygote.request_fds({"op": "spawn", "cfg": cfg}, fds=[theirs.fileno()])
        except BaseException:
            ours.close()
            groups.remove()
            raise
        finally:
            theirs.close()
        pid = reply["pid"]
        groups.holder = pid
        attempt = LocalAttempt(self, attempt_id, ours, pid, groups, limits, zygote)
        try:
            groups.adopt(pid)  # while the holder sets up its root: its first command starts after this
        except OSError as err:
            attempt.close()
            raise ForkError(f"attempt {attempt_id}: cannot move its holder into its cgroups: {err}") from err
        policy = cfg.get("proxy") or egress.NONE
        if fds:  # the proxy's listening socket, made in the attempt's network namespace
            self._proxy().serve(socket.socket(fileno=fds[0]), policy, attempt_id)
            attempt.network = policy
        with self._lock:
            self._attempts.add(attempt)
        return attempt

    def _proxy(self) -> egress.EgressProxy:
        """The egress proxy of this backend's sandboxes (started on first use)."""
        with self._lock:
            if self._egress is None:
                self._egress = egress.EgressProxy(self.registries)
            return self._egress

    def refused_hosts(self, attempt: LocalAttempt) -> list[str]:
        with self._lock:
            proxy = self._egress if attempt.network != egress.NONE else None
        return proxy.refused(attempt.id) if proxy is not None else []

    def _forget(self, attempt: LocalAttempt) -> None:
        with self._lock:
            self._attempts.discard(attempt)
            proxy = self._egress if attempt.network != egress.NONE else None
        if proxy is not None:
            proxy.forget(attempt.id)

    def live_attempts(self) -> int:
        with self._lock:
            return len(self._attempts)

    # ---- bases ------------------------------------------------------------------------------------------
    def base_for(self, ref: str | None) -> images.Base:
        """The base root a ``FROM ref`` builds on: the image (``base="image"``, built once), else the fixed
        host or debian root. Resolved once per backend and reference."""
        ref = ref if self.base == "image" else None
        with self._lock:
            found = self._bases.get(ref)
        if found is None:
            if self.base == "image":
                found = images.resolve_base(ref, log=log.info, search=self.images_dir)
            else:
                found = images.Base(self.base, Path(rootfs.base_root(self.base)), {}, (), self.base)
            with self._lock:
                self._bases[ref] = found
        return found

    def _base_lower(self, zygote: Zygote, base: images.Base) -> str:
        """The base root's lower directory in ``zygote`` (mounted there once, idmapped in userns mode)."""
        lower = zygote.base_lowers.get(base.key)
        if lower is None:
            lower = zygote.request({"op": "base", "name": base.key, "path": str(base.root)})["lower"]
            zygote.base_lowers[base.key] = lower
        return lower

    def _instructions(self, env_dir: Path | None) -> list[Instruction]:
        """The parsed Dockerfile of ``env_dir`` (parsed again only when it changed)."""
        if env_dir is None:
            return []
        path = Path(env_dir) / "Dockerfile"
        try:
            st = path.stat()
        except OSError:
            raise EnvBuildError(f"{env_dir}: no Dockerfile") from None
        stamp = (st.st_mtime_ns, st.st_size)
        cached = self._dockerfiles.get(str(path))
        if cached is not None and cached[0] == stamp:
            return cached[1]
        instructions = parse_dockerfile(path)
        self._dockerfiles[str(path)] = (stamp, instructions)
        return instructions

    # ---- parents ----------------------------------------------------------------------------------------
    def prepare(self, env_dir: Path | None, network: str = egress.NONE, build_timeout_s: float | None = None
                ) -> Parent:
        """Build (once) and return the parent for ``env_dir``, for attempts of network policy ``network``
        (its builds reach the registries; any host for ``open``), the whole build within
        ``build_timeout_s`` (default: the backend's); safe to call from many threads."""
        egress.check_policy(network)
        return self._retrying(lambda: self._prepare(env_dir, network, build_timeout_s))

    def _prepare(self, env_dir: Path | None, network: str = egress.NONE, build_timeout_s: float | None = None
                 ) -> Parent:
        """The parent for ``env_dir`` in the current zygote: from the layer store when it was built before
        (by this run, or by any run with ``layer_cache``), else built now and stored. Raises ``ZygoteDied``
        if the zygote died meanwhile."""
        hide = self._hidden(env_dir)
        instructions = self._instructions(env_dir)
        stages = _stages(instructions)
        bases = [self.base_for(stage.base) for stage in stages if stage.base_stage is None]
        internet = self._build_network(network)
        salt = json.dumps([LAYER_KEY_FORMAT, self.base, [b.key for b in bases], hide, internet, self.id_base])
        key = self._keys.get(env_dir, salt)
        parent: Parent | None = self._zyg().parents.get(key)
        if parent is not None:
            return parent
        with self._lock:
            building = self._building.setdefault(key, threading.Lock())
        with building:
            zygote = self._zyg()
            parent = zygote.parents.get(key)
            if parent is None:
                self.layers.hold(key)  # in use by this backend until it closes: never pruned meanwhile
                with self.layers.locked(key):
                    parent = self._load(zygote, key)
                    if parent is None:
                        deadline = buildnet.Deadline(build_timeout_s or self.build_timeout_s)
                        parent = self._build(zygote, Path(env_dir or "."), stages, key, hide, internet, deadline)
                with self._lock:
                    zygote.parents[key] = parent
            return parent

    def _load(self, zygote: Zygote, key: str) -> Parent | None:
        """The parent ``key`` from the layer store, its bases mounted in ``zygote``; None if not stored (or
        a base it was built on is gone)."""
        record = self.layers.load(key)
        if record is None:
            return None
        top = self.layers.path(key)
        lowers = []
        for entry in record["stack"]:
            if "layer" in entry:
                lowers.append(str(top / entry["layer"]))
            elif "shared" in entry:  # a layer other parents stack on too (``_shared_layer``): held while in use
                self.layers.hold(entry["shared"])
                if self.layers.load(entry["shared"]) is None:
                    return None  # pruned since: build this one again (and the shared layer with it)
                lowers.append(str(self.layers.path(entry["shared"]) / entry["path"]))
            elif rootfs.is_built(Path(entry["root"])) or self.base != "image":
                lowers.append(self._base_lower(zygote, images.Base("", Path(entry["root"]), {}, (), entry["base"])))
            else:
                return None
        parent = _parent_from_record(record["parent"], str(top / record["layer"]))
        parent.cached = True
        zygote.lowers[key] = lowers
        return parent

    def _hidden(self, env_dir: Path | None) -> list[str]:
        """Paths made empty in the parent: on the host's root, its private places, ``hide_paths`` and the
        task's own directory (tests, solution). An image base holds nothing of the host: its /root, /home,
        /srv ... stay the image's, as under Docker."""
        if self.base == "image":
            return []
        hide = list(self.hide_paths)
        if env_dir is not None:
            hide += sorted({str(Path(env_dir).resolve().parent), str(task_dir_of(env_dir))})
        return hide

    def _build_network(self, attempt_policy: str) -> str:
        """The network policy of a build for attempts of ``attempt_policy``: the registries (any host for
        ``open``), or none when the backend was made with ``allow_internet=False``."""
        return egress.NONE if self.allow_internet is False else egress.build_policy(attempt_policy)

    def _build(self, zygote: Zygote, env_dir: Path, stages: list[dockerfile.Stage], key: str, hide: list[str],
               internet: str, deadline: buildnet.Deadline) -> Parent:
        """Build every stage in order (each earlier one only for ``COPY --from``); the last is the parent."""
        roots: dict[str, str] = {}  # --from reference -> host path of that stage's (or image's) root

        def net_of(env_key: str) -> _BuildNet:
            return _BuildNet(internet, deadline, env_key)

        built: dict[int, tuple[Parent, list[str]]] = {}
        top = self.layers.new_build(key)  # each stage's layer in s<index>; renamed into place when done
        exported: list[Path] = []  # stage roots written for COPY --from, removed after the build
        wanted = {ref.lower() for stage in stages for ref in stage.copies_from}
        keys = {k.lower() for stage in stages for k in stage.ref_keys()}
        for ref in {ref for stage in stages for ref in stage.copies_from if ref.lower() not in keys}:
            roots[ref] = str(self.base_for(ref).root)  # COPY --from=<image>: that image's root
        try:
            for index in dockerfile.required_stages(stages):
                stage = stages[index]
                last = stage is stages[-1]
                below: Parent | None = None
                if stage.base_stage is not None:
                    below, lowers = built[stage.base_stage]
                    lowers = [below.layer, *lowers]
                else:
                    lowers = [self._base_lower(zygote, self.base_for(stage.base))]
                    if last:
                        shared, stage = self._shared_layer(zygote, env_dir, stage, lowers, net_of(key))
                        lowers = [shared.layer, *lowers] if shared is not None else lowers
                stage_key = key if last else f"{key}-stage{stage.index}"
                parent = self._build_stage(zygote, env_dir, stage, stage_key, hide if last else [], lowers,
                                           net_of(key), roots, top, below)
                built[index] = (parent, lowers)
                if not last and any(k.lower() in wanted for k in stage.ref_keys()):
                    merged = self._export_stage(zygote, stages, index, stage_key, built, exported)
                    for ref in stage.ref_keys():
                        roots[ref] = roots[ref.lower()] = merged
            last_parent, last_lowers = built[len(stages) - 1]
            if last_parent.user:
                last_parent.ids = self._resolve_user(zygote, last_parent, last_lowers, env_dir)
        except BaseException as err:
            self.layers.discard(top)
            infra = isinstance(err, (SandboxDied, ForkError)) and not isinstance(err, ZygoteDied)
            if infra and zygote.died_within(0.5):  # the builder died with its zygote: build again
                raise ZygoteDied(f"sandbox zygote {zygote.pid} died while building {env_dir}: {err}") from err
            raise
        finally:
            for path in exported:
                shutil.rmtree(path, ignore_errors=True)
        parent, lowers = built[len(stages) - 1]
        parent.build_s = round(deadline.elapsed(), 2)
        return self._commit(zygote, key, top, parent, lowers)

    def _commit(self, zygote: Zygote, key: str, top: Path, parent: Parent, lowers: list[str]) -> Parent:
        """Store the built parent (its layer, the stages it builds on, how to find its bases again) under
        ``key``; stages the last one does not build on are dropped."""
        keep = {str(Path(layer).parent) for layer in [parent.layer, *lowers]}
        for stage_dir in top.iterdir():
            if str(stage_dir) not in keep:
                shutil.rmtree(stage_dir, ignore_errors=True)
        mounted = {lower: base_key for base_key, lower in zygote.base_lowers.items()}
        roots = {b.key: str(b.root) for b in self._bases.values()}
        stack = []
        store = self.layers.root
        for lower in lowers:
            if lower.startswith(f"{top}/"):
                stack.append({"layer": os.path.relpath(lower, top)})
            elif lower.startswith(f"{store}/"):  # a shared layer: another parent of the store, by its key
                shared = os.path.relpath(lower, store).split(os.sep)[0]
                stack.append({"shared": shared, "path": os.path.relpath(lower, store / shared)})
            else:  # a base image's root (idmapped in the zygote): found again by its key
                base_key = mounted.get(lower, "")
                stack.append({"base": base_key, "root": roots.get(base_key, lower)})
        record: dict[str, Any] = {"parent": _parent_record(parent), "layer": os.path.relpath(parent.layer, top),
                                  "stack": stack}
        final = self.layers.commit(top, key, record)
        moved = _parent_from_record(record["parent"], str(final / record["layer"]))
        zygote.lowers[key] = [str(final / e["layer"]) if "layer" in e else lower
                              for e, lower in zip(stack, lowers, strict=True)]
        return moved

    def _shared_layer(self, zygote: Zygote, env_dir: Path, stage: dockerfile.Stage, lowers: list[str],
                      net: _BuildNet) -> tuple[Parent | None, dockerfile.Stage]:
        """The layer of an adapted environment's first step (``ADD`` of the toolkit archive, ``SHARED_ARCHIVE``),
        built once per base image, archive and id mapping, and the stage without that step, to build over it; or
        (None, the stage) for any other stage. Every adapted environment on one image used to hold its own copy
        of the toolkit (about a thousand files, 20 MB and seconds of build each)."""
        steps = stage.instructions
        if len(steps) < 2 or self.base != "image" or not _adds_shared_archive(steps[1]):
            return None, stage
        archive = env_dir / SHARED_ARCHIVE
        try:
            st = archive.stat()
        except OSError:
            return None, stage  # the build reports the missing file with its line
        add = steps[1]
        assert isinstance(add, dockerfile.Copy)
        identity = [LAYER_KEY_FORMAT, "shared", self.base_for(stage.base).key, self.id_base, add.dest, add.chown,
                    add.chmod, self._archive_digest(archive, st)]
        key = "shared-" + hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:24]
        rest = dataclasses.replace(stage, instructions=[steps[0], *steps[2:]])
        parent = zygote.parents.get(key)
        if parent is not None:
            return parent, rest
        with self._lock:
            building = self._building.setdefault(key, threading.Lock())
        with building:
            parent = zygote.parents.get(key)
            if parent is None:
                self.layers.hold(key)
                with self.layers.locked(key):
                    parent = self._load(zygote, key)
                    if parent is None:
                        top = self.layers.new_build(key)
                        first = dataclasses.replace(stage, instructions=list(steps[:2]))
                        try:
                            built = self._build_stage(zygote, env_dir, first, key, [], lowers, net, {}, top, None)
                        except BaseException:
                            self.layers.discard(top)
                            raise
                        parent = self._commit(zygote, key, top, built, lowers)
                with self._lock:
                    zygote.parents[key] = parent
        return parent, rest

    def _archive_digest(self, path: Path, st: os.stat_result) -> str:
        """sha256 of a file, remembered by its inode and stamps (every adapted environment links the same one)."""
        stamp = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        with self._lock:
            digest = self._digests.get(stamp)
        if digest is None:
            h = hashlib.sha256()
            with open(path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
            digest = h.hexdigest()
            with self._lock:
                self._digests[stamp] = digest
        return digest

    def _resolve_user(self, zygote: Zygote, parent: Parent, lowers: list[str], env_dir: Path) -> UserIds | None:
        """The ids of the image's USER in the built image (Docker's lookup, ``resolve_user``), read by a
        throwaway attempt of it; None for root. A USER the image does not know is an ``EnvBuildError``."""
        reader = self._spawn(zygote, self.build_limits, {"lower": [parent.layer, *lowers], "upper": None,
                                                         "work": None, "new_net": True, "workdir": None,
                                                         "state": ""})
        try:
            passwd, group = (reader.read_file(path) or b"" for path in ("/etc/passwd", "/etc/group"))
        finally:
            reader.close()
        try:
            ids = resolve_user(parent.user or "", passwd.decode(errors="replace"), group.decode(errors="replace"))
        except EnvBuildError as err:
            raise EnvBuildError(f"{env_dir / 'Dockerfile'}: {err} (attempts run as the last USER)") from None
        return None if ids.root else ids

    def _export_stage(self, zygote: Zygote, stages: list[dockerfile.Stage], index: int, key: str,
                      built: dict[int, tuple[Parent, list[str]]], exported: list[Path]) -> str:
        """Write a built stage's merged root to a host directory (hard links to its base) for COPY --from."""
        if self.base == "host":
            raise EnvBuildError("COPY --from an earlier stage needs an image base (sandbox.base = \"image\")")
        layers = [built[index][0].layer]
        below = stages[index].base_stage
        while below is not None:  # a stage on a stage: every layer down to the image
            index, below = below, stages[below].base_stage
            layers.append(built[index][0].layer)
        dest = cache_root() / "stage-roots" / f"{key}-{os.getpid()}-{len(exported)}"
        dest.parent.mkdir(parents=True, exist_ok=True)
        exported.append(dest)
        zygote.request({"op": "export_root", "base": str(self.base_for(stages[index].base).root),
                        "layers": layers[::-1], "dest": str(dest)})
        return str(dest)

    def _build_stage(self, zygote: Zygote, env_dir: Path, stage: dockerfile.Stage, key: str, hide: list[str],
                     lowers: list[str], net: _BuildNet, roots: dict[str, str], top: Path,
                     below: Parent | None) -> Parent:
        """Build one stage into a new layer over ``lowers``: on its image's base (its env first), or on
        the earlier stage ``below`` (whose env and workdir it inherits, as in Docker)."""
        base = self.base_for(stage.base) if below is None else None
        base_root = base.root if base is not None else Path("/nonexistent")
        dirs = zygote.request({"op": "parent_new", "top": str(top / f"s{stage.index}"), "hide": hide,
                               "base": str(base_root)})
        parent = Parent(key, dirs["layer"])
        parent.env.update(base.env if base is not None else below.env if below is not None else {})
        if below is not None:
            parent.workdir, parent.user = below.workdir, below.user
        elif base is not None:  # an imported image's config User and WorkingDir, as Docker starts a stage
            parent.workdir, parent.user = base.workdir, base.user
        builder: LocalAttempt | None = None
        online = net.policy != egress.NONE
        caches = buildnet.BuildCaches(net.env_key) if online and needs_builder(stage.instructions) else None
        try:
            runner = None
            if needs_builder(stage.instructions):
                binds = [list(b) for b in caches.binds] if caches is not None else []
                builder = self._spawn(zygote, self.build_limits, {
                    "lower": lowers, "upper": dirs["layer"], "work": dirs["work"], "new_net": True,
                    "proxy": net.policy, "workdir": None, "state": "", "binds": binds})
                env = {**egress.proxy_env(net.policy), **(caches.env if caches is not None else {}), **BUILD_ENV}
                proxy = self._proxy() if online else None
                runner = buildnet.BuildRunner(builder, stage.instructions, env_dir, env, net.deadline,
                                              (lambda: proxy.refused(builder.id)) if proxy else (lambda: []),
                                              net.policy, DiskGuard(top, self.build_min_free_mb))
            fetch = None
            if online:
                def fetch(url: str, out: IO[bytes], where: str) -> None:
                    buildnet.download(url, net.policy, self.registries, out, where)
            budget = max(0, free_mb(top) - self.build_min_free_mb) << 20  # Docker's: the disk, less a reserve
            apply_dockerfile(stage.instructions, parent, runner, env_dir, self.build_timeout_s,
                             stages={ref: Path(root) for ref, root in roots.items()}, fetch=fetch,
                             copy_budget=budget)
        finally:
            if builder is not None:
                builder.close()
            if caches is not None:
                caches.release()
        for bind in (caches.binds if caches is not None and builder is not None else []):
            with contextlib.suppress(OSError):  # a mount point the build left behind, if nothing was put in it
                os.rmdir(f"{dirs['layer']}{bind[1]}")
        shutil.rmtree(dirs["work"], ignore_errors=True)
        return parent

    def close(self) -> None:
        """Close every attempt, drop every parent, stop the zygote. Idempotent."""
        self._pool.close()
        with self._lock:
            self._closes += 1
            attempts, self._attempts = list(self._attempts), set()
            zygote, self._zygote = self._zygote, None
        for attempt in attempts:
            attempt.close()
        if zygote is not None:
            zygote.close()
        with self._lock:
            proxy, self._egress = self._egress, None
        if proxy is not None:
            proxy.close()
        self.layers.close()
        self._pool = WarmPool(self._make_attempt, self._pool.size, self._pool.keys)


def _parent_record(parent: Parent) -> dict[str, Any]:
    """What ``parent.json`` keeps of a built parent (its layer's path is the store's)."""
    record = dataclasses.asdict(parent)
    record.pop("layer")
    return record


def _parent_from_record(record: dict[str, Any], layer: str) -> Parent:
    ids = record.get("ids")
    fields = {k: v for k, v in record.items() if k not in ("ids", "layer")}
    parent = Parent(layer=layer, **fields)
    if ids is not None:
        parent.ids = UserIds(int(ids["uid"]), int(ids["gid"]), tuple(int(g) for g in ids["groups"]), ids["home"])
    return parent


@dataclass(frozen=True)
class _BuildNet:
    """What a build may reach (its network policy), until when, and its environment's caches' key."""

    policy: str
    deadline: buildnet.Deadline
    env_key: str


def _adds_shared_archive(step: Instruction) -> bool:
    """``ADD <SHARED_ARCHIVE> <dir>/`` from the build context, as ``tasks/offline.py`` writes it."""
    return (isinstance(step, dockerfile.Copy) and step.keyword == "ADD" and step.sources == (SHARED_ARCHIVE,)
            and step.from_ is None and not step.inline)


def _stages(instructions: list[Instruction]) -> list[dockerfile.Stage]:
    """The Dockerfile's stages; a Dockerfile without FROM (or none at all) is one stage on the default base."""
    stages = dockerfile.split_stages(instructions)
    if not stages:
        return [dockerfile.Stage(0, None, images.DEFAULT_REF, list(instructions))]
    return stages


# ---- availability probes -----------------------------------------------------------------------------------

_PROBE = """
import json, os, sys, tempfile
sys.path.insert(0, sys.argv[1])
from albatross.sandbox import linux as L
from albatross.sandbox.zygote import _make_userns
L.unshare(L.CLONE_NEWNS | L.CLONE_NEWPID | L.CLONE_NEWNET | L.CLONE_NEWIPC | L.CLONE_NEWUTS)
L.mount("none", "/", None, L.MS_REC | L.MS_PRIVATE)
root = tempfile.mkdtemp(prefix="albatross-probe-")
found = {"ok": False, "userns": False}
try:
    L.mount("tmpfs", root, "tmpfs", 0, "size=1m")
    for d in ("u", "w", "m", "b"):
        os.mkdir(f"{root}/{d}")
    os.setxattr(f"{root}/u", "trusted.overlay.opaque", b"y")
    L.mount("overlay", f"{root}/m", "overlay", 0, f"lowerdir=/,upperdir={root}/u,workdir={root}/w")
    found["ok"] = os.path.isdir(f"{root}/m/usr")
    L.idmapped_mount("/", f"{root}/b", _make_userns(int(sys.argv[2])))
    found["userns"] = os.stat(f"{root}/b/usr").st_uid == os.stat("/usr").st_uid + int(sys.argv[2])
except OSError as err:
    found["why"] = str(err)
finally:  # the mounts end with this namespace; the directory is the host's /tmp: remove it
    try:
        L.umount(root, 2)  # MNT_DETACH
    except OSError:
        pass
    os.rmdir(root)
print(json.dumps(found))
"""


@lru_cache(maxsize=1)
def _probe() -> dict[str, Any]:
    from albatross.sandbox import linux

    if sys.platform != "linux" or os.geteuid() != 0 or not linux.supported_machine():
        return {"ok": False, "userns": False, "why": "needs Linux (x86_64 or aarch64) and root"}
    if not cgroups.available():
        return {"ok": False, "userns": False, "why": cgroups.unavailable_reason()}
    import albatross

    src = str(Path(albatross.__file__).resolve().parents[1])
    try:
        probe = subprocess.run([sys.executable, "-S", "-c", _PROBE, src, str(ID_BASE)], capture_output=True,
                               timeout=60, text=True)
        found: dict[str, Any] = json.loads(probe.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError) as err:
        return {"ok": False, "userns": False, "why": f"probe failed: {err}"}
    if not found.get("ok"):
        log.info("local sandbox unavailable: %s", found.get("why", probe.stderr[-500:]))
    return found


def local_available() -> bool:
    """True when this machine can run LocalBackend: Linux, root, the memory and pids cgroup controllers (v1 or v2),
    unshare(2) of mount/pid/net/ipc/uts namespaces, and an overlay whose lower layer is the host root
    (probed once, in a throwaway process)."""
    return bool(_probe().get("ok"))


def userns_available() -> bool:
    """True when attempts can run as root of a user namespace over idmapped mounts (Linux >= 5.19)."""
    return bool(_probe().get("ok") and _probe().get("userns"))


def unavailable_reason() -> str:
    return str(_probe().get("why", ""))

"""Per-attempt cgroups (v1): a memory cgroup and a pids cgroup, commands in pids sub-cgroups ``c<N>``,
and a cpu cgroup (CFS quota) when the attempt has a CPU limit.

Both live under ``<controller mount>/<our own cgroup>/albatross/<attempt id>``, so attempt limits nest
under whatever limits this process already has. The kernel counts what we report as outcomes:
``memory.oom_control``'s ``oom_kill`` (the memory limit killed a process) and each command cgroup's
``pids.events`` ``max`` (a fork was refused at the process limit; read by the holder).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import time
from pathlib import Path

from albatross.sandbox.base import ForkError, Limits

log = logging.getLogger(__name__)
CPU_PERIOD_US = 100_000  # the CFS period; an attempt of ``cpus`` CPUs gets cpus x this much per period


def cgroup_root(controller: str) -> Path:
    """``/sys/fs/cgroup/<controller>/<our own cgroup>/albatross``."""
    mount = Path("/sys/fs/cgroup") / controller
    own = "/"
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _id, controllers, path = line.split(":", 2)
            if controller in controllers.split(","):
                own = path
    return mount / own.lstrip("/") / "albatross"


def _read_counter(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


class AttemptCgroups:
    """The cgroups of one attempt: ``memory`` (the memory limit) and ``pids`` (the process limit) with
    a sub-cgroup ``c<N>`` per command, ``c0`` made here. ``owner``: the host uid of the holder
    (user-namespace mode), which creates the later ones. ``holder``: its pid, never killed here."""

    def __init__(self, attempt_id: str, limits: Limits, owner: int = 0) -> None:
        self.memory = cgroup_root("memory") / attempt_id
        self.pids = cgroup_root("pids") / attempt_id
        self.cpu: Path | None = cgroup_root("cpu") / attempt_id if limits.cpus > 0 else None
        self.holder = 0
        try:
            for path in (self.memory, self.pids / "c0", self.cpu):
                if path is not None:
                    path.mkdir(parents=True)
            self._set_limits(limits)
            if owner:
                os.chown(self.pids, owner, owner)
        except OSError as err:
            self.remove()
            raise ForkError(f"cannot create cgroups for attempt {attempt_id}: {err}") from err

    def _set_limits(self, limits: Limits) -> None:
        limit = str(limits.memory_mb << 20)
        (self.memory / "memory.limit_in_bytes").write_text(limit)
        memsw = self.memory / "memory.memsw.limit_in_bytes"
        if memsw.exists():
            memsw.write_text(limit)
        (self.pids / "pids.max").write_text(str(limits.pids))
        if self.cpu is not None:
            (self.cpu / "cpu.cfs_period_us").write_text(str(CPU_PERIOD_US))
            (self.cpu / "cpu.cfs_quota_us").write_text(str(max(1000, round(limits.cpus * CPU_PERIOD_US))))

    def new_group(self, name: str) -> Path:
        """A pids sub-cgroup ``name`` of the attempt (made by host root; killed and removed with the others)."""
        path = self.pids / name
        path.mkdir(exist_ok=True)
        return path

    def oom_kills(self) -> int:
        """Processes the memory limit has killed so far."""
        return _read_counter(self.memory / "memory.oom_control", "oom_kill")

    def command_groups(self) -> list[Path]:
        return [p for p in self.pids.glob("c*") if p.is_dir()]

    def procs(self) -> list[int]:
        """Host pids of every process started by the attempt's commands (not the holder)."""
        out: list[int] = []
        for group in self.command_groups():
            with contextlib.suppress(OSError, ValueError):
                out += [int(p) for p in (group / "cgroup.procs").read_text().split()]
        return [pid for pid in out if pid != self.holder]

    def kill(self, name: str) -> None:
        """SIGKILL every process of one command's cgroup (repeat: a dying tree may still fork)."""
        procs = self.pids / name / "cgroup.procs"
        for _ in range(200):
            try:
                pids = [int(p) for p in procs.read_text().split() if int(p) != self.holder]
            except (OSError, ValueError):
                return
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.001)

    def kill_all(self, settle_s: float = 2.0) -> None:
        """SIGKILL every process every command started, then wait (up to ``settle_s``) until the
        holder has reaped them: until then they still hold their slots of the process limit."""
        for group in self.command_groups():
            self.kill(group.name)
        deadline = time.monotonic() + settle_s
        while time.monotonic() < deadline and self.current() > 1:
            time.sleep(0.005)

    def current(self) -> int:
        """Processes of the attempt now (the holder included; dead ones until they are reaped)."""
        try:
            return int((self.pids / "pids.current").read_text())
        except (OSError, ValueError):
            return 0

    def remove(self) -> None:
        for path in [*self.command_groups(), self.pids, self.memory, self.cpu]:
            if path is not None:
                _rmdir_retrying(path)


def _rmdir_retrying(path: Path) -> None:
    """rmdir, retrying while the cgroup is busy (its last processes may still be exiting)."""
    for delay in (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 0.0):
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError as err:
            if err.errno != errno.EBUSY:
                log.warning("cannot remove cgroup %s: %s", path, err)
                return
        time.sleep(delay)
    log.warning("cgroup %s still busy; left behind", path)



def remove_stale() -> None:
    """Remove empty attempt cgroups left by processes that died without closing (``<pid>-...``)."""
    for controller in ("memory", "pids", "cpu"):
        root = cgroup_root(controller)
        for path in root.glob("*-*") if root.is_dir() else ():
            owner = path.name.split("-", 1)[0]
            if owner.isdigit() and not Path(f"/proc/{owner}").exists():
                for sub in [*path.glob("c*"), path]:
                    with contextlib.suppress(OSError):
                        sub.rmdir()


def available() -> bool:
    return all(cgroup_root(c).parent.is_dir() for c in ("memory", "pids"))

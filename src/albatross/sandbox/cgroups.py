"""Per-attempt cgroups, v1 or v2: the same limits (memory, processes, CPU) and the same kill semantics on either.

**v1** (a hierarchy per controller, ``/sys/fs/cgroup/<controller>``): a memory cgroup, a pids cgroup with a
sub-cgroup ``c<N>`` per command, and a cpu cgroup (CFS quota) when the attempt has a CPU limit, each under
``<controller mount>/<our own cgroup>/albatross/<attempt id>``, so attempt limits nest under whatever limits this
process already has. Outcomes the kernel counts: ``memory.oom_control``'s ``oom_kill`` and each command cgroup's
``pids.events`` ``max`` (read by the holder).

**v2** (one unified hierarchy, ``cgroup2``): one cgroup per attempt, ``<base>/albatross/<attempt id>``, with
``memory.max`` (and ``memory.swap.max`` 0: no swap beyond it, as v1's ``memsw``), ``pids.max`` and ``cpu.max``;
the holder and every command live in its children ``c<N>`` (v2 allows processes only in leaves once controllers
are enabled above them; the children enable none, so everything they run is charged to the attempt). ``<base>`` is
our own cgroup, or the nearest ancestor in which the memory and pids controllers can be enabled for children (a
cgroup that holds processes cannot enable them: v2's no-internal-process rule). Outcomes: ``memory.events``
``oom_kill`` and the attempt's ``pids.events`` ``max`` (``new_pid_refusals``). A command's processes are killed
with ``cgroup.kill`` when the holder is not among them, else one by one as on v1.

Which version is used: v1 when the memory and pids controllers are mounted as v1 hierarchies (also on hybrid hosts,
whose ``cgroup2`` mount then has no controllers), else v2 when a ``cgroup2`` mount offers them. Neither (or not
root): ``unavailable_reason`` says so and names ``sandbox.type = "docker"``.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from albatross.sandbox.base import ForkError, Limits

log = logging.getLogger(__name__)
CPU_PERIOD_US = 100_000  # the CFS period; an attempt of ``cpus`` CPUs gets cpus x this much per period
SYS_CGROUP = Path("/sys/fs/cgroup")
V2_NEEDED = ("memory", "pids")


# ---------------------------------------------------------------------------------------------- the hierarchy


@dataclass(frozen=True)
class Hierarchy:
    """Where attempt cgroups go: ``version`` 1 (``root`` holds one mount per controller) or 2 (``root`` is the
    ``cgroup2`` mount, ``own`` this process's cgroup in it)."""

    version: int
    root: Path
    own: str = "/"


def _own_cgroups(text: str) -> dict[str, str]:
    """``/proc/self/cgroup``: controller name (v1; ``""`` for the v2 line) -> this process's cgroup path."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(",") if parts[1] else [""]:
                out[controller] = parts[2]
    return out


def detect(mounts: str, proc_cgroup: str) -> Hierarchy | None:
    """The hierarchy to use, from ``/proc/self/mounts`` and ``/proc/self/cgroup`` (pure: tests pass their own)."""
    v1: set[str] = set()
    v2: list[Path] = []
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 4:
            continue
        if fields[2] == "cgroup":
            v1.update(fields[3].split(","))
        elif fields[2] == "cgroup2":
            v2.append(Path(fields[1]))
    if all(c in v1 for c in V2_NEEDED):
        return Hierarchy(1, SYS_CGROUP)
    for mount in v2:
        if all(c in _controllers(mount) for c in V2_NEEDED):
            return Hierarchy(2, mount, _own_cgroups(proc_cgroup).get("", "/"))
    return None


def _controllers(cgroup: Path) -> set[str]:
    try:
        return set((cgroup / "cgroup.controllers").read_text().split())
    except OSError:
        return set()


@functools.lru_cache(maxsize=1)
def hierarchy() -> Hierarchy | None:
    """This machine's hierarchy (detected once)."""
    try:
        return detect(Path("/proc/self/mounts").read_text(), Path("/proc/self/cgroup").read_text())
    except OSError:
        return None


def available() -> bool:
    return hierarchy() is not None


def unavailable_reason() -> str:
    return ("needs root and the memory and pids cgroup controllers (cgroup v1, or cgroup v2 with them delegated to "
            "this process's cgroup or an ancestor); set sandbox.type = \"docker\" to run attempts in containers")


def cgroup_root(controller: str) -> Path:
    """Where attempt cgroups go: v1 ``/sys/fs/cgroup/<controller>/<our own cgroup>/albatross``; v2 the same
    directory for every controller, ``<base>/albatross`` (``v2_root``)."""
    h = hierarchy()
    if h is not None and h.version == 2:
        return v2_root(h.root, h.own)
    own = "/"
    with contextlib.suppress(OSError):
        own = _own_cgroups(Path("/proc/self/cgroup").read_text()).get(controller, "/")
    return SYS_CGROUP / controller / own.lstrip("/") / "albatross"


def _enable(cgroup: Path, controllers: list[str]) -> bool:
    """Enable ``controllers`` for ``cgroup``'s children (True when they are, now or already)."""
    have = _subtree(cgroup)
    if all(c in have for c in controllers):
        return True
    try:
        (cgroup / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in controllers if c not in have))
    except OSError:
        return False
    return all(c in _subtree(cgroup) for c in controllers)


def _subtree(cgroup: Path) -> set[str]:
    try:
        return set((cgroup / "cgroup.subtree_control").read_text().split())
    except OSError:
        return set()


@functools.lru_cache(maxsize=4)
def v2_root(mount: Path, own: str) -> Path:
    """``<base>/albatross`` with memory, pids (and cpu, when offered) enabled for attempt cgroups; ``<base>`` is
    ``own`` or the nearest ancestor that can enable them for its children (``ForkError`` when none can)."""
    base = mount / own.lstrip("/")
    wanted = [c for c in (*V2_NEEDED, "cpu") if c in _controllers(base)]
    while not _enable(base, wanted):
        if base == mount:
            raise ForkError(f"cgroup v2: no cgroup from {mount / own.lstrip('/')} up can enable "
                            f"{' '.join(wanted)} for its children; {unavailable_reason()}")
        base = base.parent
    root = base / "albatross"
    root.mkdir(exist_ok=True)
    if not _enable(root, wanted):
        raise ForkError(f"cgroup v2: cannot enable {' '.join(wanted)} in {root}")
    return root


# ---------------------------------------------------------------------------------------------- one attempt


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
    """The cgroups of one attempt, on ``hierarchy`` (default: this machine's). ``memory``, ``pids`` and ``cpu``
    (None without a CPU limit) are where each limit is set (v2: all the attempt's one cgroup); commands run in
    ``pids / c<N>``, ``c0`` made here. ``owner``: the host uid of the holder (user-namespace mode), which creates
    the later ones. ``holder``: its pid, never killed here."""

    def __init__(self, attempt_id: str, limits: Limits, owner: int = 0, hierarchy_: Hierarchy | None = None) -> None:
        h = hierarchy_ or hierarchy()
        self.v2 = h is not None and h.version == 2
        if self.v2:
            assert h is not None
            group = v2_root(h.root, h.own) / attempt_id
            self.memory = self.pids = group
            self.cpu: Path | None = group if limits.cpus > 0 else None
        else:
            self.memory, self.pids = cgroup_root("memory") / attempt_id, cgroup_root("pids") / attempt_id
            self.cpu = cgroup_root("cpu") / attempt_id if limits.cpus > 0 else None
        self.holder = 0
        self._refused = 0
        self.commands = CommandCgroups(self.pids, self.v2)
        try:
            for path in dict.fromkeys([self.memory, self.pids / "c0", self.cpu]):  # v2: one cgroup, and c0
                if path is not None:
                    path.mkdir(parents=True)
            self._set_limits(limits)
            if owner:
                self._give(owner)
        except OSError as err:
            self.remove()
            raise ForkError(f"cannot create cgroups for attempt {attempt_id}: {err}") from err

    def _set_limits(self, limits: Limits) -> None:
        limit = str(limits.memory_mb << 20)
        if self.v2:
            (self.memory / "memory.max").write_text(limit)
            swap = self.memory / "memory.swap.max"
            if swap.exists():
                swap.write_text("0")
            (self.pids / "pids.max").write_text(str(limits.pids))
            if self.cpu is not None:
                (self.cpu / "cpu.max").write_text(f"{max(1000, round(limits.cpus * CPU_PERIOD_US))} {CPU_PERIOD_US}")
            return
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

    def _give(self, owner: int) -> None:
        """Let the holder (host uid ``owner``) make command cgroups and move itself between them (v2 delegation:
        the directory, and the attempt's ``cgroup.procs``, which a move between siblings writes to)."""
        os.chown(self.pids, owner, owner)
        if self.v2:
            for name in ("cgroup.procs", "cgroup.threads", "cgroup.subtree_control"):
                with contextlib.suppress(FileNotFoundError):
                    os.chown(self.pids / name, owner, owner)

    def holder_config(self) -> dict[str, str]:
        """The cgroups the holder joins (``holder.py``: ``memory_cgroup``, ``pids_cgroup``/c0, ``cpu_cgroup``);
        on v2 ``c0`` is the one cgroup it joins."""
        if self.v2:
            return {"memory_cgroup": "", "pids_cgroup": str(self.pids), "cpu_cgroup": ""}
        return {"memory_cgroup": str(self.memory), "pids_cgroup": str(self.pids), "cpu_cgroup": str(self.cpu or "")}

    def adopt(self, pid: int) -> None:
        """Move the holder ``pid`` into the attempt's cgroups (those of ``holder_config``), as host root. A holder
        that died meanwhile (a failed set-up) is left to report why."""
        for key, path in self.holder_config().items():
            if path:
                target = Path(path) / "c0" if key == "pids_cgroup" else Path(path)
                with contextlib.suppress(ProcessLookupError):
                    (target / "cgroup.procs").write_text(str(pid))

    def oom_kills(self) -> int:
        """Processes the memory limit has killed so far."""
        if self.v2:
            return _read_counter(self.memory / "memory.events", "oom_kill")
        return _read_counter(self.memory / "memory.oom_control", "oom_kill")

    def new_pid_refusals(self) -> int:
        """Forks the process limit refused since the last call. v2 counts them on the attempt's cgroup (its
        children enable no pids controller, so every fork is charged there); on v1 the holder reads each command
        cgroup's own count, and this is 0."""
        if not self.v2:
            return 0
        total = _read_counter(self.pids / "pids.events", "max")
        new, self._refused = total - self._refused, total
        return max(0, new)

    def command_groups(self) -> list[Path]:
        return self.commands.groups()

    def procs(self) -> list[int]:
        """Host pids of every process started by the attempt's commands (not the holder)."""
        return self.commands.procs(self.holder)

    def kill(self, name: str) -> None:
        """SIGKILL every process of one command's cgroup, never the holder (``CommandCgroups.kill``)."""
        self.commands.kill(name, self.holder)

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
        for path in dict.fromkeys([*self.command_groups(), self.pids, self.memory, self.cpu]):
            if path is not None:
                _rmdir_retrying(path)


class CommandCgroups:
    """The command cgroups ``c<N>`` under ``parent`` (v1: the attempt's pids cgroup; v2: the attempt's cgroup) and
    how their processes are killed: every process of the cgroup gets SIGKILL, again until none is left (a dying
    tree may still fork), except the ``holder`` pid (it sits in the cgroup where the next command starts). On v2
    a cgroup without the holder is first killed at once with ``cgroup.kill``."""

    def __init__(self, parent: Path, v2: bool) -> None:
        self.parent, self.v2 = parent, v2

    def groups(self) -> list[Path]:
        return [p for p in self.parent.glob("c*") if p.is_dir()]

    def procs(self, holder: int = 0) -> list[int]:
        out: list[int] = []
        for group in self.groups():
            with contextlib.suppress(OSError, ValueError):
                out += [int(p) for p in (group / "cgroup.procs").read_text().split()]
        return [pid for pid in out if pid != holder]

    def kill(self, name: str, holder: int = 0) -> None:
        procs = self.parent / name / "cgroup.procs"
        if self.v2:
            with contextlib.suppress(OSError, ValueError):
                if holder not in [int(p) for p in procs.read_text().split()]:
                    (self.parent / name / "cgroup.kill").write_text("1")
        for _ in range(200):
            try:
                pids = [int(p) for p in procs.read_text().split() if int(p) != holder]
            except (OSError, ValueError):
                return
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.001)


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
    h = hierarchy()
    if h is None:
        return
    try:
        roots = {cgroup_root(c) for c in ("memory", "pids", "cpu")} if h.version == 1 else {cgroup_root("memory")}
    except ForkError:  # v2 without a cgroup that can delegate: the first fork says so
        return
    for root in roots:
        for path in root.glob("*-*") if root.is_dir() else ():
            owner = path.name.split("-", 1)[0]
            if owner.isdigit() and not Path(f"/proc/{owner}").exists():
                for sub in [*path.glob("c*"), path]:
                    with contextlib.suppress(OSError):
                        sub.rmdir()

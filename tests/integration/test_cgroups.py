"""The sandbox's cgroups on v1 or v2 (``sandbox/cgroups.py``): which hierarchy a machine has, the v2 limits and
counters written into a cgroup2 layout made for the test, and v2's kill semantics on a real cgroup2 mount (the
unified hierarchy of a hybrid host, or the host's own v2 one). v1 runs as always in the sandbox tests."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from albatross.sandbox.base import ForkError, Limits
from albatross.sandbox.cgroups import (
    AttemptCgroups,
    CommandCgroups,
    Hierarchy,
    detect,
    unavailable_reason,
    v2_root,
)

HYBRID = """cgroup /sys/fs/cgroup/memory cgroup rw,relatime,memory 0 0
cgroup /sys/fs/cgroup/pids cgroup rw,relatime,pids 0 0
cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0
"""
PURE_V2 = "cgroup2 {root} cgroup2 rw,nsdelegate 0 0\n"


def layout(root: Path, own: str = "/user.slice/session-1.scope") -> Path:
    """A cgroup2 tree as the kernel shows it: controllers offered at every level, enabled for the children of
    ``root`` and of ``own``'s parent; ``own`` holds processes, so it cannot enable any (its
    ``cgroup.subtree_control`` refuses writes, as the kernel does with EBUSY)."""
    leaf = root / own.lstrip("/")
    for d in [root, *reversed(leaf.relative_to(root).parents), leaf]:
        d = root / d if not d.is_absolute() else d
        d.mkdir(parents=True, exist_ok=True)
        (d / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
        if d != leaf:
            (d / "cgroup.subtree_control").write_text("cpu memory pids\n")
    (leaf / "cgroup.subtree_control").mkdir()  # writing it fails (EBUSY on a real kernel)
    albatross = leaf.parent / "albatross"  # what the kernel shows once ``v2_root`` enabled the controllers
    albatross.mkdir()
    (albatross / "cgroup.controllers").write_text("cpu memory pids\n")
    (albatross / "cgroup.subtree_control").write_text("cpu memory pids\n")
    return leaf


def test_the_hierarchy_is_v1_on_hybrid_hosts_and_v2_where_cgroup2_offers_the_controllers(tmp_path: Path) -> None:
    assert detect(HYBRID, "0::/\n4:memory:/a\n8:pids:/\n") == Hierarchy(1, Path("/sys/fs/cgroup"))
    own = layout(tmp_path)
    found = detect(PURE_V2.format(root=tmp_path), "0::/user.slice/session-1.scope\n")
    assert found == Hierarchy(2, tmp_path, "/user.slice/session-1.scope")
    (tmp_path / "cgroup.controllers").write_text("cpu io\n")  # memory and pids bound elsewhere: unusable
    assert detect(PURE_V2.format(root=tmp_path), "0::/\n") is None
    assert detect("", "") is None and 'sandbox.type = "docker"' in unavailable_reason()
    assert own.is_dir()


def test_v2_limits_counters_and_holder_cgroups_in_a_made_layout(tmp_path: Path) -> None:
    own = layout(tmp_path)
    h = Hierarchy(2, tmp_path, "/" + str(own.relative_to(tmp_path)))
    root = v2_root(h.root, h.own)
    assert root == own.parent / "albatross"  # own holds processes: the attempts go beside it
    groups = AttemptCgroups("123-ab-0", Limits(memory_mb=300, pids=40, cpus=1.5), owner=os.getuid(), hierarchy_=h)
    group = root / "123-ab-0"
    assert groups.memory == groups.pids == groups.cpu == group and (group / "c0").is_dir()
    assert (group / "memory.max").read_text() == str(300 << 20)
    assert (group / "pids.max").read_text() == "40" and (group / "cpu.max").read_text() == "150000 100000"
    assert groups.holder_config() == {"memory_cgroup": "", "pids_cgroup": str(group), "cpu_cgroup": ""}
    (group / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 2\n")
    (group / "pids.events").write_text("max 5\n")
    assert groups.oom_kills() == 2 and groups.new_pid_refusals() == 5 and groups.new_pid_refusals() == 0
    (group / "pids.events").write_text("max 7\n")
    assert groups.new_pid_refusals() == 2
    (group / "pids.current").write_text("4\n")
    assert groups.current() == 4
    no_cpu = AttemptCgroups("123-ab-1", Limits(memory_mb=64, pids=8), hierarchy_=h)
    assert no_cpu.cpu is None and not (root / "123-ab-1" / "cpu.max").exists()


def test_v2_without_a_cgroup_that_can_delegate_is_a_fork_error_naming_docker(tmp_path: Path) -> None:
    root = tmp_path / "v2"
    root.mkdir()
    (root / "cgroup.controllers").write_text("memory pids\n")
    (root / "cgroup.subtree_control").mkdir()  # even the top refuses
    with pytest.raises(ForkError, match='sandbox.type = "docker"'):
        v2_root(root, "/")


def _cgroup2_mount() -> Path | None:
    for line in Path("/proc/self/mounts").read_text().splitlines():
        fields = line.split()
        if fields[2] == "cgroup2":
            return Path(fields[1])
    return None


MOUNT = _cgroup2_mount()
needs_cgroup2 = pytest.mark.skipif(os.geteuid() != 0 or MOUNT is None, reason="needs root and a cgroup2 mount")


def _start_in(cgroup: Path, script: str) -> subprocess.Popen:
    """``sh -c script`` that enters ``cgroup`` before it runs (its children are born there)."""
    cgroup.mkdir(exist_ok=True)
    return subprocess.Popen(["sh", "-c", script], start_new_session=True,
                            preexec_fn=lambda: (cgroup / "cgroup.procs").write_text("0"))


def _wait_procs(cgroup: Path, n: int) -> list[int]:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        pids = [int(p) for p in (cgroup / "cgroup.procs").read_text().split()]
        if len(pids) >= n:
            return pids
        time.sleep(0.02)
    raise AssertionError(f"{cgroup} has not got {n} processes")


@needs_cgroup2
def test_v2_kill_semantics_on_a_real_cgroup2_mount() -> None:
    """A command's whole tree dies (``cgroup.kill``); in the cgroup the holder sits in, everything but the
    holder dies; the empty cgroups are removed."""
    assert MOUNT is not None
    parent = MOUNT / f"albatross-test-{os.getpid()}"
    parent.mkdir()
    started: list[subprocess.Popen] = []
    try:
        commands = CommandCgroups(parent, v2=True)
        started.append(_start_in(parent / "c1", "sleep 60 & sleep 60 & (sleep 60 &) ; wait"))
        tree = _wait_procs(parent / "c1", 4)
        holder = _start_in(parent / "c2", "sleep 60 & sleep 60 & wait; exec sleep 60")  # lives on
        started.append(holder)
        others = [p for p in _wait_procs(parent / "c2", 3) if p != holder.pid]
        assert sorted(commands.procs(holder.pid)) == sorted(tree + others)

        commands.kill("c1", holder.pid)
        assert started[0].wait(timeout=10) == -signal.SIGKILL
        assert (parent / "c1" / "cgroup.procs").read_text().split() == []
        commands.kill("c2", holder.pid)
        deadline = time.monotonic() + 10
        while len((parent / "c2" / "cgroup.procs").read_text().split()) > 1 and time.monotonic() < deadline:
            time.sleep(0.02)  # the holder (a shell) reaps its killed children
        assert (parent / "c2" / "cgroup.procs").read_text().split() == [str(holder.pid)]
        assert holder.poll() is None  # the holder is never killed
    finally:
        for p in started:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        for group in [*(g for g in parent.glob("c*") if g.is_dir()), parent]:
            deadline = time.monotonic() + 5
            while group.exists():
                try:
                    group.rmdir()
                except OSError:
                    assert time.monotonic() < deadline, f"{group} still busy"
                    time.sleep(0.05)
    assert not parent.exists()

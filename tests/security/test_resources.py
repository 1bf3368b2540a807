"""Resources: limits are validated before any sandbox exists, and each one holds inside an attempt."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from _probes import make_task, needs_local

from albatross.config import SandboxConfig
from albatross.sandbox import LocalBackend
from albatross.sandbox.base import LIMIT_DISK, LIMIT_OOM, LIMIT_PIDS, Limits
from albatross.tasks import load_task
from albatross.tasks.format import TaskFormatError


def test_storage_below_one_mib_in_task_toml_is_an_error(tmp_path: Path) -> None:
    """``storage_mb = 0.4`` was int() to 0, i.e. size=0m: an unlimited tmpfs."""
    task = make_task(tmp_path)
    toml = (task.path / "task.toml").read_text().replace("storage_mb = 256", "storage_mb = 0.4")
    (task.path / "task.toml").write_text(toml)
    with pytest.raises(TaskFormatError, match=r"task.toml: \[environment\] storage_mb must be between 16 and"):
        load_task(task.path)


@pytest.mark.parametrize("field,value", [("disk_mb", 0), ("memory_mb", 0), ("pids", 0),
                                         ("command_timeout_s", math.inf), ("command_timeout_s", math.nan),
                                         ("command_timeout_s", -1.0), ("attempt_timeout_s", math.inf),
                                         ("cpus", -0.5), ("cpus", math.nan)])
def test_invalid_limits_are_refused(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        Limits(**{field: value})


@pytest.mark.parametrize("field,value", [("disk_mb", 0.4), ("command_timeout_s", math.inf),
                                         ("attempt_timeout_s", math.nan), ("attempt_timeout_s", -1.0),
                                         ("cpus", -1.0), ("cpus", math.inf)])
def test_invalid_sandbox_config_is_a_config_error(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        SandboxConfig(**{field: value})


def busy_loop(backend: LocalBackend, cpus: float) -> tuple[float, int]:
    """(CPU seconds a 2 s busy loop got, times the cgroup cpu quota throttled the attempt)."""
    with backend.fork(None, limits=Limits(cpus=cpus, command_timeout_s=20)) as attempt:
        out = attempt.exec("timeout 2 sh -c 'while :; do :; done'; times").output.split("\n")
        stat = (attempt._cgroups.cpu / "cpu.stat").read_text() if attempt._cgroups.cpu else ""
    user, system = out[1].split()  # `times`: shell line, then children line "XmY.YYYs XmY.YYYs"
    seconds = sum(float(t.split("m")[0]) * 60 + float(t.split("m")[1].rstrip("s")) for t in (user, system))
    throttled = dict(line.split() for line in stat.splitlines()).get("nr_throttled", "0")
    return seconds, int(throttled)


@needs_local
def test_cpu_limit_caps_cpu_time(backend: LocalBackend) -> None:
    seconds, throttled = busy_loop(backend, 0.2)
    assert throttled > 0 and seconds < 0.2 * 2 * 1.5 + 0.1  # 0.4 s of CPU in 2 s, with slack


@needs_local
def test_cpu_limit_leaves_the_cgroup_behind_on_close(backend: LocalBackend) -> None:
    attempt = backend.fork(None, limits=Limits(cpus=0.5))
    group = attempt._cgroups.cpu
    assert group is not None and (group / "cpu.cfs_quota_us").read_text().strip() == "50000"
    attempt.close()
    assert not group.exists()


@needs_local
def test_fork_bomb_is_bounded_by_the_process_limit(backend: LocalBackend) -> None:
    with backend.fork(None, limits=Limits(pids=64, command_timeout_s=15)) as attempt:
        result = attempt.exec("bomb() { bomb | bomb & }; bomb; sleep 3", timeout_s=15)
        assert result.limit == LIMIT_PIDS
        assert attempt.exec("echo alive").output == "alive\n"


@needs_local
def test_memory_bomb_is_bounded_by_the_memory_limit(backend: LocalBackend) -> None:
    with backend.fork(None, limits=Limits(memory_mb=64, command_timeout_s=15)) as attempt:
        result = attempt.exec("/usr/bin/python3 -c 'x = bytearray(512 << 20); print(len(x))'", timeout_s=15)
        assert result.limit == LIMIT_OOM and "536870912" not in result.output


@needs_local
def test_disk_fill_is_bounded_by_the_disk_limit(backend: LocalBackend) -> None:
    with backend.fork(None, limits=Limits(disk_mb=8, command_timeout_s=15)) as attempt:
        result = attempt.exec("dd if=/dev/zero of=/app/fill bs=1M count=64 2>&1; du -m /app/fill", timeout_s=15)
        assert result.limit == LIMIT_DISK and int(result.output.split()[-2]) <= 8


@needs_local
def test_only_harmless_devices_exist(backend: LocalBackend) -> None:
    with backend.fork(None) as attempt:
        devices = set(attempt.exec("ls /dev").output.split())
        raw = attempt.exec("cat /dev/sda /dev/mem /dev/kmsg 2>&1 | head -c 100; ls /dev/net 2>&1").output
    assert devices <= {"null", "zero", "full", "random", "urandom", "tty", "fd", "stdin", "stdout", "stderr",
                       "ptmx", "pts", "shm"}
    assert "No such file" in raw

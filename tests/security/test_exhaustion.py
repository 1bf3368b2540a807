"""Disk, inode and memory exhaustion: an attempt that fills its disk, its file table or its memory has
failed, and is scored 0 (the untouched-fork check passes), never an infrastructure error that drops it
from Pass@1 and its group; on the model path (``verify_attempt``) and on ``eval --agent oracle`` alike."""

from __future__ import annotations

from pathlib import Path

import pytest
from _probes import make_task, needs_local

from albatross.records import STATUS_INFRA_ERROR
from albatross.sandbox import LocalBackend
from albatross.sandbox.base import Limits
from albatross.tasks.verify import verify_attempt

pytestmark = needs_local
FILL_DISK = "dd if=/dev/zero of=/app/fill bs=1M count=4096 2>/dev/null; true"
FILL_FILES = ("python3 -c 'import itertools\nfor i in itertools.count():\n    try:\n"
              "        open(f\"/app/f{i}\", \"w\").close()\n    except OSError:\n        break\n"
              "print(i)'; true")  # empty files: the file table fills, not the blocks
FILL_MEMORY = "dd if=/dev/zero of=/dev/shm/fill bs=1M count=1024 2>/dev/null; true"
LIMITS = {"disk": Limits(disk_mb=16, command_timeout_s=60), "files": Limits(disk_mb=16, command_timeout_s=60),
          "memory": Limits(memory_mb=96, disk_mb=512, command_timeout_s=60)}
COMMANDS = {"disk": FILL_DISK, "files": FILL_FILES, "memory": FILL_MEMORY}


@pytest.fixture(scope="module")
def task(tmp_path_factory: pytest.TempPathFactory):
    return make_task(tmp_path_factory.mktemp("tasks"))


@pytest.mark.parametrize("what", sorted(COMMANDS))
def test_exhausted_attempt_is_scored_zero(backend: LocalBackend, task, what: str) -> None:
    limits = LIMITS[what]
    with backend.fork(task.env_dir, task.workdir, limits) as attempt:
        attempt.exec(COMMANDS[what], timeout_s=60)
        result = verify_attempt(attempt, task, backend, limits)
    assert result.reward == 0.0 and not result.success


def test_full_disk_still_lets_a_solved_attempt_score_1(backend: LocalBackend, task) -> None:
    """The verifier's own files do not need the attempt's disk: a solved attempt with a full disk passes."""
    limits = LIMITS["disk"]
    with backend.fork(task.env_dir, task.workdir, limits) as attempt:
        attempt.exec(f"echo forty-two > /app/answer.txt; {FILL_DISK}", timeout_s=60)
        assert verify_attempt(attempt, task, backend, limits).reward == 1.0


def test_oracle_that_fills_the_disk_is_a_scored_failure(backend: LocalBackend, tmp_path: Path) -> None:
    """``eval --agent oracle`` classifies a hostile solve.sh as the model path does."""
    from albatross.eval.oracle import OracleAgent
    from albatross.harness.agent import AttemptSpec

    task = make_task(tmp_path, "hostile-oracle", solve_sh=f"#!/bin/bash\n{FILL_DISK}\n",
                     toml={"environment": {"storage_mb": 16}})
    traj = OracleAgent(backend, Limits(disk_mb=16)).run(AttemptSpec(task, "g", 0))
    assert traj.status != STATUS_INFRA_ERROR, traj.error
    assert traj.reward.success is False and traj.reward.score == 0.0

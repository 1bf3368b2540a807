"""Out-of-range task values: task.toml is hostile input. Memory, storage, CPUs and every timeout are checked
against a range (the error names the field and the range), unknown keys are warned about once, the
instruction's size is capped before it is read, and the run's configured limits are a ceiling that a
task's own values cannot raise."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from _probes import make_task, needs_local

from albatross.sandbox.base import Limits
from albatross.tasks import load_task
from albatross.tasks.format import TaskFormatError


def with_toml(tmp_path: Path, name: str, section: str, key: str, value: str) -> Path:
    task = make_task(tmp_path, name)
    text = (task.path / "task.toml").read_text()
    lines = [line for line in text.splitlines() if not line.startswith((f"{key} =", f"{key}_mb ="))]
    out, placed = [], False
    for line in lines:
        out.append(line)
        if line.strip() == f"[{section}]" and not placed:
            out.append(f"{key} = {value}")
            placed = True
    if not placed:
        out += [f"[{section}]", f"{key} = {value}"]
    (task.path / "task.toml").write_text("\n".join(out) + "\n")
    return task.path


OUT_OF_RANGE = [
    ("environment", "memory_mb", "1.5", "memory_mb"),
    ("environment", "memory_mb", "1e30", "memory_mb"),
    ("environment", "memory", '"1000T"', "memory"),
    ("environment", "storage_mb", "1e30", "storage_mb"),
    ("environment", "cpus", "1e6", "cpus"),
    ("environment", "build_timeout_sec", "1e12", "build_timeout_sec"),
    ("agent", "timeout_sec", "1e12", "timeout_sec"),
    ("verifier", "timeout_sec", "1e300", "timeout_sec"),
]


@pytest.mark.parametrize(("section", "key", "value", "named"), OUT_OF_RANGE)
def test_out_of_range_value_is_refused_naming_the_range(tmp_path: Path, section: str, key: str, value: str,
                                                         named: str) -> None:
    path = with_toml(tmp_path, f"bad-{key}", section, key, value)
    with pytest.raises(TaskFormatError, match=rf"\[{section}\] {named} must be between .* and .*"):
        load_task(path)


def test_unknown_keys_are_warned_about_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    first = with_toml(tmp_path / "a", "typo-a", "environment", "memroy_mb", "4096")
    second = with_toml(tmp_path / "b", "typo-b", "environment", "memroy_mb", "4096")
    with caplog.at_level(logging.WARNING):
        load_task(first)
        load_task(second)
    warned = [r.getMessage() for r in caplog.records if "memroy_mb" in r.getMessage()]
    assert len(warned) == 1 and "unknown" in warned[0], warned


def test_huge_instruction_is_refused_without_reading_it(tmp_path: Path) -> None:
    task = make_task(tmp_path)
    instruction = task.path / "instruction.md"
    with open(instruction, "r+b") as f:  # a sparse 200 MB file: reading it whole would cost 200 MB
        f.truncate(200 << 20)
    with pytest.raises(TaskFormatError, match="instruction.md: larger than"):
        load_task(task.path)
    assert os.path.getsize(instruction) == 200 << 20


@needs_local
def test_task_memory_cannot_raise_the_runs_limit(tmp_path: Path) -> None:
    """The run allows 128 MB; the task asks for 2048 MB; an oracle that needs 300 MB must not get it."""
    from albatross.eval.oracle import OracleAgent
    from albatross.harness.agent import AttemptSpec
    from albatross.sandbox import LocalBackend

    solve = ("#!/bin/bash\npython3 -c 'x = bytearray(300 << 20); x[::4096] = b\"y\" * len(x[::4096])' "
             "&& echo forty-two > /app/answer.txt\n")
    task = make_task(tmp_path, "greedy", solve_sh=solve, toml={"environment": {"memory_mb": 2048}})
    backend = LocalBackend(warm=0, hide_paths=[tmp_path])
    try:
        traj = OracleAgent(backend, Limits(memory_mb=128)).run(AttemptSpec(task, "g", 0))
    finally:
        backend.close()
    assert traj.reward.success is False, "the task's memory_mb lifted the run's 128 MB limit"

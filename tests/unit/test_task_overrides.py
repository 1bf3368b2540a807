"""Per-task overrides (``tasks/overrides.py``): the built-in Terminal-Bench 2.0 set, files with reasons,
and what they may not change."""

from __future__ import annotations

from pathlib import Path

import pytest

from albatross.tasks.format import TaskFormatError, load_task
from albatross.tasks.overrides import BUILTIN, apply_overrides, load_overrides
from albatross.tasks.scaffold import write_scaffold


def test_builtin_set_names_tasks_with_reasons() -> None:
    found = load_overrides("terminal-bench-2")
    assert set(found) == set(BUILTIN["terminal-bench-2"])
    assert all(o.reason and o.values and set(o.values) <= {"toolchain", "keep_agent_processes", "memory_mb"}
               for o in found.values())
    servers = {t for t, o in found.items() if o.values.get("keep_agent_processes")}  # tests reach a live server
    assert {"configure-git-webserver", "nginx-request-logging", "pypi-server", "kv-store-grpc"} <= servers
    assert found["dna-insert"].values == {"toolchain": "attempt"}
    assert found["gcode-to-text"].values == {"memory_mb": 4096}  # its written files count in its memory
    assert load_overrides(None) == {} and load_overrides("") == {}


def test_file_override_changes_only_the_named_task(tmp_path: Path) -> None:
    task_dir = write_scaffold(tmp_path / "tasks", "mytask")
    other = write_scaffold(tmp_path / "tasks", "other")
    file = tmp_path / "o.toml"
    file.write_text('[mytask]\nreason = "checks /usr/local/bin"\nverifier.toolchain = "attempt"\n'
                    'verifier.keep_agent_processes = true\nenvironment.memory_mb = 3072\n')
    overrides = load_overrides(file)
    task = apply_overrides(load_task(task_dir), overrides)
    assert (task.toolchain, task.keep_agent_processes, task.memory_mb) == ("attempt", True, 3072)
    untouched = apply_overrides(load_task(other), overrides)
    assert (untouched.toolchain, untouched.memory_mb) == ("image", load_task(other).memory_mb)


@pytest.mark.parametrize("text, message", [
    ('[t]\nverifier.toolchain = "attempt"\n', "needs a reason"),
    ('[t]\nreason = "r"\nenvironment.storage_mb = 99999\n', "cannot be overridden"),
    ('[t]\nreason = "r"\nenvironment.memory_mb = 32\n', "must be a whole number from 64"),
    ('[t]\nreason = "r"\nenvironment.memory_mb = 4096.0\n', "must be a whole number"),
    ('[t]\nreason = "r"\nenvironment.memory_mb = "4G"\n', "must be a whole number"),
    ('[t]\nreason = "r"\nverifier.toolchain = "host"\n', "must be image or attempt"),
    ('[t]\nreason = "r"\nverifier.keep_agent_processes = "yes"\n', "must be bool"),
    ("t = 1\n", "must be a table"),
    ("[t\n", "invalid TOML"),
])
def test_bad_overrides_name_file_and_entry(tmp_path: Path, text: str, message: str) -> None:
    file = tmp_path / "o.toml"
    file.write_text(text)
    with pytest.raises(TaskFormatError, match=message) as err:
        load_overrides(file)
    assert str(file) in str(err.value)


def test_missing_file_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(TaskFormatError, match="terminal-bench-2"):
        load_overrides(tmp_path / "nope.toml")

"""Task directories: loading real Terminal-Bench 2 tasks, rejecting broken ones, writing, rewards."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from albatross.tasks import (
    TaskFormatError,
    VerifierError,
    load_task,
    load_tasks,
    parse_reward,
    write_task,
)
from albatross.tasks.format import dockerfile_workdir

TB2 = Path(os.environ.get("ALBATROSS_TB2_SAMPLE", Path(__file__).resolve().parents[2].parent / "shared" / "tb2-sample"))
needs_tb2 = pytest.mark.skipif(not TB2.is_dir(), reason=f"Terminal-Bench 2 sample tasks not found at {TB2}")

TB2_EXPECTED = {  # id -> (agent timeout, verifier timeout, instruction start, category)
    "constraints-scheduling": (1200.0, 1200.0, "Find a 1-hour meeting slot", "personal-assistant"),
    "git-leak-recovery": (900.0, 900.0, "A secret was accidentally committed", "software-engineering"),
    "log-summary-date-ranges": (900.0, 900.0, "You are given multiple log files", "data-processing"),
    "openssl-selfsigned-cert": (900.0, 900.0, "Your company needs a self-signed", "security"),
    "regex-log": (900.0, 900.0, "Write a regex expression", "data-processing"),
}


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ALBATROSS_CACHE", str(tmp_path / ".cache"))


# ------------------------------------------------------------------------------------- real tasks


@needs_tb2
@pytest.mark.parametrize("task_id", sorted(TB2_EXPECTED))
def test_loads_real_tb2_task(task_id: str) -> None:
    task = load_task(TB2 / task_id)
    agent_s, verifier_s, start, category = TB2_EXPECTED[task_id]
    assert task.id == task_id
    assert (task.agent_timeout_s, task.verifier_timeout_s) == (agent_s, verifier_s)
    assert task.instruction.startswith(start)
    assert (task.memory_mb, task.storage_mb, task.cpus) == (2048, 10240, 1.0)
    assert task.workdir == "/app"
    assert task.allow_internet is False
    assert task.metadata["category"] == category and task.metadata["difficulty"] == "medium"
    assert task.source_env_dir == TB2 / task_id / "environment" and (task.tests_dir / "test.sh").is_file()
    assert (task.solution_dir / "solve.sh").is_file() and task.demo_steps is None
    assert (task.build_timeout_s, task.source_path) == (600.0, TB2 / task_id)
    if task_id == "regex-log":  # FROM ubuntu and WORKDIR only: nothing needs the network
        assert task.offline is None and task.env_dir == task.source_env_dir
    else:  # apt-get / a python image: built from a copy that carries the offline toolkit
        assert task.offline is not None and (task.env_dir / ".albatross-offline.tar").is_file()


@needs_tb2
def test_load_tasks_expands_a_directory_of_tasks_sorted() -> None:
    tasks = load_tasks([TB2])
    assert [t.id for t in tasks] == sorted(TB2_EXPECTED)


# ------------------------------------------------------------------------------------ broken tasks


def _minimal(task_dir: Path, **toml_tables: dict) -> Path:
    task_toml = {"agent": {"timeout_sec": 30}, "verifier": {"timeout_sec": 20}, **toml_tables}
    return write_task(
        task_dir,
        instruction="Do the thing.\n",
        task_toml=task_toml,
        env_files={"data.txt": "x\n"},
        dockerfile="FROM debian:bookworm-slim\nWORKDIR /srv\nCOPY data.txt /srv/\n",
        solve_sh="#!/bin/bash\ntrue\n",
        test_sh="#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n",
    )


def _error(task_dir: Path) -> str:
    with pytest.raises(TaskFormatError) as info:
        load_task(task_dir)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_minimal_task_loads(tmp_path: Path) -> None:
    task = load_task(_minimal(tmp_path / "ok"))
    assert (task.id, task.instruction, task.workdir) == ("ok", "Do the thing.\n", "/srv")
    assert (task.agent_timeout_s, task.verifier_timeout_s) == (30.0, 20.0)
    assert (task.memory_mb, task.storage_mb, task.metadata) == (2048, 10240, {})
    assert (task.build_timeout_s, task.offline, task.source_path) == (600.0, None, tmp_path / "ok")


def test_build_timeout_is_read(tmp_path: Path) -> None:
    task = load_task(_minimal(tmp_path / "ok", environment={"build_timeout_sec": 42}))
    assert task.build_timeout_s == 42.0
    assert _error(_minimal(tmp_path / "bad", environment={"build_timeout_sec": 0})).endswith(
        "[environment] build_timeout_sec must be positive")


def test_missing_instruction_names_the_file(tmp_path: Path) -> None:
    task_dir = _minimal(tmp_path / "t")
    (task_dir / "instruction.md").unlink()
    assert _error(task_dir) == f"{task_dir / 'instruction.md'}: missing"


def test_empty_instruction_is_rejected(tmp_path: Path) -> None:
    task_dir = _minimal(tmp_path / "t")
    (task_dir / "instruction.md").write_text("  \n")
    assert _error(task_dir) == f"{task_dir / 'instruction.md'}: is empty"


def test_bad_toml_names_the_file(tmp_path: Path) -> None:
    task_dir = _minimal(tmp_path / "t")
    (task_dir / "task.toml").write_text("[agent\ntimeout_sec = 3\n")
    assert _error(task_dir).startswith(f"{task_dir / 'task.toml'}: invalid TOML:")


@pytest.mark.parametrize(
    ("tables", "field"),
    [
        ({"agent": {"timeout_sec": "ten"}}, "[agent] timeout_sec must be a number"),
        ({"verifier": {"timeout_sec": True}}, "[verifier] timeout_sec must be a number"),
        ({"agent": {"timeout_sec": -5}}, "[agent] timeout_sec must be positive"),
        ({"environment": {"memory": "lots"}}, '[environment] memory must be a size like "512M" or "2G"'),
        ({"environment": {"storage_mb": "big"}}, "[environment] storage_mb must be a number"),
        ({"environment": {"cpus": 0}}, "[environment] cpus must be positive"),
        ({"environment": {"allow_internet": "yes"}}, "[environment] allow_internet must be true or false"),
    ],
)
def test_bad_field_names_file_and_field(tmp_path: Path, tables: dict, field: str) -> None:
    task_dir = _minimal(tmp_path / "t", **tables)
    assert _error(task_dir) == f"{task_dir / 'task.toml'}: {field}"


def test_table_that_is_not_a_table(tmp_path: Path) -> None:
    task_dir = _minimal(tmp_path / "t")
    (task_dir / "task.toml").write_text('agent = "fast"\n')
    assert _error(task_dir) == f"{task_dir / 'task.toml'}: [agent] must be a table"


@pytest.mark.parametrize("missing", ["tests/test.sh", "environment/Dockerfile", "task.toml"])
def test_missing_required_file(tmp_path: Path, missing: str) -> None:
    task_dir = _minimal(tmp_path / "t")
    (task_dir / missing).unlink()
    assert _error(task_dir) == f"{task_dir / missing}: missing"


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ("{not json", "invalid JSON"),
        ('{"steps": []}', "steps must be a non-empty list of non-empty strings"),
        ('{"steps": ["ls", 3, "submit"]}', "steps must be a non-empty list of non-empty strings"),
        ('{"steps": ["ls"]}', 'steps must end with "submit"'),
    ],
)
def test_bad_demo_json(tmp_path: Path, content: str, problem: str) -> None:
    task_dir = _minimal(tmp_path / "t")
    (task_dir / "solution" / "demo.json").write_text(content)
    assert _error(task_dir).startswith(f"{task_dir / 'solution' / 'demo.json'}: {problem}")


def test_not_a_directory(tmp_path: Path) -> None:
    assert _error(tmp_path / "nope") == f"{tmp_path / 'nope'}: not a task directory"


# ------------------------------------------------------------------------------------------ fields


@pytest.mark.parametrize(
    ("environment", "memory_mb", "storage_mb"),
    [
        ({"memory": "2G", "storage": "10G"}, 2048, 10240),
        ({"memory": "512M", "storage": "1.5G"}, 512, 1536),
        ({"memory": "4GiB", "storage": "256mb"}, 4096, 256),
        ({"memory_mb": 300, "memory": "2G", "storage_mb": 100}, 300, 100),
    ],
)
def test_memory_and_storage_sizes(tmp_path: Path, environment: dict, memory_mb: int, storage_mb: int) -> None:
    task = load_task(_minimal(tmp_path / "t", environment=environment))
    assert (task.memory_mb, task.storage_mb) == (memory_mb, storage_mb)


@pytest.mark.parametrize(
    ("dockerfile", "workdir"),
    [
        ("FROM x\nWORKDIR /app\nRUN true\n", "/app"),
        ("FROM x\nWORKDIR /srv\nWORKDIR /opt/work\n", "/opt/work"),
        ("FROM x\nWORKDIR /srv\nworkdir sub\n", "/srv/sub"),
        ("FROM x\nRUN true\n", "/app"),
    ],
)
def test_dockerfile_workdir(tmp_path: Path, dockerfile: str, workdir: str) -> None:
    path = tmp_path / "Dockerfile"
    path.write_text(dockerfile)
    assert dockerfile_workdir(path) == workdir


def test_write_task_round_trips(tmp_path: Path) -> None:
    task_dir = write_task(
        tmp_path / "round",
        instruction="Say hi.\n",
        task_toml={
            "version": "1.0",
            "metadata": {"family": "greet", "seed": 7, "tags": ["a", "b"], "note": 'quote " and \\'},
            "agent": {"timeout_sec": 12.5},
            "verifier": {"timeout_sec": 3},
            "environment": {"cpus": 2, "memory_mb": 256, "storage_mb": 64, "allow_internet": True},
        },
        env_files={"app/hello.txt": "hi\n", "app/blob.bin": b"\x00\x01"},
        dockerfile="FROM debian:bookworm-slim\nWORKDIR /app\nCOPY app/ /app/\n",
        solve_sh="#!/bin/bash\necho hi > out.txt\n",
        test_sh="#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n",
        test_files={"expected.txt": "hi\n"},
        demo_steps=["echo hi > out.txt", "submit"],
    )
    task = load_task(task_dir)
    assert task.metadata == {"family": "greet", "seed": 7, "tags": ["a", "b"], "note": 'quote " and \\'}
    assert (task.agent_timeout_s, task.verifier_timeout_s, task.cpus) == (12.5, 3.0, 2.0)
    assert (task.memory_mb, task.storage_mb, task.allow_internet) == (256, 64, True)
    assert task.demo_steps == ["echo hi > out.txt", "submit"]
    assert (task.env_dir / "app" / "blob.bin").read_bytes() == b"\x00\x01"
    assert (task.tests_dir / "expected.txt").read_text() == "hi\n"
    assert os.access(task.tests_dir / "test.sh", os.X_OK)


def test_write_task_refuses_paths_outside_the_task(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="must be a relative path"):
        write_task(
            tmp_path / "t",
            instruction="x",
            task_toml={},
            env_files={"../escape.txt": "x"},
            dockerfile="FROM x\n",
            solve_sh="",
            test_sh="",
        )
    assert not (tmp_path / "escape.txt").exists()


# ------------------------------------------------------------------------------------- load_tasks


def test_load_tasks_nested_and_single(tmp_path: Path) -> None:
    for name in ("b", "a"):
        _minimal(tmp_path / "suite" / "group" / name)
    _minimal(tmp_path / "suite" / "c")
    assert [t.id for t in load_tasks([tmp_path / "suite"])] == ["c", "a", "b"]
    assert [t.id for t in load_tasks(tmp_path / "suite" / "c")] == ["c"]


def test_load_tasks_rejects_duplicates_and_empty_dirs(tmp_path: Path) -> None:
    _minimal(tmp_path / "one" / "same")
    _minimal(tmp_path / "two" / "same")
    with pytest.raises(TaskFormatError, match="duplicate task id 'same'"):
        load_tasks([tmp_path / "one", tmp_path / "two"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(TaskFormatError, match="no task directories"):
        load_tasks([tmp_path / "empty"])


def test_load_tasks_reports_the_broken_task(tmp_path: Path) -> None:
    _minimal(tmp_path / "suite" / "good")
    bad = _minimal(tmp_path / "suite" / "bad")
    shutil.rmtree(bad / "tests")
    with pytest.raises(TaskFormatError, match=f"^{bad / 'tests' / 'test.sh'}: missing$"):
        load_tasks([tmp_path / "suite"])


# ---------------------------------------------------------------------------------------- rewards


def test_reward_json_is_the_mean_and_success_needs_every_test() -> None:
    result = parse_reward(b'{"exists": 1, "correct": 0}', None)
    assert (result.metrics, result.reward, result.success) == ({"exists": 1.0, "correct": 0.0}, 0.5, False)
    assert parse_reward(b'{"a": 1.0, "b": 1}', None).success


def test_reward_txt_and_precedence() -> None:
    result = parse_reward(None, b" 1\n")
    assert (result.metrics, result.reward, result.success) == ({"reward": 1.0}, 1.0, True)
    assert parse_reward(None, b"0.25").success is False
    assert parse_reward(b'{"t": 0}', b"1").reward == 0.0


@pytest.mark.parametrize(
    ("reward_json", "reward_txt", "problem"),
    [
        (None, None, "no reward file"),
        (b"{oops", None, "reward.json: invalid JSON"),
        (b"[1, 0]", None, "reward.json: must be a non-empty object"),
        (b"{}", None, "reward.json: must be a non-empty object"),
        (b'{"t": "1"}', None, "reward.json: t must be a number"),
        (b'{"t": true}', None, "reward.json: t must be a number"),
        (b'{"t": 1.5}', None, "reward.json: t: 1.5 is not a finite number in [0, 1]"),
        (b'{"t": NaN}', None, "reward.json: t: nan is not a finite number"),
        (None, b"", "reward.txt: not a number"),
        (None, b"pass", "reward.txt: not a number"),
        (None, b"-0.5", "reward.txt: -0.5 is not a finite number in [0, 1]"),
        (None, b"inf", "reward.txt: inf is not a finite number"),
    ],
)
def test_malformed_rewards_are_verifier_errors(
    reward_json: bytes | None, reward_txt: bytes | None, problem: str
) -> None:
    with pytest.raises(VerifierError) as info:
        parse_reward(reward_json, reward_txt)
    assert str(info.value).startswith(problem)

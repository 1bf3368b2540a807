"""The offline toolkit (real shims run on this host), adapted environments, per-test verifier results and
Terminal-Bench 0.2 conversion."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from albatross.sandbox.images import base_problem
from albatross.tasks import TaskFormatError, VerifierError, load_task, load_tasks, parse_reward, write_task
from albatross.tasks.offline import (
    OfflineEnv,
    adapt_environment,
    network_evidence,
    toolkit_dir,
    uses_toolkit,
)
from albatross.tasks.verify import parse_test_results


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("ALBATROSS_CACHE", str(tmp_path / ".cache"))  # dot: not searched for tasks
    return tmp_path / ".cache"


def _shim(name: str, *args: str, cwd: Path | None = None, env: dict[str, str] | None = None):
    tk = toolkit_dir()
    full_env = {**os.environ, "PATH": f"{tk}/bin:{os.environ['PATH']}", **(env or {})}
    return subprocess.run([str(tk / "bin" / name), *args], capture_output=True, text=True, cwd=cwd, env=full_env,
                          timeout=120)


# --------------------------------------------------------------------------------------- evidence


@pytest.mark.parametrize(
    ("output", "found"),
    [
        ("curl: (6) Could not resolve host: astral.sh", "curl: (6) Could not resolve host: astral.sh"),
        ("ok\nURLError: <urlopen error [Errno -3] Temporary failure in name resolution>\n", "URLError"),
        ("albatross-offline: needs the network: apt-get install cowsay", "albatross-offline: needs"),
        ("all good\nexit 1\n", None),
    ],
)
def test_network_evidence_finds_the_line(output: str, found: str | None) -> None:
    line = network_evidence(output)
    assert (line is None) if found is None else line.startswith(found)


@pytest.mark.parametrize(
    ("image", "ok"),
    [("ubuntu:24.04", True), ("python:3.13-slim-bookworm", True), ("debian:bookworm-slim", True),
     ("docker.io/library/python:3.11", True), ("ghcr.io/laude-institute/t-bench/python-3-13:20250620", True),
     ("alpine:3.19", False), ("nvidia/cuda:12.4.0-devel-ubuntu22.04", False)],
)
def test_which_base_images_map_to_the_local_root(image: str, ok: bool) -> None:
    problem = base_problem(image)
    assert (problem is None) == ok
    if not ok:
        assert problem.startswith(f"FROM {image}: cannot be built here: no base for {image}")


def test_scripts_that_need_the_toolkit() -> None:
    assert uses_toolkit("apt-get update\ncurl -LsSf https://astral.sh/uv/install.sh | sh\n")
    assert uses_toolkit("uvx -p 3.13 pytest /tests")
    assert not uses_toolkit("python3 /tests/check.py\necho adapt > x.txt\n")


# ----------------------------------------------------------------------------------------- shims


def test_toolkit_holds_executable_shims_and_pytest() -> None:
    tk = toolkit_dir()
    for name in ("apt-get", "apt", "pip", "pip3", "uv", "uvx", "curl", "wget", "pytest"):
        assert os.access(tk / "bin" / name, os.X_OK), name
    assert (tk / "site" / "albatross_pytest.py").is_file()
    assert (tk / "site" / "pytest").is_dir() and (tk / "site" / "pluggy").is_dir()
    assert toolkit_dir() == tk  # built once per cache root


@pytest.mark.skipif(shutil.which("dpkg-query") is None, reason="needs a Debian-family host (dpkg-query)")
def test_apt_get_shim_is_satisfied_by_installed_packages_only() -> None:
    assert _shim("apt-get", "update").returncode == 0
    done = _shim("apt-get", "install", "-y", "--no-install-recommends", "coreutils", "bash")
    assert done.returncode == 0 and "already installed on the local base" in done.stderr
    missing = _shim("apt-get", "install", "-y", "albatross-no-such-package")
    assert missing.returncode == 100
    assert network_evidence(missing.stderr) == (
        "albatross-offline: needs the network: apt-get install albatross-no-such-package "
        "(not installed on the local base)")


def test_pip_shim_installs_nothing_it_cannot_find_locally() -> None:
    assert _shim("pip", "install", "-q", "pytest>=7").returncode == 0
    missing = _shim("pip", "install", "albatross-no-such-dist==1.0")
    assert missing.returncode == 1 and "needs the network: install albatross-no-such-dist==1.0" in missing.stderr


def test_uv_installer_is_served_locally(tmp_path: Path) -> None:
    served = _shim("curl", "-LsSf", "https://astral.sh/uv/0.9.5/install.sh")
    assert served.returncode == 0 and "albatross offline toolkit" in served.stdout
    run = subprocess.run(["sh"], input=served.stdout, capture_output=True, text=True,
                         env={**os.environ, "HOME": str(tmp_path)})
    assert run.returncode == 0
    assert os.path.realpath(tmp_path / ".local/bin/uvx") == str(toolkit_dir() / "bin" / "uvx")
    version = subprocess.run(["bash", "-c", f". {tmp_path}/.local/bin/env && uv --version"], capture_output=True,
                             text=True, env={**os.environ, "HOME": str(tmp_path)})
    assert version.stdout.strip() == "uv 0.0.0 (albatross offline shim)"


def test_uvx_runs_the_tb2_pytest_command_with_per_test_results(tmp_path: Path) -> None:
    (tmp_path / "test_outputs.py").write_text("def test_ok():\n    assert True\n\n\ndef test_bad():\n    assert 0\n")
    results = tmp_path / "logs" / "albatross-tests.json"
    run = _shim("uvx", "-p", "3.13", "-w", "pytest==8.4.1", "-w", "pytest-json-ctrf==0.3.5", "pytest", "--ctrf",
                str(tmp_path / "logs" / "ctrf.json"), str(tmp_path / "test_outputs.py"), "-rA",
                cwd=tmp_path, env={"ALBATROSS_TEST_RESULTS": str(results)})
    assert run.returncode == 1, run.stdout + run.stderr
    assert parse_test_results(results.read_bytes()) == {"test_outputs.py::test_ok": 1.0,
                                                        "test_outputs.py::test_bad": 0.0}
    ctrf = json.loads((tmp_path / "logs" / "ctrf.json").read_text())["results"]
    assert (ctrf["summary"]["passed"], ctrf["summary"]["failed"]) == (1, 1)
    assert parse_test_results((tmp_path / "logs" / "ctrf.json").read_bytes()) == parse_test_results(
        results.read_bytes())


def test_uvx_refuses_a_tool_it_does_not_have() -> None:
    run = _shim("uvx", "--with", "albatross-no-such-dist", "pytest", "--version")
    assert run.returncode == 1 and "needs the network" in run.stderr


# ------------------------------------------------------------------------------ adapted environments


def _task(tmp_path: Path, dockerfile: str, name: str = "t") -> Path:
    return write_task(tmp_path / name, instruction="x\n", task_toml={}, env_files={"data.txt": "data\n"},
                      dockerfile=dockerfile, solve_sh="#!/bin/bash\ntrue\n",
                      test_sh="#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n")


def test_plain_environment_is_not_adapted(tmp_path: Path) -> None:
    task = load_task(_task(tmp_path, "FROM debian:bookworm-slim\nWORKDIR /app\nCOPY data.txt /app/\n"))
    assert task.offline is None and task.env_dir == task.source_env_dir == tmp_path / "t" / "environment"


def test_environment_that_installs_packages_is_adapted(tmp_path: Path) -> None:
    dockerfile = "# comment\nFROM ubuntu:24.04\nWORKDIR /app\nRUN apt-get update && apt-get install -y git\n"
    task = load_task(_task(tmp_path, dockerfile))
    assert isinstance(task.offline, OfflineEnv) and task.env_dir != task.source_env_dir
    adapted = (task.env_dir / "Dockerfile").read_text().splitlines()
    assert adapted[:2] == ["# comment", "FROM ubuntu:24.04"]
    assert adapted[2] == "ADD .albatross-offline.tar /usr/local/lib/albatross-offline/"
    assert adapted[3].startswith("ENV PATH=/usr/local/lib/albatross-offline/bin:/usr/local/sbin:")
    assert adapted[4:] == dockerfile.splitlines()[2:]
    with tarfile.open(task.env_dir / ".albatross-offline.tar") as tar:
        shim = tar.getmember("./bin/apt-get")
    assert shim.isfile() and shim.mode & 0o111 and (shim.uid, shim.gid) == (0, 0)
    assert (task.env_dir / "data.txt").read_text() == "data\n"
    assert task.dockerfile == task.source_env_dir / "Dockerfile"
    again = load_task(tmp_path / "t")
    assert again.env_dir == task.env_dir  # cached by content


def test_adapted_environments_share_the_toolkit_and_are_pruned_with_their_task(tmp_path: Path) -> None:
    """Hundreds of tasks (the demo's) must not cost hundreds of toolkit copies, nor outlive their task."""
    from albatross.tasks.offline import prune_adapted

    dockerfile = "FROM python:3.11-slim-bookworm\nWORKDIR /app\n"
    first, second = (load_task(_task(tmp_path, dockerfile, name)) for name in ("a", "b"))
    assert first.env_dir != second.env_dir
    tar_a, tar_b = (t.env_dir / ".albatross-offline.tar" for t in (first, second))
    assert os.stat(tar_a).st_ino == os.stat(tar_b).st_ino  # hard links of one toolkit archive
    shutil.rmtree(tmp_path / "a")
    assert prune_adapted() == 1
    assert not first.env_dir.exists() and second.env_dir.is_dir()


def test_python_images_get_a_python_alias(tmp_path: Path) -> None:
    task = load_task(_task(tmp_path, "FROM python:3.13-slim-bookworm\nWORKDIR /app\n"))
    assert "/usr/local/lib/albatross-offline/pybin:" in (task.env_dir / "Dockerfile").read_text()


def test_build_errors_name_the_original_line(tmp_path: Path) -> None:
    env = tmp_path / "t" / "environment"
    _task(tmp_path, "FROM ubuntu:24.04\nWORKDIR /app\nRUN pip install x\nRUN false\n")
    adapted = adapt_environment(env)
    assert (adapted.after_line, adapted.inserted) == (1, 2)
    assert [adapted.source_line(n) for n in (1, 2, 3, 4, 5, 6)] == [1, 1, 1, 2, 3, 4]
    message = f"{adapted.env_dir / 'Dockerfile'}:6: RUN exited with 1"
    assert adapted.map_message(message) == f"{env / 'Dockerfile'}:4: RUN exited with 1"


# ------------------------------------------------------------------------------ per-test results


def test_reward_txt_with_per_test_results() -> None:
    tests = json.dumps({"tests": [{"name": "a", "status": "passed"}, {"name": "b", "status": "failed"},
                                  {"name": "c", "status": "skipped"}]}).encode()
    result = parse_reward(None, b"0\n", tests)
    assert (result.metrics, result.reward, result.success) == ({"a": 1.0, "b": 0.0}, 0.0, False)
    assert (result.source, result.problem) == ("reward.txt+tests", "")


@pytest.mark.parametrize(
    ("reward", "statuses", "problem"),
    [
        (b"1", ["passed", "failed"], "reward.txt is 1 but 1 of 2 tests failed (t1)"),
        (b"0", ["passed", "passed"], "reward.txt is 0 but all 2 tests passed"),
        (b"1", ["passed", "passed"], ""),
    ],
)
def test_per_test_results_that_contradict_the_reward(reward: bytes, statuses: list[str], problem: str) -> None:
    ctrf = {"results": {"tests": [{"name": f"t{i}", "status": s} for i, s in enumerate(statuses)]}}
    assert parse_reward(None, reward, json.dumps(ctrf).encode()).problem == problem


def test_unreadable_per_test_results_are_ignored() -> None:
    assert parse_test_results(b"{not json") == {} and parse_test_results(None) == {}
    assert parse_reward(None, b"1", b"[]").metrics == {"reward": 1.0}
    with pytest.raises(VerifierError, match="nan is not a finite number"):
        parse_reward(None, b"nan", b'{"tests": []}')


# ----------------------------------------------------------------------------- Terminal-Bench 0.2


def _legacy(root: Path, compose: str = "", solution: str = "solution.sh") -> Path:
    task = root / "legacy-task"
    (task / "tests").mkdir(parents=True)
    (task / "task.yaml").write_text(
        "instruction: |-\n  Fix the thing.\n  Then stop.\nauthor_name: Ann\ndifficulty: hard\ncategory: games\n"
        "tags: [a, b]\nmax_agent_timeout_sec: 240\nmax_test_timeout_sec: 45\n")
    (task / "Dockerfile").write_text(
        "FROM ghcr.io/laude-institute/t-bench/python-3-13:20250620\nCOPY data.txt /app/\n")
    (task / "data.txt").write_text("data\n")
    (task / "run-tests.sh").write_text("#!/bin/bash\npytest $TEST_DIR/test_outputs.py -rA\n")
    (task / "tests" / "test_outputs.py").write_text("def test_x():\n    pass\n")
    if solution == "solution.sh":
        (task / "solution.sh").write_text("#!/bin/bash\necho fixed > /app/out.txt\n")
    else:
        (task / "solution.yaml").write_text("- command: echo one\n- command: echo two\n")
    (task / "docker-compose.yaml").write_text(compose or (
        "services:\n  client:\n    build: {context: .}\n    environment:\n      - TEST_DIR=${T_BENCH_TEST_DIR}\n"
        "      - MODE=strict\n"))
    return task


def test_terminal_bench_02_task_is_converted_as_harbor_does(tmp_path: Path, cache: Path) -> None:
    task = load_task(_legacy(tmp_path))
    assert (task.id, task.source_path) == ("legacy-task", tmp_path / "legacy-task")
    assert task.path.is_relative_to(cache) and task.instruction == "Fix the thing.\nThen stop.\n"
    assert (task.agent_timeout_s, task.verifier_timeout_s) == (240.0, 45.0)
    assert task.metadata["difficulty"] == "hard" and task.metadata["tags"] == ["a", "b"]
    dockerfile = (task.source_env_dir / "Dockerfile").read_text().splitlines()
    assert dockerfile[:3] == ["FROM python:3.13-slim-bookworm", "WORKDIR /app", "COPY data.txt /app/"]
    assert "ENV MODE=strict" in dockerfile and not any("TEST_DIR" in line for line in dockerfile)
    assert task.workdir == "/app" and (task.source_env_dir / "data.txt").is_file()
    test_sh = (task.tests_dir / "test.sh").read_text()
    assert "pytest /tests/test_outputs.py -rA" in test_sh and "echo 1 > /logs/verifier/reward.txt" in test_sh
    assert (task.tests_dir / "test_outputs.py").is_file()
    assert (task.solution_dir / "solve.sh").read_text() == "#!/bin/bash\necho fixed > /app/out.txt\n"
    assert [t.id for t in load_tasks([tmp_path])] == ["legacy-task"]


def test_solution_yaml_becomes_a_script(tmp_path: Path) -> None:
    task = load_task(_legacy(tmp_path, solution="solution.yaml"))
    assert (task.solution_dir / "solve.sh").read_text().endswith("echo one\necho two\n")


def test_multi_container_legacy_task_is_refused(tmp_path: Path) -> None:
    source = _legacy(tmp_path, compose="services:\n  client: {}\n  db: {image: postgres}\n")
    with pytest.raises(TaskFormatError, match=r"docker-compose.yaml: services: 2 services; only one container"):
        load_task(source)


def test_legacy_task_without_instruction_names_the_field(tmp_path: Path) -> None:
    source = _legacy(tmp_path)
    (source / "task.yaml").write_text("difficulty: easy\n")
    with pytest.raises(TaskFormatError, match=r"task.yaml: instruction must be a non-empty string$"):
        load_task(source)

"""Network policies of attempts, for real: ``registries`` reaches PyPI through the egress proxy and nothing
else, ``none`` reaches nothing; a task narrows the run's policy, which is recorded with every attempt; the
offline gate judges a task under its policy. Needs the local sandbox and PyPI (reachable where CI runs)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from albatross.sandbox import LocalBackend, local_available
from albatross.sandbox.base import Limits
from albatross.tasks import load_task, write_task
from albatross.tasks.gates import FAIL, PASS, GateOptions, gate_task
from sandbox_util import ok_output, task_env

pytestmark = pytest.mark.skipif(not local_available(), reason="the local sandbox needs root, cgroups, namespaces")
FETCH = ("python3 -c \"import sys, urllib.request\ntry:\n    print(urllib.request.urlopen(sys.argv[1], "
         "timeout=30).status)\nexcept Exception as e:\n    print(e)\" ")


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return task_env(tmp_path_factory.mktemp("net"), "FROM python:3.11-slim-bookworm\nWORKDIR /app\n")


def test_registries_attempt_reaches_pypi_and_nothing_else(backend: LocalBackend, env: Path) -> None:
    with backend.fork(env, limits=Limits(network="registries", command_timeout_s=120)) as attempt:
        assert attempt.network == "registries"
        assert ok_output(attempt, FETCH + "https://pypi.org/simple/six/") == "200"
        assert "Blocked by network policy" in ok_output(attempt, FETCH + "https://github.com/")
        assert "Blocked by network policy" in ok_output(attempt, FETCH + "http://example.com/")
        assert ok_output(attempt, "pip download -q --no-deps six -d /tmp/dl && ls /tmp/dl").startswith("six-")
        resolve = ok_output(attempt, "python3 -c 'import socket; socket.getaddrinfo(\"pypi.org\", 443)' 2>&1 || true")
        assert "Temporary failure" in resolve or "not known" in resolve  # no resolver: only the proxy
        assert attempt.refused_hosts() == ["github.com", "example.com"]


def test_none_attempt_has_no_proxy(backend: LocalBackend, env: Path) -> None:
    with backend.fork(env, limits=Limits(network="none")) as attempt:
        assert attempt.network == "none"
        assert ok_output(attempt, 'echo "[$https_proxy]"') == "[]"
        assert attempt.refused_hosts() == []
        refused = ok_output(attempt, FETCH + "http://127.0.0.1:3128/")
        assert "Connection refused" in refused


def _task(root: Path, name: str, environment: dict[str, object], solve: str = "echo forty-two > answer.txt") -> Path:
    return write_task(root / name, instruction="Write forty-two to answer.txt.\n",
                      task_toml={"agent": {"timeout_sec": 120}, "verifier": {"timeout_sec": 60},
                                 "environment": {"memory_mb": 512, "storage_mb": 256, **environment}},
                      env_files={}, dockerfile="FROM python:3.11-slim-bookworm\nWORKDIR /app\n",
                      solve_sh=f"#!/bin/bash\n{solve}\n",
                      test_sh="#!/bin/bash\nmkdir -p /logs/verifier\n[ \"$(cat /app/answer.txt)\" = forty-two ] && "
                              "echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n")


@pytest.mark.parametrize(("asks", "recorded"), [({}, "registries"), ({"network": "none"}, "none"),
                                               ({"allow_internet": False}, "none"),
                                               ({"network": "open"}, "registries")])
def test_policy_is_the_runs_narrowed_by_the_task_and_recorded(backend: LocalBackend, tmp_path: Path,
                                                              asks: dict[str, object], recorded: str) -> None:
    from albatross.eval.oracle import OracleAgent
    from albatross.harness.agent import AttemptSpec

    task = load_task(_task(tmp_path, "t", asks))
    traj = OracleAgent(backend, Limits(network="registries")).run(AttemptSpec(task, "g", 0))
    assert traj.network == recorded and traj.reward.success, traj.error
    assert traj.to_dict()["network"] == recorded


def test_offline_gate_judges_the_task_under_its_policy(backend: LocalBackend, tmp_path: Path) -> None:
    """An oracle that installs a package from PyPI: solvable under ``registries``, not under ``none``."""
    path = _task(tmp_path, "needs-pypi", {}, "pip download -q --no-deps six -d /tmp/six && echo forty-two > answer.txt")
    online = gate_task(path, backend, GateOptions(reruns=2, parallelism=1, network="registries"))
    assert online.gates["offline"].status == PASS and "registries" in online.gates["offline"].reason, online.gates
    offline = gate_task(path, backend, GateOptions(reruns=2, parallelism=1, network="none"))
    assert offline.gates["offline"].status == FAIL, offline.gates["offline"]


def test_an_oracle_that_hides_the_refusal_fails_the_offline_gate_naming_the_host(backend: LocalBackend,
                                                                                 tmp_path: Path) -> None:
    """A tool that swallows the proxy's answer (opam prints only curl's exit code) still fails gate 8, not gate
    3: the proxy's own record of the hosts it refused names the host."""
    path = _task(tmp_path, "silent", {}, "python3 -c 'import urllib.request; urllib.request.urlopen(\"https://"
                 "example.com/\", timeout=30)' >/dev/null 2>&1 || exit 1\necho forty-two > answer.txt")
    report = gate_task(path, backend, GateOptions(reruns=2, parallelism=1, network="registries"))
    assert report.gates["offline"].status == FAIL, report.gates
    assert "needs example.com, which the network policy refused" in report.gates["offline"].reason
    assert report.gates["oracle"].status != FAIL


def test_add_of_a_registry_url_downloads_under_the_builds_policy(backend: LocalBackend, tmp_path: Path) -> None:
    """``ADD https://pypi.org/...`` is fetched by albatross (as Docker's daemon does), over TLS, because the
    build's policy allows the registries; a host outside them is a named build failure."""
    from albatross.sandbox import EnvBuildError

    good = task_env(tmp_path / "a", "FROM python:3.11-slim-bookworm\nADD https://pypi.org/simple/six/ /six.html\n")
    with backend.fork(good) as attempt:
        assert b"six-" in (attempt.read_file("/six.html") or b"")
    bad = task_env(tmp_path / "b", "FROM python:3.11-slim-bookworm\nADD https://github.com/robots.txt /r.txt\n")
    with pytest.raises(EnvBuildError, match=r"Dockerfile:2: ADD https://github.com/robots.txt: needs github.com, "
                                            r"which the network policy registries does not allow"):
        backend.fork(bad)


def test_uvx_with_installs_what_is_missing_where_the_policy_allows(tmp_path: Path) -> None:
    """The toolkit's ``uvx -w REQ`` (Terminal-Bench's verifier line) with a network: what is not installed
    comes from PyPI through the toolkit's own pip, for that command only; without one, it needs the network."""
    from albatross.tasks.offline import toolkit_dir

    (tmp_path / "test_w.py").write_text("from importlib.metadata import version\n\nimport tomli_w\n\n\n"
                                        "def test_w():\n    assert tomli_w.dumps({'a': 1}) == 'a = 1\\n'\n"
                                        "    assert version('tomli-w') == '1.0.0'\n")
    tk = toolkit_dir()
    argv = [str(tk / "bin" / "uvx"), "-w", "tomli-w==1.0.0", "pytest", "-q", "-p", "no:cacheprovider", "test_w.py"]
    env = {**os.environ, "PATH": f"{tk}/bin:{os.environ['PATH']}", "TMPDIR": str(tmp_path)}
    online = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, timeout=300,
                            env={**env, "ALBATROSS_NETWORK": "registries"})
    assert online.returncode == 0 and "1 passed" in online.stdout, online.stdout + online.stderr
    assert "installing tomli-w==1.0.0 from the package registries for this command" in online.stderr
    offline = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, timeout=120, env=env)
    assert offline.returncode == 1 and "needs the network: install tomli-w==1.0.0" in offline.stderr


def test_a_verifier_that_pip_installs_its_own_test_tools(backend: LocalBackend, tmp_path: Path) -> None:
    """test.sh's own ``pip install pytest pytest-json-ctrf`` (as Terminal-Bench verifiers on python images
    do) installs into the verifier's scratch layer over the pristine image, and the installed plugin, not the
    toolkit's stand-in, writes ``--ctrf``: per-test results, reward 1 only for the solved attempt."""
    from albatross.tasks.verify import verify_attempt

    test_sh = ("#!/bin/bash\npip install -q pytest==8.4.1 requests==2.32.5 pytest-json-ctrf==0.3.5\n"
               "pytest --ctrf /logs/verifier/ctrf.json /tests/test_outputs.py -rA\n"
               "if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi\n")
    path = write_task(tmp_path / "pip-tests", instruction="Write forty-two to answer.txt.\n",
                      task_toml={"agent": {"timeout_sec": 120}, "verifier": {"timeout_sec": 300},
                                 "environment": {"memory_mb": 1024, "storage_mb": 512}},
                      env_files={}, dockerfile="FROM python:3.11-slim-bookworm\nWORKDIR /app\n",
                      solve_sh="#!/bin/bash\necho forty-two > answer.txt\n", test_sh=test_sh,
                      test_files={"test_outputs.py": "import requests  # noqa: F401\n\n\ndef test_answer():\n    assert open('/app/answer.txt').read()"
                                                     ".strip() == 'forty-two'\n\n\ndef test_app():\n"
                                                     "    assert __import__('os').path.isdir('/app')\n"})
    task = load_task(path)
    limits = Limits(network="registries", command_timeout_s=120, memory_mb=1024, disk_mb=512)
    for solved in (True, False):
        with backend.fork(task.env_dir, task.workdir, limits) as attempt:
            if solved:
                assert attempt.exec("echo forty-two > answer.txt").exit_code == 0
            result = verify_attempt(attempt, task, backend, limits)
        assert result.metrics == {"test_outputs.py::test_answer": float(solved), "test_outputs.py::test_app": 1.0}, \
            result
        assert result.success is solved

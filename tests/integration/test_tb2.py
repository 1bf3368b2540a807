"""Five real Terminal-Bench 2.0 tasks, offline, on the local sandbox: each builds, its oracle scores 1 and
doing nothing scores 0 (the verifier's `curl | sh` uv install and `uvx ... pytest` served by the offline
toolkit). The tasks are others' benchmark data, read from ../shared/tb2-sample/ (or
$ALBATROSS_TB2_SAMPLE); the tests skip where it is absent."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from albatross.sandbox import LocalBackend, local_available
from albatross.sandbox.base import Limits
from albatross.tasks import load_task
from albatross.tasks.gates import GATES, GateOptions, validate
from albatross.tasks.offline import network_evidence
from albatross.tasks.verify import run_oracle, run_verifier

TB2 = Path(os.environ.get("ALBATROSS_TB2_SAMPLE", Path(__file__).resolve().parents[2].parent / "shared" / "tb2-sample"))
FAST = ["constraints-scheduling", "git-leak-recovery", "openssl-selfsigned-cert", "regex-log"]
SLOW = "log-summary-date-ranges"  # its oracle alone runs for about 30 s

pytestmark = [
    pytest.mark.skipif(not TB2.is_dir(), reason=f"Terminal-Bench 2 sample tasks not found at {TB2} (benchmark "
                       "data kept outside the project; set ALBATROSS_TB2_SAMPLE)"),
    pytest.mark.skipif(not local_available(), reason="the local sandbox needs root, cgroup v1, namespaces and "
                       "overlayfs"),
]


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalBackend]:
    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ALBATROSS_CACHE", str(cache))
        backend = LocalBackend(hide_paths=[cache])
        yield backend
        backend.close()


def _limits(task) -> Limits:
    return Limits(memory_mb=task.memory_mb, pids=1024, disk_mb=1024, command_timeout_s=task.agent_timeout_s)


@pytest.mark.parametrize("task_id", [*FAST, pytest.param(SLOW, marks=pytest.mark.slow)])
def test_real_task_scores_one_with_its_oracle_and_zero_untouched(backend: LocalBackend, task_id: str) -> None:
    task = load_task(TB2 / task_id)
    attempt = backend.fork(task.env_dir, task.workdir, _limits(task))
    try:
        solve = run_oracle(attempt, task)
        oracle = run_verifier(attempt, task)
    finally:
        attempt.close()
    assert solve.exit_code == 0, solve.output[-2000:]
    assert oracle.result is not None, oracle.error
    assert (oracle.result.reward, oracle.result.success, oracle.result.problem) == (1.0, True, "")
    assert oracle.result.source == "reward.txt+tests" and set(oracle.result.metrics.values()) == {1.0}
    assert "served the uv installer from the offline toolkit" in oracle.run.output
    assert network_evidence(solve.output + oracle.run.output) is None
    attempt = backend.fork(task.env_dir, task.workdir, _limits(task))
    try:
        noop = run_verifier(attempt, task)
    finally:
        attempt.close()
    assert noop.result is not None and (noop.result.reward, noop.result.success) == (0.0, False)


@pytest.mark.slow
def test_all_five_pass_the_nine_gates(backend: LocalBackend) -> None:
    reports = validate([TB2 / t for t in [*FAST, SLOW]], backend, GateOptions(parallelism=2))
    assert {(r.task, g): r.gates[g].reason for r in reports for g in GATES if r.gates[g].status != "pass"} == {}
    untouched = {r.task: r.untouched for r in reports}
    assert len(untouched["git-leak-recovery"]) == 4 and untouched["regex-log"] == []


def test_built_environment_is_cached_on_disk_for_the_next_run(tmp_path: Path) -> None:
    """A real task's environment, built by one backend with the layer cache, is what the next backend
    (another run) forks from: the same stored layer, not built again, with the image's workdir and files."""
    task = load_task(TB2 / "regex-log")
    first = LocalBackend(layer_cache=True, warm=0)
    try:
        layer = Path(first.prepare(task.env_dir).layer)
    finally:
        first.close()
    stored = layer.parents[1]
    before = (stored.stat().st_ino, (stored / "parent.json").stat().st_ino)  # a rebuild writes both anew
    second = LocalBackend(layer_cache=True, warm=0)
    try:
        assert Path(second.prepare(task.env_dir).layer) == layer
        attempt = second.fork(task.env_dir, task.workdir, _limits(task))
        try:
            out = attempt.exec("pwd; . /etc/os-release; echo $VERSION_CODENAME").output
        finally:
            attempt.close()
    finally:
        second.close()
    assert (stored.stat().st_ino, (stored / "parent.json").stat().st_ino) == before  # not built again
    assert time.time() - (stored / "parent.json").stat().st_mtime < 60  # but marked used (the cache's LRU order)
    assert out == "/app\nnoble\n", out  # ubuntu:24.04 is Ubuntu's noble, from the Ubuntu archive

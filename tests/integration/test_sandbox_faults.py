"""Infrastructure faults: injected at random into real forks, retried on fresh forks, counted by kind,
never scored; and a thousand forks and closes leave the machine as it was."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest

from albatross.config import HarnessConfig
from albatross.engine.base import SamplingParams
from albatross.engine.scripted import ScriptedEngine
from albatross.harness.agent import Agent, AttemptSpec
from albatross.harness.chat import TinyChatFormat, TinyTokenizer
from albatross.harness.retry import run_with_retries
from albatross.records import STATUS_INFRA_ERROR, Trajectory
from albatross.sandbox import ForkError, Limits, LocalBackend, SandboxDied, local_available
from albatross.sandbox.cgroups import cgroup_root
from albatross.sandbox.faults import FAULT_DIE, FAULT_FORK, FaultInjector
from albatross.tasks.builtin import corpus_strings, generate_tasks
from albatross.tasks.format import load_tasks

needs_local = pytest.mark.skipif(
    not local_available(), reason="the local sandbox needs root, cgroup v1 memory+pids, namespaces, overlayfs"
)
GROUP_SIZE = 8
GROUPS = 25  # 200 attempts


class OracleAgent(Agent):
    """The real Agent; every try is played by a fresh scripted engine replaying the task's demo steps,
    and recorded (so the test sees the failed tries, not only the final ones)."""

    tries: list[Trajectory]

    def run(self, spec: AttemptSpec, engine: object = None) -> Trajectory:
        steps = [f"```bash\n{s}\n```" for s in spec.task.demo_steps or ["submit"]]
        traj = super().run(spec, engine=ScriptedEngine(steps, self.fmt.action))
        self.tries.append(traj)
        return traj


def test_fault_injector_is_seeded_and_counts() -> None:
    draws = [FaultInjector(0.3, seed=5).draw() for _ in range(3)]
    one, two = FaultInjector(0.3, seed=5), FaultInjector(0.3, seed=5)
    assert [one.draw() for _ in range(200)] == [two.draw() for _ in range(200)]
    assert one.counts["forks"] == 200 and 30 < one.counts[FAULT_FORK] + one.counts[FAULT_DIE] < 90
    assert FaultInjector(0.0).draw() == "" and len(draws) == 3
    with pytest.raises(ValueError, match="fail_rate"):
        FaultInjector(1.5)


@needs_local
def test_injected_faults_raise_the_right_errors() -> None:
    backend = LocalBackend(warm=0, fail_rate=1.0, fault_seed=3)
    try:
        seen = Counter()
        for _ in range(12):
            try:
                attempt = backend.fork(None)
            except ForkError:
                seen["fork"] += 1
                continue
            with pytest.raises(SandboxDied):
                attempt.exec("echo never")
            attempt.close()
            seen["died"] += 1
        assert seen["fork"] > 0 and seen["died"] > 0
        assert backend.live_attempts() == 0
    finally:
        backend.close()


@needs_local
def test_ten_percent_failed_forks_lose_no_group_and_score_no_failure(tmp_path: Path) -> None:
    tasks = load_tasks(generate_tasks(tmp_path, n_train=GROUPS, n_heldout=0, seed=11)["train"])
    backend = LocalBackend(hide_paths=[tmp_path], fail_rate=0.1, fault_seed=2024)
    fmt = TinyChatFormat(TinyTokenizer.from_corpus(corpus_strings()))
    agent = OracleAgent(None, backend, fmt, HarnessConfig(max_turns=4, max_format_errors=2), SamplingParams(),
                        Limits(command_timeout_s=10))
    agent.tries = []
    counts: Counter = Counter()
    lost = 0
    try:
        for g, task in enumerate(tasks):
            final = [run_with_retries(agent, AttemptSpec(task, f"g{g}", i), 3, counts) for i in range(GROUP_SIZE)]
            lost += any(t.status == STATUS_INFRA_ERROR for t in final)
    finally:
        backend.close()
    injected = backend.faults.counts
    failed = [t for t in agent.tries if t.status == STATUS_INFRA_ERROR]
    assert 0.05 <= len(failed) / len(agent.tries) <= 0.15
    assert injected[FAULT_FORK] > 0 and injected[FAULT_DIE] > 0
    assert len(failed) == injected[FAULT_FORK] + injected[FAULT_DIE] == counts["infra_error_attempts"]
    assert counts["infra_error:ForkError"] == injected[FAULT_FORK]
    assert counts["infra_error:SandboxDied"] == injected[FAULT_DIE]
    assert all(not t.reward.metrics and not t.success for t in failed)  # a failure never became a reward
    assert all(t.success for t in agent.tries if t.status != STATUS_INFRA_ERROR)  # every oracle try solved
    assert len(agent.tries) - len(failed) == GROUPS * GROUP_SIZE
    assert lost / GROUPS < 0.005


# ---- nothing left behind ------------------------------------------------------------------------------


def _descendants(pid: int) -> set[int]:
    out, todo = set(), [pid]
    while todo:
        parent = todo.pop()
        for child in Path(f"/proc/{parent}/task").glob("*/children"):
            try:
                kids = {int(k) for k in child.read_text().split()}
            except OSError:
                continue
            todo += list(kids - out)
            out |= kids
    return out


def _machine_state() -> tuple[frozenset[str], frozenset[int], frozenset[str]]:
    """Our mount table, our descendant processes, and the attempt cgroups named after this process."""
    mounts = frozenset(Path("/proc/self/mountinfo").read_text().splitlines())
    ours = f"{os.getpid()}-"
    groups = frozenset(str(p) for c in ("memory", "pids") for p in cgroup_root(c).glob(f"{ours}*"))
    return mounts, frozenset(_descendants(os.getpid())), groups


@needs_local
@pytest.mark.slow
def test_a_thousand_forks_and_closes_leave_the_machine_as_it_was(tmp_path: Path) -> None:
    env = tmp_path / "task" / "environment"
    (env / "data").mkdir(parents=True)
    (env / "data" / "f.txt").write_text("x\n")
    (env / "Dockerfile").write_text("FROM python:3.11-slim\nWORKDIR /app\nCOPY data/ /app/\n")
    before = _machine_state()
    backend = LocalBackend(hide_paths=[tmp_path])
    try:
        for i in range(1000):
            with backend.fork(env, limits=Limits(command_timeout_s=20)) as attempt:
                command = "sleep 100 & echo ok" if i % 50 == 0 else "echo ok"  # some leave a job running
                assert attempt.exec(command).output == "ok\n"
            if i == 20:
                zygote = backend._zygote
                assert zygote is not None
                zygote_mounts = Path(f"/proc/{zygote.proc.pid}/mountinfo").read_text()
        assert backend._zygote is zygote and zygote.alive() and backend.restarts == 0, (
            f"the zygote was replaced or died (restarts {backend.restarts}, exit code {zygote.proc.poll()})")
        assert Path(f"/proc/{zygote.proc.pid}/mountinfo").read_text() == zygote_mounts  # no growth inside
        assert backend.live_attempts() <= backend._pool.size  # only the warm ones
    finally:
        backend.close()
    assert _machine_state() == before

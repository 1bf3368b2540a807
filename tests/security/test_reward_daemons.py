"""Reward daemons: a task whose tests check processes the agent left running (``[verifier]
keep_agent_processes = true``, as the built-in job_control family sets) keeps the agent's processes alive
while test.sh runs. They must still not reach the verifier: its reward directory and /tests are its own
(a mount namespace of its own), and its processes cannot be entered through /proc."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from _probes import make_task, needs_local

from albatross.sandbox import LocalBackend
from albatross.tasks.verify import verify_attempt

pytestmark = needs_local


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalBackend]:
    backend = LocalBackend(warm=0, hide_paths=[tmp_path_factory.getbasetemp()])
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def task(tmp_path_factory: pytest.TempPathFactory):
    return make_task(tmp_path_factory.mktemp("tasks"), "keeps-processes",
                     toml={"verifier": {"keep_agent_processes": True}})


def daemon(loop: str) -> str:
    """Start ``loop`` as a detached background job of the agent that outlives its command."""
    return f"nohup setsid bash -c '{loop}' >/dev/null 2>&1 < /dev/null & sleep 0.3"


DAEMONS = {
    "writes-reward-json": daemon("while :; do mkdir -p /logs/verifier 2>/dev/null; "
                                 "echo {\\\"pass\\\": 1} > /logs/verifier/reward.json 2>/dev/null; sleep 0.002; done"),
    "rewrites-test-sh": daemon("while :; do [ -d /tests ] && printf \"#!/bin/bash\\nmkdir -p /logs/verifier; "
                               "echo 1 > /logs/verifier/reward.txt\\n\" > /tests/test.sh 2>/dev/null; "
                               "sleep 0.001; done"),
    "through-proc-root": daemon("while :; do for p in /proc/[0-9]*; do "
                                "echo {\\\"pass\\\": 1} > $p/root/logs/verifier/reward.json 2>/dev/null; "
                                "done; done"),
}


@pytest.mark.parametrize("name", sorted(DAEMONS))
def test_daemon_left_running_cannot_set_the_reward(backend: LocalBackend, task, name: str) -> None:
    with backend.fork(task.env_dir, task.workdir) as attempt:
        attempt.exec(DAEMONS[name], timeout_s=10)
        assert attempt.exec("pgrep -c bash").output.strip() != "0"
        result = verify_attempt(attempt, task, backend)
        alive = attempt.exec("pgrep -fc 'while :' || true").output.strip()
    assert alive != "0"  # the daemon ran through the whole verification
    assert result.reward == 0.0 and result.success is False, result

"""Reward integrity: what an attempt leaves behind cannot forge, drop or turn its reward into an
infrastructure error. Each probe is a hostile agent (commands through the attempt) followed by the
real verifier; the task passes only when /app/answer.txt holds the answer, which the agent never writes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from _probes import TEST_SH, make_task, needs_local

from albatross.sandbox import LocalBackend, ProcessBackend
from albatross.tasks.verify import REWARD_TXT, VerifierError, verify_attempt

pytestmark = needs_local


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalBackend]:
    backend = LocalBackend(warm=0, hide_paths=[tmp_path_factory.getbasetemp()])
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def task(tmp_path_factory: pytest.TempPathFactory):
    return make_task(tmp_path_factory.mktemp("tasks"))


def score_after(backend: LocalBackend, task, *agent_commands: str) -> float:
    """The reward of an attempt whose agent ran ``agent_commands`` (scored by ``verify_attempt``)."""
    with backend.fork(task.env_dir, task.workdir) as attempt:
        for command in agent_commands:
            attempt.exec(command, timeout_s=20)
        return verify_attempt(attempt, task, backend).reward


def test_background_job_rewriting_reward_txt_after_test_sh(backend, task) -> None:
    loop = f"while :; do [ -d /logs/verifier ] && echo 1 > {REWARD_TXT}; done 2>/dev/null"
    forge = f"for i in 1 2 3 4 5 6; do nohup bash -c '{loop}' >/dev/null 2>&1 & done; sleep 0.3"
    assert score_after(backend, task, forge) == 0.0


def test_background_job_dropping_reward_json_when_tests_appear(backend, task) -> None:
    forge = ("nohup bash -c 'until [ -e /tests/test.sh ]; do sleep 0.005; done; mkdir -p /logs/verifier; "
             "echo {\\\"pass\\\": 1} > /logs/verifier/reward.json' >/dev/null 2>&1 &")
    assert score_after(backend, task, forge) == 0.0


def test_setsid_daemon_is_dead_before_the_verifier_runs(backend, task) -> None:
    with backend.fork(task.env_dir, task.workdir) as attempt:
        attempt.exec("setsid nohup sleep 300 >/dev/null 2>&1 & (setsid sleep 300 &) ; sleep 0.2", timeout_s=10)
        assert attempt.exec("pgrep -c sleep").output.strip() == "2"
        verify_attempt(attempt, task, backend)
        assert attempt.exec("pgrep -c sleep || true").output.strip() == "0"


def test_daemon_killing_the_verifier(backend, task) -> None:
    """A daemon that kills test.sh would turn a failure into an infrastructure error (no reward)."""
    killer = "nohup bash -c 'while :; do pkill -9 -f tests/[t]est.sh; sleep 0.005; done' >/dev/null 2>&1 &"
    with backend.fork(task.env_dir, task.workdir) as attempt:
        attempt.exec(killer, timeout_s=10)
        result = verify_attempt(attempt, task, backend)
    assert result.reward == 0.0 and result.source == "reward.txt"  # test.sh itself wrote the 0


def test_exported_bash_env_is_not_sourced_by_the_verifier(backend, task) -> None:
    plant = (f"printf 'mkdir -p /logs/verifier; echo 1 > {REWARD_TXT}; exit 0\\n' > /app/.env.sh; "
             "export BASH_ENV=/app/.env.sh")
    assert score_after(backend, task, plant) == 0.0


def test_exported_path_with_fake_tools_is_not_inherited(backend, task) -> None:
    plant = ("mkdir -p /app/fakebin && printf '#!/bin/sh\\necho forty-two\\n' > /app/fakebin/cat && "
             "chmod +x /app/fakebin/cat && export PATH=/app/fakebin:$PATH")
    assert score_after(backend, task, plant) == 0.0


def test_exported_shell_function_is_not_inherited(backend, task) -> None:
    """(Contained before too: the persistent shell saves variables, not functions; kept as a guard.)"""
    plant = "cat() { echo forty-two; }; export -f cat"
    assert score_after(backend, task, plant) == 0.0


def test_planted_file_in_tests_is_removed(tmp_path: Path, backend) -> None:
    """test.sh sources an optional /tests/config.sh the task does not ship; the agent plants one."""
    test_sh = TEST_SH.replace("mkdir -p /logs/verifier\n", "mkdir -p /logs/verifier\n"
                              "[ -f /tests/config.sh ] && source /tests/config.sh\n")
    task = make_task(tmp_path, "optional-config", test_sh)
    plant = f"mkdir -p /tests && printf 'echo 1 > {REWARD_TXT}; exit 0\\n' > /tests/config.sh"
    assert score_after(backend, task, plant) == 0.0


def test_fifo_in_place_of_the_reward_directory_is_replaced(backend, task) -> None:
    """A FIFO (or file, or link) where /logs/verifier should be: the verifier still scores the attempt."""
    with backend.fork(task.env_dir, task.workdir) as attempt:
        attempt.exec("rm -rf /logs/verifier; mkdir -p /logs; mkfifo /logs/verifier", timeout_s=10)
        result = verify_attempt(attempt, task, backend)
    assert result.reward == 0.0 and result.source == "reward.txt"


def test_reward_directory_as_a_link_elsewhere_is_replaced(backend, task) -> None:
    with backend.fork(task.env_dir, task.workdir) as attempt:
        attempt.exec("mkdir -p /app/mine && echo 1 > /app/mine/reward.txt && rm -rf /logs/verifier && "
                     "ln -s /app/mine /logs/verifier && chattr +i /app/mine/reward.txt 2>/dev/null; true")
        result = verify_attempt(attempt, task, backend)
        assert result.reward == 0.0
        assert attempt.read_file("/app/mine/reward.txt") == b"1\n"  # the agent's file was not the reward


def test_reward_file_is_read_without_following_links(backend, task) -> None:
    with backend.fork(task.env_dir, task.workdir) as attempt:
        attempt.exec(f"echo 1 > /app/one && mkdir -p /logs/verifier && ln -sf /app/one {REWARD_TXT}")
        assert attempt.read_file(REWARD_TXT) is None
        assert attempt.read_file("/app/one") == b"1\n"


def test_self_sabotage_rm_rf_app_is_scored_zero_not_infra(backend, task) -> None:
    """rm -rf /app makes test.sh's `cd /app` fail (no reward): the attempt's failure, scored 0."""
    result_reward = score_after(backend, task, "rm -rf /app")
    assert result_reward == 0.0


def test_verifier_that_never_writes_a_reward_is_an_infra_error(tmp_path: Path, backend) -> None:
    task = make_task(tmp_path, "silent", "#!/bin/bash\necho checked\n")
    with backend.fork(task.env_dir, task.workdir) as attempt:
        with pytest.raises(VerifierError, match="untouched fork"):
            verify_attempt(attempt, task, backend)


def test_process_backend_kills_background_jobs_before_verifying(tmp_path: Path) -> None:
    """The unisolated backend does its best: jobs left in the attempt's process groups die first."""
    test_sh = ('#!/bin/bash\nmkdir -p "$SANDBOX_ROOT/logs/verifier"\n'
               'if [ "$(cat "$SANDBOX_ROOT/app/answer.txt" 2>/dev/null)" = "forty-two" ]; then echo 1; else echo 0; '
               'fi > "$SANDBOX_ROOT/logs/verifier/reward.txt"\n')
    task = make_task(tmp_path, "process", test_sh)
    backend = ProcessBackend()
    try:
        with backend.fork(task.env_dir, task.workdir) as attempt:
            attempt.exec("nohup bash -c 'while :; do mkdir -p $SANDBOX_ROOT/logs/verifier; "
                         "echo 1 > $SANDBOX_ROOT/logs/verifier/reward.txt; sleep 0.01; done' >/dev/null 2>&1 &")
            assert verify_attempt(attempt, task, backend).reward == 0.0
    finally:
        backend.close()


def _agent_run(backend: LocalBackend, task, actions: list[str]):
    """One attempt of the real harness, its actions played by a scripted engine."""
    from albatross.config import HarnessConfig
    from albatross.engine.base import SamplingParams
    from albatross.engine.scripted import ScriptedEngine
    from albatross.harness.agent import Agent, AttemptSpec
    from albatross.harness.chat import TinyChatFormat, TinyTokenizer
    from albatross.sandbox.base import Limits
    from albatross.tasks.builtin import corpus_strings

    fmt = TinyChatFormat(TinyTokenizer.from_corpus([*corpus_strings(), *actions]))
    agent = Agent(None, backend, fmt, HarnessConfig(max_turns=len(actions), max_format_errors=2),
                  SamplingParams(), Limits(command_timeout_s=5))
    engine = ScriptedEngine([f"```bash\n{a}\n```" for a in actions], fmt.action, version=1)
    return agent.run(AttemptSpec(task, "g", 0), engine=engine)


def test_harness_scores_self_sabotage_as_a_failure_in_pass_at_1(tmp_path: Path, backend) -> None:
    task = make_task(tmp_path, "sabotage")
    traj = _agent_run(backend, task, ["rm -rf /app", "submit"])
    assert traj.status == "ok" and traj.reward is not None and not traj.reward.success, traj.error
    assert traj.reward.metrics == {"reward": 0.0}


def test_harness_reports_a_verifier_that_never_writes_a_reward_as_infra(tmp_path: Path, backend) -> None:
    task = make_task(tmp_path, "silent-harness", "#!/bin/bash\necho checked\n")
    traj = _agent_run(backend, task, ["echo hello", "submit"])
    assert traj.status == "infra_error" and "untouched fork" in traj.error


@pytest.mark.parametrize(("name", "command", "test_sh"), [
    ("same-sabotage", "rm -rf /app", TEST_SH),  # the attempt's own failure: scored 0 on both paths
    ("same-silent", "echo hello", "#!/bin/bash\necho checked\n"),  # the task's: an infra error on both
])
def test_oracle_and_model_paths_give_the_same_attempt_the_same_outcome(tmp_path: Path, backend, name: str,
                                                                       command: str, test_sh: str) -> None:
    """One verification path: the same command as the oracle's solve.sh (``eval --agent oracle``) and as the
    model's action (the harness) ends in the same status and reward."""
    from albatross.eval.oracle import OracleAgent
    from albatross.harness.agent import AttemptSpec
    from albatross.sandbox.base import Limits

    task = make_task(tmp_path, name, test_sh, solve_sh=f"#!/bin/bash\n{command}\n")
    oracle = OracleAgent(backend, Limits(command_timeout_s=5)).run(AttemptSpec(task, "g", 0))
    model = _agent_run(backend, task, [command, "submit"])
    assert oracle.status == model.status, (oracle.error, model.error)
    if name == "same-silent":
        assert model.status == "infra_error" and "untouched fork" in oracle.error and "untouched fork" in model.error
    else:
        assert model.status == "ok" and oracle.reward is not None and model.reward is not None
        assert (oracle.reward.success, oracle.reward.metrics) == (model.reward.success, model.reward.metrics) \
            == (False, {"reward": 0.0})

"""The agent loop through a real sandbox, played by a scripted engine."""

import pytest

from albatross.config import HarnessConfig
from albatross.engine.base import SamplingParams
from albatross.engine.scripted import ScriptedEngine
from albatross.harness.agent import Agent, AttemptSpec
from albatross.harness.chat import TinyChatFormat, TinyTokenizer
from albatross.sandbox import local_available, make_backend
from albatross.sandbox.base import Limits
from albatross.tasks.builtin import corpus_strings, generate_tasks
from albatross.tasks.format import load_tasks

pytestmark = pytest.mark.skipif(not local_available(), reason="needs root, user/mount namespaces and overlayfs")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("tasks")
    paths = generate_tasks(root, n_train=6, n_heldout=0, seed=3)
    tasks = load_tasks(paths["train"])
    backend = make_backend("local", hide_paths=[str(root)])
    fmt = TinyChatFormat(TinyTokenizer.from_corpus(corpus_strings()))
    agent = Agent(None, backend, fmt, HarnessConfig(max_turns=4, max_format_errors=2),
                  SamplingParams(), Limits(command_timeout_s=5))
    yield agent, tasks
    backend.close()


def _play(agent, task, actions):
    engine = ScriptedEngine(actions, agent.fmt.action, version=7)
    return agent.run(AttemptSpec(task, "g", 0), engine=engine)


def test_oracle_steps_solve_every_family(setup):
    agent, tasks = setup
    families = set()
    for task in tasks:
        traj = _play(agent, task, [f"```bash\n{s}\n```" for s in task.demo_steps])
        assert traj.status == "ok", traj.error
        assert traj.success, (task.id, [t.observation for t in traj.turns])
        families.add(task.metadata["family"])
        s = traj.samples[0]
        # token-in/token-out: model tokens carry the engine's version; the rest are masked
        assert all(v == 7 for v, m in zip(s.versions, s.loss_mask, strict=True) if m)
        assert all(v == -1 for v, m in zip(s.versions, s.loss_mask, strict=True) if not m)
        assert s.num_model_tokens == traj.completion_tokens
        assert len(s.token_ids) == traj.prompt_tokens + traj.completion_tokens
    assert len(families) >= 3


def test_multistep_observation_is_real(setup):
    agent, tasks = setup
    task = next(t for t in tasks if t.metadata["family"] == "follow_pointer")
    traj = _play(agent, task, [f"```bash\n{s}\n```" for s in task.demo_steps])
    target = task.demo_steps[1].split()[1]
    assert traj.turns[0].observation.strip() == target


def test_noop_fails_and_format_errors_end_attempt(setup):
    agent, tasks = setup
    traj = _play(agent, tasks[0], ["```bash\nsubmit\n```"])
    assert traj.status == "ok" and not traj.success
    traj = _play(agent, tasks[0], ["no code block here"])
    assert traj.status == "format_error"
    assert "Format error" in traj.turns[0].observation


def test_turn_budget(setup):
    agent, tasks = setup
    traj = _play(agent, tasks[0], ["```bash\nls\n```"])
    assert traj.status == "max_turns"
    assert len(traj.turns) == 4


def test_failed_command_shows_exit_code(setup):
    agent, tasks = setup
    traj = _play(agent, tasks[0], ["```bash\ncat missing-file\n```", "```bash\nsubmit\n```"])
    assert "exit code 1" in traj.turns[0].observation


def test_default_layout_is_prompt_then_exact_actions_and_raw_observations(setup):
    """The demo's token layout with default settings: no tool list, short outputs shown exactly."""
    agent, tasks = setup
    task = tasks[0]
    actions = ["```bash\nls\n```", "```bash\nls /missing\n```", "```bash\nsubmit\n```"]
    traj = _play(agent, task, actions)
    fmt, t = agent.fmt, agent.fmt.tokenizer
    assert traj.turns[0].observation == "".join(f"{name}\n" for name in sorted(
        traj.turns[0].observation.split()))  # plain `ls` output, nothing added
    assert traj.turns[1].observation.endswith("No such file or directory\n[exit code 2]\n")
    expected = [t.special("<|user|>")] + t.encode(task.instruction.strip()) + [t.special("<|assistant|>")]
    for action, turn in zip(actions, traj.turns, strict=True):
        expected += fmt.action(action) + (fmt.observation(turn.observation) if turn.tool != "submit" else [])
    assert traj.samples[0].token_ids == expected
    assert [turn.tool for turn in traj.turns] == ["bash", "bash", "submit"]  # submit is one turn, once
    assert traj.input_tokens == sum(turn.context_tokens for turn in traj.turns)

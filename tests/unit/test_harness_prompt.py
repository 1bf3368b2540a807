"""`harness.system_prompt` and `harness.tools`: what the docs tell users to change, reaching the model's prompt."""

import pytest

from albatross.config import ConfigError, load_config
from albatross.engine.base import SamplingParams
from albatross.harness.agent import Agent
from albatross.harness.chat import make_chat_format
from albatross.harness.context import Context
from albatross.harness.parsers import FormatError
from albatross.harness.templates import toy_tokenizer
from albatross.sandbox.base import Limits


@pytest.fixture(scope="module")
def tokenizer():
    return toy_tokenizer("qwen3", ["count the lines of the file", "bash command echo", "You are careful."])


def _agent(tokenizer, *overrides: str) -> Agent:
    cfg = load_config(None, ["harness.action_format=tool_calls", *overrides])
    return Agent(None, None, make_chat_format(tokenizer, cfg.harness), cfg.harness, SamplingParams(), Limits())


def test_the_system_prompt_and_the_tools_reach_the_prompt(tokenizer):
    agent = _agent(tokenizer, "harness.system_prompt=You are careful.", "harness.tools=bash,read_file")
    prompt = tokenizer.decode(Context(agent.fmt, "count the lines", agent.tools).prompt)
    assert prompt.startswith("<|im_start|>system\nYou are careful.")
    assert '"name": "bash"' in prompt and '"name": "read_file"' in prompt and '"name": "submit"' in prompt
    assert '"name": "write_file"' not in prompt and '"name": "job_start"' not in prompt
    with pytest.raises(FormatError):  # a tool not offered is a malformed action, as any unknown tool
        agent.parser.parse('<tool_call>\n{"name": "write_file", "arguments": {"path": "a", "content": "b"}}\n'
                           "</tool_call>")
    default = _agent(tokenizer)
    prompt = tokenizer.decode(Context(default.fmt, "count the lines", default.tools).prompt)
    assert "You are careful." not in prompt and '"name": "write_file"' in prompt


def test_an_unknown_tool_is_refused_by_name():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["harness.tools=bash,browser"])
    assert "harness.tools" in str(e.value)


def test_an_own_agent_loop_plugs_in_by_config(tokenizer, tmp_path):
    from pathlib import Path

    from albatross.errors import UserError
    from albatross.harness.agent import build_agent

    example = Path(__file__).resolve().parents[2] / "examples" / "own_agent.py"
    cfg = load_config(None, [f"harness.agent={example}:build", "harness.max_turns=3"])
    agent = build_agent(cfg, None, None, tokenizer)
    assert type(agent).__name__ == "ShellAgent" and agent.max_turns == 3 and agent.engine is None
    for spec, needle in ((f"{example}:nope", "no function 'nope'"), (f"{tmp_path}/gone.py:build", "cannot load"),
                         ("no_such_module_x:build", "cannot load"), ("build", "expected module:function")):
        with pytest.raises(UserError) as e:
            build_agent(load_config(None, [f"harness.agent={spec}"]), None, None, tokenizer)
        assert needle in str(e.value) and "\n" not in str(e.value)


def test_an_attempt_without_an_engine_is_a_clear_error_before_any_fork(tokenizer, tmp_path):
    from albatross.harness.agent import AttemptSpec
    from albatross.tasks.format import Task

    agent = _agent(tokenizer)  # no engine, no sandbox backend: the check comes first
    with pytest.raises(ValueError, match="needs an engine"):
        agent.run(AttemptSpec(Task("t", tmp_path, "count the lines", 60.0, 60.0, tmp_path / "environment",
                                   tmp_path / "tests", tmp_path / "solution"), "g", 0))

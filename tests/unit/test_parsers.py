import json

import pytest

from albatross.harness.parsers import SUBMIT, BashBlockParser, FormatError, ToolCallParser, parse_bash_block
from albatross.harness.tools import TOOL_SCHEMAS, tool_call_text


def tool_parser() -> ToolCallParser:
    return ToolCallParser(TOOL_SCHEMAS)


def test_bash_block_parser_commands_and_submit():
    p = BashBlockParser()
    assert p.parse("I will list.\n```bash\nls -la\n```").args == {"command": "ls -la"}
    assert p.parse("```bash\nsubmit\n```").tool == SUBMIT
    assert parse_bash_block("```sh\necho hi\n```") == "echo hi"
    with pytest.raises(FormatError, match="exactly one"):
        p.parse("no block")
    with pytest.raises(FormatError, match="2 ```bash blocks"):
        p.parse("```bash\na\n```\n```bash\nb\n```")


def test_tool_call_roundtrip_every_tool():
    p = tool_parser()
    calls = {
        "bash": {"command": "ls", "timeout": 5},
        "job_start": {"command": "sleep 1"},
        "job_list": {},
        "job_log": {"job_id": 1, "bytes": 100},
        "job_wait": {"job_id": 1, "timeout": 3},
        "job_kill": {"job_id": 1},
        "read_file": {"path": "a.py", "start_line": 1, "end_line": 9},
        "write_file": {"path": "a.py", "content": "x = 1\n"},
        "edit_file": {"path": "a.py", "old_string": "1", "new_string": "2", "replace_all": True},
        "submit": {},
    }
    assert set(calls) == set(TOOL_SCHEMAS)
    for name, args in calls.items():
        action = p.parse("Thinking first.\n" + tool_call_text(name, **args))
        assert (action.tool, action.args) == (name, args)
    assert json.loads(p.parse(tool_call_text("write_file", path="a", content="b")).command)["name"] == "write_file"
    assert p.parse(tool_call_text("bash", command="ls")).command == "ls"


def test_arguments_as_json_string_are_accepted():
    text = '<tool_call>\n{"name": "bash", "arguments": "{\\"command\\": \\"pwd\\"}"}\n</tool_call>'
    assert tool_parser().parse(text).args == {"command": "pwd"}


@pytest.mark.parametrize("text, message", [
    ("just prose", "no tool call"),
    ('<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}\n</tool_call>', "not valid JSON"),
    ('<tool_call>{"name": "bash", "arguments": {"command": "ls"}}', "not closed"),
    ('<tool_call>["bash"]</tool_call>', "JSON object"),
    ('<tool_call>{"arguments": {}}</tool_call>', "JSON object"),
    ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', "unknown tool 'rm_rf'"),
    ('<tool_call>{"name": "bash", "arguments": {}}</tool_call>', "needs argument"),
    ('<tool_call>{"name": "bash", "arguments": {"command": "ls", "cwd": "/"}}</tool_call>', "no argument"),
    ('<tool_call>{"name": "bash", "arguments": {"command": 3}}</tool_call>', "must be a JSON string"),
    ('<tool_call>{"name": "job_log", "arguments": {"job_id": true}}</tool_call>', "must be a JSON integer"),
    ('<tool_call>{"name": "bash", "arguments": [1]}</tool_call>', "must be a JSON object"),
    ('<tool_call>{"name": "bash", "arguments": "{oops"}</tool_call>', "arguments string"),
    (tool_call_text("job_list") + tool_call_text("job_list"), "found 2 tool calls"),
])
def test_malformed_tool_calls_say_what_is_wrong(text, message):
    with pytest.raises(FormatError, match=message) as err:
        tool_parser().parse(text)
    assert str(err.value).startswith("Format error:")


def test_sandbox_limit_is_named_to_the_agent():
    from albatross.harness.tools import format_observation
    from albatross.sandbox.base import ExecResult

    obs = format_observation(ExecResult("partial\n", 137, limit="oom"), 400)
    assert "out of memory" in obs and "137" in obs
    assert format_observation(ExecResult("ok\n", 0), 400) == "ok\n"


@pytest.mark.parametrize("tool_calls", [False, True])
@pytest.mark.parametrize("command", ["wc -l < a.txt > answer.txt", "echo '{\"k\": 1}' | jq .k", "submit"])
def test_a_written_command_parses_back_in_either_format(command, tool_calls):
    from albatross.harness.parsers import BashBlockParser, ToolCallParser, write_command
    from albatross.harness.tools import TOOL_SCHEMAS

    parser = ToolCallParser(TOOL_SCHEMAS) if tool_calls else BashBlockParser()
    action = parser.parse(write_command(command, tool_calls))
    assert action.tool == ("submit" if command == "submit" else "bash")
    assert command == "submit" or action.command == command
